"""Checks of a schedule before any rank runs it, and what the table implies.

``check(schedule)`` refuses a table that cannot run as written, naming the first bad
action (``ScheduleError``): an action on a rank that does not hold its stage, a compute
action missing or twice, a backward before its forward, a value used before it is
received, a send without its receive (or the reverse), or ranks that wait for each other
(found by running the ranks against each other: sends do not wait, a receive waits for
its send), and, in a table with ZeRO-3's weight actions, a compute action on weights
that are not gathered, a gather of gathered weights, a release of weights that are not
or that a pending backward still holds, or weights never released. It returns the ``Plan``: when each action runs with the given
costs, the bubble fraction, the peak number of micro-batches' activations alive per rank
and the peak number of stages whose weights a rank holds whole.

Costs are in units of one forward: ``F`` 1, ``B`` 2, ``I`` 1, ``W`` 1 by default, and
communication takes no time, so 1F1B's bubble is exactly ``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from fsharded.parallel.pipeline._table import (
    COMMS,
    COMPUTE,
    WEIGHTS,
    Action,
    Schedule,
    ScheduleError,
)

__all__ = ["check", "Plan", "COSTS", "timeline"]

COSTS: Mapping[str, Fraction] = {"F": Fraction(1), "B": Fraction(2), "I": Fraction(1), "W": Fraction(1)}


@dataclass(frozen=True)
class Plan:
    """What a checked table implies: ``spans[r]``, each compute action of rank ``r`` with
    its start and end; ``makespan``; ``busy[r]``; ``bubble``, the idle fraction of all
    ranks' time; ``peak_activations[r]``, the most micro-batches whose activations rank
    ``r`` holds at once (from a stage's forward to the end of its backward);
    ``peak_gathered[r]``, the most stages whose weights rank ``r`` holds whole at once
    (ZeRO-3's weight actions; 0 in a table without them)."""

    schedule: Schedule
    spans: tuple[tuple[tuple[Fraction, Fraction, Action], ...], ...]
    makespan: Fraction
    busy: tuple[Fraction, ...]
    bubble: Fraction
    peak_activations: tuple[int, ...]
    peak_gathered: tuple[int, ...] = ()


def _bad(r: int, k: int, a: Action, why: str) -> ScheduleError:
    return ScheduleError(f"rank {r}, action {k} ({a}): {why}")


def check(s: Schedule, costs: Mapping[str, Fraction | int] | Callable[[int, Action], float] | None = None,
          comm: Callable[[int, Action], float] | None = None) -> Plan:
    """The ``Plan`` of ``s``, or ``ScheduleError`` naming the first action that cannot run.
    ``costs``: each compute action's duration, by kind (``COSTS``: a forward is 1, a
    backward 2), or a function of (rank, action), e.g. the durations a run measured
    (``Result.spans``): the plan is then the table's timeline under those costs.
    ``comm``: the time a ``SEND`` keeps its rank (the value leaves when it ends), and for
    a ``RECV`` the time its value takes to arrive once it left (default: none,
    communication is free). Both count as idle, as waiting does: the bubble is the
    ranks' time not computing."""
    if not callable(costs):
        by_kind = {k: Fraction(v) for k, v in {**COSTS, **(costs or {})}.items()}
        costs = lambda r, a: by_kind[a.kind]  # noqa: E731
    p, S, m = s.ranks, s.stages, s.microbatches
    if len(s.actions) != p:
        raise ScheduleError(f"{s.name}: {len(s.actions)} rows of actions for {p} ranks")
    seen: dict[tuple[str, int, int], tuple[int, int]] = {}  # (kind, stage, mb) -> (rank, index)
    sends: dict[tuple[str, int, int], tuple[int, int, Action]] = {}
    recvs: dict[tuple[str, int, int], tuple[int, int, Action]] = {}
    for r, row in enumerate(s.actions):
        for k, a in enumerate(row):
            if not (0 <= a.stage < S) or not (0 <= a.mb < m):
                raise _bad(r, k, a, f"stage {a.stage} / micro-batch {a.mb} outside {S} stages x {m} micro-batches")
            if a.kind in COMPUTE:
                if s.rank_of(a.stage) != r:
                    raise _bad(r, k, a, f"stage {a.stage} lives on rank {s.rank_of(a.stage)}")
                key = (a.kind, a.stage, a.mb)
                if key in seen:
                    raise _bad(r, k, a, f"runs twice (first at action {seen[key][1]})")
                seen[key] = (r, k)
                _check_order(s, r, k, a, seen)
            elif a.kind in COMMS:
                _check_comm(s, r, k, a, seen, sends, recvs)
            elif a.kind not in WEIGHTS:
                raise _bad(r, k, a, f"unknown kind {a.kind!r}; one of {COMPUTE + COMMS + WEIGHTS}")
    if any(a.kind in WEIGHTS for row in s.actions for a in row):
        for r, row in enumerate(s.actions):
            _check_weights(s, r, row)
    for stage in range(S):
        for i in range(m):
            whole, split = ("B", stage, i) in seen, (("I", stage, i) in seen, ("W", stage, i) in seen)
            if ("F", stage, i) not in seen:
                raise ScheduleError(f"rank {s.rank_of(stage)}: no forward of micro-batch {i} on stage {stage}")
            if not whole and split != (True, True):
                raise ScheduleError(f"rank {s.rank_of(stage)}: no backward of micro-batch {i} on stage {stage} "
                                    f"(a B, or both I and W)")
            if whole and any(split):
                raise ScheduleError(f"rank {s.rank_of(stage)}: micro-batch {i} on stage {stage} has a B and "
                                    f"an I or W: a backward is whole or split, not both")
    for key, (r, k, a) in sends.items():
        if key not in recvs:
            raise _bad(r, k, a, f"rank {a.peer} never receives it")
    for key, (r, k, a) in recvs.items():
        if key not in sends:
            raise _bad(r, k, a, f"rank {a.peer} never sends it")
    return _simulate(s, costs, comm)


def _check_order(s: Schedule, r: int, k: int, a: Action, seen: dict) -> None:
    """What ``a`` needs has already run on this rank: its own forward (a backward), the
    value it consumes (received, or made by a stage on this rank)."""
    last = s.stages - 1
    if a.kind in ("B", "I") and ("F", a.stage, a.mb) not in seen:
        raise _bad(r, k, a, f"backward of micro-batch {a.mb} on stage {a.stage} before its forward")
    if a.kind == "W" and ("I", a.stage, a.mb) not in seen:
        raise _bad(r, k, a, f"weight gradient of micro-batch {a.mb} on stage {a.stage} before its input gradient")
    if a.kind == "F" and a.stage > 0:
        src = s.rank_of(a.stage - 1)
        need = ("F", a.stage - 1, a.mb) if src == r else ("RECV act", a.stage - 1, a.mb)
        if need not in seen:
            raise _bad(r, k, a, f"its input (stage {a.stage - 1}'s activation) is not here yet: "
                                f"{'that forward runs later on this rank' if src == r else 'no receive before it'}")
    if a.kind in ("B", "I") and a.stage < last:
        src = s.rank_of(a.stage + 1)
        if src == r:
            ok = ("B", a.stage + 1, a.mb) in seen or ("I", a.stage + 1, a.mb) in seen
        else:
            ok = ("RECV grad", a.stage + 1, a.mb) in seen
        if not ok:
            raise _bad(r, k, a, f"its output's gradient (from stage {a.stage + 1}) is not here yet")


def _check_weights(s: Schedule, r: int, row: tuple[Action, ...]) -> None:
    """ZeRO-3's weight actions on rank ``r``: each compute action runs on its stage's
    gathered weights (a ``GATHER`` before it with no ``RELEASE`` between), a stage is not
    gathered twice nor released unless gathered nor while a micro-batch's backward on it
    is pending (its graph holds the weights), and every gather is released (its weights'
    gradients are reduce-scattered there). A table with weight actions has them on every
    rank."""
    whole: dict[int, int] = {}  # stage -> the index of its gather
    open_: dict[int, set[int]] = {}  # stage -> micro-batches whose forward ran and backward has not
    for k, a in enumerate(row):
        if a.kind == "F":
            open_.setdefault(a.stage, set()).add(a.mb)
        elif a.kind in ("B", "W"):
            open_.get(a.stage, set()).discard(a.mb)
        if a.kind == "GATHER":
            if s.rank_of(a.stage) != r:
                raise _bad(r, k, a, f"stage {a.stage} lives on rank {s.rank_of(a.stage)}")
            if a.stage in whole:
                raise _bad(r, k, a, f"stage {a.stage}'s weights are gathered already (at action {whole[a.stage]}), "
                                    f"with no release between")
            whole[a.stage] = k
        elif a.kind == "RELEASE":
            if a.stage not in whole:
                raise _bad(r, k, a, f"stage {a.stage}'s weights are not gathered here")
            if open_.get(a.stage):
                raise _bad(r, k, a, f"micro-batches {sorted(open_[a.stage])} are between their forward and their "
                                    f"backward on stage {a.stage}: their graphs hold its weights, so the release "
                                    f"would free nothing; release after their backward")
            del whole[a.stage]
        elif a.kind in COMPUTE and a.stage not in whole:
            raise _bad(r, k, a, f"stage {a.stage}'s weights are not gathered here (a table with weight actions "
                                f"gathers every stage before it computes, and releases it after)")
    if whole:
        st, k = next(iter(whole.items()))
        raise _bad(r, k, row[k], f"stage {st}'s weights are never released: the gradients of the weights "
                                 f"it gathered would not be reduce-scattered")


def _check_comm(s: Schedule, r: int, k: int, a: Action, seen: dict, sends: dict, recvs: dict) -> None:
    if a.what not in ("act", "grad"):
        raise _bad(r, k, a, "a send or receive carries 'act' or 'grad'")
    nxt = a.stage + 1 if a.what == "act" else a.stage - 1
    if not (0 <= nxt < s.stages):
        raise _bad(r, k, a, f"stage {a.stage} has no {'next' if a.what == 'act' else 'previous'} stage")
    src, dst = s.rank_of(a.stage), s.rank_of(nxt)
    me, other = (src, dst) if a.kind == "SEND" else (dst, src)
    if r != me or a.peer != other:
        raise _bad(r, k, a, f"stage {a.stage}'s {a.what} goes from rank {src} to rank {dst}")
    key = (a.what, a.stage, a.mb)
    if a.kind == "SEND":
        made = ("F", a.stage, a.mb) in seen if a.what == "act" else \
            (("B", a.stage, a.mb) in seen or ("I", a.stage, a.mb) in seen)
        if not made:
            raise _bad(r, k, a, "sent before the action that makes it")
        if key in sends:
            raise _bad(r, k, a, "sent twice")
        sends[key] = (r, k, a)
    else:
        if key in recvs:
            raise _bad(r, k, a, "received twice")
        recvs[key] = (r, k, a)
        seen[(f"RECV {a.what}", a.stage, a.mb)] = (r, k)


def _simulate(s: Schedule, costs: Callable[[int, Action], Any], comm: Callable[[int, Action], Any] | None) -> Plan:
    """Run the ranks against each other: each its list in order, a receive waiting for its
    send. Ranks that all wait are a deadlock, named by what each waits for."""
    p = s.ranks
    pos, clock = [0] * p, [Fraction(0)] * p
    sent: dict[tuple[str, int, int], Fraction] = {}
    spans: list[list[tuple[Fraction, Fraction, Action]]] = [[] for _ in range(p)]
    live, peak = [0] * p, [0] * p
    whole, most = [0] * p, [0] * p  # stages whose weights a rank holds gathered
    while any(pos[r] < len(s.actions[r]) for r in range(p)):
        moved = False
        for r in range(p):
            row = s.actions[r]
            while pos[r] < len(row):
                a = row[pos[r]]
                if a.kind == "RECV":
                    t = sent.get((a.what, a.stage, a.mb))
                    if t is None:
                        break  # waits for its send
                    clock[r] = max(clock[r], t + (comm(r, a) if comm is not None else 0))
                elif a.kind == "SEND":
                    if comm is not None:
                        clock[r] += comm(r, a)
                    sent[(a.what, a.stage, a.mb)] = clock[r]
                elif a.kind in WEIGHTS:  # (their communication takes no time in the plan, as sends)
                    whole[r] += 1 if a.kind == "GATHER" else -1
                    most[r] = max(most[r], whole[r])
                else:
                    start = clock[r]
                    clock[r] += costs(r, a)
                    spans[r].append((start, clock[r], a))
                    if a.kind == "F":
                        live[r] += 1
                        peak[r] = max(peak[r], live[r])
                    elif a.kind in ("B", "W"):
                        live[r] -= 1
                pos[r] += 1
                moved = True
        if not moved:
            waits = "; ".join(f"rank {r} at action {pos[r]} ({s.actions[r][pos[r]]})"
                              for r in range(p) if pos[r] < len(s.actions[r]))
            raise ScheduleError(f"{s.name}: deadlock, every rank left waits for a receive: {waits}")
    makespan = max(clock) if p else Fraction(0)
    busy = tuple(sum((e - b for b, e, _ in row), Fraction(0)) for row in spans)
    bubble = 1 - sum(busy, Fraction(0)) / (p * makespan) if makespan else Fraction(0)
    return Plan(s, tuple(tuple(row) for row in spans), makespan, busy, bubble, tuple(peak), tuple(most))


def timeline(plan_or_schedule: Plan | Schedule, *, width: int = 4) -> str:
    """The table as text: one line per rank, one cell of ``width`` characters per unit of
    time (a forward), the action running in it (``.`` idle), then the bubble."""
    plan = plan_or_schedule if isinstance(plan_or_schedule, Plan) else check(plan_or_schedule)
    s = plan.schedule
    lines = []
    for r, row in enumerate(plan.spans):
        cells = ["."] * int(plan.makespan)
        for b, e, a in row:
            for u in range(int(b), int(e)):
                cells[u] = a.label(s.virtual)
        lines.append(f"rank {r}: " + "".join(c.ljust(width)[:width] for c in cells).rstrip())
    kinds = Counter(a.kind for row in s.actions for a in row)
    lines.append(f"{s.name}: p={s.ranks} v={s.virtual} m={s.microbatches}, {plan.makespan} units, "
                 f"bubble {float(plan.bubble):.3f}, peak activations per rank {list(plan.peak_activations)}, "
                 f"{kinds['SEND']} sends" + (f", {kinds['GATHER']} gathers, peak stages gathered per rank "
                                             f"{list(plan.peak_gathered)}" if kinds["GATHER"] else ""))
    return "\n".join(lines)
