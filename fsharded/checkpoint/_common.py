"""What ``fsharded.checkpoint`` and its readers and exporters (DeepSpeed's format, DCP's
reader of ours, DCP and safetensors exchange) share: the error types, the dotted paths of a
tree's leaves, whether a mesh runs on real ranks, the blocks' checksums, reading
checksummed blocks, and assembling a box of a leaf from the blocks (``checkpoint._index`` reads
and checks the manifest and the blocks files first)."""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import optree
import torch

from fsharded.mesh import Mesh, _tree
from fsharded.spmd._transfer import backend_for

FORMAT = 1  # the manifest's format version; a newer one is refused

try:  # CRC-32C in hardware (SSE 4.2 / ARMv8 CRC), ~5x zlib's CRC-32; it releases the GIL
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - a dependency; zlib's CRC-32 then
    _crc32c = None


def checksummer() -> tuple[str, Callable[..., int]]:
    """The blocks' checksum as (its key in a block entry, fn(buffer, running value) -> int):
    CRC-32C where the ``crc32c`` package is installed, zlib's CRC-32 otherwise."""
    if _crc32c is not None:
        return "crc32c", lambda buf, value=0: _crc32c.crc32c(buf, value=value)
    return "crc32", zlib.crc32


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: corrupt, incomplete, of another model,
    or of a newer format."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose files are damaged or incomplete: a checksum that does not match,
    a truncated or missing file, a manifest or blocks file that was edited, blocks that do
    not tile their leaf. Another (older) checkpoint may still load: ``Manager.restore``
    passes over these, not over other errors (a checkpoint of another model)."""


# What every error about a damaged checkpoint ends with: what to do.
DAMAGED = ("the checkpoint is damaged: resume from an older one (Manager.restore and `fsharded train "
           "--resume latest` pass over damaged ones) or restore its files from a copy")


CHUNK = 8 << 20  # bytes read or written (and checksummed) at a time


def _verifier(b: dict, path: str) -> tuple[str, Callable[..., int]]:
    """(the key of the block's recorded checksum, its fn(buffer, running value))."""
    if "crc32c" in b:
        if _crc32c is None:
            raise CheckpointError(f"checkpoint: {path} is checksummed with CRC-32C: pip install "
                                  f"crc32c to read it")
        return "crc32c", lambda buf, value=0: _crc32c.crc32c(buf, value=value)
    if "crc32" in b:
        return "crc32", zlib.crc32
    raise CorruptCheckpointError(f"checkpoint: {path}: the block of {b.get('path')!r} has no checksum: {DAMAGED}")


_PATHS: dict = {}  # (treespec, its string) -> the dotted paths of its leaves (a step saves the same tree often)


def _flatten(tree: Any) -> tuple[list[str], list, Any]:
    """(dotted paths, leaves, treespec); NamedTuple fields and dataclass fields by name
    (``opt_state.0.mu.w``), so a path reads as the attribute it is."""
    leaves, tdef = optree.tree_flatten(tree)
    key = (tdef, str(tdef))  # its string too: {1: x} and {True: x} have equal treespecs
    paths = _PATHS.get(key)
    if paths is None:
        paths = [".".join(str(getattr(e, "field", e.entry)) for e in acc) or "<root>"
                 for acc in tdef.accessors()]
        if len(_PATHS) >= 64:
            _PATHS.clear()
        _PATHS[key] = paths
    return list(paths), leaves, tdef


_SPECS: dict = {}  # (treespec, the spec tree) -> one spec per leaf


def _flat_specs(specs: Any, tree: Any, tdef: Any) -> list:
    """``_tree.broadcast_prefix(specs, tree)`` (one spec per leaf of ``tree``, whose
    treespec is ``tdef``), remembered for the spec trees seen before."""
    try:
        sleaves, sdef = optree.tree_flatten(specs, is_leaf=_tree._is_spec_leaf, none_is_leaf=True)
        key = (tdef, sdef, tuple(sleaves))
        out = _SPECS.get(key)
    except TypeError:  # an unhashable spec: broadcast_prefix names what is wrong
        return _tree.broadcast_prefix(specs, tree, what="specs")
    if out is None:
        out = _tree.broadcast_prefix(specs, tree, what="specs")
        if len(_SPECS) >= 64:
            _SPECS.clear()
        _SPECS[key] = out
    return list(out)


def _distributed(mesh: Mesh, backend: str | None) -> bool:
    return backend_for(mesh, backend) == "distributed" and mesh.size > 1


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"checkpoint: unknown dtype {name!r}")
    return dt


class _Reader:
    """Reads blocks from the data files (kept open), verifying each one's checksum."""

    def __init__(self, directory: str) -> None:
        self.directory, self.files = directory, {}

    def read(self, b: dict, dtype: torch.dtype) -> torch.Tensor:
        path = os.path.join(self.directory, b["file"])
        fd = self.files.get(path)
        if fd is None:
            try:
                fd = self.files[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise CorruptCheckpointError(f"checkpoint: {path} is missing (it holds {b['path']!r}): "
                                             f"{DAMAGED}") from None
        n, offset = b["nbytes"], b["offset"]
        t = torch.empty(n, dtype=torch.uint8)
        buf = memoryview(t.numpy())
        kind, crc = _verifier(b, path)
        value = got = 0
        while got < n:  # straight into the tensor, a chunk at a time, checksummed while cached
            k = os.preadv(fd, [buf[got:got + CHUNK]], offset + got)
            if k == 0:
                break
            value = crc(buf[got:got + k], value)
            got += k
        if got != n:
            raise CorruptCheckpointError(f"checkpoint: {path} is truncated: {b['path']}'s block at byte "
                                         f"{offset} has {got} of {n} bytes: {DAMAGED}")
        if value != b[kind]:
            raise CorruptCheckpointError(
                f"checkpoint: checksum mismatch in {path} for {b['path']} (block at {b['start']}, bytes "
                f"{offset}-{offset + n}): the file is corrupt; {DAMAGED}")
        return t.view(dtype).reshape(b["shape"])

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)
        self.files = {}


def _bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _assemble(reader: _Reader, path: str, blocks: Iterable[dict], start: list, size: list,
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The box ``start``/``size`` of leaf ``path`` from the blocks that intersect it."""
    if device.type == "meta":
        device = torch.device("cpu")
    blocks = list(blocks)
    whole = [b for b in blocks if b["start"] == list(start) and b["shape"] == list(size)]
    if whole:  # a block that is this box exactly (the same layout as saved): no copy
        return reader.read(whole[0], dtype).to(device)
    t = torch.empty(size, dtype=dtype)
    covered = 0
    for b in blocks:
        lo = [max(s, bs) for s, bs in zip(start, b["start"])]
        hi = [min(s + n, bs + bn) for s, n, bs, bn in zip(start, size, b["start"], b["shape"])]
        if any(h <= lo_ for lo_, h in zip(lo, hi)) and size:
            continue
        src = reader.read(b, dtype)
        dst = t
        for d, (l_, h) in enumerate(zip(lo, hi)):
            src = src.narrow(d, l_ - b["start"][d], h - l_)
            dst = dst.narrow(d, l_ - start[d], h - l_)
        dst.copy_(src)
        covered += math.prod(h - l_ for l_, h in zip(lo, hi))
    if covered != math.prod(size):  # checked (``checkpoint._index``) before a byte is read: never here
        raise CorruptCheckpointError(
            f"checkpoint: {reader.directory}: the blocks of {path!r} cover {covered} of the "
            f"{math.prod(size)} elements this device needs: {DAMAGED}")
    return t.to(device)


def refuse_placeholders(paths: list, leaves: list, owned: list, what: str) -> None:
    """Refuse to store a leaf that is a placeholder on this rank (a zero broadcast to its
    shape: a pipeline stage's leaf on another pipe rank, ``train_step``'s per-stage
    storage) without ``owners`` saying who holds it: its zeros would be written as the
    leaf's values."""
    bad = [p for p, x, o in zip(paths, leaves, owned)
           if o is None and isinstance(x, torch.Tensor) and x.numel() > 1 and all(st == 0 for st in x.stride())]
    if bad:
        raise ValueError(
            f"{what}: on this rank these leaves are placeholders (zeros broadcast to their shape: "
            f"with a pipelined loss each pipe rank stores its own stages' leaves only): {bad[:6]}"
            f"{' ...' if len(bad) > 6 else ''}. Save a train step's state with step.save / step.save_async "
            f"(or Manager.save_state), which name each leaf's holders (owners=); for other formats take "
            f"the whole parameters first: step.params(state)")
