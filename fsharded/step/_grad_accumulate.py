"""Gradient accumulation (DeepSpeed's gradient_accumulation_steps): each shard's batch is
split into ``k`` micro-batches along its first dim, each differentiated in turn (its loss
over ``k``); their gradients are summed in the reduction dtype and reduced once as their
specs say (``_reduce.Reduction``: reducing each micro-batch would cost k times the
communication). The loss and the metrics are the micro-batches' means.

>>> grads = Accumulated(Inputs(layout, cap), LocalLoss(layout, loss_fn, ...),
...                     Reduction(layout, ...), differentiator(eager=False), k=2, dtype=torch.float32)
>>> leaves, loss, (metrics, stats) = grads(params, batch, scale, ("data",), mark_varying)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from fsharded import random as R
from fsharded.step._differentiate import Inputs, LocalLoss
from fsharded.step._reduce import Reduction

__all__ = ["Accumulated"]


def _micro(x: Any, i: int, k: int) -> Any:
    """Rows ``[i m, (i+1) m)`` of a batch leaf of ``k m`` rows."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.shape[0] % k:
        raise ValueError(
            f"train_step(accumulation={k}): each shard's batch has {x.shape[0]} rows, not "
            f"divisible into {k} micro-batches"
        )
    m = x.shape[0] // k
    return x[i * m:(i + 1) * m]


def _over(f: Callable, k: int, p: Any, micro: Any) -> tuple:
    out, aux = f(p, micro)
    return out / k, aux


class Accumulated:
    """``__call__(params, batch, scale, varying, mark, model_state=None) -> (placed gradient
    leaves, the mean local loss, the mean (metrics, stats))`` over ``k`` micro-batches."""

    def __init__(self, inputs: Inputs, loss: LocalLoss, reduction: Reduction, grad: Callable, *,
                 k: int, dtype: torch.dtype) -> None:
        if k < 2:
            raise ValueError(f"Accumulated: k must be at least 2 micro-batches, got {k!r}")
        self.inputs, self.loss, self.reduction, self.grad = inputs, loss, reduction, grad
        self.k, self.dtype = k, dtype

    def _one(self, f: Callable, x0: Any, batch: Any, i: int, streams: list | None) -> tuple:
        micro = optree.tree_map(functools.partial(_micro, i=i, k=self.k), batch)
        with R.innermost().rekeyed(streams[i]) if streams is not None else contextlib.nullcontext():
            g, (_, (loss, extra)) = self.grad(f, x0, micro)
        return [t.to(self.dtype) for t in optree.tree_leaves(g)], loss, extra

    def __call__(self, params: Any, batch: Any, scale: Any, varying: tuple[str, ...], mark: Callable,
                 model_state: Any = None) -> tuple[list, torch.Tensor, tuple]:
        x0, f = self.inputs(params, self.loss.bind(scale, model_state), varying, mark)
        # Each micro-batch's (scaled) loss is divided by k before its backward, as DeepSpeed
        # does (and a pipeline schedule): under fp16 the gradients backward carries are
        # those of the mean loss, so they overflow at the same loss scale.
        f = functools.partial(_over, f, self.k)
        # Under the step's key scope each micro-batch draws from a stream of its own,
        # reserved in order (so a pipeline's stages, run in another order, draw the same).
        mode = R.innermost()
        streams = [mode.reserve() for _ in range(self.k)] if mode is not None else None
        grads, loss, extra = self._one(f, x0, batch, 0, streams)
        for i in range(1, self.k):
            g, l_i, e_i = self._one(f, x0, batch, i, streams)
            grads = [torch.add(a, b) for a, b in zip(grads, g)]
            del g
            loss = loss + l_i
            extra = optree.tree_map(torch.add, extra, e_i)
        loss = loss / self.k
        extra = optree.tree_map(lambda t: t / self.k, extra)
        del x0  # the weights gathered for the loss are not needed during the reduction
        return self.reduction(grads), loss, extra
