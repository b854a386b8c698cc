"""Parallel layouts as data: ZeRO stages as placements (more strategies to come)."""

from fsharded.parallel.zero import Placement, ZeroPlan, shard_leaf_spec, zero

__all__ = ["zero", "Placement", "ZeroPlan", "shard_leaf_spec"]
