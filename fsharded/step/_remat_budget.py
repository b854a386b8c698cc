"""A remat budget (``train_step(remat="budget:8GiB")``, ``parallel.remat.Budget``) made a
policy: at the step's first call, the least recomputation whose estimated peak fits."""

from __future__ import annotations

from typing import Any

import optree
import torch

from fsharded.mesh import _tree
from fsharded.mesh._layout import global_shape
from fsharded.parallel.pipeline import Pipelined
from fsharded.parallel.remat import Blocks, Budget
from fsharded.step._estimate import estimate_memory

__all__ = ["choose"]


def choose(step: Any, state: Any, batch: Any) -> Blocks | None:
    """The first of ``step.remat.candidates`` whose ``estimate_memory`` peak (one device's
    state, gathered weights, activations and gradients, measured on meta tensors of this
    batch's shards) is within the budget; every rank picks the same, from the same shapes.
    A budget nothing fits is a ``ValueError`` naming what each candidate needs. A
    pipelined loss: the policies count each stage's blocks (``"blocks:K"``: every K-th of a
    stage's), and the peak is that of the pipe rank that needs most (its stages' state and
    the schedule's micro-batches in flight)."""
    budget: Budget = step.remat
    pl = step.placement(state.params, step._mask(state))
    leaves, tdef = optree.tree_flatten(state.params)
    meta = []
    for x, spec in zip(leaves, _tree.broadcast_prefix(pl.master, state.params)):
        shape = global_shape(spec, tuple(x.shape), step.mesh) if step.distributed else tuple(x.shape)
        meta.append(torch.empty(shape, dtype=x.dtype, device="meta"))
    params = optree.tree_unflatten(tdef, meta)
    n = _blocks_counted(step, params)
    tried = []
    for cand in budget.candidates(n):
        est = estimate_memory(params, pl, step.optimizer, precision=step.policy, mesh=step.mesh, loss=step.loss_fn,
                              batch=batch, batch_spec=step.batch_spec, blocks=step.blocks, remat=cand,
                              bucket_elems=step.bucket_elems)
        tried.append(f"{cand or 'none'} {est.peak / 2**20:,.2f} MiB")
        if est.peak <= budget.bytes:
            return cand
    raise ValueError(f"train_step(remat={str(budget)!r}): no policy fits {budget.bytes / 2**20:,.2f} MiB per device; "
                     f"estimated peaks: {'; '.join(tried)}. Raise the budget, shard more (ZeRO-3, more ranks), "
                     f"or take a smaller batch")


def _blocks_counted(step: Any, params: Any) -> int:
    """The blocks a policy counts in one forward: a pipeline stage's (the most of any
    stage), or the block list's (none where the step names no list)."""
    if isinstance(step.loss_fn, Pipelined):
        return max((len(r) for r in step.loss_fn.stages.ranges), default=0)
    try:
        return len(_tree.get_path(params, step.blocks)) if step.blocks is not None else 0
    except (KeyError, TypeError):
        return 0
