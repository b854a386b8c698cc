"""The bundled GPT's weights from a ``.safetensors`` file (``fsharded export`` of a
checkpoint, or any file naming the tensors as the GPT's tree does: ``emb``,
``blocks.0.attn.wq``, ...), whole or laid out on a mesh (each rank reads only its slices).

``fsharded export`` records the model's config in the file's metadata
(``fsharded.model``, and ``fsharded.encoding``: how text became tokens); a file without it
takes the config as an argument. A file of another model (a missing, extra or mis-shaped
tensor) is an error naming the tensors, before anything is read.
"""

from __future__ import annotations

import json
import os
from typing import Any

import optree
import torch

from fsharded import comm
from fsharded.checkpoint._common import _flatten
from fsharded.inference._sharded import check_divides, mesh_specs
from fsharded.mesh import Mesh, P
from fsharded.mesh._layout import dims
from fsharded.models import gpt
from fsharded.models._gpt_config import GPTConfig
from fsharded.spmd._transfer import backend_for

__all__ = ["load_safetensors", "safetensors_config"]


def safetensors_config(path: str | os.PathLike) -> tuple[GPTConfig | None, str | None]:
    """The GPT config and the text encoding a file's metadata records (None where it does
    not)."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as f:
        meta = f.metadata() or {}
    cfg = GPTConfig.from_dict(json.loads(meta["fsharded.model"])) if "fsharded.model" in meta else None
    enc = json.loads(meta["fsharded.encoding"]) if "fsharded.encoding" in meta else None
    return cfg, enc


def load_safetensors(path: str | os.PathLike, config: GPTConfig | None = None, *, mesh: Mesh | None = None,
                     param_specs: Any = None, dtype: torch.dtype | None = None) -> tuple[dict, GPTConfig]:
    """``(params, config)`` of the GPT in the file at ``path``: ``config`` or the file's
    own; with ``mesh``, laid out by ``param_specs`` (default ``mesh_specs``): global
    tensors on the virtual mesh, this rank's slices on real ranks. Floating tensors are
    cast to ``dtype`` where given."""
    from safetensors import safe_open

    path = os.fspath(path)
    if config is None:
        config, _ = safetensors_config(path)
        if config is None:
            raise ValueError(f"load_safetensors: {path} does not record its model's config (it was not written by "
                             f"fsharded export of a fsharded train checkpoint): pass config=")
    with torch.device("meta"):
        like = gpt.init(config, 0)
    names, leaves, treedef = _flatten(like)
    specs = None
    if mesh is not None:
        check_divides(like, mesh)
        specs = mesh_specs(like, mesh) if param_specs is None else param_specs
    flat_specs = optree.tree_leaves(specs, none_is_leaf=True) if specs is not None else [None] * len(leaves)
    dist = mesh is not None and backend_for(mesh, None) == "distributed" and mesh.size > 1
    coords = mesh.coords(comm.rank()) if dist else None
    out = []
    with safe_open(path, framework="pt") as f:
        have = set(f.keys())
        missing, extra = [n for n in names if n not in have], sorted(have - set(names))
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names if n in have}
        misfit = [f"{n}: {list(shapes[n])} in the file, {list(x.shape)} in the model" for n, x in zip(names, leaves)
                  if n in shapes and shapes[n] != tuple(x.shape)]
        if missing or extra or misfit:
            lines = [f"load_safetensors: {path} does not hold this GPT ({config})"]
            lines += [f"  missing: {n}" for n in missing[:5]] + [f"  extra: {n}" for n in extra[:5]]
            lines += [f"  shape: {m}" for m in misfit[:5]]
            raise ValueError("\n".join(lines) + "\nGive the config the weights were trained with.")
        for n, spec in zip(names, flat_specs):
            if dist:
                t = f.get_slice(n)[_slices(shapes[n], spec, mesh, coords)]
            else:
                t = f.get_tensor(n)
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            out.append(t)
    return optree.tree_unflatten(treedef, out), config


def _slices(shape: tuple[int, ...], spec: Any, mesh: Mesh, coords: dict[str, int]) -> tuple[slice, ...]:
    """This device's block of a tensor of ``shape`` laid out by ``spec`` (``local_slice``'s)."""
    key = [slice(None)] * len(shape)
    for d, axes in enumerate(dims(spec if spec is not None else P(), len(shape))):
        if axes:
            k, i = 1, 0
            for a in axes:
                k *= mesh.shape[a]
                i = i * mesh.shape[a] + coords[a]
            if shape[d] % k:
                raise ValueError(f"load_safetensors: dim {d} of a tensor of shape {list(shape)} does not split over "
                                 f"{axes} ({k} shards): use a mesh whose axes divide the model (the heads, the "
                                 f"hidden units, the experts)")
            size = shape[d] // k
            key[d] = slice(i * size, (i + 1) * size)
    return tuple(key)
