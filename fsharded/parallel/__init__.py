"""Parallel layouts and strategies: ZeRO stages as placements, tensor parallelism,
sequence parallelism (``sequence``, ``ulysses``, ``ring``) and mixture of experts with
expert parallelism (``moe``), one strategy per module."""

from fsharded.parallel import moe, ring, sequence, tensor, ulysses
from fsharded.parallel.blocks import run_block
from fsharded.parallel.zero import Placement, ZeroPlan, shard_leaf_spec, zero

__all__ = ["tensor", "sequence", "ulysses", "ring", "moe", "run_block", "zero", "Placement", "ZeroPlan",
           "shard_leaf_spec"]
