"""Moving values between global form and the backends' sharded forms: ``shard``,
``unshard``, and ``DTensor`` interop on real ranks."""

from __future__ import annotations

import sys
from typing import Any

import optree
import torch

from fsharded import comm
from fsharded.mesh import _tree
from fsharded.mesh._layout import (
    check_sharded_tree,
    check_tree,
    dims,
    from_stacked,
    global_shape,
    local_slice,
    spec_mesh_axes,
    to_stacked,
)
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec, format_spec_errors, spec_errors

__all__ = ["shard", "unshard", "Sharded", "local_shards", "to_dtensor", "from_dtensor",
           "gather_global", "backend_for"]


def is_dtensor(x: Any) -> bool:
    """``isinstance(x, DTensor)`` without importing DTensor (a large part of start-up time):
    no value is one before its module is loaded."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(x, mod.DTensor)


def backend_for(mesh: Mesh, backend: str | None) -> str:
    if backend is None:
        backend = "distributed" if comm.is_initialized() else "virtual"
    if backend not in ("virtual", "distributed"):
        raise ValueError(f"backend must be 'virtual' or 'distributed', got {backend!r}")
    if backend == "distributed":
        comm.check_world(mesh)
    return backend


class Sharded(torch.Tensor):
    """A value in a backend's sharded form that remembers the global value it stands for:
    what ``shard`` returns. On the virtual mesh the stacked tensor, on real ranks this
    rank's shard; ``spec``, ``mesh`` and ``backend`` say how. It computes like a plain
    tensor (every op gives a plain tensor back), and ``shard_map`` takes it as the global
    value, where a plain stacked tensor or local shard would be split a second time."""

    spec: PartitionSpec
    mesh: Mesh
    backend: str

    @staticmethod
    def wrap(x: torch.Tensor, spec: PartitionSpec, mesh: Mesh, backend: str) -> Sharded:
        out = x.as_subclass(Sharded)
        out.spec, out.mesh, out.backend = spec, mesh, backend
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def plain(self) -> torch.Tensor:
        """The same data as a plain tensor."""
        return self.as_subclass(torch.Tensor)

    def global_shape(self) -> tuple[int, ...]:
        shape = tuple(self.shape)
        if self.backend == "virtual":
            shape = shape[len(spec_mesh_axes(self.spec, self.mesh)):]
        return global_shape(self.spec, shape, self.mesh)

    def __reduce_ex__(self, protocol):
        # Saved as the plain shard with its layout; loads back as a Sharded.
        return (_rebuild, (self.plain(), self.spec, self.mesh, self.backend))


def _rebuild(x: torch.Tensor, spec: PartitionSpec, mesh: Mesh, backend: str) -> Sharded:
    return Sharded.wrap(x, spec, mesh, backend)


def shard(tree: Any, specs: Any, mesh: Mesh, *, backend: str | None = None) -> Any:
    """Global tensors -> the backend's sharded form (see module docstring), as ``Sharded``
    values: ``shard_map`` takes them for the global values they stand for.

    >>> mesh = Mesh({"data": 2})
    >>> shard(torch.arange(4.0), P("data"), mesh).plain()   # virtual: (2, 2) stacked
    tensor([[0., 1.],
            [2., 3.]])
    """
    backend = backend_for(mesh, backend)
    flat_specs = _tree.broadcast_prefix(specs, tree)
    leaves, treedef = optree.tree_flatten(local_shards(tree, specs, mesh, backend=backend))
    out = [Sharded.wrap(x, s, mesh, backend) if isinstance(x, torch.Tensor) else x
           for x, s in zip(leaves, flat_specs)]
    return optree.tree_unflatten(treedef, out)


def local_shards(tree: Any, specs: Any, mesh: Mesh, *, backend: str | None = None) -> Any:
    """``shard`` as plain tensors (how a training step keeps its state)."""
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


def globals_of(leaves: list, mesh: Mesh, backend: str, paths: list[str]) -> list:
    """``Sharded`` arguments of a shard_map call -> what the checks and the backend take:
    on the virtual mesh the global value (any layout); on real ranks the shard itself
    (kept; its layout is checked against in_specs by the caller)."""
    out = []
    for x, path in zip(leaves, paths):
        if isinstance(x, Sharded):
            if x.mesh != mesh or x.backend != backend:
                raise ValueError(
                    f"shard_map: argument {path} was sharded on {x.mesh!r} for the {x.backend} "
                    f"backend, but this shard_map runs on {mesh!r} ({backend}); unshard it "
                    f"(fsharded.unshard) and pass the global value"
                )
            if backend == "virtual":
                x = from_stacked(x.plain(), x.spec, mesh)
        out.append(x)
    return out


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
    from torch.distributed.tensor import Replicate, Shard

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
    from torch.distributed.tensor import DTensor

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
