"""Gradient accumulation: apply an optimizer once every ``k`` micro-batches (optax's
``MultiSteps``, DeepSpeed's ``gradient_accumulation_steps``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from fsharded.optim._base import GradientTransformation, _wrap, scheduled_lrs

__all__ = ["MultiStepsState", "MultiSteps", "accumulate"]


class MultiStepsState(NamedTuple):
    """``mini_step``: micro-batches summed in ``acc_grads`` since the last update (0-d int64;
    0 right after an update); ``gradient_step``: updates applied; ``inner_state``: the
    wrapped optimizer's state; ``acc_grads``: the running sum, shaped (and typed) like the
    parameters."""

    mini_step: torch.Tensor
    gradient_step: torch.Tensor
    inner_state: Any
    acc_grads: Any


def MultiSteps(opt: GradientTransformation, every_k: int) -> GradientTransformation:
    """Wrap ``opt`` so that it runs on the mean of every ``every_k`` consecutive gradients.

    Calls 1..k-1 of each group add to the sum and return zero updates; call ``k`` returns
    ``opt``'s update for the mean and resets the sum. ``opt``'s state (its step count, so
    its learning-rate schedule) advances only on those calls, as DeepSpeed's does.

    There is no Python branch on the counter, so this runs under ``vmap`` on the virtual
    mesh: ``opt.update`` runs on every call and its result is kept or discarded with
    ``torch.where``. A step therefore costs one optimizer update per micro-batch, and any
    collectives inside ``opt`` (mesh-aware clipping, LAMB's norms) run every call too.

    >>> from fsharded.optim import sgd
    >>> opt = MultiSteps(sgd(1.0), every_k=2)
    >>> params = {"w": torch.zeros(1)}
    >>> s = opt.init(params)
    >>> u, s = opt.update({"w": torch.ones(1)}, s, params)   # accumulated: u == 0
    >>> u, s = opt.update({"w": torch.full((1,), 3.0)}, s, params)
    >>> u["w"]
    tensor([-2.])
    """
    if isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1:
        raise ValueError(f"MultiSteps: every_k must be a positive int, got {every_k!r}")

    def init(params):
        zero = torch.zeros((), dtype=torch.int64)
        return MultiStepsState(zero, zero.clone(), opt.init(params), optree.tree_map(torch.zeros_like, params))

    def update(updates, state, params=None):
        emit = state.mini_step == every_k - 1  # 0-d bool tensor
        acc = optree.tree_map(lambda a, g: a + g.to(a.dtype), state.acc_grads, updates)
        mean = optree.tree_map(lambda a: a / every_k, acc)
        inner_updates, inner_state = opt.update(mean, state.inner_state, params)

        keep = lambda new, old: torch.where(emit, new, old)  # noqa: E731
        out = optree.tree_map(lambda u: torch.where(emit, u, torch.zeros_like(u)), inner_updates)
        new_state = MultiStepsState(
            mini_step=torch.where(emit, torch.zeros_like(state.mini_step), state.mini_step + 1),
            gradient_step=state.gradient_step + emit.to(state.gradient_step.dtype),
            inner_state=optree.tree_map(keep, inner_state, state.inner_state),
            acc_grads=optree.tree_map(lambda a: torch.where(emit, torch.zeros_like(a), a), acc),
        )
        return out, new_state

    # The rates of the inner optimizer's next applied update (the one this call, or a later
    # one of the same group, runs at).
    update.lrs = lambda state: scheduled_lrs(opt, state.inner_state)
    return _wrap(init, update, getattr(opt, "lr", None))


accumulate = MultiSteps
"""``accumulate(opt, every_k)``: another name for ``MultiSteps``."""
