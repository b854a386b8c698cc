"""``fsharded.checkpoint``'s exchange with other formats: DCP (``dcp_state_dict``,
``save_dcp``, ``load_dcp``: what FSDP2 and torchtitan read and write) and a consolidated
``.safetensors`` file (``export_safetensors``: what Hugging Face's ``from_pretrained``
reads)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import warnings
from collections.abc import Iterator
from typing import Any

import optree
import torch

from fsharded.checkpoint._common import (
    CheckpointError,
    _assemble,
    _bytes,
    _distributed,
    _dtype,
    _flat_specs,
    _flatten,
    _Reader,
    refuse_placeholders,
)
from fsharded.checkpoint._index import _blocks, read_manifest
from fsharded.mesh import Mesh, PartitionSpec
from fsharded.mesh._layout import global_shape
from fsharded.mesh._spec import shard_shape
from fsharded.spmd._transfer import to_dtensor

__all__ = ["dcp_state_dict", "save_dcp", "load_dcp", "export_safetensors"]


# -- torch.distributed.checkpoint (DCP) -------------------------------------------------------------


def dcp_state_dict(tree: Any, specs: Any, mesh: Mesh, *, backend: str | None = None) -> dict[str, Any]:
    """``tree`` as the flat ``{dotted path: value}`` dict DCP walks: on real ranks each
    tensor a ``DTensor`` of this rank's shard (its global shape and placement from the
    spec), elsewhere the global tensor; non-tensor leaves as they are. A state with
    NamedTuples handed to DCP as is would be pickled whole, one rank's shards for all
    (DCP walks dicts and lists only): this dict is what to give ``dcp.save``."""
    paths, leaves, tdef = _flatten(tree)
    flat_specs = _flat_specs(specs, tree, tdef)
    dist = _distributed(mesh, backend)
    if dist:  # a replicated DTensor whose ranks hold different values would be read wrong
        refuse_placeholders(paths, leaves, [None] * len(leaves), "checkpoint.dcp_state_dict")
    out = {}
    for path, x, spec in zip(paths, leaves, flat_specs):
        spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec()
        out[path] = to_dtensor(x, spec, mesh) if dist and isinstance(x, torch.Tensor) else x
    return out


def save_dcp(directory: str | os.PathLike, tree: Any, specs: Any, mesh: Mesh, *,
             backend: str | None = None) -> str:
    """``dcp.save`` of ``dcp_state_dict(tree, specs, mesh)``: a DCP checkpoint that
    FSDP2 / torchtitan code reads with ``dcp.load`` into its own DTensors by these paths."""
    import torch.distributed.checkpoint as dcp

    directory = os.fspath(directory)
    sd = dcp_state_dict(tree, specs, mesh, backend=backend)
    with _one_process_quiet():
        dcp.save(sd, checkpoint_id=directory, no_dist=not _distributed(mesh, backend))
    return directory


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: we say so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def load_dcp(directory: str | os.PathLike, like: Any, specs: Any, mesh: Mesh, *,
             backend: str | None = None, prefix: str = "") -> Any:
    """A DCP checkpoint (``save_dcp``'s, or one of an FSDP2 model's ``state_dict()``: keys
    are the module's parameter names, as in ``fs.nn.functional`` params) as a tree shaped
    like ``like``, laid out by ``specs`` on ``mesh``; DCP reshards. ``prefix``: prepended
    to every path to find its key (e.g. ``"model."``). Keys of the tree missing from the
    checkpoint, or of another shape or dtype, are an error listing them."""
    import torch.distributed.checkpoint as dcp

    directory = os.fspath(directory)
    paths, leaves, tdef = _flatten(like)
    flat_specs = _flat_specs(specs, like, tdef)
    dist = _distributed(mesh, backend)
    try:
        meta = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint.load_dcp: no DCP checkpoint at {directory}") from None
    problems, sd = [], {}
    for path, x, spec in zip(paths, leaves, flat_specs):
        key = prefix + path
        m = meta.get(key)
        if m is None:
            problems.append(f"  missing: {key}")
            continue
        if not isinstance(x, torch.Tensor):
            sd[key] = x
            continue
        spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec()
        gshape = global_shape(spec, tuple(x.shape), mesh) if dist else tuple(x.shape)
        size = getattr(m, "size", None)
        dtype = getattr(getattr(m, "properties", None), "dtype", None)
        if size is None or tuple(size) != gshape or dtype != x.dtype:
            problems.append(f"  shape/dtype: {key}: {list(gshape)} {x.dtype} here, "
                            f"{list(size) if size is not None else 'a non-tensor'} {dtype} in the checkpoint")
            continue
        local = torch.empty(shard_shape(spec, gshape, mesh) if dist else gshape, dtype=x.dtype)
        sd[key] = to_dtensor(local, spec, mesh) if dist else local
    if problems:
        raise CheckpointError(f"checkpoint.load_dcp: {directory} does not fit the tree:\n" + "\n".join(problems))
    with _one_process_quiet():
        dcp.load(sd, checkpoint_id=directory, no_dist=not dist)
    out = []
    for path, x in zip(paths, leaves):
        v = sd[prefix + path]
        if isinstance(x, torch.Tensor):
            v = v.to_local() if dist else v
            v = v.to(x.device if x.device.type != "meta" else "cpu")
        out.append(v)
    return optree.tree_unflatten(tdef, out)


# -- export -----------------------------------------------------------------------------------------

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}


def export_safetensors(directory: str | os.PathLike, out: str | os.PathLike, *, select: str | None = "params",
                       rename: dict[str, str] | None = None, dtype: torch.dtype | None = None,
                       metadata: dict[str, str] | None = None) -> list[str]:
    """Write the full (consolidated) tensors of the checkpoint at ``directory`` to one
    ``.safetensors`` file, streamed leaf by leaf (one leaf in memory at a time; the header
    is known from the manifest). ``select``: the subtree to export, its prefix dropped
    (``"params"`` for a train state: the names are then the model's, e.g. an
    ``fs.nn.functional`` module's parameter names, which ``load_state_dict`` and
    ``from_pretrained`` read); ``None`` for every tensor. ``rename``: names to replace.
    ``dtype``: cast floating tensors (e.g. ``torch.bfloat16`` for a release). ``metadata``:
    strings added to the file's ``__metadata__`` (``fsharded export`` puts the model's
    config there, from which ``fs.inference.load_safetensors`` rebuilds it). Returns the
    names written."""
    directory, out = os.fspath(directory), os.fspath(out)
    manifest = read_manifest(directory)
    pre = f"{select}." if select else ""
    leaves = [e for e in manifest["leaves"] if "shape" in e and e["path"].startswith(pre)]
    if not leaves:
        raise CheckpointError(f"checkpoint.export_safetensors: {directory} has no tensors under {select!r}")
    rename = rename or {}
    header, names, offset = {}, [], 0
    plan = []
    for e in leaves:
        name = rename.get(e["path"][len(pre):], e["path"][len(pre):])
        src = _dtype(e["dtype"])
        dt = dtype if dtype is not None and src.is_floating_point else src
        if dt not in _ST_DTYPES:
            raise CheckpointError(f"checkpoint.export_safetensors: {e['path']} is {dt}, which safetensors cannot hold")
        n = math.prod(e["shape"]) * torch.empty((), dtype=dt).element_size()
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": e["shape"], "data_offsets": [offset, offset + n]}
        offset += n
        names.append(name)
        plan.append((e, src, dt))
    if len(set(names)) != len(names):
        raise CheckpointError("checkpoint.export_safetensors: two leaves map to one name; check rename=")
    bad = [k for k, v in (metadata or {}).items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise CheckpointError(f"checkpoint.export_safetensors: metadata holds strings only; {bad[0]!r} is not one")
    header["__metadata__"] = {**(metadata or {}), "format": "pt", "exported_by": "fsharded"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    blocks = _blocks(directory, manifest)
    reader = _Reader(directory)
    tmp = f"{out}.tmp-{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for e, src, dt in plan:
                t = _assemble(reader, e["path"], blocks.get(e["path"], []), [0] * len(e["shape"]),
                              list(e["shape"]), src, torch.device("cpu"))
                f.write(_bytes(t.to(dt)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        reader.close()
        if os.path.exists(tmp):
            os.remove(tmp)
    return names
