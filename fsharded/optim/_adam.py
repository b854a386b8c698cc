"""Adam and AdamW, as chains of ``scale_by_adam``, weight decay and the learning rate."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from fsharded.optim._base import (
    GradientTransformation,
    Optimizer,
    ScalarOrSchedule,
    chain,
    check_hyper,
    is_donating,
    plain,
    scale_by_learning_rate,
)
from fsharded.optim._fused import FusedForm
from fsharded.optim._weight_decay import Mask, add_decayed_weights

__all__ = ["ScaleByAdamState", "scale_by_adam", "adam", "adamw"]


class ScaleByAdamState(NamedTuple):
    """``count``: updates so far (0-d int64); ``mu``, ``nu``: first and second moments,
    shaped like the parameters."""

    count: torch.Tensor
    mu: Any
    nu: Any


def bias_corrections(count: torch.Tensor, b1: float, b2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``1 - b**count`` for both betas, in float64: in float32, ``1 - 0.999**t`` at small t
    loses ~4 of its 7 digits."""
    t = count.to(torch.float64)
    return 1.0 - b1**t, 1.0 - b2**t


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's direction ``m_hat / (sqrt(v_hat) + eps)`` with bias-corrected moments.

    Matches ``torch.optim.Adam``'s arithmetic: ``m`` is updated with ``lerp``, ``eps`` is
    added after dividing ``sqrt(v)`` by ``sqrt(1 - b2**t)``.
    """
    _check_betas("scale_by_adam", b1, b2)
    check_hyper("scale_by_adam", "eps", eps)

    def init(params):
        zeros = lambda p: torch.zeros_like(p)  # noqa: E731
        return ScaleByAdamState(
            torch.zeros((), dtype=torch.int64), optree.tree_map(zeros, params), optree.tree_map(zeros, params)
        )

    def update(updates, state, params=None):
        count = state.count + 1
        if count.device.type != "meta" and plain((updates, state)):
            return _adam_foreach(updates, state, count, b1, b2, eps)
        mu = optree.tree_map(lambda g, m: torch.lerp(m, g.to(m.dtype), 1.0 - b1), updates, state.mu)
        nu = optree.tree_map(
            lambda g, v: b2 * v + (1.0 - b2) * torch.square(g.to(v.dtype)), updates, state.nu
        )
        bc1, bc2 = bias_corrections(count, b1, b2)

        def direction(m, v):
            # Cast the float64 corrections per leaf: a 0-d leaf would otherwise be promoted.
            return (m / bc1.to(m.dtype)) / (torch.sqrt(v) / torch.sqrt(bc2).to(v.dtype) + eps)

        return optree.tree_map(direction, mu, nu), ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update)


def _adam_foreach(updates, state, count, b1, b2, eps):
    """The same arithmetic with multi-tensor (foreach) kernels: a handful of launches for
    all leaves instead of several per leaf. Only outside torch.func transforms, where the
    step count can be read as a Python number; every op is out of place on its inputs."""
    g, tdef = optree.tree_flatten(updates)
    m, v = optree.tree_leaves(state.mu), optree.tree_leaves(state.nu)
    if not g:
        return updates, ScaleByAdamState(count, state.mu, state.nu)
    g = [x.to(y.dtype) for x, y in zip(g, m)]
    bc1, bc2 = (float(c) for c in bias_corrections(count, b1, b2))
    if is_donating():  # the caller gave up the old state: update the moments in place
        torch._foreach_lerp_(m, g, 1.0 - b1)
        torch._foreach_mul_(v, b2)
        mu, nu = m, v
    else:
        mu = torch._foreach_lerp(m, g, 1.0 - b1)
        nu = torch._foreach_mul(v, b2)
    torch._foreach_addcmul_(nu, g, g, value=1.0 - b2)
    denom = torch._foreach_sqrt(nu)
    torch._foreach_div_(denom, bc2**0.5)
    torch._foreach_add_(denom, eps)
    direction = torch._foreach_div(mu, bc1)
    torch._foreach_div_(direction, denom)
    unflat = lambda xs: optree.tree_unflatten(tdef, xs)  # noqa: E731
    return unflat(direction), ScaleByAdamState(count, unflat(mu), unflat(nu))


def _check_betas(who: str, *betas: float) -> None:
    for name, b in zip(("b1", "b2"), betas):
        check_hyper(who, name, b, high=1.0)


def adamw(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: Mask | None = None,
) -> Optimizer:
    """AdamW (Loshchilov & Hutter), as ``torch.optim.AdamW``: decoupled decay
    ``p <- p - lr * weight_decay * p`` on the leaves ``mask`` selects (all when ``None``;
    ``mask=decay_mask`` skips biases and norms).

    >>> from fsharded.optim import apply_updates
    >>> opt = adamw(1e-2)
    >>> params = {"w": torch.ones(3)}
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": torch.ones(3)}, state, params)
    >>> params = apply_updates(params, updates)
    """
    opt = chain(
        scale_by_adam(b1, b2, eps),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(lr, who="adamw"),
    )
    opt.fused = FusedForm("adamw", dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay), 0, mask)
    return opt


def adam(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> Optimizer:
    """Adam, as ``torch.optim.Adam``: ``weight_decay`` is L2 (added to the gradient before
    the moments), not decoupled."""
    opt = chain(
        add_decayed_weights(weight_decay),
        scale_by_adam(b1, b2, eps),
        scale_by_learning_rate(lr, who="adam"),
    )
    opt.fused = FusedForm("adam", dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay), 1)
    return opt
