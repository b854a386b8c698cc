"""shard_map on the torch.distributed backend: one rank per device, real collectives."""

from __future__ import annotations

import contextlib
from typing import Any

import optree
import torch
import torch.distributed as dist

from fsharded import _env, _vma
from fsharded.mesh._shard import _dims, from_dtensor, gather_global, local_slice


def _is_dtensor(x: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(x, DTensor)


class _EnterShard(torch.autograd.Function):
    """Global tensor -> this rank's shard. Backward assembles the global cotangent
    (gathers over the axes the spec names; replicated over the others)."""

    @staticmethod
    def forward(x, spec, mesh, coords):
        return local_slice(x, spec, mesh, coords).clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.spec, ctx.mesh = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        return gather_global(g.contiguous(), ctx.spec, ctx.mesh), None, None, None


class _Assemble(torch.autograd.Function):
    """This rank's output shard -> the global tensor on every rank. Backward takes this
    rank's slice of the (replicated) global cotangent; along axes where the output varied
    but was declared replicated, only the shard-0 replica receives it (as on the virtual
    mesh, where shard 0's value is the output)."""

    @staticmethod
    def forward(y, spec, mesh, coords, mask_axes):
        return gather_global(y.contiguous(), spec, mesh)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.spec, ctx.mesh, ctx.coords, ctx.mask_axes = inputs

    @staticmethod
    def backward(ctx, g):
        gl = local_slice(g, ctx.spec, ctx.mesh, ctx.coords).contiguous()
        if any(ctx.coords[a] != 0 for a in ctx.mask_axes):
            gl = torch.zeros_like(gl)
        return gl, None, None, None, None


def call(sm: Any, args: tuple, *, local: bool = False) -> Any:
    """Run ``sm`` on this rank. ``local=True``: arguments are already this rank's shards
    and outputs stay shards (no slicing, no gathering) — how step functions keep state."""
    mesh = sm.mesh
    rank = dist.get_rank()
    coords = mesh.coords(rank)
    leaves, specs, treedef, paths = sm._flat_in(args, local=local)
    needs_vma = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in leaves
    )
    if local:
        shards = list(leaves)
    else:
        shards = [_enter(x, s, mesh, coords, p) for x, s, p in zip(leaves, specs, paths)]
    frame = _env.AxisFrame(mesh, "distributed", coords=coords)
    mode = _vma.VmaMode(frame) if needs_vma else None
    with _env.enter(frame), (mode if mode is not None else contextlib.nullcontext()):
        if mode is not None:
            for x, s in zip(shards, specs):
                if isinstance(x, torch.Tensor):
                    mode.set(x, frozenset(s.axes))
        out = sm.f(*optree.tree_unflatten(treedef, shards))
        o_leaves, o_specs, o_def, o_paths = sm._flat_out(out)
        flags = []
        if sm.check_rep:
            from fsharded._shard_map import _differs_local

            for y, s in zip(o_leaves, o_specs):
                for a in mesh.axis_names:
                    if a not in set(s.axes):
                        flags.append(_differs_local(y, frame, a))
        masks = []
        for y, s in zip(o_leaves, o_specs):
            vma = mode.get(y) if mode is not None else frozenset()
            masks.append(tuple(a for a in mesh.axis_names if a in vma and a not in set(s.axes)))
    if flags:
        from fsharded._shard_map import _raise_if_differs

        _raise_if_differs(flags, {"o_paths": o_paths, "o_specs": o_specs}, mesh.axis_names)
    if local:
        return optree.tree_unflatten(o_def, o_leaves)
    outs = [
        _Assemble.apply(y, s, mesh, coords, m) for y, s, m in zip(o_leaves, o_specs, masks)
    ]
    return optree.tree_unflatten(o_def, outs)


def _enter(x: Any, spec: Any, mesh: Any, coords: dict, path: str) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if _is_dtensor(x):
        try:
            _, dspec, dmesh = from_dtensor(x)
        except ValueError as e:
            raise ValueError(f"shard_map: DTensor argument {path}: {e}") from None
        if dmesh != mesh or _dims(dspec, x.dim()) != _dims(spec, x.dim()):
            raise ValueError(
                f"shard_map: DTensor argument {path} is laid out as {dspec!r} on {dmesh!r} "
                f"but in_specs say {spec!r} on {mesh!r}; redistribute it or change in_specs"
            )
        return x.to_local()
    return _EnterShard.apply(x, spec, mesh, coords)
