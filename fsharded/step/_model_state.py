"""The model state a step carries beside the parameters (``train_step(update_model_state=)``:
DeepSeek-V3's per-expert routing bias, running statistics): laid out by its specs at
``init``, and updated once per applied step from the loss's stats, checked against the old
one's structure, shapes, dtypes and specs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from fsharded.mesh import _tree
from fsharded.mesh._mesh import Mesh
from fsharded.spmd._transfer import local_shards
from fsharded.spmd.collectives import pmean, varying_axes
from fsharded.spmd.shard_map import shard_map

__all__ = ["init_model_state", "new_model_state"]


def init_model_state(model_state: Any, update: Callable | None, specs: Any, mesh: Mesh, distributed: bool) -> Any:
    """``TrainState.model_state`` for the global ``model_state`` (None without ``update``):
    copies laid out by ``specs`` (this rank's shards on real ranks)."""
    if update is None:
        if model_state is not None:
            raise ValueError("train_step.init: model_state given, but the step has no update_model_state: "
                             "pass train_step(..., update_model_state=fn) (fn(model_state, stats) -> "
                             "model_state), or keep the tensors in the parameters or the loss")
        return None
    if model_state is None:
        raise ValueError("train_step.init: this step updates a model state (update_model_state): pass "
                         "init(params, model_state=tree) with its initial value")
    paths, leaves, _ = _tree.tree_flatten_with_paths(model_state)
    bad = [f"  model_state.{p}: {type(x).__name__}" for p, x in zip(paths, leaves)
           if not isinstance(x, torch.Tensor)]
    if bad or not leaves:
        raise ValueError("train_step.init: model_state must be a non-empty pytree of tensors"
                         + ("; these leaves are not:\n" + "\n".join(bad[:8]) if bad else ""))
    ms = optree.tree_map(lambda x: x.detach().clone(), model_state)
    full = optree.tree_unflatten(optree.tree_structure(ms), _tree.broadcast_prefix(specs, ms, what="model_state_specs"))
    if distributed:
        return local_shards(ms, full, mesh)
    shard_map(lambda m: m, mesh=mesh, in_specs=(full,), out_specs=full)._flat_in((ms,))
    return ms


def new_model_state(ms: Any, stats: Any, update: Callable, specs: Any, mesh: Mesh,
                    batch_axes: tuple[str, ...]) -> Any:
    """``update(ms, stats)`` on the stats averaged over the batch shards (the same on every
    shard), checked against the old model state's structure, shapes, dtypes and ``specs``."""
    if batch_axes:
        stats = optree.tree_map(lambda t: pmean(t, batch_axes), stats)
    with torch.no_grad():
        new = update(ms, stats)
    paths, old_leaves, old_def = _tree.tree_flatten_with_paths(ms)
    new_leaves, new_def = optree.tree_flatten(new)
    if new_def != old_def:
        raise ValueError(f"train_step: update_model_state changed the model state's structure: it took "
                         f"{old_def} and returned {new_def}; return a tree of the same form")
    flat_specs = _tree.broadcast_prefix(specs, ms)
    bad = []
    for p, o, n, spec in zip(paths, old_leaves, new_leaves, flat_specs):
        if not isinstance(n, torch.Tensor) or n.shape != o.shape or n.dtype != o.dtype:
            got = f"{n.dtype} {tuple(n.shape)}" if isinstance(n, torch.Tensor) else type(n).__name__
            bad.append(f"  model_state.{p}: {o.dtype} {tuple(o.shape)} became {got}")
        elif extra := [a for a in varying_axes(n) if a not in spec.axes and mesh.shape[a] > 1]:
            bad.append(f"  model_state.{p}: varies over {extra} after update_model_state, its spec is "
                       f"{spec!r} (it would differ between those shards: reduce what it is computed from "
                       f"over them, or shard it there)")
    if bad:
        raise ValueError("train_step: update_model_state returned a model state that does not fit the "
                         "old one:\n" + "\n".join(bad[:8]))
    return optree.tree_unflatten(new_def, [t.detach() for t in new_leaves])
