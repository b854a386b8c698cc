"""The SPMD core: ``shard_map`` over a mesh, its collectives, their varying-axes types.

Inside: the axis environment (``_env``), the collective primitives each as one unit
(``_prims``: forward on both backends, transpose, tangent, vmap rule, varying-axes rule,
bytes sent), the public collectives (``collectives``), the varying-axes table
(``_vma``), the manifest (``_manifest``), ``shard_map`` (``shard_map``) and its two
backends (``_virtual``, ``_distributed``), and moving values in and out (``_transfer``).
"""

from fsharded.spmd._manifest import Entry, Manifest
from fsharded.spmd._transfer import Sharded, from_dtensor, shard, to_dtensor, unshard
from fsharded.spmd.collectives import (
    all_gather,
    all_gather_invariant,
    all_to_all,
    axis_index,
    axis_size,
    is_bound,
    pmax,
    pmean,
    pmin,
    ppermute,
    ppermute_start,
    psum,
    psum_scatter,
    pvary,
    varying_axes,
)
from fsharded.spmd.shard_map import ShardMapped, shard_map

__all__ = [
    "shard_map",
    "ShardMapped",
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "pvary",
    "all_gather",
    "all_gather_invariant",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "ppermute_start",
    "axis_index",
    "axis_size",
    "is_bound",
    "varying_axes",
    "shard",
    "Sharded",
    "unshard",
    "to_dtensor",
    "from_dtensor",
    "Entry",
    "Manifest",
]
