"""What the step reads of a batch: the mesh axes its spec splits it over, and the tokens a
language-model batch trains on."""

from __future__ import annotations

from typing import Any

import optree
import torch

from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec


def _count_tokens(batch: Any) -> int | None:
    """Tokens a language-model batch trains on: ``targets``, or ``tokens`` minus the shift."""
    if isinstance(batch, dict):
        if isinstance(batch.get("targets"), torch.Tensor):
            return batch["targets"].numel()
        t = batch.get("tokens")
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            return t.shape[0] * (t.shape[1] - 1)
    return None


def _batch_axes(batch_spec: Any, mesh: Mesh) -> tuple[str, ...]:
    named = set()
    for s in optree.tree_leaves(batch_spec, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None,
                                none_is_leaf=True):
        if isinstance(s, PartitionSpec):
            named |= set(s.axes)
    return tuple(a for a in mesh.axis_names if a in named)
