"""Parallel layouts as data: ZeRO stages as placements (more strategies to come)."""

from fsharded.parallel import tensor
from fsharded.parallel.blocks import run_block
from fsharded.parallel.zero import Placement, ZeroPlan, shard_leaf_spec, zero

__all__ = ["tensor", "run_block", "zero", "Placement", "ZeroPlan", "shard_leaf_spec"]
