"""The gradient side of a step, as pieces chosen once when its plan is built
(``choose_gradients``, called by ``TrainStep._plan``):

- the local loss, how it sees the parameters: every leaf whole (``_differentiate.LocalLoss``:
  the leaves sharded for storage gathered up front, inside the differentiated function), or
  the block list's leaves gathered at their ``run_block`` (``_grad_blocks.BlockLoss``);
- a strategy that differentiates it: once (``_grad_plain.Plain``), over micro-batches
  (``_grad_accumulate.Accumulated``), or, for a pipelined loss, by a pipeline schedule's
  executor over the pipe axis (``_grad_pipeline.PipelineGradients``);
- the reduction each leaf's specs imply (``_reduce.Reduction``);
- the varying-axes typing assumed while the loss runs, where the specs allow (``_assume``).

What moves each leaf follows from its placement's specs (``_layout.Moves``), never from a
ZeRO stage number; which backend differentiates is passed in (``eager``), never probed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from fsharded.parallel.pipeline import Pipelined
from fsharded.step import _assume
from fsharded.step._differentiate import Inputs, LocalLoss, differentiator, label
from fsharded.step._grad_accumulate import Accumulated
from fsharded.step._grad_blocks import BlockLoss, gathers_blocks
from fsharded.step._grad_pipeline import PipelineGradients, check_pipelined
from fsharded.step._grad_plain import Plain
from fsharded.step._layout import Layout, block_mask
from fsharded.step._reduce import Reduction

__all__ = ["GradientStrategy", "Layout", "block_mask", "choose_gradients", "label"]


class GradientStrategy(Protocol):
    """``(params, batch, scale, varying, mark, model_state=None) -> (the reduced gradient
    leaves of the trained leaves, in their master placement; the local loss; (the metrics,
    the stats) the loss function returned beside it, averaged over micro-batches)``.
    ``params``: the state's master weights; ``scale``: the loss scale state; ``varying``:
    the batch axes (of size > 1) to mark the parameters varying over, with ``mark``."""

    def __call__(self, params: Any, batch: Any, scale: Any, varying: tuple[str, ...], mark: Callable,
                 model_state: Any = None) -> tuple[list, torch.Tensor, tuple]: ...


def choose_gradients(layout: Layout, loss_fn: Callable, *, policy: Any, scaling: Any,
                     batch_axes: tuple[str, ...], accumulation: int, eager: bool, distributed: bool,
                     cap: int, check_loss: Callable, remat: Any = None, graph: bool = False) -> GradientStrategy:
    """The gradient strategy of one state layout. ``eager``: nothing is vmapped (plain
    autograd); ``distributed``: real ranks with plain autograd (each rank its own pipeline
    stages; but for a step captured as one graph, ``graph``: reductions in backward,
    ZeRO-3 prefetch); ``cap``: elements per communication bucket."""
    if isinstance(loss_fn, Pipelined):
        check_pipelined(loss_fn, layout, accumulation=accumulation)
        return PipelineGradients(loss_fn, Inputs(layout, cap), Reduction(layout, batch_axes, cap, policy.reduce_dtype),
                                 layout, policy=policy, scaling=scaling, batch_axes=batch_axes, functional=not eager,
                                 distributed=distributed, cap=cap, remat=remat, graph=graph)
    distributed = distributed and not graph  # (a graph reduces after backward, in the graph)
    common = dict(policy=policy, scaling=scaling, check_loss=check_loss, cap=cap, remat=remat)
    if gathers_blocks(layout):
        loss: LocalLoss = BlockLoss(layout, loss_fn, distributed=distributed, **common)
    else:
        loss = LocalLoss(layout, loss_fn, **common)
    grad = _assume.Assumed(differentiator(eager=eager, backward_ctx=loss.backward_ctx),
                           _assume.assumable(layout, batch_axes), loss.drain)
    inputs, reduction = Inputs(layout, cap), Reduction(layout, batch_axes, cap, policy.reduce_dtype)
    if accumulation > 1:
        return Accumulated(inputs, loss, reduction, grad, k=accumulation, dtype=policy.reduce_dtype)
    return Plain(inputs, loss, reduction, grad, dtype=policy.reduce_dtype,
                 reduce_in_backward=distributed and eager and reduction.in_backward,
                 eager_ranks=distributed and eager)
