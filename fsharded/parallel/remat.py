"""Rematerialisation (``jax.checkpoint``): keep a function's inputs, not its insides, and
run it again in backward.

``torch.utils.checkpoint`` and saved-tensor hooks do not work under ``torch.func.grad``;
this is an autograd Function whose forward runs the function without recording anything
and whose backward re-runs it under ``torch.func.vjp``. It works under ``torch.func``
transforms, on the virtual mesh (vmap) and on real ranks, and it is how ZeRO-3 drops a
block's gathered weights after the block and gathers them again in backward.

Every tensor the function differentiates must be an argument: a tensor captured by
closure is a constant here and gets no gradient.

>>> y = checkpoint(lambda w, x: torch.tanh(x @ w))(w, x)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from fsharded.spmd import _env

__all__ = ["checkpoint"]


class _Remat(torch.autograd.Function):
    generate_vmap_rule = True
    vma_typed = True  # inside a shard_map body, its insides are typed (see _typed)

    @staticmethod
    def forward(fn, *args):
        with torch.no_grad():
            return _typed(fn, args, None)

    @staticmethod
    def setup_context(ctx, inputs, output):
        fn, *args = inputs
        ctx.fn = fn
        mode = _mode()
        ctx.types = [mode.get(a) for a in args] if mode is not None else None
        ctx.save_for_backward(*args)

    @staticmethod
    def backward(ctx, g):
        args = ctx.saved_tensors
        with torch.enable_grad():
            _, vjp = torch.func.vjp(lambda *a: _typed(ctx.fn, a, ctx.types), *args)
        return (None, *vjp(g))


def _mode():
    frame = _env.current()
    return frame.vma if frame is not None else None


def _typed(fn: Callable, args: tuple, types: list | None) -> torch.Tensor:
    """Run ``fn`` with its ops typed by the shard_map body's varying-axes table, so the
    forward and its recomputation in backward insert the same implicit pvarys (a
    recomputation that differed would give other gradients)."""
    mode = _mode()
    if mode is None:
        return fn(*args)
    with mode.typing() if mode.dispatching else contextlib.nullcontext():
        if types is not None:
            for a, t in zip(args, types):
                mode.set(a, t)
        out = fn(*args)
    mode.carry(out)
    return out


def checkpoint(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` (tensors in, one tensor out) recomputed in backward instead of stored."""

    def wrapped(*args: torch.Tensor) -> torch.Tensor:
        bad = [type(a).__name__ for a in args if not isinstance(a, torch.Tensor)]
        if bad:
            raise TypeError(f"checkpoint: arguments must be tensors (close over the rest), got {bad}")
        return _Remat.apply(fn, *args)

    return wrapped
