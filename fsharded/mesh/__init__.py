"""Meshes, partition specs and moving tensors between global and sharded form."""

from fsharded.mesh._mesh import Mesh
from fsharded.mesh._shard import from_dtensor, shard, to_dtensor, unshard
from fsharded.mesh._spec import NamedSharding, P, PartitionSpec

__all__ = [
    "Mesh",
    "PartitionSpec",
    "P",
    "NamedSharding",
    "shard",
    "unshard",
    "to_dtensor",
    "from_dtensor",
]
