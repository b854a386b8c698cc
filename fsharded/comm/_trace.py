"""Timing of the collectives this rank runs and of the step's phases (``fsharded.timeline``).

While a recording is open (``start`` ... ``stop``), every eager collective of
``fsharded.comm._shm`` is timed (``traced``): a blocking call from its entry to its
return; an asynchronous one (``async_op=True``) from its issue to the first moment this
rank saw it complete (``wait()`` returned or ``is_completed()`` said so), which bounds its
real end from above. ``span(name)`` times a phase of the program (forward, backward).
Times are ``time.perf_counter()`` seconds (CLOCK_MONOTONIC: one clock for every process
on a host). Nothing is recorded, and nothing costs more than one global read, otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CommEvent", "Span", "start", "stop", "traced", "span", "active", "autograd_phase", "phase"]

# The step's part outside autograd's backward (``phase``): "forward" unless a step says
# it reduces gradients ("reduce") or updates ("update").
_PHASE: contextvars.ContextVar[str] = contextvars.ContextVar("fsharded_phase", default="forward")


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Collectives issued inside are of phase ``name`` (outside autograd's backward, which
    is always "backward"): a step's gradient reduction after backward is "reduce", its
    clipping, update and metrics "update"."""
    token = _PHASE.set(name)
    try:
        yield
    finally:
        _PHASE.reset(token)


@dataclass
class CommEvent:
    """One collective on this rank: ``op`` over a group of ``group_size`` ranks on a
    tensor of ``nbytes`` (the operand this rank contributes)."""

    op: str
    group_size: int
    nbytes: int
    phase: str  # "backward" when called inside autograd's backward, else "forward"
    start: float
    end: float | None  # None until an asynchronous one is seen complete
    asynchronous: bool


@dataclass
class Span:
    """A phase of the program on this rank."""

    name: str
    start: float
    end: float


class _Recording:
    def __init__(self) -> None:
        self.events: list[CommEvent] = []
        self.spans: list[Span] = []


_REC: _Recording | None = None


def active() -> bool:
    return _REC is not None


def start() -> _Recording:
    global _REC
    if _REC is not None:
        raise RuntimeError("fsharded.timeline: a recording is already open on this rank")
    _REC = _Recording()
    return _REC


def stop() -> _Recording | None:
    global _REC
    rec, _REC = _REC, None
    return rec


def autograd_phase() -> str:
    """"backward" inside autograd's backward pass, else the phase ``phase`` set
    ("forward" by default)."""
    try:
        node = torch._C._current_autograd_node()
    except AttributeError:  # pragma: no cover - older torch
        node = None
    return "backward" if node is not None else _PHASE.get()


class _TracedWork:
    """An asynchronous collective's work handle that notes when it was seen complete."""

    def __init__(self, work: Any, event: CommEvent) -> None:
        self._work, self._event = work, event

    def _seen(self) -> None:
        if self._event.end is None:
            self._event.end = time.perf_counter()

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        self._seen()
        return out

    def is_completed(self) -> bool:
        done = self._work.is_completed() if hasattr(self._work, "is_completed") else False
        if done:
            self._seen()
        return done


def traced(op: str, src: int, group: int = 2, *, started: bool = False) -> Callable:
    """Time the decorated collective (``args[src]``: the tensor this rank sends,
    ``args[group]`` the axis group) while a recording is open. Asynchronous: called with
    ``async_op=True`` (the result is the work handle), or ``started`` (the result is
    ``(buffer, pending)``, ``send_recv_start``'s)."""

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            rec = _REC
            if rec is None:
                return fn(*args, **kwargs)
            x, g = args[src], args[group]
            ev = CommEvent(op, g.size, x.numel() * x.element_size(), autograd_phase(), time.perf_counter(), None,
                           started or bool(kwargs.get("async_op", False)))
            rec.events.append(ev)
            out = fn(*args, **kwargs)
            if started:  # point-to-point requests: complete when waited for
                return out[0], _TracedWork(out[1], ev)
            if ev.asynchronous and out is not None:
                work = _TracedWork(out, ev)
                work.is_completed()  # done at issue (the shared-memory transport): ends now
                return work
            ev.end = time.perf_counter()
            return out

        return wrapper

    return deco


# The code object of every traced collective's wrapper frame, which call-site fingerprints
# (``_shm._site``) step over.
WRAPPER_CODE = traced("", 0)(lambda *a, **k: None).__code__


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """Time a phase of the program while a recording is open."""
    rec = _REC
    if rec is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        rec.spans.append(Span(name, t0, time.perf_counter()))
