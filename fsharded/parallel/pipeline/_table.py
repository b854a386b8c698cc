"""A pipeline schedule as data: per rank, the list of actions it runs in order.

Stages ``0 .. p*v - 1`` are the model's pieces in order; stage ``s`` lives on rank
``s % p`` (``v`` virtual stages per rank, placed round robin as in interleaved 1F1B).
Micro-batches are ``0 .. m - 1``. The compute actions are

- ``F``: forward of micro-batch ``mb`` on ``stage``;
- ``B``: its whole backward;
- ``I`` and ``W``: the backward split into the input-gradient part (what the previous
  stage waits for) and the weight-gradient part (which nothing waits for: zero-bubble
  schedules move it into the bubbles);

and the communication actions ``SEND`` / ``RECV`` of an activation (``"act"``: stage to
stage + 1) or a gradient (``"grad"``: stage to stage - 1). ``with_comms`` derives the
communication from the compute order: a send right after the action that produces the
value, a receive right before the one that needs it, so a schedule is written as its
compute order alone (``Schedule.from_table``).

With ZeRO-3 a stage's weights are sharded over the data axis and exist whole only while
the rank uses them: ``GATHER`` all-gathers a stage's weights, ``RELEASE`` reduce-scatters
the gradients they gathered and frees both. ``with_gathers`` places them in a table: each
stage's gather one compute action ahead of its first action (its transfer overlaps that
action), its release right after its last.

>>> s = Schedule.from_table(["F0 F1 B0 B1", "F0 B0 F1 B1"], microbatches=2)
>>> [str(a) for a in s.actions[1]][:4]
['RECV act 0 stage 0 from 0', 'F0', 'B0', 'SEND grad 0 stage 1 to 0']
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Action", "Schedule", "ScheduleError", "with_comms", "with_gathers", "COMPUTE", "COMMS", "WEIGHTS"]

COMPUTE = ("F", "B", "I", "W")
COMMS = ("SEND", "RECV")
WEIGHTS = ("GATHER", "RELEASE")


class ScheduleError(ValueError):
    """A schedule that cannot run as written: names the first bad action and its rank."""


@dataclass(frozen=True)
class Action:
    """One entry of a rank's list. ``kind``: ``F``, ``B``, ``I``, ``W``, ``SEND`` or
    ``RECV``; ``stage`` and ``mb`` what it works on; for a send or a receive, ``what``
    (``"act"`` or ``"grad"``) and ``peer`` (the other rank). The value a send or receive
    carries is that of ``stage``: its output activation, or the gradient of its input."""

    kind: str
    mb: int
    stage: int
    what: str | None = None
    peer: int | None = None

    def __str__(self) -> str:
        if self.kind in COMMS:
            way = "to" if self.kind == "SEND" else "from"
            return f"{self.kind} {self.what} {self.mb} stage {self.stage} {way} {self.peer}"
        if self.kind in WEIGHTS:
            return f"{self.kind} stage {self.stage} ({'for' if self.kind == 'GATHER' else 'after'} micro-batch {self.mb})"
        return f"{self.kind}{self.mb}"

    def label(self, v: int) -> str:
        """Short form for pictures: ``F3``, with the stage where a rank holds several."""
        if self.kind in WEIGHTS:
            return f"{self.kind[0]}@{self.stage}"
        return f"{self.kind}{self.mb}" + (f"@{self.stage}" if v > 1 else "")


@dataclass(frozen=True)
class Schedule:
    """``actions[r]``: what rank ``r`` runs, in order. ``ranks`` (p), ``virtual`` (v,
    stages per rank) and ``microbatches`` (m) fix the stages and micro-batches every
    action must name."""

    name: str
    ranks: int
    virtual: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    @classmethod
    def from_table(cls, rows: Sequence[str], *, microbatches: int, virtual: int = 1,
                   name: str = "table") -> Schedule:
        """A schedule written as a table: one string per rank of compute actions in order,
        ``F<mb>``, ``B<mb>``, ``I<mb>`` or ``W<mb>``, with ``@<stage>`` where the rank
        holds several stages (``F3@5``: micro-batch 3 forward on stage 5; without it, the
        rank's own stage). Sends and receives are derived (``with_comms``)."""
        p = len(rows)
        if p < 1:
            raise ScheduleError("a schedule needs at least one rank (one row)")
        order: list[list[Action]] = []
        token = re.compile(r"^([FBIW])(\d+)(?:@(\d+))?$")
        for r, row in enumerate(rows):
            acts = []
            for word in row.split():
                m = token.match(word)
                if m is None:
                    raise ScheduleError(f"rank {r}: {word!r} is not an action; write F<mb>, B<mb>, I<mb> or W<mb>, "
                                        f"with @<stage> where a rank holds several stages (e.g. F3@5)")
                if m.group(3) is None and virtual > 1:
                    raise ScheduleError(f"rank {r}: {word!r} names no stage, and each rank holds {virtual}: "
                                        f"write {word}@<stage>")
                stage = int(m.group(3)) if m.group(3) is not None else r
                acts.append(Action(m.group(1), int(m.group(2)), stage))
            order.append(acts)
        return with_comms(name, p, virtual, microbatches, order)


def with_comms(name: str, ranks: int, virtual: int, microbatches: int,
               order: Sequence[Sequence[Action]]) -> Schedule:
    """The schedule of the compute ``order`` with its sends and receives: after ``F`` of a
    stage that is not the last, a send of its activation to the next stage's rank; before
    ``F`` of a stage that is not the first, the receive of it; after ``B`` / ``I`` of a
    stage that is not the first, a send of its input's gradient to the previous stage's
    rank; before ``B`` / ``I`` of a stage that is not the last, the receive of it. Stages
    on the same rank pass values without communication."""
    p, last = ranks, ranks * virtual - 1
    out: list[tuple[Action, ...]] = []
    for r, acts in enumerate(order):
        row: list[Action] = []
        for a in acts:
            if a.kind not in COMPUTE:
                raise ScheduleError(f"rank {r}: {a}: give compute actions only; sends and receives are derived")
            if a.kind == "F" and a.stage > 0 and (a.stage - 1) % p != r:
                row.append(Action("RECV", a.mb, a.stage - 1, "act", (a.stage - 1) % p))
            if a.kind in ("B", "I") and a.stage < last and (a.stage + 1) % p != r:
                row.append(Action("RECV", a.mb, a.stage + 1, "grad", (a.stage + 1) % p))
            row.append(a)
            if a.kind == "F" and a.stage < last and (a.stage + 1) % p != r:
                row.append(Action("SEND", a.mb, a.stage, "act", (a.stage + 1) % p))
            if a.kind in ("B", "I") and a.stage > 0 and (a.stage - 1) % p != r:
                row.append(Action("SEND", a.mb, a.stage, "grad", (a.stage - 1) % p))
        out.append(tuple(row))
    return Schedule(name, ranks, virtual, microbatches, tuple(out))


def with_gathers(s: Schedule, *, ahead: int = 1) -> Schedule:
    """``s`` with ZeRO-3's weight actions: on each rank, the ``GATHER`` of each of its
    stages' weights ``ahead`` compute actions before the stage's first action (its
    transfer overlaps them), and its ``RELEASE`` (the gradients reduce-scattered, the
    weights freed) right after the stage's last action, while the rank's other stages may
    still compute. A stage is gathered once per step: between a micro-batch's forward and
    its backward the graph holds the stage's weights, so releasing them earlier would free
    nothing. Tables that already hold weight actions are refused."""
    if ahead < 0:
        raise ScheduleError(f"{s.name}: with_gathers needs ahead >= 0 (got {ahead})")
    out = []
    for r, row in enumerate(s.actions):
        if any(a.kind in WEIGHTS for a in row):
            raise ScheduleError(f"{s.name}: rank {r} already gathers and releases weights")
        at = [k for k, a in enumerate(row) if a.kind in COMPUTE]  # row positions of the compute actions
        uses = [row[k] for k in at]
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for j, a in enumerate(uses):
            first.setdefault(a.stage, j)
            last[a.stage] = j
        gather: dict[int, list[Action]] = {}  # compute position -> gathers issued before it
        release: dict[int, list[Action]] = {}  # compute position -> releases after it
        for st, j in first.items():
            gather.setdefault(max(j - ahead, 0), []).append(Action("GATHER", uses[j].mb, st))
        for st, j in last.items():
            release.setdefault(j, []).append(Action("RELEASE", uses[j].mb, st))
        # A gather goes before the receives its action waits for (issued as early as it can
        # be); a release after the sends that follow its action (the activation leaves first).
        before: dict[int, list[Action]] = {}
        after: dict[int, list[Action]] = {}
        for j, k in enumerate(at):
            start, cut = k, k
            while start > (at[j - 1] if j else -1) + 1 and row[start - 1].kind == "RECV":
                start -= 1
            while cut + 1 < len(row) and row[cut + 1].kind == "SEND":
                cut += 1
            before.setdefault(start, []).extend(gather.get(j, []))
            after.setdefault(cut, []).extend(release.get(j, []))
        new: list[Action] = []
        for k, a in enumerate(row):
            new.extend(before.get(k, []))
            new.append(a)
            new.extend(after.get(k, []))
        out.append(tuple(new))
    return Schedule(s.name + " + ZeRO-3 gathers", s.ranks, s.virtual, s.microbatches, tuple(out))
