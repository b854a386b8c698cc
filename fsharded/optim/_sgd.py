"""SGD (with momentum / Nesterov) and Adagrad, with ``torch.optim``'s semantics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import optree
import torch

from fsharded.optim._base import (
    GradientTransformation,
    Optimizer,
    ScalarOrSchedule,
    Schedule,
    as_schedule,
    chain,
    check_hyper,
    scale_by_learning_rate,
)
from fsharded.optim._weight_decay import add_decayed_weights

__all__ = ["TraceState", "trace", "sgd", "ScaleByAdagradState", "scale_by_adagrad", "adagrad"]


class TraceState(NamedTuple):
    """``count``: updates so far (0-d int64); ``trace``: the momentum buffer."""

    count: torch.Tensor
    trace: Any


def trace(momentum: float, *, nesterov: bool = False, dampening: float = 0.0) -> GradientTransformation:
    """``torch.optim.SGD``'s momentum buffer: ``b <- momentum * b + (1 - dampening) * g``,
    except that the first update sets ``b <- g`` (torch's lazily created buffer, which
    dampening does not touch). Emits ``b``, or ``g + momentum * b`` with ``nesterov``.
    """

    def init(params):
        return TraceState(torch.zeros((), dtype=torch.int64), optree.tree_map(torch.zeros_like, params))

    def update(updates, state, params=None):
        first = state.count == 0  # a 0-d tensor: selected with where, never branched on

        def buf(g, b):
            g = g.to(b.dtype)
            return torch.where(first, g, momentum * b + (1.0 - dampening) * g)

        new = optree.tree_map(buf, updates, state.trace)
        if nesterov:
            out = optree.tree_map(lambda g, b: g.to(b.dtype) + momentum * b, updates, new)
        else:
            out = new
        return out, TraceState(state.count + 1, new)

    return GradientTransformation(init, update)


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
) -> Optimizer:
    """SGD as ``torch.optim.SGD``: L2 ``weight_decay`` added to the gradient, then the
    momentum buffer (see ``trace``), then ``-lr``.

    >>> opt = sgd(0.1, momentum=0.9, nesterov=True)
    """
    check_hyper("sgd", "momentum", momentum)
    check_hyper("sgd", "dampening", dampening, high=1.0, closed_high=True)
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError("sgd: nesterov needs momentum > 0 and dampening == 0 (as in torch.optim.SGD)")
    parts = [add_decayed_weights(weight_decay)]
    if momentum != 0.0:
        parts.append(trace(momentum, nesterov=nesterov, dampening=dampening))
    parts.append(scale_by_learning_rate(lr, who="sgd"))
    return chain(*parts)


class ScaleByAdagradState(NamedTuple):
    """``sum``: the running sum of squared gradients, shaped like the parameters."""

    sum: Any


def scale_by_adagrad(initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> GradientTransformation:
    """``g / (sqrt(sum g^2) + eps)``, the sum including the current gradient."""

    def init(params):
        return ScaleByAdagradState(
            optree.tree_map(lambda p: torch.full_like(p, initial_accumulator_value), params)
        )

    def update(updates, state, params=None):
        acc = optree.tree_map(lambda g, s: s + torch.square(g.to(s.dtype)), updates, state.sum)
        out = optree.tree_map(lambda g, s: g.to(s.dtype) / (torch.sqrt(s) + eps), updates, acc)
        return out, ScaleByAdagradState(acc)

    return GradientTransformation(init, update)


@dataclass(frozen=True)
class _DecayedLR:
    """torch Adagrad's ``lr / (1 + step * lr_decay)`` on top of any schedule."""

    lr: Schedule
    lr_decay: float

    def __call__(self, step: Any) -> torch.Tensor:
        s = torch.as_tensor(step)
        return self.lr(s) / (1.0 + s.to(torch.float64) * self.lr_decay)


def adagrad(
    lr: ScalarOrSchedule,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
) -> Optimizer:
    """Adagrad as ``torch.optim.Adagrad``: L2 ``weight_decay``; update ``k`` (from 0) runs
    at ``lr(k) / (1 + k * lr_decay)``, which is what ``get_lr`` reports."""
    if initial_accumulator_value < 0.0:
        raise ValueError(f"adagrad: initial_accumulator_value must be >= 0, got {initial_accumulator_value!r}")
    check_hyper("adagrad", "lr_decay", lr_decay)  # negative: the rate would grow past inf
    sched = as_schedule(lr, who="adagrad")
    if lr_decay != 0.0:
        sched = _DecayedLR(sched, lr_decay)
    return chain(
        add_decayed_weights(weight_decay),
        scale_by_adagrad(initial_accumulator_value, eps),
        scale_by_learning_rate(sched),
    )
