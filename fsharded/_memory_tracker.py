"""The memory tracker: a dispatch mode counting live tensor bytes by storage (``track``).

Its public face is ``fs.memory`` (``fsharded.tools.memory``), whose docstring says what is
counted and how. It sits at the bottom with its hooks (``fsharded._memory_hooks``), below
everything that measures with it: ``estimate_memory`` and the schedule's dry run run a step
on stand-ins under it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import optree
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

# The hooks the core calls live beside the tracker; fs.memory exports them too.
from fsharded._memory_hooks import (
    CURRENT,
    current,
    in_collective,
    is_paused,
    label,
)

__all__ = ["MemoryTracker", "track", "current", "label", "CATEGORIES"]

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "comm buffers")



def _preserved() -> bool:
    """Whether a storage keeps one Python object for its whole life (PyTorch preserves it,
    as for tensors): then a weak reference's callback fires exactly when the storage is
    freed, and deaths need no sweep over every live storage after each op."""
    t = torch.empty(1)
    return t.untyped_storage() is t.untyped_storage()


_PRESERVED = _preserved()


def _storage(t: torch.Tensor) -> Any | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
        return None


def _python_body(func: Any, args: tuple, kwargs: dict | None) -> Any:
    """The Python implementation of an ``fsharded::`` custom op called on no CUDA tensor
    and not told to run Triton (its pure-torch reference, whose temporaries the tracker
    should see), else None."""
    name = getattr(func, "name", None)
    qual = name() if callable(name) else None
    if not qual or not qual.startswith("fsharded::"):
        return None
    from torch._library import custom_ops

    opdef = custom_ops.OPDEFS.get(qual.split(".")[0])
    if opdef is None:
        return None
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in optree.tree_leaves((args, kwargs))):
        return None
    named = dict(zip((a.name for a in func._schema.arguments), args)) | dict(kwargs or {})
    if named.get("backend") == "triton" or named.get("impl") == "triton":
        return None  # a Triton kernel (the interpreter on CPU): its outputs are what it allocates
    return opdef._init_fn


class MemoryTracker(TorchDispatchMode):
    """The dispatch mode behind ``track()``; read ``peak_bytes`` and ``peak_by_category``."""

    def __init__(self, *, include_meta: bool = False, mesh: Any = None) -> None:
        super().__init__()
        # Meta tensors have sizes but no data: counting them measures a program without
        # running it (``fsharded.estimate_memory`` does, for activations).
        self.include_meta = include_meta
        # storage key -> weak ref (its bytes in ``_size``); categories kept apart so that
        # reclassifying after the fact also re-labels what was live at the peak.
        self._live: dict[int, Any] = {}  # StorageWeakRef, or a weakref.ref with a callback
        self._category: dict[int, str] = {}
        self._by_addr: dict[int, int] = {}
        self._serial = 0
        self._clock = 0  # ops seen so far
        self._in_op = False  # inside __torch_dispatch__: a death then belongs to this op
        # What backward allocates: gradients, unless a step function labels its parameter
        # gradients itself (then the rest of backward is activation gradients).
        self.backward_category = "gradients"
        self._born: dict[int, int] = {}
        self._died: dict[int, int] = {}
        self._size: dict[int, int] = {}  # bytes counted (per device, with a mesh)
        self._raw: dict[int, int] = {}  # bytes of the storage
        self._peak: tuple[int, int, int] | None = None  # (version, peak, tick), cached
        self._version = 0
        # Per device on the virtual mesh: every tensor's mesh axes (the vmap levels its
        # storage is batched over: one copy per device along them); a storage counts
        # its bytes divided by the number of copies it holds.
        self.mesh = mesh
        self._axes: WeakTensorKeyDictionary | None = WeakTensorKeyDictionary() if mesh is not None else None

    # -- registration ----------------------------------------------------------------------

    def _add(self, t: torch.Tensor, category: str, copies: int = 1) -> None:
        s = _storage(t)
        if s is None or (t.device.type == "meta" and not self.include_meta):
            return
        if self._lookup(s) is not None:
            return
        # A freed storage's address can be reused: entries get their own serial numbers,
        # so a category given later never re-labels an earlier, dead storage.
        self._serial += 1
        self._version += 1
        n = s.nbytes()
        serial, addr = self._serial, s._cdata
        if _PRESERVED:
            self._live[serial] = weakref.ref(s, lambda _, serial=serial, addr=addr: self._dead(serial, addr))
        else:
            self._live[serial] = StorageWeakRef(s)
        self._by_addr[addr] = serial
        self._category[self._serial] = category
        self._born[self._serial] = self._clock
        self._size[self._serial] = n // copies
        self._raw[self._serial] = n

    def _lookup(self, s: Any) -> int | None:
        serial = self._by_addr.get(s._cdata)
        if serial is None or serial not in self._live or (not _PRESERVED and self._live[serial].expired()):
            return None
        return serial

    def _dead(self, serial: int, addr: int) -> None:
        """A storage was freed (its weak reference's callback): inside an op it died in that
        op's tick; between ops, at the next one's (as a sweep after it would have seen)."""
        if self._live.pop(serial, None) is None:
            return
        if self._by_addr.get(addr) == serial:
            del self._by_addr[addr]
        self._died[serial] = self._clock if self._in_op else self._clock + 1
        self._version += 1

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
        if _PRESERVED:  # deaths are recorded as they happen
            return [(key, self._size[key]) for key in self._live]
        live, dead = [], []
        for key, ref in self._live.items():
            if ref.expired():
                dead.append(key)
            else:
                live.append((key, self._size[key]))
        for key in dead:
            del self._live[key]
            self._died[key] = self._clock
        if dead:
            self._version += 1
        return live

    def _update(self) -> None:
        if not _PRESERVED:
            self._sweep()

    def _events(self, keep: Any = None) -> Iterator[tuple[int, list[tuple[int, int]]]]:
        """The live bytes after every tick at which they changed, from the births and
        deaths of the storages ``keep`` accepts (all by default), with their sizes as
        they are now (a storage re-counted per device later counts so all its life)."""
        events: dict[int, list[tuple[int, int]]] = {}
        for serial, born in self._born.items():
            if keep is None or keep(serial):
                died = self._died.get(serial, self._clock + 1)
                events.setdefault(born, []).append((serial, self._size[serial]))
                events.setdefault(died, []).append((serial, -self._size[serial]))
        live = 0
        for tick in sorted(events):
            # Frees before allocations at one tick: storages freed and made during the same
            # op are seen by one sweep after it, which holds only the new ones.
            for _, d in sorted(events[tick], key=lambda e: e[1]):
                live += d
            yield tick, live

    def peak_of(self, categories: tuple[str, ...] | list[str]) -> int:
        """The largest number of bytes ever alive at once in ``categories`` (by the
        categories storages have now, so ``reclassify`` after the fact counts)."""
        cats = set(categories)
        return max((live for _, live in self._events(lambda s: self._category[s] in cats)), default=0)

    def _peak_tick(self) -> tuple[int, int]:
        if self._peak is None or self._peak[0] != self._version:
            peak, at = 0, -1
            for tick, live in self._events():
                if live > peak:
                    peak, at = live, tick
            self._peak = (self._version, peak, at)
        return self._peak[1], self._peak[2]

    @property
    def peak_bytes(self) -> int:
        """The largest number of bytes alive at once (per device, with a mesh)."""
        return self._peak_tick()[0]

    @property
    def peak_by_category(self) -> dict[str, int]:
        """What was alive at the peak, by (current) category."""
        _, at = self._peak_tick()
        out = dict.fromkeys(CATEGORIES, 0)
        for serial, born in self._born.items():
            if born <= at < self._died.get(serial, self._clock + 1):
                c = self._category[serial]
                out[c] = out.get(c, 0) + self._size[serial]
        return out

    # -- per device on the virtual mesh ------------------------------------------------------

    def axes_of(self, t: torch.Tensor) -> frozenset:
        """The mesh axes ``t``'s storage holds one copy per device along (virtual mesh)."""
        if self._axes is None:
            return frozenset()
        return self._axes.get(t, frozenset())

    def _copies(self, axes: frozenset) -> int:
        n = 1
        for a in axes:
            n *= self.mesh.shape.get(a, 1)
        return n

    def tag(self, t: torch.Tensor, axes: Any, *, since: int | None = None,
            layout: bool = False) -> None:
        """Record that ``t`` holds one copy per device along ``axes``. Its storage is
        re-counted when it was made at tick ``since`` or later (the op that made it could
        not tell), or always with ``layout`` (a global tensor laid out by a spec)."""
        if self._axes is None or not isinstance(t, torch.Tensor):
            return
        axes = frozenset(axes)
        self._axes[t] = axes
        s = _storage(t)
        serial = self._lookup(s) if s is not None else None
        if serial is not None and (layout or (since is not None and self._born[serial] >= since)):
            n = self._raw[serial] // self._copies(axes)
            if n != self._size[serial]:
                self._size[serial] = n
                self._version += 1

    @property
    def clock(self) -> int:
        return self._clock

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if is_paused():  # not this device's: run it, count nothing
            return func(*args, **(kwargs or {}))
        self._clock += 1
        self._in_op = True  # what dies from here to the end of this op dies in its tick
        try:
            return self._dispatch(func, args, kwargs)
        finally:
            self._in_op = False

    def _dispatch(self, func, args, kwargs):
        body = _python_body(func, args, kwargs)
        if body is not None:
            # One of fsharded's own kernels off the GPU: its reference runs in Python here,
            # and what it allocates inside (the score matrix of a flash attention) counts.
            with self:
                return body(*args, **(kwargs or {}))
        # The operands' storages and their sizes: an output on one of them is a view or an
        # in-place write, new bytes only where the op grew it (``out=`` resized).
        operands = {s._cdata: s.nbytes() for t in optree.tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor) and (s := _storage(t)) is not None}
        out = func(*args, **(kwargs or {}))
        if in_collective():
            cat = "comm buffers"
        elif torch._C._current_autograd_node() is not None:
            cat = self.backward_category
        else:
            cat = "activations"
        outs = [t for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        # A view of an operand (or the operand, written in place) holds no new bytes: with
        # the operand allocated before tracking began (a weight, the batch), counting it
        # here would charge the program for memory it did not allocate. A storage the op
        # grew was reallocated: its old bytes freed here, its new ones allocated.
        new = []
        for t in outs:
            st = _storage(t)
            if st is None or st._cdata not in operands:
                new.append(t)
            elif st.nbytes() > operands[st._cdata]:
                serial = self._lookup(st)
                if serial is not None:
                    self._dead(serial, st._cdata)
                operands[st._cdata] = st.nbytes()  # once, if it is output twice
                new.append(t)
        if self._axes is not None:
            # An op's result varies along every axis any of its operands does (vmap's
            # batching rules keep batch dims; the collectives re-tag their results).
            axes = frozenset().union(*(self._axes.get(t, frozenset()) for t in
                                       optree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)))
            copies = self._copies(axes)
            for t in outs:  # views too: later ops take their axes from them
                self._axes[t] = axes
            for t in new:
                self._add(t, cat, copies)
        else:
            for t in new:
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
def track(*, include_meta: bool = False, mesh: Any = None) -> Iterator[MemoryTracker]:
    """Track live tensor bytes of everything run inside the block (see module doc).
    ``include_meta=True`` also counts meta tensors (sizes without data). ``mesh``: count
    per device what a virtual-mesh program holds for all of its devices in this process
    (see "Per device" in the module doc); on real ranks each process is one device and
    ``mesh`` changes nothing."""
    mode = MemoryTracker(include_meta=include_meta, mesh=mesh)
    tok = CURRENT.set(mode)
    try:
        with mode:
            yield mode
    finally:
        CURRENT.reset(tok)
    mode._update()
