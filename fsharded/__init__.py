"""fsharded: DeepSpeed's capabilities as JAX-style functional transforms on PyTorch.

>>> import torch, fsharded as fs
>>> from fsharded import P
>>> mesh = fs.Mesh({"data": 2})
>>> f = fs.shard_map(lambda x: fs.psum(x.sum(), "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
>>> f(torch.arange(4.0))
tensor(6.)
"""

# First: the old names of the modules that moved into fsharded.tools (fsharded.memory, ...).
from fsharded import _moved  # noqa: F401, I001
from fsharded import (
    checkpoint,
    comm,
    config,
    distributed,
    inference,
    lax,
    models,
    nn,
    optim,
    parallel,
    precision,
    random,
    spmd,
)
from fsharded._tree import tree_flatten_with_paths, tree_map_with_path
from fsharded.mesh import Mesh, NamedSharding, P, PartitionSpec
from fsharded.mesh._tree import rules
from fsharded.spmd import (
    Entry,
    Manifest,
    Sharded,
    ShardMapped,
    all_gather,
    all_gather_invariant,
    all_to_all,
    axis_index,
    axis_size,
    from_dtensor,
    is_bound,
    pmax,
    pmean,
    pmin,
    ppermute,
    ppermute_start,
    psum,
    psum_scatter,
    pvary,
    shard,
    shard_map,
    to_dtensor,
    unshard,
    varying_axes,
)
from fsharded.step._builder import TrainState, TrainStep, train_step
from fsharded.step._estimate import (
    InsufficientMemoryError,
    MemoryEstimate,
    available_memory,
    estimate_memory,
)
from fsharded.tools import data, memory, timeline, visualize  # noqa: F401 - fs.visualize, as before
from fsharded.tools.visualize import visualize_sharding

__version__ = "0.1.0"

__all__ = [
    "Mesh",
    "PartitionSpec",
    "P",
    "NamedSharding",
    "shard",
    "Sharded",
    "unshard",
    "to_dtensor",
    "from_dtensor",
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
    "rules",
    "tree_flatten_with_paths",
    "tree_map_with_path",
    "Entry",
    "Manifest",
    "estimate_memory",
    "available_memory",
    "InsufficientMemoryError",
    "MemoryEstimate",
    "distributed",
    "comm",
    "spmd",
    "lax",
    "optim",
    "parallel",
    "nn",
    "random",
    "memory",
    "models",
    "inference",
    "precision",
    "config",
    "data",
    "checkpoint",
    "timeline",
    "train_step",
    "visualize_sharding",
    "TrainStep",
    "TrainState",
]
