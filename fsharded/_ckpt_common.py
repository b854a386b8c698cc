"""What ``fsharded.checkpoint`` and its DeepSpeed reader share: the error type, the
dotted paths of a tree's leaves, and whether a mesh runs on real ranks."""

from __future__ import annotations

from typing import Any

import optree

from fsharded.mesh import Mesh
from fsharded.spmd._transfer import backend_for


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: corrupt, incomplete, of another model,
    or of a newer format."""


def _flatten(tree: Any) -> tuple[list[str], list, Any]:
    """(dotted paths, leaves, treespec); NamedTuple fields and dataclass fields by name
    (``opt_state.0.mu.w``), so a path reads as the attribute it is."""
    accessors, leaves, tdef = optree.tree_flatten_with_accessor(tree)
    paths = [".".join(str(getattr(e, "field", e.entry)) for e in acc) or "<root>" for acc in accessors]
    return paths, leaves, tdef


def _distributed(mesh: Mesh, backend: str | None) -> bool:
    return backend_for(mesh, backend) == "distributed" and mesh.size > 1
