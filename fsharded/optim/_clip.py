"""Mesh-aware norms and global-norm clipping.

Inside ``shard_map`` every leaf is a shard. Given the spec tree that says how each leaf is
sharded, a leaf's squared norm is its local sum of squares ``psum``'d over exactly the mesh
axes its spec names: a sharded leaf then counts every element once, and a leaf replicated
over an axis is not counted once per replica. Axes the current ``shard_map`` does not bind
(or no ``shard_map`` at all) are skipped, so the same code gives the plain norm unsharded.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from fsharded.mesh._tree import broadcast_prefix
from fsharded.optim._base import GradientTransformation, plain
from fsharded.spmd import collectives

__all__ = ["leaf_sq_norms", "global_norm", "clip_factor", "ClipByGlobalNormState", "clip_by_global_norm"]


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    # Half-precision sums of squares overflow and round badly; accumulate in fp32 at least.
    return torch.promote_types(x.dtype, torch.float32)


def leaf_sq_norms(tree: Any, specs: Any = None) -> list[torch.Tensor]:
    """Each leaf's squared L2 norm over the whole (unsharded) tensor, in leaf order.

    ``specs``: a spec tree (or prefix) for ``tree``, as given to ``shard_map``; ``None``
    treats every leaf as whole.
    """
    leaves = optree.tree_leaves(tree)
    flat_specs = [None] * len(leaves) if specs is None else broadcast_prefix(specs, tree, what="specs")
    out = []
    for x, spec in zip(leaves, flat_specs):
        x = x.to(_acc_dtype(x))
        sq = (x * x).sum()
        axes = tuple(a for a in (spec.axes if spec is not None else ()) if collectives.is_bound(a))
        out.append(collectives.psum(sq, axes) if axes else sq)
    return out


def global_norm(tree: Any, specs: Any = None, *, flat_specs: list | None = None) -> torch.Tensor:
    """The L2 norm of all leaves of ``tree`` together, mesh-aware (see the module doc).

    Leaves sharded over the same axes are summed locally first, so one ``psum`` per
    distinct set of axes runs, not one per leaf. ``flat_specs``: the specs already
    expanded to one per leaf (skips matching the spec tree on every call).

    >>> float(global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}))
    5.0
    """
    return torch.sqrt(global_sq_norm(tree, specs, flat_specs=flat_specs))


def global_sq_norm(tree: Any, specs: Any = None, *, flat_specs: list | None = None) -> torch.Tensor:
    """The squared L2 norm of all leaves of ``tree`` together, mesh-aware: ``global_norm``
    before its square root (for a caller that adds parts held elsewhere first)."""
    leaves = optree.tree_leaves(tree)
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    if flat_specs is None:
        flat_specs = [None] * len(leaves) if specs is None else broadcast_prefix(specs, tree, what="specs")
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, spec in enumerate(flat_specs):
        # psum over a set of axes does not depend on their order: one group per set.
        axes = tuple(sorted(a for a in (spec.axes if spec is not None else ()) if collectives.is_bound(a)))
        groups.setdefault(axes, []).append(i)
    fast = plain(leaves) and all(x.dtype in (torch.float32, torch.float64) and x.device.type != "meta"
                                 for x in leaves)
    norms = torch._foreach_norm(leaves) if fast else None  # one multi-tensor kernel
    same = fast and len({x.dtype for x in leaves}) == 1
    if not fast:
        sq = [(y * y).sum() for y in (x.to(_acc_dtype(x)) for x in leaves)]
    elif not same:
        sq = [n * n for n in norms]
    total = None
    for axes, idx in groups.items():
        if same:  # the group's squares in one op: each n * n, summed in leaf order as below
            part = torch.stack([norms[i] for i in idx]).square().sum() if len(idx) > 1 else norms[idx[0]].square()
        else:
            part = torch.stack([sq[i] for i in idx]).sum() if len(idx) > 1 else sq[idx[0]]
        part = collectives.psum(part, axes) if axes else part
        total = part if total is None else total + part
    return total


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What clipping to ``max_norm`` multiplies every update by, given their global ``norm``:
    ``max_norm / (norm + 1e-6)`` capped at 1, as ``torch.nn.utils.clip_grad_norm_`` (and
    DeepSpeed's ``gradient_clipping``) do. 0-d, in ``norm``'s dtype.

    >>> float(clip_factor(torch.tensor(5.0), 1.0))
    0.19999995827674866
    """
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


class ClipByGlobalNormState(NamedTuple):
    """``norm``: the global norm of the updates last seen, before clipping (0-d; 0 before the
    first update). It is the gradient norm a training loop logs, computed once."""

    norm: torch.Tensor


def clip_by_global_norm(max_norm: float, *, specs: Any = None) -> GradientTransformation:
    """Scale all updates by ``max_norm / (norm + 1e-6)`` when that is below 1, as
    ``torch.nn.utils.clip_grad_norm_`` (and DeepSpeed's ``gradient_clipping``) do.

    ``specs``: how the updates are sharded inside ``shard_map`` (the gradient specs: with
    ZeRO-2 these differ from the parameter specs); see ``global_norm``.

    >>> tx = clip_by_global_norm(1.0)
    >>> g, s = tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(None))
    >>> g["w"], s.norm
    (tensor([0.6000, 0.8000]), tensor(5.))
    """
    if not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be positive, got {max_norm!r}")

    def init(params):
        return ClipByGlobalNormState(torch.zeros((), dtype=torch.float32))

    def update(updates, state, params=None):
        norm = global_norm(updates, specs)
        factor = clip_factor(norm, max_norm)
        clipped = optree.tree_map(lambda u: u * factor.to(u.dtype), updates)
        return clipped, ClipByGlobalNormState(norm.to(state.norm.dtype))

    return GradientTransformation(init, update)
