"""Live-bytes memory tracking on any device, CPU included.

``track()`` installs a dispatch mode that follows tensor *storages*: every storage an op
creates is recorded with its size and a category, and a C++-level weak reference tells
when the storage is really freed (not just when one Python tensor object dies: views,
and tensors autograd saved for backward, keep it alive). After every op the live bytes are
summed, so the peak is exact at op granularity.

Categories: storages created during backward are ``gradients``; those created by a
collective are ``comm buffers``; everything else is ``activations`` (temporaries
included). Trees that exist before tracking starts (parameters, optimizer state) are
registered with ``tracker.register(tree, category)`` and count as live from the start;
``tracker.reclassify(tree, category)`` moves storages created during tracking (a step's new
parameters, say) into another category, retroactively.

>>> with fs.memory.track() as mem:
...     mem.register(state.params, "parameters"); mem.register(state.opt_state, "optimizer state")
...     state, metrics = step(state, batch)
...     mem.reclassify(state.params, "parameters"); mem.reclassify(state.opt_state, "optimizer state")
>>> print(mem)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import optree
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MemoryTracker", "track", "current", "label", "CATEGORIES"]

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "comm buffers")

_CURRENT: contextvars.ContextVar[MemoryTracker | None] = contextvars.ContextVar("fsharded_memory", default=None)
_IN_COLLECTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("fsharded_in_collective", default=False)


@contextlib.contextmanager
def collective_scope() -> Iterator[None]:
    """Mark allocations as communication buffers (used by the collectives)."""
    tok = _IN_COLLECTIVE.set(True)
    try:
        yield
    finally:
        _IN_COLLECTIVE.reset(tok)


def _storage(t: torch.Tensor) -> Any | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
        return None


class MemoryTracker(TorchDispatchMode):
    """The dispatch mode behind ``track()``; read ``peak_bytes`` and ``peak_by_category``."""

    def __init__(self, *, include_meta: bool = False) -> None:
        super().__init__()
        # Meta tensors have sizes but no data: counting them measures a program without
        # running it (``fsharded.estimate_memory`` does, for activations).
        self.include_meta = include_meta
        # storage key -> [weak ref, nbytes]; categories kept apart so that reclassifying
        # after the fact also re-labels what was live at the peak.
        self._live: dict[int, list] = {}
        self._category: dict[int, str] = {}
        self._by_addr: dict[int, int] = {}
        self._serial = 0
        self._clock = 0  # ops seen so far
        # What backward allocates: gradients, unless a step function labels its parameter
        # gradients itself (then the rest of backward is activation gradients).
        self.backward_category = "gradients"
        self._born: dict[int, int] = {}
        self._died: dict[int, int] = {}
        self._size: dict[int, int] = {}
        self.peak_bytes = 0
        self._at_peak: list[tuple[int, int]] = []

    # -- registration ----------------------------------------------------------------------

    def _add(self, t: torch.Tensor, category: str) -> None:
        s = _storage(t)
        if s is None or (t.device.type == "meta" and not self.include_meta):
            return
        if self._lookup(s) is not None:
            return
        # A freed storage's address can be reused: entries get their own serial numbers,
        # so a category given later never re-labels an earlier, dead storage.
        self._serial += 1
        self._live[self._serial] = [StorageWeakRef(s), s.nbytes()]
        self._by_addr[s._cdata] = self._serial
        self._category[self._serial] = category
        self._born[self._serial] = self._clock
        self._size[self._serial] = s.nbytes()

    def _lookup(self, s: Any) -> int | None:
        serial = self._by_addr.get(s._cdata)
        if serial is None or serial not in self._live or self._live[serial][0].expired():
            return None
        return serial

    def register(self, tree: Any, category: str) -> None:
        """Count the storages of ``tree`` (already allocated) as live ``category``."""
        for t in optree.tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                self._add(t, category)
        self._update()

    def reclassify(self, tree: Any, category: str) -> None:
        """Move the storages of ``tree`` into ``category`` (for the peak too, approximately:
        the per-category peaks are recomputed from the current split)."""
        for t in optree.tree_leaves(tree):
            s = _storage(t) if isinstance(t, torch.Tensor) else None
            serial = self._lookup(s) if s is not None else None
            if serial is not None:
                self._category[serial] = category

    # -- accounting ------------------------------------------------------------------------

    def live_bytes(self) -> dict[str, int]:
        """Bytes alive now, by category."""
        out = dict.fromkeys(CATEGORIES, 0)
        for key, n in self._sweep():
            c = self._category[key]
            out[c] = out.get(c, 0) + n
        return out

    def _sweep(self) -> list[tuple[int, int]]:
        live, dead = [], []
        for key, (ref, n) in self._live.items():
            if ref.expired():
                dead.append(key)
            else:
                live.append((key, n))
        for key in dead:
            del self._live[key]
            self._died[key] = self._clock
        return live

    def _update(self) -> None:
        live = self._sweep()
        total = sum(n for _, n in live)
        if total > self.peak_bytes:
            self.peak_bytes = total
            self._at_peak = live

    def peak_of(self, categories: tuple[str, ...] | list[str]) -> int:
        """The largest number of bytes ever alive at once in ``categories`` (by the
        categories storages have now, so ``reclassify`` after the fact counts)."""
        events = []
        for serial, born in self._born.items():
            if self._category[serial] in categories:
                died = self._died.get(serial, self._clock + 1)
                events.append((born, self._size[serial]))
                events.append((died, -self._size[serial]))
        events.sort(key=lambda e: (e[0], e[1]))  # frees before allocations at one tick
        live = peak = 0
        for _, d in events:
            live += d
            peak = max(peak, live)
        return peak

    @property
    def peak_by_category(self) -> dict[str, int]:
        """What was alive at the peak, by (current) category."""
        out = dict.fromkeys(CATEGORIES, 0)
        for key, n in self._at_peak:
            c = self._category[key]
            out[c] = out.get(c, 0) + n
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._clock += 1
        out = func(*args, **(kwargs or {}))
        if _IN_COLLECTIVE.get():
            cat = "comm buffers"
        elif torch._C._current_autograd_node() is not None:
            cat = self.backward_category
        else:
            cat = "activations"
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t, cat)
        self._update()
        return out

    def __str__(self) -> str:
        rows = [(c, self.peak_by_category.get(c, 0)) for c in CATEGORIES]
        w = max(len(c) for c, _ in rows)
        lines = [f"peak live bytes: {self.peak_bytes / 2**20:,.2f} MiB, of which"]
        lines += [f"  {c.ljust(w)}  {n / 2**20:10,.2f} MiB" for c, n in rows]
        return "\n".join(lines)


@contextlib.contextmanager
def track(*, include_meta: bool = False) -> Iterator[MemoryTracker]:
    """Track live tensor bytes of everything run inside the block (see module doc).
    ``include_meta=True`` also counts meta tensors (sizes without data)."""
    mode = MemoryTracker(include_meta=include_meta)
    tok = _CURRENT.set(mode)
    try:
        with mode:
            yield mode
    finally:
        _CURRENT.reset(tok)
    mode._update()


def current() -> MemoryTracker | None:
    """The tracker of the innermost ``track()`` block, if any (step functions label their
    gradients and new state with it)."""
    return _CURRENT.get()


def label(tree: Any, category: str) -> None:
    """Reclassify ``tree``'s storages in the active tracker (no-op when none, or under
    torch.func transforms where tensors are wrappers)."""
    mem = _CURRENT.get()
    if mem is not None and not torch._C._are_functorch_transforms_active():
        mem.reclassify(tree, category)
