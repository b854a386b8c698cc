"""The device mesh: ordered named axes with sizes."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["Mesh"]


class Mesh:
    """An ordered mapping of mesh axis names to sizes, e.g. ``Mesh({"data": 2, "tensor": 2})``.

    Devices are laid out row-major: the last axis varies fastest, so on ``torchrun`` the
    rank of coordinates ``(d, t)`` is ``d * 2 + t``. The same mesh runs on the virtual
    backend (one process) and on ``torch.distributed`` ranks. Frozen and hashable.

    >>> Mesh({"data": 2, "tensor": 2})
    Mesh(data=2, tensor=2)
    """

    __slots__ = ("_axes", "_device_type")

    def __init__(self, axes: Mapping[str, int] | Iterable[tuple[str, int]], *, device_type: str | None = None):
        items = tuple(axes.items() if isinstance(axes, Mapping) else axes)
        names = [n for n, _ in items]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be unique, got {names}")
        for n, s in items:
            if not isinstance(n, str) or not n:
                raise ValueError(f"mesh axis names must be non-empty strings, got {n!r}")
            if not isinstance(s, int) or isinstance(s, bool) or s < 1:
                raise ValueError(f"mesh axis {n!r} must have a positive int size, got {s!r}")
        object.__setattr__(self, "_axes", tuple((n, int(s)) for n, s in items))
        object.__setattr__(self, "_device_type", device_type)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Mesh is immutable")

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, in mesh order."""
        return dict(self._axes)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self._axes)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(s for _, s in self._axes)

    @property
    def size(self) -> int:
        """Number of devices."""
        return math.prod(self.axis_sizes)

    @property
    def device_type(self) -> str | None:
        return self._device_type

    def axis_size(self, axis: str | tuple[str, ...]) -> int:
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        return math.prod(self.shape[a] for a in axes)

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a flat (row-major) device index."""
        out = {}
        for n, s in reversed(self._axes):
            out[n] = rank % s
            rank //= s
        return {n: out[n] for n in self.axis_names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        r = 0
        for n, s in self._axes:
            r = r * s + coords[n]
        return r

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self._axes == other._axes

    def __hash__(self) -> int:
        return hash(("Mesh", self._axes))

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in self._axes) + ")"

    def __reduce__(self):
        # Keep device_type (set by from_torch) across pickling / torch.save.
        return (functools.partial(Mesh, device_type=self._device_type), (dict(self._axes),))

    # torch.distributed interop: fsharded.comm's (a value holds no process groups) ----------

    @classmethod
    def from_torch(cls, device_mesh: Any) -> Mesh:
        """Deprecated spelling of ``fs.comm.from_device_mesh(device_mesh)``: the ``Mesh`` of
        a ``DeviceMesh``, which is remembered for ``fs.comm.device_mesh``."""
        from fsharded import comm  # the one call up from the mesh: kept for existing callers

        return comm.from_device_mesh(device_mesh)

    def to_torch(self, device_type: str | None = None) -> Any:
        """Deprecated spelling of ``fs.comm.device_mesh(mesh, device_type=...)``: the
        ``DeviceMesh`` with this mesh's axes over the initialised process group."""
        from fsharded import comm  # the one call up from the mesh: kept for existing callers

        return comm.device_mesh(self, device_type=device_type)
