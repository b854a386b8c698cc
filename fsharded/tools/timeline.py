"""A measured timeline of the collectives of a step on real ranks, and of its phases.

>>> with fsharded.timeline.record() as tl:       # on every rank
...     state, metrics = step(state, batch)
>>> tl.show()                                     # rank 0 prints; tl.figure() draws

Every eager collective the ranks run while the recording is open is timed on its rank: a
blocking one from its call to its return, an asynchronous one (ZeRO-3's prefetched
gathers and in-backward reduce-scatters, ring attention's K/V exchange) from its issue to
the first moment the rank saw it complete, which bounds its end from above. The step's
phases are timed too (``step``, and ``forward`` / ``backward`` of each micro-batch on real
ranks). On exit every rank's record is gathered to every rank (one ``all_gather_object``),
so any rank can draw all of them; times are seconds from the earliest rank's start
(``time.perf_counter``: one clock for the processes of a host; across hosts each rank's
times are relative to the barrier that opens the recording).

``comm_s(rank)`` is the time the rank spent blocked in collectives, ``async_s(rank)`` the
time asynchronous ones were in flight, and ``overlap_s(rank)`` the part of that when the
rank was not blocked in another collective (communication hidden behind compute). On the
virtual mesh nothing is communicated and the timeline is empty (its collectives are
array operations in one process); ``step.collectives(state, batch)`` lists what real
ranks would send.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from fsharded.comm import _trace
from fsharded.comm._trace import CommEvent, Span
from fsharded.tools.visualize import _rank

__all__ = ["record", "Timeline", "RankRecord"]


@dataclass
class RankRecord:
    """One rank's record: its collectives and phases, in seconds from the timeline's start."""

    rank: int
    start: float
    end: float
    events: list[CommEvent] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in _union(intervals))


def _minus(a: tuple[float, float], blocked: list[tuple[float, float]]) -> float:
    """Length of interval ``a`` outside the (merged) ``blocked`` intervals."""
    total = a[1] - a[0]
    for s, e in blocked:
        total -= max(0.0, min(a[1], e) - max(a[0], s))
    return total


@dataclass
class Timeline:
    """The ranks' records (``ranks``, by rank), filled when ``record()`` exits."""

    ranks: list[RankRecord] = field(default_factory=list)
    virtual: bool = False

    # -- numbers ----------------------------------------------------------------------

    def _rank(self, rank: int) -> RankRecord:
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(f"timeline: no record of rank {rank} (ranks: {[r.rank for r in self.ranks]})")

    def blocking(self, rank: int = 0) -> list[CommEvent]:
        return [e for e in self._rank(rank).events if not e.asynchronous]

    def asynchronous(self, rank: int = 0) -> list[CommEvent]:
        return [e for e in self._rank(rank).events if e.asynchronous]

    def comm_s(self, rank: int = 0) -> float:
        """Seconds the rank was blocked in collectives."""
        return _length([(e.start, e.end) for e in self.blocking(rank)])

    def async_s(self, rank: int = 0) -> float:
        """Seconds asynchronous collectives were in flight (their union)."""
        return _length([(e.start, e.end) for e in self.asynchronous(rank)])

    def overlap_s(self, rank: int = 0) -> float:
        """Seconds asynchronous collectives were in flight while the rank computed (not
        blocked in another collective)."""
        blocked = _union([(e.start, e.end) for e in self.blocking(rank)])
        flying = _union([(e.start, e.end) for e in self.asynchronous(rank)])
        return sum(_minus(iv, blocked) for iv in flying)

    def span_s(self, name: str, rank: int = 0) -> float:
        return sum(s.end - s.start for s in self._rank(rank).spans if s.name == name)

    # -- text -------------------------------------------------------------------------

    def text(self, *, rows: int = 40) -> str:
        if self.virtual or not self.ranks:
            return ("timeline: no collectives were timed (on the virtual mesh they are array operations in "
                    "one process; record a step on real ranks, e.g. under torchrun)")
        out = []
        for r in self.ranks:
            step = r.end - r.start
            out.append(f"rank {r.rank}: {len(r.events)} collectives in {step * 1e3:.2f} ms; blocked in "
                       f"collectives {self.comm_s(r.rank) * 1e3:.2f} ms, asynchronous in flight "
                       f"{self.async_s(r.rank) * 1e3:.2f} ms ({self.overlap_s(r.rank) * 1e3:.2f} ms beside compute)")
            for s in r.spans:
                if s.name != "step":
                    continue
                out.append(f"  step {s.start * 1e3:9.2f} -> {s.end * 1e3:9.2f} ms; forward "
                           f"{self.span_s('forward', r.rank) * 1e3:.2f} ms, backward "
                           f"{self.span_s('backward', r.rank) * 1e3:.2f} ms")
            out.append(f"  {'start ms':>9s} {'ms':>8s}  {'op':14s} {'ranks':>5s} {'bytes':>12s}  phase")
            for e in r.events[:rows]:
                out.append(f"  {e.start * 1e3:9.2f} {(e.end - e.start) * 1e3:8.3f}  {e.op:14s} {e.group_size:5d} "
                           f"{e.nbytes:12,d}  {e.phase}{' (async)' if e.asynchronous else ''}")
            if len(r.events) > rows:
                out.append(f"  ... {len(r.events) - rows} more")
        return "\n".join(out)

    __str__ = text

    def __repr__(self) -> str:
        return f"Timeline({len(self.ranks)} ranks, {sum(len(r.events) for r in self.ranks)} collectives)"

    def show(self) -> None:
        if _rank() == 0:
            print(self.text())

    # -- picture ----------------------------------------------------------------------

    def figure(self, ax: Any = None) -> Any:
        """Two lanes per rank: the phases (forward, backward, the rest of the step) above,
        the collectives below (blocking solid, asynchronous hatched and lighter), in ms."""
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        fig, ax = plt.subplots(figsize=(9, 0.9 + 1.1 * max(1, len(self.ranks)))) if ax is None else (ax.figure, ax)
        phase_colours = {"step": "#dddddd", "forward": "#4c72b0", "backward": "#dd8452"}
        ops = sorted({e.op for r in self.ranks for e in r.events})
        cmap = plt.get_cmap("tab10")
        op_colour = {op: cmap((i + 2) % 10) for i, op in enumerate(ops)}
        ticks, labels = [], []
        for i, r in enumerate(sorted(self.ranks, key=lambda r: r.rank)):
            y = 2.5 * i
            for name in ("step", "forward", "backward"):
                bars = [(s.start * 1e3, (s.end - s.start) * 1e3) for s in r.spans if s.name == name]
                if bars:
                    ax.broken_barh(bars, (y + 1.05, 0.8), facecolors=phase_colours[name])
            for e in r.events:
                bar = [(e.start * 1e3, max((e.end - e.start) * 1e3, 1e-3))]
                ax.broken_barh(bar, (y, 0.8), facecolors=op_colour[e.op], alpha=0.55 if e.asynchronous else 1.0,
                               hatch="///" if e.asynchronous else None, edgecolor="black", linewidth=0.3)
            ticks += [y + 0.4, y + 1.45]
            labels += [f"rank {r.rank} comm", f"rank {r.rank} phase"]
        ax.set_yticks(ticks, labels, fontsize=7)
        ax.set_xlabel("ms", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        handles = [Patch(facecolor=c, label=n) for n, c in phase_colours.items()]
        handles += [Patch(facecolor=op_colour[o], label=o) for o in ops]
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="asynchronous"))
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.set_title("collectives and phases of the recorded steps", fontsize=9)
        fig.tight_layout()
        return fig

    def _repr_png_(self) -> bytes | None:
        if not self.ranks:
            return None
        import io

        import matplotlib.pyplot as plt

        fig = self.figure()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        return buf.getvalue()

    # -- files ------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """As JSON (``Timeline.load`` reads it back), e.g. from a torchrun job for a notebook."""
        with open(path, "w") as f:
            json.dump({"virtual": self.virtual, "ranks": [asdict(r) for r in self.ranks]}, f)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Timeline:
        with open(path) as f:
            d = json.load(f)
        ranks = [RankRecord(r["rank"], r["start"], r["end"], [CommEvent(**e) for e in r["events"]],
                            [Span(**s) for s in r["spans"]]) for r in d["ranks"]]
        return cls(ranks, d.get("virtual", False))


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def record() -> Iterator[Timeline]:
    """Time every collective and step phase inside, on every rank (enter it on all of them:
    on exit the records are exchanged). The yielded ``Timeline`` is filled on exit; if the
    body raises, only this rank's record is kept (no exchange that could hang)."""
    import torch.distributed as dist

    tl = Timeline(virtual=not _distributed())
    if not tl.virtual:
        dist.barrier()
    rec = _trace.start()
    t0 = time.perf_counter()
    ok = False
    try:
        yield tl
        ok = True
    finally:
        _trace.stop()
        t1 = time.perf_counter()
        for e in rec.events:  # an asynchronous one never seen complete: until the end
            if e.end is None:
                e.end = t1
        mine = RankRecord(dist.get_rank() if not tl.virtual else 0, t0, t1, rec.events, rec.spans)
        every = [mine]
        if ok and not tl.virtual and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        origin = min(r.start for r in every)
        for r in every:
            r.start, r.end = r.start - origin, r.end - origin
            for e in r.events:
                e.start, e.end = e.start - origin, e.end - origin
            for s in r.spans:
                s.start, s.end = s.start - origin, s.end - origin
        tl.ranks = sorted(every, key=lambda r: r.rank)
        if tl.virtual and not tl.ranks[0].events:
            tl.ranks = []
