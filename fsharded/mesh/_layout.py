"""Layout arithmetic: where each device's shard of a global tensor lies.

* virtual mesh: a *stacked* tensor with one leading dim per mesh axis the spec names (in
  mesh order), followed by the shard shape — what ``shard_map`` vmaps over;
* real ranks: this rank's local slice.

Values only: nothing here talks to other ranks.
"""

from __future__ import annotations

import math

import torch

from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec, _entry_axes, format_spec_errors, spec_errors

__all__ = ["to_stacked", "from_stacked", "local_slice", "check_tree", "check_sharded_tree",
           "global_shape", "dims", "spec_mesh_axes"]


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


def dims(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
    return [_entry_axes(spec[d]) if d < len(spec) else () for d in range(ndim)]


def to_stacked(x: torch.Tensor, spec: PartitionSpec, mesh: Mesh) -> torch.Tensor:
    """Global tensor -> ``(n_a, n_b, ..., *shard_shape)`` over the axes ``spec`` names."""
    new_shape: list[int] = []
    axis_pos: dict[str, int] = {}
    keep: list[int] = []
    for d, axes in enumerate(dims(spec, x.dim())):
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
    per_dim = dims(spec, y.dim() - len(spec_mesh_axes(spec, mesh)))
    lead = spec_mesh_axes(spec, mesh)
    nlead = len(lead)
    # Bring each axis dim next to the tensor dim it splits (major first), then merge.
    order: list[int] = []
    out_shape: list[int] = []
    for d, axes in enumerate(per_dim):
        order += [lead.index(a) for a in axes] + [nlead + d]
        out_shape.append(y.shape[nlead + d] * math.prod(mesh.shape[a] for a in axes))
    return y.permute(order).reshape(out_shape)


def spec_mesh_axes(spec: PartitionSpec, mesh: Mesh) -> list[str]:
    named = set(spec.axes)
    return [a for a in mesh.axis_names if a in named]


def local_slice(x: torch.Tensor, spec: PartitionSpec, mesh: Mesh, coords: dict[str, int]) -> torch.Tensor:
    """This device's shard of a global tensor (a view where possible)."""
    for d, axes in enumerate(dims(spec, x.dim())):
        if not axes:
            continue
        k, i = 1, 0
        for a in axes:
            k *= mesh.shape[a]
            i = i * mesh.shape[a] + coords[a]
        size = x.shape[d] // k
        x = x.narrow(d, i * size, size)
    return x


def check_sharded_tree(leaves: list, specs: list, paths: list[str], mesh: Mesh, backend: str,
                       what: str = "unshard") -> None:
    """Validate leaves in the backend's sharded form against their specs (for ``unshard``,
    or ``what`` else takes shards)."""
    bad = []
    for path, y, spec in zip(paths, leaves, specs):
        if not isinstance(y, torch.Tensor):
            if len(spec):
                bad.append((path, spec, (), [f"{type(y).__name__} is not a tensor and cannot be sharded"]))
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
                errs = spec_errors(spec, global_shape(spec, shape[len(lead):], mesh), mesh)
        else:
            errs = spec_errors(spec, global_shape(spec, shape, mesh), mesh)
        if errs:
            bad.append((path, spec, shape, errs))
    if bad:
        raise ValueError(f"{what}: " + format_spec_errors(bad, mesh))


def global_shape(spec: PartitionSpec, local_shape: tuple, mesh: Mesh) -> tuple[int, ...]:
    """The global shape whose shard has ``local_shape`` (axes must be in the mesh)."""
    out = list(local_shape)
    for d, e in enumerate(spec[: len(out)]):
        out[d] *= math.prod(mesh.shape[a] for a in _entry_axes(e))
    return tuple(out)
