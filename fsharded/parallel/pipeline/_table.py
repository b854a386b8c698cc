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

>>> s = Schedule.from_table(["F0 F1 B0 B1", "F0 B0 F1 B1"], microbatches=2)
>>> [str(a) for a in s.actions[1]][:4]
['RECV act 0 stage 0 from 0', 'F0', 'B0', 'SEND grad 0 stage 1 to 0']
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Action", "Schedule", "ScheduleError", "with_comms", "COMPUTE", "COMMS"]

COMPUTE = ("F", "B", "I", "W")
COMMS = ("SEND", "RECV")


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
        return f"{self.kind}{self.mb}"

    def label(self, v: int) -> str:
        """Short form for pictures: ``F3``, with the stage where a rank holds several."""
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
