"""PartitionSpec, NamedSharding and spec validation against shapes and meshes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fsharded.mesh._mesh import Mesh

__all__ = ["PartitionSpec", "P", "NamedSharding", "spec_axes", "check_spec", "shard_shape"]


class PartitionSpec(tuple):
    """How each tensor dim maps onto mesh axes: ``P("data", None)``, ``P(("tensor", "data"))``.

    Entry ``i`` is ``None`` (dim ``i`` is not sharded), an axis name, or a tuple of axis
    names (dim ``i`` is split over their product, major axis first). Axes the spec does not
    name replicate the tensor. Trailing dims beyond the spec are not sharded. Frozen and
    hashable, like JAX's.

    >>> P("data", None)
    PartitionSpec('data', None)
    """

    __slots__ = ()

    def __new__(cls, *entries: Any) -> PartitionSpec:
        norm = []
        for e in entries:
            if e is None or isinstance(e, str):
                norm.append(e)
            elif isinstance(e, (tuple, list)) and all(isinstance(a, str) for a in e):
                t = tuple(e)
                norm.append(None if not t else (t[0] if len(t) == 1 else t))
            else:
                raise TypeError(
                    f"PartitionSpec entries are None, an axis name or a tuple of axis names; "
                    f"got {e!r}"
                )
        return super().__new__(cls, norm)

    def __repr__(self) -> str:
        return "PartitionSpec(" + ", ".join(repr(e) for e in self) + ")"

    def __reduce__(self):
        return (PartitionSpec, tuple(self))

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec names, in order of appearance."""
        try:
            return _AXES[self]
        except KeyError:
            return _AXES.setdefault(self, spec_axes(self))


# PartitionSpec.axes of the specs seen (a program has few; read per leaf per step).
_AXES: dict[PartitionSpec, tuple[str, ...]] = {}


P = PartitionSpec


def _entry_axes(e: Any) -> tuple[str, ...]:
    if e is None:
        return ()
    return (e,) if isinstance(e, str) else tuple(e)


def spec_axes(spec: Sequence) -> tuple[str, ...]:
    return tuple(a for e in spec for a in _entry_axes(e))


def spec_errors(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> list[str]:
    """Every way ``spec`` fails to fit a tensor of ``shape`` on ``mesh`` (empty if it fits)."""
    errs = []
    if len(spec) > len(shape):
        errs.append(
            f"spec has {len(spec)} entries but the tensor has rank {len(shape)}; "
            f"drop the extra entries"
        )
    seen: set[str] = set()
    for d, e in enumerate(spec):
        axes = _entry_axes(e)
        for a in axes:
            if a not in mesh.shape:
                errs.append(f"axis {a!r} is not in the mesh (axes: {list(mesh.axis_names)})")
            elif a in seen:
                errs.append(f"axis {a!r} is used twice; each mesh axis may shard one dim")
            seen.add(a)
        if d < len(shape) and axes and all(a in mesh.shape for a in axes):
            k = math.prod(mesh.shape[a] for a in axes)
            if shape[d] % k:
                sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
                errs.append(
                    f"dim {d} of size {shape[d]} is not divisible by {k} ({sizes}); "
                    f"pad it to a multiple of {k} or shard another dim"
                )
    return errs


def check_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh, path: str = "<root>") -> None:
    errs = spec_errors(spec, shape, mesh)
    if errs:
        raise ValueError(format_spec_errors([(path, spec, tuple(shape), errs)], mesh))


def format_spec_errors(items: list[tuple[str, Any, tuple, list[str]]], mesh: Mesh) -> str:
    lines = [f"{len(items)} leaf spec(s) do not fit {mesh!r}:"]
    for path, spec, shape, errs in items:
        lines.append(f"  {path}: spec {spec!r}, shape {tuple(shape)}")
        lines.extend(f"    - {e}" for e in errs)
    return "\n".join(lines)


def shard_shape(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> tuple[int, ...]:
    out = list(shape)
    for d, e in enumerate(spec):
        k = math.prod(mesh.shape[a] for a in _entry_axes(e))
        out[d] //= k
    return tuple(out)


@dataclass(frozen=True)
class NamedSharding:
    """A ``PartitionSpec`` bound to a ``Mesh``.

    >>> NamedSharding(Mesh({"data": 2}), P("data")).shard_shape((8, 3))
    (4, 3)
    """

    mesh: Mesh
    spec: PartitionSpec

    def __post_init__(self) -> None:
        if not isinstance(self.spec, PartitionSpec):
            object.__setattr__(self, "spec", PartitionSpec(*self.spec))
        bad = [a for a in self.spec.axes if a not in self.mesh.shape]
        if bad:
            raise ValueError(f"spec {self.spec!r} names axes {bad} not in {self.mesh!r}")

    def shard_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of one shard of a tensor of ``global_shape``; ``ValueError`` if it does not fit."""
        check_spec(self.spec, global_shape, self.mesh)
        return shard_shape(self.spec, global_shape, self.mesh)

    def is_replicated_over(self, axis: str) -> bool:
        return axis not in self.spec.axes
