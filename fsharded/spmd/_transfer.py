"""Moving values between global form and the backends' sharded forms: ``shard``,
``unshard``, and ``DTensor`` interop on real ranks."""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsharded import _tree, comm
from fsharded.mesh._layout import (
    check_sharded_tree,
    check_tree,
    dims,
    from_stacked,
    global_shape,
    local_slice,
    to_stacked,
)
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec, format_spec_errors, spec_errors

__all__ = ["shard", "unshard", "to_dtensor", "from_dtensor", "gather_global", "backend_for"]


def backend_for(mesh: Mesh, backend: str | None) -> str:
    if backend is None:
        backend = "distributed" if comm.is_initialized() else "virtual"
    if backend not in ("virtual", "distributed"):
        raise ValueError(f"backend must be 'virtual' or 'distributed', got {backend!r}")
    if backend == "distributed":
        comm.check_world(mesh)
    return backend


def shard(tree: Any, specs: Any, mesh: Mesh, *, backend: str | None = None) -> Any:
    """Global tensors -> the backend's sharded form (see module docstring).

    >>> mesh = Mesh({"data": 2})
    >>> shard(torch.arange(4.0), P("data"), mesh)   # virtual: (2, 2) stacked
    tensor([[0., 1.],
            [2., 3.]])
    """
    backend = backend_for(mesh, backend)
    paths, leaves, treedef = _tree.tree_flatten_with_paths(tree)
    flat_specs = _tree.broadcast_prefix(specs, tree)
    check_tree(leaves, flat_specs, paths, mesh, "shard")
    if backend == "virtual":
        out = [
            to_stacked(x, s, mesh) if isinstance(x, torch.Tensor) else x
            for x, s in zip(leaves, flat_specs)
        ]
    else:
        coords = mesh.coords(comm.rank())
        out = [
            local_slice(x, s, mesh, coords).clone(memory_format=torch.contiguous_format) if isinstance(x, torch.Tensor) else x
            for x, s in zip(leaves, flat_specs)
        ]
    return optree.tree_unflatten(treedef, out)


def unshard(tree: Any, specs: Any, mesh: Mesh, *, backend: str | None = None) -> Any:
    """The backend's sharded form -> global tensors; the inverse of ``shard``.

    Virtual backend: stacked tensors (leading dim per mesh axis the spec names, mesh
    order) are merged back (differentiable). Distributed backend: every rank's local shard
    is all-gathered, so each rank gets the whole global tensor (not differentiable: the
    result is detached). Shapes that cannot be a shard of their spec are a ``ValueError``.
    """
    backend = backend_for(mesh, backend)
    paths, leaves, treedef = _tree.tree_flatten_with_paths(tree)
    flat_specs = _tree.broadcast_prefix(specs, tree)
    check_sharded_tree(leaves, flat_specs, paths, mesh, backend)
    out = []
    for y, s in zip(leaves, flat_specs):
        if not isinstance(y, torch.Tensor):
            out.append(y)
        elif backend == "virtual":
            out.append(from_stacked(y, s, mesh))
        else:
            out.append(gather_global(y.detach(), s, mesh))
    return optree.tree_unflatten(treedef, out)


def gather_global(local: torch.Tensor, spec: PartitionSpec, mesh: Mesh) -> torch.Tensor:
    """All-gather a local shard into the global tensor on every rank (no autograd)."""
    x = local
    # Callers differentiate around this themselves: keep the functional collectives'
    # own autograd (which torch.func rejects) out of it.
    with torch.no_grad():
        for d, axes in enumerate(dims(spec, local.dim())):
            if axes:
                x = comm.all_gather_dim(x, comm.axis_group(mesh, axes), d)
    return x


# DTensor interop ------------------------------------------------------------------------


def placements(spec: PartitionSpec, mesh: Mesh, ndim: int) -> list:
    """DTensor placements (one per mesh axis) for ``spec``."""
    out: list = [Replicate()] * len(mesh.axis_names)
    for d, axes in enumerate(dims(spec, ndim)):
        if len(axes) > 1:
            # DTensor shards a dim over several mesh dims in mesh-dim order; accept only
            # tuples already in that order so the chunk layout is the same.
            pos = [mesh.axis_names.index(a) for a in axes]
            if pos != sorted(pos):
                raise ValueError(
                    f"spec {spec!r}: DTensor can only express multi-axis dims in mesh order "
                    f"({mesh.axis_names}); reorder the tuple or reshard first"
                )
        for a in axes:
            out[mesh.axis_names.index(a)] = Shard(d)
    return out


def to_dtensor(local: torch.Tensor, spec: PartitionSpec, mesh: Mesh) -> Any:
    """Wrap this rank's shard as a ``DTensor`` on ``mesh.to_torch()`` (no copy).

    ``local`` is what ``shard(x, spec, mesh)`` gives on the distributed backend; the
    result's ``full_tensor()`` is ``x``. Differentiable (``DTensor.from_local``).
    """
    if not isinstance(spec, PartitionSpec):
        spec = PartitionSpec(*spec)
    check_sharded_tree([local], [spec], ["<root>"], mesh, "distributed")
    pl = placements(spec, mesh, local.dim())
    dm = mesh.to_torch()
    gshape = global_shape(spec, tuple(local.shape), mesh)
    return DTensor.from_local(
        local, dm, pl, run_check=False, shape=torch.Size(gshape),
        stride=torch.empty(gshape, device="meta").stride(),
    )


def from_dtensor(dt: Any) -> tuple[torch.Tensor, PartitionSpec, Mesh]:
    """``(local shard, spec, mesh)`` of a ``DTensor`` with Shard/Replicate placements."""
    mesh = Mesh.from_torch(dt.device_mesh)
    entries: list[list[str]] = [[] for _ in range(dt.dim())]
    for axis, pl in zip(mesh.axis_names, dt.placements):
        # type() and not isinstance(): _StridedShard (a non-default shard order) is not a
        # Shard today, but must never be read as one; its layout is not major-first.
        if type(pl) is Shard:
            entries[pl.dim % max(dt.dim(), 1)].append(axis)
        elif not isinstance(pl, Replicate):
            raise ValueError(
                f"from_dtensor: placement {type(pl).__name__} ({pl}) on mesh axis {axis!r} has no PartitionSpec; "
                f"redistribute to Shard/Replicate (with multi-axis dims in mesh order) first, "
                f"e.g. dt.redistribute(dt.device_mesh, [Replicate()] * {len(mesh.axis_names)})"
            )
    while entries and not entries[-1]:
        entries.pop()
    spec = PartitionSpec(*[tuple(e) if e else None for e in entries])
    errs = spec_errors(spec, tuple(dt.shape), mesh)
    if errs:
        raise ValueError("from_dtensor: " + format_spec_errors([("<root>", spec, tuple(dt.shape), errs)], mesh))
    return dt.to_local(), spec, mesh
