"""The axis environment: which mesh axes the running code is mapped over, and how.

``shard_map`` enters a frame for the duration of one call and leaves it on exit, like
JAX's axis env: context that never outlives the call, not global configuration.
Collectives look their axis names up here.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fsharded.mesh._mesh import Mesh

__all__ = ["AxisFrame", "Axes", "bind", "current", "enter"]


@dataclass(frozen=True, eq=False)
class AxisFrame:
    mesh: Mesh
    backend: str  # "virtual" | "distributed"
    # virtual: per-axis token, a vmapped arange(n) batched exactly at that axis' vmap level.
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    # distributed: this rank's mesh coordinates.
    coords: dict[str, int] = field(default_factory=dict)
    # The varying-axes table of this body (a ``_vma.VmaMode``), or None when untyped.
    vma: Any = None


@dataclass(frozen=True, eq=False)
class Axes:
    """Mesh axes a collective runs over, bound to the current frame."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    frame: AxisFrame

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    @property
    def virtual(self) -> bool:
        return self.frame.backend == "virtual"

    def single(self, name: str) -> Axes:
        return Axes((name,), (self.frame.mesh.shape[name],), self.frame)

    @property
    def label(self) -> str:
        return self.names[0] if len(self.names) == 1 else "(" + ",".join(self.names) + ")"


_FRAME: contextvars.ContextVar[AxisFrame | None] = contextvars.ContextVar(
    "fsharded_axis_frame", default=None
)


def current() -> AxisFrame | None:
    return _FRAME.get()


@contextlib.contextmanager
def enter(frame: AxisFrame) -> Iterator[AxisFrame]:
    if _FRAME.get() is not None:
        raise NotImplementedError(
            "nested shard_map is not supported yet; map over all the axes in one shard_map"
        )
    tok = _FRAME.set(frame)
    try:
        yield frame
    finally:
        _FRAME.reset(tok)


def bind(axis: Any, op: str) -> Axes:
    """Resolve ``axis`` (a name or tuple of names) against the enclosing shard_map."""
    names = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(axis, (tuple, list)) else None
    if names is None or not all(isinstance(a, str) for a in names):
        raise TypeError(f"{op}: axis must be a mesh axis name or a tuple of names, got {axis!r}")
    frame = _FRAME.get()
    if frame is None:
        raise ValueError(
            f"{op} over axis {axis!r} called outside shard_map: collectives need the mesh "
            f"axes bound by an enclosing shard_map(f, mesh=..., ...)"
        )
    missing = [a for a in names if a not in frame.mesh.shape]
    if missing:
        raise ValueError(
            f"{op}: axis {missing[0]!r} is not bound by the enclosing shard_map; "
            f"bound axes: {list(frame.mesh.axis_names)} ({frame.mesh!r})"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"{op}: axis tuple {names} names an axis twice")
    return Axes(names, tuple(frame.mesh.shape[a] for a in names), frame)
