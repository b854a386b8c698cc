"""Recording of the collectives a shard_map'ed function runs: the collective manifest.

Every collective passes through ``record``; while a ``recording()`` context is open each
call is appended, in program order, as an ``Entry``. ``shard_map(...).collectives(*args)``
runs the function without its data (a dry run: meta or fake tensors on the virtual mesh,
or one device's values where the program reads them; see ``_schedule``), with no
communication, inside such a context.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fsharded.comm._trace import autograd_phase

__all__ = ["Entry", "Manifest", "recording"]


@dataclass(frozen=True)
class Entry:
    """One collective call: ``op`` over ``axis`` on a per-shard tensor of ``shape``."""

    op: str
    axis: str
    axis_size: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    bytes_sent: int  # per rank, ring algorithms
    phase: str  # "backward" inside autograd's backward, else "forward" (a step: "reduce", "update")
    params: tuple = ()

    def __str__(self) -> str:
        return (
            f"{self.phase:8s} {self.op:20s} {self.axis:>14s} {str(self.dtype).replace('torch.', ''):9s} "
            f"{str(list(self.shape)):>18s} {self.bytes_sent:>12,d}"
        )


class Manifest(tuple):
    """An ordered tuple of ``Entry``; prints as a table with totals per axis."""

    def total_bytes(self, axis: str | None = None) -> int:
        return sum(e.bytes_sent for e in self if axis is None or e.axis == axis)

    def by_axis(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self:
            out[e.axis] = out.get(e.axis, 0) + e.bytes_sent
        return out

    def ops(self) -> list[tuple[str, str]]:
        return [(e.op, e.axis) for e in self]

    def __str__(self) -> str:
        head = f"{'phase':8s} {'op':20s} {'axis':>14s} {'dtype':9s} {'local shape':>18s} {'bytes/rank':>12s}"
        lines = [head, "-" * len(head)]
        lines += [str(e) for e in self]
        lines.append("-" * len(head))
        for ax, b in self.by_axis().items():
            lines.append(f"total over {ax}: {b:,d} bytes sent per rank")
        if not self:
            lines.append("(no collectives)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Manifest({len(self)} collectives, {self.total_bytes():,d} bytes/rank)"


_REC: contextvars.ContextVar[list | None] = contextvars.ContextVar("fsharded_manifest", default=None)


_DRY: contextvars.ContextVar[bool] = contextvars.ContextVar("fsharded_dry_run", default=False)


@contextlib.contextmanager
def recording(*, dry: bool = False) -> Iterator[list]:
    """Record every collective called inside. ``dry=True`` (a dry run as one device, on
    real ranks or not): collectives answer locally (``_prims.dry_answer``: their result if
    every shard held this one's value, of the exact shape) and send nothing, so a rank can
    list its own schedule without its peers."""
    entries: list = []
    tok, dtok = _REC.set(entries), _DRY.set(dry)
    try:
        yield entries
    finally:
        _REC.reset(tok)
        _DRY.reset(dtok)


def mark() -> int:
    """How many collectives the active record holds (0 outside ``recording``)."""
    rec = _REC.get()
    return len(rec) if rec is not None else 0


def rewind(n: int) -> None:
    """Drop what the active record got after ``mark()`` gave ``n``: collectives of an
    attempt that was abandoned and is run again."""
    rec = _REC.get()
    if rec is not None:
        del rec[n:]


def active() -> bool:
    """Whether collectives are being recorded (``recording``), dry or not."""
    return _REC.get() is not None


def dry() -> bool:
    """Inside ``recording(dry=True)``."""
    return _DRY.get()


def record(prim: Any, params: tuple, axes: Any, x: torch.Tensor) -> None:
    entries = _REC.get()
    if entries is None:
        return
    n = axes.size
    shape = tuple(x.shape)
    entries.append(
        Entry(
            op=prim.name,
            axis=axes.label,
            axis_size=n,
            dtype=x.dtype,
            shape=shape,
            bytes_sent=int(prim.sent(shape, x.element_size(), n, params)) if n > 1 else 0,
            phase=autograd_phase(),
            params=params,
        )
    )
