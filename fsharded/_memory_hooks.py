"""The memory tracker's hooks, low enough for the core to call: the collectives mark their
buffers (``collective_scope``), the step and the ZeRO gathers name what they make
(``label``), the virtual mesh tags values per device (``tag``, ``per_device``). Each is a
no-op unless a tracker (``fsharded._memory_tracker.track``, ``fs.memory.track``) has made
itself current here; none of them imports it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import optree
import torch

__all__ = ["collective_scope", "in_collective", "current", "per_device", "tag", "label", "paused", "is_paused",
           "CURRENT"]

# The active tracker (a ``fsharded._memory_tracker.MemoryTracker``), set by its ``track``.
CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("fsharded_memory", default=None)
_IN_COLLECTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("fsharded_in_collective", default=False)
_PAUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("fsharded_memory_paused", default=False)


@contextlib.contextmanager
def collective_scope() -> Iterator[None]:
    """Mark allocations as communication buffers (used by the collectives)."""
    tok = _IN_COLLECTIVE.set(True)
    try:
        yield
    finally:
        _IN_COLLECTIVE.reset(tok)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Allocations in the block are not counted (what another device does, run here for
    its values only: the other pipe ranks' actions in a dry run of one rank's step). A
    storage counted before still dies when it is freed."""
    tok = _PAUSED.set(True)
    try:
        yield
    finally:
        _PAUSED.reset(tok)


def is_paused() -> bool:
    """Whether allocations now go uncounted (``paused``)."""
    return _PAUSED.get()


def in_collective() -> bool:
    """Whether allocations now are a collective's buffers."""
    return _IN_COLLECTIVE.get()


def tag(t: Any, axes: Any, *, since: int | None = None, layout: bool = False) -> None:
    """``MemoryTracker.tag`` on the active per-device tracker (no-op when none)."""
    mem = CURRENT.get()
    if mem is not None and mem._axes is not None:
        mem.tag(t, axes, since=since, layout=layout)


def per_device() -> Any:
    """The active tracker if it counts per device on a mesh, else None."""
    mem = CURRENT.get()
    return mem if mem is not None and mem._axes is not None else None


def current() -> Any:
    """The tracker of the innermost ``track()`` block, if any (step functions label their
    gradients and new state with it)."""
    return CURRENT.get()


def label(tree: Any, category: str) -> None:
    """Reclassify ``tree``'s storages in the active tracker (no-op when none). A value
    wrapped by torch.func (batched by vmap on the virtual mesh, tracked by grad) is found
    by the tensor beneath its levels, which the tracker sees."""
    mem = CURRENT.get()
    if mem is None:
        return
    F = torch._C._functorch
    plain = []
    for t in optree.tree_leaves(tree):
        if not isinstance(t, torch.Tensor):
            continue
        while F.is_functorch_wrapped_tensor(t):
            t = F.get_unwrapped(t)
        plain.append(t)
    mem.reclassify(plain, category)
