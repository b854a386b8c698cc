"""A loss function to be run as a pipeline: what ``train_step`` takes to pipeline a model.

>>> import fsharded as fs
>>> from fsharded.models import gpt, gpt_stages
>>> params = gpt.init(gpt.GPTConfig.tiny(n_layers=4))
>>> loss = pipelined(gpt_stages.pipeline_stages(params, 2), schedule="1f1b", microbatches=4)
>>> step = fs.train_step(loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"pipe": 2, "data": 2}))  # doctest: +SKIP

Called as a function, it is the loss of the whole model on the batch (the mean over the
micro-batches of the stages run in order): the numbers the pipeline computes, without
one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optree
import torch

from fsharded.parallel.pipeline._stages import Stages
from fsharded.parallel.pipeline._table import WEIGHTS, Schedule, with_gathers
from fsharded.parallel.pipeline.schedules import SCHEDULES, make

__all__ = ["Pipelined", "pipelined", "split_batch"]


@dataclass(frozen=True)
class Pipelined:
    """``stages`` run under ``schedule`` (a name in ``SCHEDULES`` or a ``Schedule``) with
    ``microbatches`` micro-batches and ``virtual`` stages per rank, over the mesh axis
    ``axis``. Build it with ``pipelined``."""

    stages: Stages
    schedule: str | Schedule
    microbatches: int
    virtual: int
    axis: str

    def gathers_table(self, ranks: int) -> Schedule:
        """The table with ZeRO-3's weight actions (``with_gathers``: each stage's gather one
        compute action ahead of its first use, its release after its last), or the table
        itself where it places its own."""
        s = self.table(ranks)
        if any(a.kind in WEIGHTS for row in s.actions for a in row):
            return s
        return with_gathers(s)

    def table(self, ranks: int) -> Schedule:
        """The schedule for ``ranks`` ranks along the axis, checked against the stages."""
        if isinstance(self.schedule, Schedule):
            s = self.schedule
            if (s.ranks, s.microbatches) != (ranks, self.microbatches):
                raise ValueError(f"pipeline: the schedule {s.name!r} is for {s.ranks} ranks and {s.microbatches} "
                                 f"micro-batches; the {self.axis!r} axis has {ranks}, and microbatches="
                                 f"{self.microbatches}")
        else:
            s = make(self.schedule, ranks, self.microbatches, self.virtual)
        if s.stages != self.stages.n:
            raise ValueError(f"pipeline: {ranks} ranks on the {self.axis!r} axis x {s.virtual} stages per rank = "
                             f"{s.stages} stages, but the model was cut into {self.stages.n}; cut it into "
                             f"{s.stages} (e.g. gpt_stages.pipeline_stages(params, {s.stages}))")
        return s

    def owners(self, paths: list[str], ranks: int) -> list[frozenset[int]]:
        """Per parameter leaf (by its dotted path), the ranks along the axis whose stages
        hold it; a leaf no stage reads is held by every rank."""
        sched = self.table(ranks)
        every = frozenset(range(ranks))
        return [frozenset(sched.rank_of(s) for s in held) or every for held in self.stages.holders(paths)]

    def __call__(self, params: Any, batch: Any) -> torch.Tensor:
        losses = []
        for micro in split_batch(batch, self.microbatches):
            x, extra = None, 0
            for s in range(self.stages.n):
                x = self.stages.forward(s, self.stages.params_of(params, s), x, micro)
                if isinstance(x, tuple):  # (activation or loss, the stage's extra loss terms, metrics)
                    x, e, _ = x
                    extra = extra + (0 if e is None else e)
            losses.append(x + extra)
        return torch.stack(losses).mean()


def pipelined(stages: Stages, *, schedule: str | Schedule = "1f1b", microbatches: int = 4, virtual: int = 1,
              axis: str = "pipe") -> Pipelined:
    """``stages`` as a loss function that ``train_step`` runs as a pipeline over the mesh
    axis ``axis``: each rank along it runs its stages' actions of ``schedule``
    (``"gpipe"``, ``"1f1b"``, ``"interleaved"`` with ``virtual`` stages per rank, ``"zb"``,
    or a table of your own) on ``microbatches`` slices of its batch shard.

    Under ZeRO-3 (``fs.parallel.zero(3)`` on the data axis) a stage's weights are stored
    sharded and gathered by the table's ``GATHER`` action, one compute action ahead of
    their first use, and released (their gradients reduce-scattered) by its ``RELEASE``
    after their last (``with_gathers``)."""
    if not isinstance(stages, Stages):
        raise TypeError(f"pipelined: stages must be a Stages (e.g. gpt_stages.pipeline_stages(params, n)), "
                        f"got {type(stages).__name__}")
    if isinstance(schedule, str) and schedule not in SCHEDULES:
        raise ValueError(f"pipelined: schedule {schedule!r} is not one of {sorted(SCHEDULES)}, or give a Schedule")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pipelined: microbatches must be a positive int, got {microbatches!r}")
    return Pipelined(stages, schedule, microbatches, virtual, axis)


def split_batch(batch: Any, m: int) -> list:
    """``batch``'s tensors cut into ``m`` equal micro-batches along their first dim."""
    leaves, tdef = optree.tree_flatten(batch)
    n = {x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(n) != 1:
        raise ValueError(f"pipeline: the batch's tensors must share their first (batch) dim to be cut into "
                         f"micro-batches; got first dims {sorted(n)}")
    (b,) = n
    if b % m:
        raise ValueError(f"pipeline: this shard's batch of {b} does not divide into {m} micro-batches; give a "
                         f"batch per shard that is a multiple of {m}, or microbatches= a divisor of {b}")
    parts = [x.chunk(m) if isinstance(x, torch.Tensor) and x.dim() > 0 else [x] * m for x in leaves]
    return [optree.tree_unflatten(tdef, [p[i] for p in parts]) for i in range(m)]
