"""Meshes and partition specs: values only (no process groups, no communication).

``shard``/``unshard``/``to_dtensor``/``from_dtensor`` live in ``fsharded.spmd`` (and
at the top level, ``fsharded.shard``...)."""

from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import NamedSharding, P, PartitionSpec

__all__ = [
    "Mesh",
    "PartitionSpec",
    "P",
    "NamedSharding",
]
