"""What torch.func's wrappers make of a value, asked in one place for the layers above.

Inside ``shard_map`` the backend is known (the frame's ``backend``: on the virtual mesh
every value the body computes from a shard is batched by the axes' vmap levels; on real
ranks it is a plain tensor), and code that chooses by backend takes it from there. The
questions here are about one value, where the answer does not follow from the backend:

- optimizers run inside a step and on their own, under a caller's ``vmap`` or ``grad``;
  on the virtual mesh a replicated leaf is a plain tensor beside batched ones;
- model code (kernels, MoE, ring attention) runs inside the differentiated loss on both
  backends, and on real ranks too under torch.func: remat re-runs its block with
  ``torch.func.vjp`` in backward (``parallel.remat``);
- a dry run traces the step on fake or meta tensors.

>>> import torch
>>> seen = []
>>> _ = torch.func.vmap(lambda x: seen.append(plain(x)) or x)(torch.ones(3, 2))
>>> plain({"w": torch.ones(2)}), seen
(True, [False])
"""

from __future__ import annotations

import contextlib
from typing import Any

import optree
import torch

__all__ = ["is_wrapped", "plain", "capturing", "is_capturing", "transforms_active", "requires_grad",
           "readable_beneath_grad"]

_F = torch._C._functorch


def is_wrapped(t: torch.Tensor) -> bool:
    """``t`` is a torch.func wrapper: batched by a ``vmap`` level or tracked by ``grad`` /
    ``vjp``. Its values cannot be read on the host, nor updated in place by foreach or fused
    kernels, which have no batching rule."""
    return _F.is_functorch_wrapped_tensor(t)


def plain(tree: Any) -> bool:
    """Every tensor in ``tree`` is an ordinary tensor, not a torch.func wrapper
    (``is_wrapped``), and no graph is being captured (``capturing``): where foreach
    kernels, in-place updates and reading a value on the host apply. Decided by the values
    themselves, not by which transforms are active around them."""
    if _CAPTURING:
        return False
    return not any(isinstance(t, torch.Tensor) and _F.is_functorch_wrapped_tensor(t)
                   for t in optree.tree_leaves(tree))


_CAPTURING = 0


@contextlib.contextmanager
def capturing() -> Any:
    """Around the capture of a step as one graph (``step.compile``): every value is a
    traced stand-in that cannot be read on the host, so ``plain`` answers False and the
    code takes its tensor-only forms (no host reads, no foreach-in-place shortcuts)."""
    global _CAPTURING
    _CAPTURING += 1
    try:
        yield
    finally:
        _CAPTURING -= 1


def is_capturing() -> bool:
    """Inside ``capturing``."""
    return _CAPTURING > 0


def transforms_active() -> bool:
    """A torch.func transform (``vmap``, ``grad``, ``vjp``) is active around the caller: an
    ``autograd.Function`` without ``setup_context`` and a ``vmap`` rule cannot run here."""
    return torch._C._are_functorch_transforms_active()


def requires_grad(t: torch.Tensor) -> bool:
    """``t.requires_grad``, looking through vmap wrappers (a batched tensor reports False even
    when the tensor under it is tracked, as on the virtual mesh)."""
    while not t.requires_grad:
        if not _F.is_functorch_wrapped_tensor(t):
            return False
        t = _F.get_unwrapped(t)
    return True


def readable_beneath_grad(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor beneath ``t``'s ``grad`` / ``vjp`` wrappers, whose values can be read (a
    check of indices on the host); None where a ``vmap`` level batches it (each batch
    element is another value) or a wrapper cannot be looked through."""
    while _F.is_functorch_wrapped_tensor(t):
        if _F.is_batchedtensor(t):
            return None
        try:
            t = _F.get_unwrapped(t)
        except RuntimeError:  # a wrapper we cannot look through
            return None
    return t
