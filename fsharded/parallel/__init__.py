"""Parallel layouts and strategies: ZeRO stages as placements, tensor parallelism,
sequence parallelism (``sequence``, ``ulysses``, ``ring``), mixture of experts with
expert parallelism (``moe``) and pipeline schedules (``pipeline``), one strategy per module."""

from fsharded.parallel import moe, offload, pipeline, ring, sequence, tensor, ulysses
from fsharded.parallel.blocks import run_block
from fsharded.parallel.zero import Placement, ZeroPlan, shard_leaf_spec, zero

__all__ = ["tensor", "sequence", "ulysses", "ring", "moe", "offload", "pipeline", "run_block", "zero", "Placement", "ZeroPlan",
           "shard_leaf_spec"]
