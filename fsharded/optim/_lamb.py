"""LAMB (You et al., 2019): Adam's direction plus decoupled decay, rescaled per parameter by
the trust ratio ``||w|| / ||u||``.

Semantics (the paper's Algorithm 2 with phi = identity, as optax's ``lamb``):

    m, v   <- Adam moments;  r = m_hat / (sqrt(v_hat) + eps)     (bias-corrected)
    u      <- r + weight_decay * w                              (on leaves ``mask`` selects)
    ratio  <- ||w|| / ||u||, or 1 when either norm is 0          (per parameter tensor)
    w      <- w - lr * ratio * u

Unlike torch-optimizer's ``Lamb`` (no bias correction by default, ``||w||`` clamped to
[0, 10]) and DeepSpeed's ``FusedLamb`` (ratio clamped to [0.01, 10]), nothing is clamped.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from fsharded.optim._adam import scale_by_adam
from fsharded.optim._base import (
    EmptyState,
    GradientTransformation,
    Optimizer,
    ScalarOrSchedule,
    chain,
    scale_by_learning_rate,
)
from fsharded.optim._clip import leaf_sq_norms
from fsharded.optim._weight_decay import Mask, add_decayed_weights

__all__ = ["scale_by_trust_ratio", "lamb"]


def scale_by_trust_ratio(*, specs: Any = None) -> GradientTransformation:
    """Scale each update leaf by ``||param|| / ||update||`` (1 where either is 0).

    The norms are of whole parameters: inside ``shard_map`` pass the ``specs`` the
    parameters and updates are sharded by, and each leaf's squared norms are ``psum``'d
    over its spec's axes (see ``fsharded.optim.global_norm``).
    """

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_trust_ratio: update(..., params) needs the parameters")
        u_leaves, treedef = optree.tree_flatten(updates)
        w_sq = leaf_sq_norms(params, specs)
        u_sq = leaf_sq_norms(updates, specs)
        out = []
        for u, ws, us in zip(u_leaves, w_sq, u_sq):
            w_norm, u_norm = torch.sqrt(ws), torch.sqrt(us)
            # Computed everywhere, then replaced where a norm is 0 (a zero-initialised weight,
            # a zero update): a where, not a branch, so it stays vmap-safe.
            ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            out.append(u * ratio.to(u.dtype))
        return optree.tree_unflatten(treedef, out), state

    return GradientTransformation(lambda params: EmptyState(), update)


def lamb(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    mask: Mask | None = None,
    specs: Any = None,
) -> Optimizer:
    """LAMB (see the module doc). ``mask`` selects the decayed leaves; the trust ratio
    applies to every leaf. ``specs``: the parameters' spec tree when the update runs inside
    ``shard_map`` on shards (needed for whole-tensor norms); ``None`` outside.

    >>> opt = lamb(1e-3, weight_decay=0.01)
    """
    return chain(
        scale_by_adam(b1, b2, eps),
        add_decayed_weights(weight_decay, mask),
        scale_by_trust_ratio(specs=specs),
        scale_by_learning_rate(lr, who="lamb"),
    )
