"""Where a checkpoint save puts each leaf: the manifest's entries, each writer's blocks
(the boxes of the global value its devices write: coordinate 0 along the axes a spec
leaves out), their offsets and bytes in the data file; checked against the specs first."""

from __future__ import annotations

import collections
import math
from typing import Any

import torch

from fsharded.mesh import Mesh, PartitionSpec
from fsharded.mesh._layout import check_sharded_tree, check_tree, dims, global_shape, local_slice


def _spec_json(spec: PartitionSpec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _box(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh, coords: dict) -> tuple[list, list]:
    """(start, size) of the device at ``coords``'s shard of a global ``shape`` under ``spec``."""
    start, size = [0] * len(shape), list(shape)
    for d, axes in enumerate(dims(spec, len(shape))):
        k, i = 1, 0
        for a in axes:
            k *= mesh.shape[a]
            i = i * mesh.shape[a] + coords[a]
        size[d] = shape[d] // k
        start[d] = i * size[d]
    return start, size


def _writes(spec: PartitionSpec, coords: dict, owner: tuple | None = None) -> bool:
    """Whether this device writes its shard: coordinate 0 along the axes the spec leaves out,
    but along an ``owner``'s axis (``(axis, coordinates)``: only those hold the leaf) the
    first of its coordinates."""
    named = set(spec.axes)
    if owner is not None:
        axis, where = owner
        if coords[axis] != min(where):
            return False
        named.add(axis)
    return all(c == 0 for a, c in coords.items() if a not in named)



class _Layout:
    """Where a save puts the leaves of one kind of tree (its structure, each leaf's shape
    and dtype, the specs, the mesh, the writer): the manifest's entries of its tensors
    (``None`` for a JSON value, stored as it is at each save), this writer's blocks as
    (path, start, shape, leaf index, (spec, coords) to slice a global value or ``None``),
    and each block's bytes and offset in the data file (``total``: the file's size)."""

    __slots__ = ("entries", "blocks", "nbytes", "offsets", "total")

    def __init__(self, paths: list, leaves: list, flat_specs: list, mesh: Mesh, dist: bool,
                 rank: int, owners: list | None = None) -> None:
        self.entries: list[dict | None] = []
        self.blocks: list[tuple] = []
        self.nbytes: list[int] = []
        self.offsets: list[int] = []
        self.total = 0
        flat_specs = [s if isinstance(s, PartitionSpec) else PartitionSpec() for s in flat_specs]
        _check_specs(paths, leaves, flat_specs, mesh, dist)
        writers = [mesh.coords(rank)] if dist else [mesh.coords(i) for i in range(mesh.size)]
        owners = owners if owners is not None else [None] * len(leaves)
        for i, (path, x, spec, owner) in enumerate(zip(paths, leaves, flat_specs, owners)):
            if not isinstance(x, torch.Tensor):
                self.entries.append(None)
                continue
            shape = global_shape(spec, tuple(x.shape), mesh) if dist else tuple(x.shape)
            self.entries.append({"path": path, "shape": list(shape), "dtype": str(x.dtype),
                                 "spec": _spec_json(spec)})
            for coords in writers:
                if _writes(spec, coords, owner):
                    start, size = _box(spec, shape, mesh, coords)
                    self.blocks.append((path, start, size, i, None if dist else (spec, coords)))
                    self.offsets.append(self.total)
                    self.nbytes.append(math.prod(size) * x.element_size())
                    self.total += self.nbytes[-1]


def _check_specs(paths: list, leaves: list, flat_specs: list, mesh: Mesh, dist: bool) -> None:
    """Every leaf storable, at a path of its own, and its spec fitting it (a global value on
    one process, this rank's shard on real ranks): otherwise the blocks would not cover the
    leaf, and a save would succeed that no load can read. One error listing every failing
    leaf."""
    for path, x in zip(paths, leaves):
        if not isinstance(x, (torch.Tensor, int, float, bool, str)) and x is not None:
            raise TypeError(f"checkpoint.save: {path} is a {type(x).__name__}; leaves must "
                            f"be tensors or JSON values (int, float, bool, str)")
    twice = sorted(p for p, n in collections.Counter(paths).items() if n > 1)
    if twice:  # a checkpoint addresses its leaves by path: one would overwrite the other
        raise ValueError(f"checkpoint.save: several leaves have the dotted path {', '.join(map(repr, twice[:5]))} "
                         f"(a key with dots spelling the path of another leaf, or 1 and '1' as keys of one dict); "
                         f"rename one of the keys")
    if dist:
        check_sharded_tree(leaves, flat_specs, paths, mesh, "distributed", what="checkpoint.save")
    else:
        check_tree(leaves, flat_specs, paths, mesh, "checkpoint.save")


_LAYOUTS: dict = {}  # the layouts of the trees saved lately (a step saves the same kind again)


def _layout(paths: list, leaves: list, flat_specs: list, mesh: Mesh, dist: bool, rank: int,
            tdef: Any, owners: list | None = None) -> tuple[_Layout, list[dict], list[tuple]]:
    """The layout of a save (remembered by ``tdef`` and the paths, the leaves' shapes and
    dtypes, the specs, the mesh and the writer), the manifest's leaf entries and this
    writer's blocks: (path, start, shape, tensor)."""
    key = (tdef, tuple(paths), mesh, dist, rank,  # the paths: {1: x} and {True: x} have equal treespecs
           tuple((x.shape, x.dtype) if isinstance(x, torch.Tensor) else type(x) for x in leaves))
    try:
        key = (key, tuple(flat_specs), tuple(owners) if owners is not None else None)
        layout = _LAYOUTS.get(key)
    except TypeError:  # an unhashable spec
        key = layout = None
    if layout is None:
        layout = _Layout(paths, leaves, flat_specs, mesh, dist, rank, owners)
        if key is not None:
            if len(_LAYOUTS) >= 16:
                _LAYOUTS.clear()
            _LAYOUTS[key] = layout
    entries = [e if e is not None else {"path": p, "value": x}
               for e, p, x in zip(layout.entries, paths, leaves)]
    pieces = [(path, start, size, leaves[i] if where is None else local_slice(leaves[i], where[0], mesh, where[1]))
              for path, start, size, i, where in layout.blocks]
    return layout, entries, pieces
