"""The schedules: GPipe, 1F1B, interleaved 1F1B and zero-bubble (ZB-H1), each a function of
the ranks ``p``, the micro-batches ``m`` (and the stages per rank ``v``) that returns the
table (``_table.Schedule``), checked before it is returned (``check``).

>>> s = one_f_one_b(4, 8)
>>> check(s).bubble                      # (p - 1) / (m + p - 1)
Fraction(3, 11)
>>> print(timeline(zero_bubble(2, 2)))   # doctest: +SKIP
"""

from __future__ import annotations

from fsharded.parallel.pipeline._check import check
from fsharded.parallel.pipeline._table import Action, Schedule, ScheduleError, with_comms

__all__ = ["gpipe", "one_f_one_b", "interleaved", "zero_bubble", "SCHEDULES", "make"]


def _sizes(name: str, p: int, m: int, v: int = 1) -> None:
    for what, k in (("ranks", p), ("micro-batches", m), ("stages per rank", v)):
        if not isinstance(k, int) or k < 1:
            raise ScheduleError(f"{name}: {what} must be a positive int, got {k!r}")


def gpipe(p: int, m: int) -> Schedule:
    """Every micro-batch forward, then every backward (GPipe): the bubble of 1F1B, with
    all ``m`` micro-batches' activations alive at once."""
    _sizes("gpipe", p, m)
    order = [[Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)] for r in range(p)]
    return _checked(with_comms("gpipe", p, 1, m, order))


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush, DeepSpeed's schedule): rank ``r`` runs ``p - r - 1`` forwards
    ahead, then alternates one forward and one backward, then drains the backwards; at
    most ``p - r`` micro-batches' activations alive on rank ``r``."""
    _sizes("one_f_one_b", p, m)
    order = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [Action("F", i, r) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", warm + i, r), Action("B", i, r)]
        acts += [Action("B", i, r) for i in range(m - warm, m)]
        order.append(acts)
    return _checked(with_comms("1f1b", p, 1, m, order))


def interleaved(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): each rank holds ``v`` stages, ``r, r + p, ...``;
    micro-batches go through the chunks in groups of ``p``, which divides the bubble by
    about ``v`` for ``v`` times the point-to-point messages. ``m`` must be a multiple of
    ``p``."""
    _sizes("interleaved", p, m, v)
    if v < 2:
        raise ScheduleError("interleaved: v (stages per rank) must be at least 2; with one stage per rank it "
                            "is one_f_one_b")
    if m % p:
        raise ScheduleError(f"interleaved: the micro-batches ({m}) must be a multiple of the ranks ({p}); "
                            f"use {((m + p - 1) // p) * p}, or one_f_one_b")
    n = m * v

    def mb(k: int) -> int:
        return (k // (p * v)) * p + k % p

    order = []
    for r in range(p):
        fwd = [Action("F", mb(k), ((k // p) % v) * p + r) for k in range(n)]
        bwd = [Action("B", mb(k), (v - 1 - (k // p) % v) * p + r) for k in range(n)]
        warm = min((p - r - 1) * 2 + (v - 1) * p, n)
        acts = fwd[:warm]
        for j in range(n - warm):
            acts += [fwd[warm + j], bwd[j]]
        acts += bwd[n - warm:]
        order.append(acts)
    return _checked(with_comms("interleaved", p, v, m, order))


def zero_bubble(p: int, m: int) -> Schedule:
    """A zero-bubble schedule with ZB-H1's memory (after Qi et al., 2024): each backward
    split into its input-gradient part ``I``, which the previous stage waits for, and its
    weight-gradient part ``W``, which nothing waits for and which fills what would be idle
    time. Rank ``r`` keeps at most ``p - r`` micro-batches' activations, as in 1F1B (an
    activation lives until its ``W``).

    Built by running the ranks against each other with unit costs: a rank that is free
    runs the next ``I`` whose gradient has arrived, else the next ``F`` whose input has
    arrived (within the memory bound), else a pending ``W``. Its bubble is below 1F1B's
    for every ``p > 1``; it is this greedy order, not a searched optimum."""
    _sizes("zero_bubble", p, m)
    f_end: dict[tuple[int, int], int] = {}  # (stage, mb) -> time its F ended
    i_end: dict[tuple[int, int], int] = {}
    nf, ni, nw = [0] * p, [0] * p, [0] * p
    free = [0] * p
    order: list[list[Action]] = [[] for _ in range(p)]
    t = 0
    while any(nw[r] < m for r in range(p)):
        for r in range(p):
            if free[r] > t:
                continue
            i, f = ni[r], nf[r]
            if i < f and f_end[r, i] <= t and (r == p - 1 or i_end.get((r + 1, i), t + 1) <= t):
                order[r].append(Action("I", i, r))
                i_end[r, i] = t + 1
                ni[r] += 1
            elif f < m and f - nw[r] < p - r and (r == 0 or f_end.get((r - 1, f), t + 1) <= t):
                order[r].append(Action("F", f, r))
                f_end[r, f] = t + 1
                nf[r] += 1
            elif nw[r] < ni[r]:
                order[r].append(Action("W", nw[r], r))
                nw[r] += 1
            else:
                continue
            free[r] = t + 1
        t += 1
    return _checked(with_comms("zb-h1", p, 1, m, order))


def _checked(s: Schedule) -> Schedule:
    check(s)
    return s


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb": zero_bubble}


def make(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called ``name`` (``gpipe``, ``1f1b``, ``interleaved``, ``zb``: the
    names of ``pipeline.schedule`` in a config)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"no pipeline schedule named {name!r}; known: {', '.join(SCHEDULES)}")
    if name == "interleaved":
        return interleaved(p, m, v)
    if v != 1:
        raise ScheduleError(f"{name}: one stage per rank (v=1); v={v} is for the interleaved schedule")
    return SCHEDULES[name](p, m)
