"""Moving tensors between global form and the backends' sharded forms.

* virtual mesh: a *stacked* tensor with one leading dim per mesh axis the spec names (in
  mesh order), followed by the shard shape — what ``shard_map`` vmaps over;
* torch.distributed: this rank's local shard, convertible to and from ``DTensor``.
"""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

from fsharded import _tree
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec, _entry_axes, format_spec_errors, spec_errors

__all__ = ["shard", "unshard", "to_dtensor", "from_dtensor", "to_stacked", "from_stacked"]


def check_tree(leaves: list, specs: list, paths: list[str], mesh: Mesh, what: str) -> None:
    """Validate every (leaf, spec) pair; one ValueError listing every failing leaf."""
    bad = []
    for path, x, spec in zip(paths, leaves, specs):
        if isinstance(x, torch.Tensor):
            errs = spec_errors(spec, tuple(x.shape), mesh)
            if errs:
                bad.append((path, spec, tuple(x.shape), errs))
        elif len(spec):
            bad.append((path, spec, (), [f"{type(x).__name__} is not a tensor and cannot be sharded"]))
    if bad:
        raise ValueError(f"{what}: " + format_spec_errors(bad, mesh))


def _dims(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
    return [_entry_axes(spec[d]) if d < len(spec) else () for d in range(ndim)]


def to_stacked(x: torch.Tensor, spec: PartitionSpec, mesh: Mesh) -> torch.Tensor:
    """Global tensor -> ``(n_a, n_b, ..., *shard_shape)`` over the axes ``spec`` names."""
    new_shape: list[int] = []
    axis_pos: dict[str, int] = {}
    keep: list[int] = []
    for d, axes in enumerate(_dims(spec, x.dim())):
        k = math.prod(mesh.shape[a] for a in axes)
        for a in axes:
            axis_pos[a] = len(new_shape)
            new_shape.append(mesh.shape[a])
        keep.append(len(new_shape))
        new_shape.append(x.shape[d] // k)
    order = [axis_pos[a] for a in mesh.axis_names if a in axis_pos] + keep
    return x.reshape(new_shape).permute(order)


def from_stacked(y: torch.Tensor, spec: PartitionSpec, mesh: Mesh) -> torch.Tensor:
    """Inverse of ``to_stacked``."""
    dims = _dims(spec, y.dim() - len(spec_mesh_axes(spec, mesh)))
    lead = spec_mesh_axes(spec, mesh)
    nlead = len(lead)
    # Bring each axis dim next to the tensor dim it splits (major first), then merge.
    order: list[int] = []
    out_shape: list[int] = []
    for d, axes in enumerate(dims):
        order += [lead.index(a) for a in axes] + [nlead + d]
        out_shape.append(y.shape[nlead + d] * math.prod(mesh.shape[a] for a in axes))
    return y.permute(order).reshape(out_shape)


def spec_mesh_axes(spec: PartitionSpec, mesh: Mesh) -> list[str]:
    named = set(spec.axes)
    return [a for a in mesh.axis_names if a in named]


def local_slice(x: torch.Tensor, spec: PartitionSpec, mesh: Mesh, coords: dict[str, int]) -> torch.Tensor:
    """This device's shard of a global tensor (a view where possible)."""
    for d, axes in enumerate(_dims(spec, x.dim())):
        if not axes:
            continue
        k, i = 1, 0
        for a in axes:
            k *= mesh.shape[a]
            i = i * mesh.shape[a] + coords[a]
        size = x.shape[d] // k
        x = x.narrow(d, i * size, size)
    return x


def _backend(mesh: Mesh, backend: str | None) -> str:
    from fsharded import distributed

    if backend is None:
        backend = "distributed" if distributed.is_initialized() else "virtual"
    if backend not in ("virtual", "distributed"):
        raise ValueError(f"backend must be 'virtual' or 'distributed', got {backend!r}")
    if backend == "distributed":
        distributed.check_world(mesh)
    return backend


def shard(tree: Any, specs: Any, mesh: Mesh, *, backend: str | None = None) -> Any:
    """Global tensors -> the backend's sharded form (see module docstring).

    >>> mesh = Mesh({"data": 2})
    >>> shard(torch.arange(4.0), P("data"), mesh)   # virtual: (2, 2) stacked
    tensor([[0., 1.],
            [2., 3.]])
    """
    backend = _backend(mesh, backend)
    paths, leaves, treedef = _tree.tree_flatten_with_paths(tree)
    flat_specs = _tree.broadcast_prefix(specs, tree)
    check_tree(leaves, flat_specs, paths, mesh, "shard")
    if backend == "virtual":
        out = [
            to_stacked(x, s, mesh) if isinstance(x, torch.Tensor) else x
            for x, s in zip(leaves, flat_specs)
        ]
    else:
        import torch.distributed as dist

        coords = mesh.coords(dist.get_rank())
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
    backend = _backend(mesh, backend)
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


def check_sharded_tree(leaves: list, specs: list, paths: list[str], mesh: Mesh, backend: str) -> None:
    """Validate leaves in the backend's sharded form against their specs (for ``unshard``)."""
    bad = []
    for path, y, spec in zip(paths, leaves, specs):
        if not isinstance(y, torch.Tensor):
            if len(spec):
                bad.append((path, spec, (), [f"{type(y).__name__} is not a tensor"]))
            continue
        shape = tuple(y.shape)
        unknown = [a for a in spec.axes if a not in mesh.shape]
        if unknown:
            errs = spec_errors(spec, shape, mesh)  # names the unknown axes
        elif backend == "virtual":
            lead = spec_mesh_axes(spec, mesh)
            want = tuple(mesh.shape[a] for a in lead)
            if shape[: len(lead)] != want:
                errs = [
                    f"a stacked shard must start with one dim per mesh axis the spec names "
                    f"({', '.join(f'{a}={mesh.shape[a]}' for a in lead) or 'none'}), "
                    f"got leading dims {shape[: len(lead)]}"
                ]
            else:
                errs = spec_errors(spec, _global_shape(spec, shape[len(lead):], mesh), mesh)
        else:
            errs = spec_errors(spec, _global_shape(spec, shape, mesh), mesh)
        if errs:
            bad.append((path, spec, shape, errs))
    if bad:
        raise ValueError("unshard: " + format_spec_errors(bad, mesh))


def _global_shape(spec: PartitionSpec, local_shape: tuple, mesh: Mesh) -> tuple[int, ...]:
    """The global shape whose shard has ``local_shape`` (axes must be in the mesh)."""
    out = list(local_shape)
    for d, e in enumerate(spec[: len(out)]):
        out[d] *= math.prod(mesh.shape[a] for a in _entry_axes(e))
    return tuple(out)


def gather_global(local: torch.Tensor, spec: PartitionSpec, mesh: Mesh) -> torch.Tensor:
    """All-gather a local shard into the global tensor on every rank (no autograd)."""
    from fsharded import distributed
    from fsharded.collectives import ALL_GATHER

    x = local
    # Callers differentiate around this themselves: keep the functional collectives'
    # own autograd (which torch.func rejects) out of it.
    with torch.no_grad():
        for d, axes in enumerate(_dims(spec, local.dim())):
            if axes:
                g = distributed.axis_group(mesh, axes)
                x = ALL_GATHER.dist(x, g, (d,))
    return x


# DTensor interop ------------------------------------------------------------------------


def placements(spec: PartitionSpec, mesh: Mesh, ndim: int) -> list:
    """DTensor placements (one per mesh axis) for ``spec``."""
    from torch.distributed.tensor import Replicate, Shard

    out: list = [Replicate()] * len(mesh.axis_names)
    for d, axes in enumerate(_dims(spec, ndim)):
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
    from torch.distributed.tensor import DTensor

    if not isinstance(spec, PartitionSpec):
        spec = PartitionSpec(*spec)
    check_sharded_tree([local], [spec], ["<root>"], mesh, "distributed")
    pl = placements(spec, mesh, local.dim())
    dm = mesh.to_torch()
    gshape = _global_shape(spec, tuple(local.shape), mesh)
    return DTensor.from_local(
        local, dm, pl, run_check=False, shape=torch.Size(gshape),
        stride=torch.empty(gshape, device="meta").stride(),
    )


def from_dtensor(dt: Any) -> tuple[torch.Tensor, PartitionSpec, Mesh]:
    """``(local shard, spec, mesh)`` of a ``DTensor`` with Shard/Replicate placements."""
    from torch.distributed.tensor import Replicate, Shard

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
