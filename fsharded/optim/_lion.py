"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms").

Semantics (the paper's Algorithm 2, as lucidrains' ``lion-pytorch`` and optax's ``lion``):

    c <- b1 * m + (1 - b1) * g
    w <- w - lr * (sign(c) + weight_decay * w)     (decay on leaves ``mask`` selects)
    m <- b2 * m + (1 - b2) * g
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from fsharded.optim._adam import _check_betas
from fsharded.optim._base import (
    GradientTransformation,
    Optimizer,
    ScalarOrSchedule,
    chain,
    scale_by_learning_rate,
)
from fsharded.optim._fused import FusedForm
from fsharded.optim._weight_decay import Mask, add_decayed_weights

__all__ = ["ScaleByLionState", "scale_by_lion", "lion"]


class ScaleByLionState(NamedTuple):
    """``mu``: the momentum, shaped like the parameters."""

    mu: Any


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """Lion's direction ``sign(b1 * m + (1 - b1) * g)`` and its momentum update."""
    _check_betas("scale_by_lion", b1, b2)

    def init(params):
        return ScaleByLionState(optree.tree_map(torch.zeros_like, params))

    def update(updates, state, params=None):
        out = optree.tree_map(
            lambda g, m: torch.sign(b1 * m + (1.0 - b1) * g.to(m.dtype)), updates, state.mu
        )
        mu = optree.tree_map(lambda g, m: b2 * m + (1.0 - b2) * g.to(m.dtype), updates, state.mu)
        return out, ScaleByLionState(mu)

    return GradientTransformation(init, update)


def lion(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 0.0,
    mask: Mask | None = None,
) -> Optimizer:
    """Lion (see the module doc). Its updates have unit size per element, so it wants an
    ``lr`` 3-10x below AdamW's and a ``weight_decay`` as much above.

    >>> opt = lion(1e-4, weight_decay=0.1)
    """
    opt = chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay, mask), scale_by_learning_rate(lr, who="lion"))
    opt.fused = FusedForm("lion", dict(b1=b1, b2=b2, weight_decay=weight_decay), 0, mask)
    return opt
