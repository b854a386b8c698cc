"""Pipeline parallelism, starting from its schedules as checked data.

A schedule is a table: per rank, the actions it runs in order (``Action``: forward,
backward, or the backward split into its input- and weight-gradient parts; sends and
receives of activations and gradients; under ZeRO-3, gathers and releases of a stage's
weights, placed by ``with_gathers``). ``gpipe``, ``one_f_one_b``, ``interleaved`` and
``zero_bubble`` build the known ones; ``Schedule.from_table`` takes one written by hand.
``check`` refuses a table that cannot run (naming the first bad action) and returns its
``Plan``: when each action runs, the bubble fraction and the peak activations per rank;
``timeline`` draws it as text.

>>> from fsharded.parallel import pipeline
>>> pipeline.check(pipeline.one_f_one_b(4, 8)).bubble
Fraction(3, 11)

A model cut into stages is a ``Stages`` (``cut`` balances its blocks); ``run`` executes a
table for it, every rank in one process (a ``Mailbox`` between them) or this rank alone
under ``torch.distributed`` (``PointToPoint``), and returns the loss and each stage's
gradients. ``pipelined(stages, schedule=..., microbatches=...)`` makes the loss function
``train_step`` runs as a pipeline over the mesh's ``pipe`` axis.
"""

from fsharded.parallel.pipeline._check import COSTS, Plan, check, timeline
from fsharded.parallel.pipeline._execute import Mailbox, PointToPoint, Result, run
from fsharded.parallel.pipeline._pipelined import Pipelined, pipelined, split_batch
from fsharded.parallel.pipeline._stages import Stages, cut
from fsharded.parallel.pipeline._table import (
           Action,
           Schedule,
           ScheduleError,
           with_comms,
           with_gathers,
)
from fsharded.parallel.pipeline.schedules import (
           SCHEDULES,
           gpipe,
           interleaved,
           make,
           one_f_one_b,
           zero_bubble,
)

__all__ = ["Action", "Schedule", "ScheduleError", "with_comms", "with_gathers", "check", "Plan", "COSTS", "timeline",
           "gpipe", "one_f_one_b", "interleaved", "zero_bubble", "SCHEDULES", "make",
           "Stages", "cut", "run", "Result", "Mailbox", "PointToPoint", "Pipelined", "pipelined",
           "split_batch"]
