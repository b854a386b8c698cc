"""shard_map on real ranks (torch.distributed): one rank per device, real collectives."""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import torch

from fsharded import comm
from fsharded.mesh._layout import dims, local_slice
from fsharded.mesh._spec import PartitionSpec
from fsharded.spmd import _env, _prims, _vma
from fsharded.spmd._env import Axes
from fsharded.spmd._transfer import Sharded, from_dtensor, gather_global, is_dtensor


class _EnterShard(torch.autograd.Function):
    """Global tensor -> this rank's shard. Backward assembles the global cotangent
    (gathers over the axes the spec names; invariant over the others)."""

    @staticmethod
    def forward(x, spec, mesh, coords):
        # A copy of a slice (this rank keeps no view of the global storage); the whole
        # tensor, where nothing is sliced, as a view (a copy would double a replicated input).
        y = local_slice(x, spec, mesh, coords)
        return y.view_as(y) if y.shape == x.shape else y.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.spec, ctx.mesh, ctx.coords = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, g):
        # Through the collectives' own Function, so a vmap over this backward (jacrev
        # through shard_map) batches the gathers.
        return _gather(g, ctx.spec, ctx.mesh, ctx.coords), None, None, None

    @staticmethod
    def jvp(ctx, t, _spec, _mesh, _coords):
        return local_slice(t, ctx.spec, ctx.mesh, ctx.coords).clone()

    @staticmethod
    def vmap(info, in_dims, x, spec, mesh, coords):
        # A user's vmap over the shard_map'ed function: slice the per-example dims.
        d = in_dims[0]
        x = x.movedim(d, 0) if d is not None else x.unsqueeze(0).expand(info.batch_size, *x.shape)
        return _EnterShard.apply(x, PartitionSpec(None, *spec), mesh, coords), 0


class _Assemble(torch.autograd.Function):
    """This rank's output shard -> the global tensor on every rank. Backward takes this
    rank's slice of the (invariant) global cotangent."""

    @staticmethod
    def forward(y, spec, mesh, coords):
        return gather_global(y.contiguous(), spec, mesh)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.spec, ctx.mesh, ctx.coords = inputs

    @staticmethod
    def backward(ctx, g):
        return local_slice(g, ctx.spec, ctx.mesh, ctx.coords).contiguous(), None, None, None

    @staticmethod
    def jvp(ctx, t, _spec, _mesh, _coords):
        return _gather(t, ctx.spec, ctx.mesh, ctx.coords)

    @staticmethod
    def vmap(info, in_dims, y, spec, mesh, coords):
        d = in_dims[0]
        y = y.movedim(d, 0) if d is not None else y.unsqueeze(0).expand(info.batch_size, *y.shape)
        return _Assemble.apply(y, PartitionSpec(None, *spec), mesh, coords), 0


def _gather(t: torch.Tensor, spec: Any, mesh: Any, coords: dict) -> torch.Tensor:
    """The global tensor of this rank's shard ``t``, through the collectives' own Function
    (so a vmap over it, as in jacrev and jacfwd, batches the gathers)."""
    frame = _env.AxisFrame(mesh, "distributed", coords=coords)
    for d, axes in enumerate(dims(spec, t.dim())):
        if axes:
            t = _prims._dispatch(_prims.ALL_GATHER, (d,), _axes(frame, axes), t, record=False)
    return t


def call(sm: Any, args: tuple, *, local: bool = False) -> Any:
    """Run ``sm`` on this rank. ``local=True``: arguments are already this rank's shards
    and outputs stay shards (no slicing, no gathering) — how step functions keep state."""
    mesh = sm.mesh
    coords = mesh.coords(comm.rank())
    leaves, specs, treedef, paths = sm._flat_in(args, local=local)
    was_sharded = [isinstance(x, Sharded) for x in leaves]
    leaves = [x.plain() if sh else x for x, sh in zip(leaves, was_sharded)]  # already shards
    if local:
        shards = list(leaves)
    else:
        shards = [x if sh else _enter(x, s, mesh, coords, p)
                  for x, s, p, sh in zip(leaves, specs, paths, was_sharded)]
    frame = _env.AxisFrame(mesh, "distributed", coords=coords)
    if mesh.size == 1:  # one rank: nothing can differ between devices, nothing to type
        with _env.enter(frame):
            out = sm.f(*optree.tree_unflatten(treedef, shards))
            o_leaves, o_specs, o_def, _ = sm._flat_out(out)
        if local:
            return optree.tree_unflatten(o_def, o_leaves)
        return optree.tree_unflatten(o_def, [_Assemble.apply(y, s, mesh, coords)
                                             for y, s in zip(o_leaves, o_specs)])
    mode = _vma.VmaMode(mesh.axis_names, _prims.implicit_pvary(frame))
    frame = dataclasses.replace(frame, vma=mode)
    with _env.enter(frame), mode:
        o_leaves, o_specs, o_def, kinds = _vma.run_body(mode, sm, shards, specs, treedef)
        res = []
        for y, (fan, undeclared) in zip(o_leaves, kinds):
            if undeclared:  # check_vma=False: shard 0's value along them, as on the virtual mesh
                y = _prims._dispatch(_prims.REPLICA, (), _axes(frame, undeclared), y)
            if fan and y.requires_grad and torch.is_grad_enabled():
                # Fan-out: the same value on every shard along ``fan``; its cotangent is
                # the sum of the shards' (JAX's implicit pvary at the output).
                y = mode.pvary(y, fan)
            res.append(y)
    if local:
        return optree.tree_unflatten(o_def, res)
    outs = [_Assemble.apply(y, s, mesh, coords) for y, s in zip(res, o_specs)]
    return optree.tree_unflatten(o_def, outs)


def _axes(frame: _env.AxisFrame, names: tuple[str, ...]) -> Axes:
    return Axes(names, tuple(frame.mesh.shape[a] for a in names), frame)


def _enter(x: Any, spec: Any, mesh: Any, coords: dict, path: str) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if is_dtensor(x):
        try:
            _, dspec, dmesh = from_dtensor(x)
        except ValueError as e:
            raise ValueError(f"shard_map: DTensor argument {path}: {e}") from None
        if dmesh != mesh or dims(dspec, x.dim()) != dims(spec, x.dim()):
            raise ValueError(
                f"shard_map: DTensor argument {path} is laid out as {dspec!r} on {dmesh!r} "
                f"but in_specs say {spec!r} on {mesh!r}; redistribute it or change in_specs"
            )
        return x.to_local()
    return _EnterShard.apply(x, spec, mesh, coords)
