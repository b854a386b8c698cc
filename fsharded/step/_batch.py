"""What the step reads of a batch: the mesh axes its spec splits it over, the tokens a
language-model batch trains on, and (on real ranks) this rank's rows of a global batch."""

from __future__ import annotations

from typing import Any

import optree
import torch
import torch.distributed as dist

from fsharded.mesh import _tree
from fsharded.mesh._layout import check_tree, local_slice
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


def local_batch(sm: Any, batch: Any) -> Any:
    """This rank's shard of a global batch, by the batch spec of ``sm`` (a shard_map of the
    step; validated against the global shapes, so a batch that does not divide over the data
    axis is a clear error)."""
    mesh, batch_spec = sm.mesh, sm.in_specs[1]
    paths, leaves, tdef = _tree.tree_flatten_with_paths(batch)
    specs = _tree.broadcast_prefix(batch_spec, batch, what="batch_spec")
    check_tree(leaves, specs, [f"batch.{p}" for p in paths], mesh, "train_step batch")
    coords = mesh.coords(dist.get_rank())
    out = [local_slice(x, s, mesh, coords) if isinstance(x, torch.Tensor) else x
           for x, s in zip(leaves, specs)]
    return optree.tree_unflatten(tdef, out)
