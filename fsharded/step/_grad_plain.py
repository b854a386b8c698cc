"""The plain gradient strategy: differentiate the local loss once, then reduce each
gradient as its specs say (``_reduce.Reduction``). On real ranks, where the reduction
allows it, the buckets are reduced while backward runs instead (``reduce_in_backward``,
chosen when the plan is built), so at ZeRO-2 the full gradient never exists at once.

>>> grads = Plain(Inputs(layout, cap), LocalLoss(layout, loss_fn, ...), Reduction(layout, ...),
...               differentiator(eager=False), dtype=torch.float32)
>>> leaves, loss, (metrics, stats) = grads(params, batch, scale, ("data",), mark_varying)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from fsharded.step._differentiate import Inputs, LocalLoss
from fsharded.step._reduce import Reduction

__all__ = ["Plain"]


class Plain:
    """``__call__(params, batch, scale, varying, mark, model_state=None) -> (placed gradient
    leaves, the local loss, (metrics, stats))``: one forward and backward of the whole
    shard's batch. ``grad``: ``_differentiate.differentiator(...)``; ``dtype``: the
    reduction's (the gradients are cast to it first)."""

    def __init__(self, inputs: Inputs, loss: LocalLoss, reduction: Reduction, grad: Callable, *,
                 dtype: torch.dtype, reduce_in_backward: bool = False, eager_ranks: bool = False) -> None:
        self.inputs, self.loss, self.reduction, self.grad = inputs, loss, reduction, grad
        self.dtype, self.reduce_in_backward = dtype, reduce_in_backward
        self.eager_ranks = eager_ranks  # real ranks, plain autograd: ZeRO-3's gradients may go to the host

    def __call__(self, params: Any, batch: Any, scale: Any, varying: tuple[str, ...], mark: Callable,
                 model_state: Any = None) -> tuple[list, torch.Tensor, tuple]:
        x0, f = self.inputs(params, self.loss.bind(scale, model_state), varying, mark)
        reducer = self.reduction.during_backward(x0) if self.reduce_in_backward else None
        if reducer is not None:  # reduced into the gradient placement during backward
            g, (_, (loss, extra)) = self.grad(f, x0, batch, reducer=reducer)
            return self.reduction.place(optree.tree_leaves(g)), loss, extra
        sink = self.reduction.host_sink() if self.eager_ranks else None
        if sink is not None:  # the ZeRO-3 gradients to the host as backward makes them
            g, (_, (loss, extra)) = self.grad(f, x0, batch, reducer=sink)
        else:
            g, (_, (loss, extra)) = self.grad(f, x0, batch)
        leaves = optree.tree_leaves(g)
        with torch._C.DisableTorchFunction():  # (a dtype read is no typed op)
            cast = any(t.dtype != self.dtype for t in leaves)
        if cast:
            leaves = [t.to(self.dtype) for t in leaves]
        # The reduction consumes the list (each gradient freed once bucketed); the weights
        # gathered for the loss are not needed during it.
        del g, x0
        return self.reduction(leaves), loss, extra
