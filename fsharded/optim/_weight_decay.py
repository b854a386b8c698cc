"""Weight decay and the masks that say which parameters get it."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from typing import Any

import optree
import torch

from fsharded._tree import tree_flatten_with_paths, tree_map_with_path
from fsharded.optim._base import EmptyState, GradientTransformation, _foreach_ok, check_hyper

__all__ = ["decay_mask", "add_decayed_weights", "Mask"]

# A bool pytree (or a prefix of the parameter tree), or params -> bool pytree.
Mask = Any

# A path component names a normalisation layer: "ln", "ln_f", "ln1", "pre_ln", or any
# component containing "norm" (layernorm, rmsnorm, norm1, input_layernorm).
_NORM_COMPONENT = re.compile(r"(.*norm.*)|((.*_)?ln\d*(_.*)?)", re.IGNORECASE)


def decay_mask(params: Any, *, no_decay: Sequence[str] = ()) -> Any:
    """The usual rule for transformers: decay matrices, not biases or norm weights.

    A leaf is *not* decayed (``False``) when it has fewer than 2 dims (biases, norm gains,
    scalars), when a component of its dotted path names a norm layer (contains ``norm``, or
    is ``ln``, ``ln_f``, ``ln1``, ``*_ln``...), or when its path matches one of the
    ``no_decay`` globs. Embedding tables are 2-D and are decayed, as in nanoGPT/Megatron.
    Pass it as ``mask=decay_mask`` to ``adamw``, ``lion`` or ``lamb``.

    >>> import torch
    >>> params = {"ln_f": {"w": torch.ones(4, 4)}, "fc": {"w": torch.ones(4, 4), "b": torch.ones(4)}}
    >>> decay_mask(params)
    {'ln_f': {'w': False}, 'fc': {'w': True, 'b': False}}
    """

    def rule(path: str, x: Any) -> bool:
        if getattr(x, "ndim", 0) < 2:
            return False
        if any(_NORM_COMPONENT.fullmatch(c) for c in path.split(".")):
            return False
        return not any(fnmatch.fnmatchcase(path, g) for g in no_decay)

    return tree_map_with_path(rule, params)


def resolve_mask(mask: Mask | None, params: Any, who: str) -> list[bool]:
    """One static Python bool per leaf of ``params`` (``True``: apply)."""
    n = optree.tree_structure(params).num_leaves
    if mask is None:
        return [True] * n
    tree = mask(params) if callable(mask) else mask
    try:
        full = optree.tree_broadcast_prefix(tree, params)
    except ValueError as e:
        raise ValueError(
            f"{who}: the mask is not a prefix of the parameter tree (give one bool per leaf, "
            f"a prefix, or a callable params -> bool tree): {e}"
        ) from None
    paths, leaves, _ = tree_flatten_with_paths(full)
    bad = [f"  {p}: {type(v).__name__}" for p, v in zip(paths, leaves) if not isinstance(v, bool)]
    if bad:
        # A tensor mask would make the choice data-dependent; masks are static structure.
        raise TypeError(f"{who}: mask leaves must be Python bools, got:\n" + "\n".join(bad))
    return list(leaves)


def add_decayed_weights(weight_decay: float = 0.0, mask: Mask | None = None) -> GradientTransformation:
    """``updates + weight_decay * params`` on the leaves ``mask`` selects.

    Before the moments it is L2 regularisation (``torch.optim.Adam``/``SGD``'s
    ``weight_decay``); after them and before the learning rate it is decoupled decay
    (``AdamW``: ``p <- p - lr * wd * p``).
    """
    check_hyper("add_decayed_weights", "weight_decay", weight_decay)

    def update(updates, state, params=None):
        if weight_decay == 0.0:
            return updates, state
        if params is None:
            raise ValueError("add_decayed_weights: update(..., params) needs the parameters")
        flags = resolve_mask(mask, params, "add_decayed_weights")
        u_leaves, treedef = optree.tree_flatten(updates)
        p_leaves = optree.tree_leaves(params)
        if len(p_leaves) != len(u_leaves):
            raise ValueError(
                f"add_decayed_weights: {len(u_leaves)} update leaves but {len(p_leaves)} parameters"
            )
        pick = [i for i, f in enumerate(flags) if f]
        out = list(u_leaves)
        if pick and _foreach_ok(updates) and all(u_leaves[i].dtype == p_leaves[i].dtype for i in pick):
            decayed = torch._foreach_add([u_leaves[i] for i in pick], [p_leaves[i] for i in pick],
                                         alpha=weight_decay)
            for i, d in zip(pick, decayed):
                out[i] = d
        else:
            for i in pick:
                out[i] = u_leaves[i] + weight_decay * p_leaves[i].to(u_leaves[i].dtype)
        return optree.tree_unflatten(treedef, out), state

    return GradientTransformation(lambda params: EmptyState(), update)

