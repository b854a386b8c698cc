"""Rematerialisation (``jax.checkpoint``): keep a function's inputs, not its insides, and
run it again in backward.

``torch.utils.checkpoint`` and saved-tensor hooks do not work under ``torch.func.grad``;
this is an autograd Function whose forward runs the function without recording anything
and whose backward re-runs it under ``torch.func.vjp``. It works under ``torch.func``
transforms, on the virtual mesh (vmap) and on real ranks, and it is how ZeRO-3 drops a
block's gathered weights after the block and gathers them again in backward.

Every tensor the function differentiates must be an argument: a tensor captured by
closure is a constant here and gets no gradient. Random ops inside (dropout) draw the same
values in the recomputation: inside an ``fs.random.scope`` the remat forks a key when it is
applied and runs both passes under it (outside a scope, random ops are refused on the
virtual mesh by vmap and would draw differently on a rank: use a scope).

>>> y = checkpoint(lambda w, x: torch.tanh(x @ w))(w, x)

A policy (``Blocks``) applies it to a model's blocks in a training step
(``train_step(..., remat="blocks")``): every block, or every k-th, runs through
``checkpoint``, so only its inputs are kept between forward and backward.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch

from fsharded import _memory_hooks
from fsharded import random as R
from fsharded.parallel.blocks import Keyed
from fsharded.spmd import _env

__all__ = ["checkpoint", "Blocks", "Budget", "policy", "parse_bytes"]


class _Remat(torch.autograd.Function):
    generate_vmap_rule = True
    vma_typed = True  # inside a shard_map body, its insides are typed (see _typed)

    # apply(fn, rng, moved, *args, *copies): ``moved`` names the arguments kept in host
    # memory between forward and backward (``copies``, one per name, made by the caller).

    @staticmethod
    def forward(fn, rng, moved, *tensors):
        args = tensors[:len(tensors) - len(moved)]
        with torch.no_grad(), _keyed(rng):
            return _typed(fn, args, None)

    @staticmethod
    def setup_context(ctx, inputs, output):
        fn, rng, moved, *tensors = inputs
        n = len(tensors) - len(moved)
        args, copies = tensors[:n], dict(zip(moved, tensors[n:]))
        ctx.fn, ctx.keyed, ctx.n = fn, rng is not None, n
        ctx.moved = {i: args[i].device for i in moved}  # where each goes back to
        mode = _mode()
        ctx.types = [mode.get(a) for a in args] if mode is not None else None
        # The host copies instead of the arguments they stand for: those are not kept.
        ctx.save_for_backward(*((rng,) if rng is not None else ()),
                              *(copies.get(i, a) for i, a in enumerate(args)))

    @staticmethod
    def backward(ctx, *gs):
        saved = ctx.saved_tensors
        rng, args = (saved[0], saved[1:]) if ctx.keyed else (None, saved)
        if ctx.moved:  # back from host memory (a real copy, on a CPU device too)
            args = tuple(_to_device(a, ctx.moved[i]) if i in ctx.moved else a for i, a in enumerate(args))
        extra = (None,) * len(ctx.moved)  # the copies get no gradient
        # Differentiate only the floating inputs autograd wants a gradient for: integer
        # inputs (positions, masks) and constants ride along as they are.
        want = [i for i, a in enumerate(args) if ctx.needs_input_grad[3 + i] and a.is_floating_point()]
        if not want:
            return (None, None, None, *(None for _ in args), *extra)

        def f(*diff):
            full = list(args)
            for i, d in zip(want, diff):
                full[i] = d
            return _run_keyed(ctx.fn, rng, tuple(full), ctx.types)

        def dot(*diff):  # <f(diff), g>: its gradient is f's vjp with g (summed over outputs)
            outs = f(*diff)
            outs = outs if isinstance(outs, tuple) else (outs,)
            terms = [(o * g).sum() for o, g in zip(outs, gs)
                     if g is not None and o.is_floating_point()]
            return torch.stack(terms).sum() if terms else outs[0].new_zeros(())

        # The same key as the forward: the recomputation draws the same dropout masks.
        # torch.func.grad rather than vjp: under vmap, torch 2.13 fails an internal assert
        # when a vjp taken inside this backward runs under an outer vjp without
        # create_graph. grad ignores the grad mode around it (a backward without
        # create_graph runs under no_grad), which stays off, so no graph of the backward
        # itself outlives it (one would keep the recomputed activations until backward ends).
        grads = torch.func.grad(dot, argnums=tuple(range(len(want))))(*(args[i] for i in want))
        grads = dict(zip(want, grads))
        return (None, None, None, *(grads.get(i) for i in range(len(args))), *extra)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host-memory copy of ``t``, detached (page-locked where ``t`` is on a GPU, copied
    without waiting: the copy back in backward is ordered after it on the same stream). A
    CPU tensor is copied too, so the same copies and buffers run on a CPU-only machine."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The host copy ``t`` back on ``device`` (a new tensor, on a CPU device too)."""
    if device.type == "cpu":
        return t.clone()
    return t.to(device, non_blocking=True)


def _mode():
    """The body's varying-axes table, or None where nothing is typed (outside shard_map,
    or a stretch run under ``VmaMode.assuming``: no implicit pvary arises there, in the
    forward or in its recomputation)."""
    frame = _env.current()
    mode = frame.vma if frame is not None else None
    return mode if mode is not None and mode.assumed is None else None


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


def _keyed(rng: torch.Tensor | None):
    return R.scope(rng) if rng is not None else contextlib.nullcontext()


def _run_keyed(fn: Callable, rng: torch.Tensor | None, args: tuple, types: list | None) -> torch.Tensor:
    with _keyed(rng):
        return _typed(fn, args, types)


def checkpoint(fn: Callable[..., Any], *, key: torch.Tensor | None = None,
               offload: Callable[[int, torch.Tensor], bool] | bool = False) -> Callable[..., Any]:
    """``fn`` (tensors in; a tensor or a pytree of tensors out, e.g. a block's ``(x, aux)``)
    recomputed in backward instead of stored.

    ``key``: run both passes under ``fs.random.scope(key)`` (a block's own key, see
    ``run_block``) instead of a key forked from the enclosing scope. It travels as an
    input of the recomputation, not captured (torch.func cannot lift captured tensors).

    ``offload``: keep the inputs it names (True: every floating one; or a predicate of the
    argument's position and value) in host memory between forward and backward, as
    DeepSpeed's ``cpu_checkpointing`` does: a copy is made in forward, the argument itself
    is not kept, and backward copies it back before recomputing. The numbers do not change
    (the copies are exact)."""

    def wrapped(*args: torch.Tensor) -> Any:
        bad = [type(a).__name__ for a in args if not isinstance(a, torch.Tensor)]
        if bad:
            raise TypeError(f"checkpoint: arguments must be tensors (close over the rest), got {bad}")
        moved = tuple(i for i, a in enumerate(args) if a.is_floating_point() and (
            offload(i, a) if callable(offload) else offload))
        copies = [_to_host(args[i]) for i in moved]
        _memory_hooks.label(copies, "offloaded activations")
        shape: list = []

        def flat(*a: torch.Tensor) -> Any:
            out = fn(*a)
            if isinstance(out, torch.Tensor):
                return out
            leaves, tdef = optree.tree_flatten(out)
            bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
            if bad or not leaves:
                raise TypeError(f"checkpoint: the function must return tensors, got {bad or 'none'}")
            shape[:] = [tdef]
            return tuple(leaves)

        out = _Remat.apply(flat, key if key is not None else R.fork(), moved, *args, *copies)
        return optree.tree_unflatten(shape[0], list(out)) if shape else out

    return wrapped


# -- policies: which blocks of a step are recomputed ---------------------------------------------


@dataclass(frozen=True)
class Blocks:
    """Recompute blocks in backward: every ``every``-th block a forward runs (the first,
    then every ``every``-th after it; 1: all of them) keeps only its inputs, and runs again
    in backward. A step applies it where the model runs its blocks (``run_block``), inside
    the step's own handling of them (ZeRO-3 gathers the block's weights first). What it
    changes, numerically: nothing; the recomputation draws the forward's dropout masks."""

    every: int = 1
    offload: bool = False
    """Keep the recomputed blocks' inputs in host memory between forward and backward
    (DeepSpeed's ``cpu_checkpointing``; ``"blocks,offload"``): copied out in forward, back
    before the block runs again. The same numbers; device memory holds no block input."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"remat.Blocks: every must be an int >= 1, got {self.every!r}")
        if not isinstance(self.offload, bool):
            raise ValueError(f"remat.Blocks: offload must be a bool, got {self.offload!r}")

    def __str__(self) -> str:
        return ("blocks" if self.every == 1 else f"blocks:{self.every}") + (",offload" if self.offload else "")

    def handler(self, inner: Callable[..., Any] | None = None,
                done: Callable[[Any], bool] | None = None) -> Callable[..., Any]:
        """A ``run_block`` handler for one forward: the chosen blocks rematerialised, then
        handed to ``inner`` (the step's own handler; None: run as they are). ``done(params)``:
        whether ``inner`` recomputes that block already (then it is not done twice)."""
        count = itertools.count()

        def handle(block: Callable[..., Any], params: Any, *args: Any, **kw: Any) -> Any:
            if next(count) % self.every == 0 and not (done is not None and done(params)):
                block = _rematerialised(block, self.offload)
            return inner(block, params, *args, **kw) if inner is not None else block(params, *args, **kw)

        return handle


def _rematerialised(block: Callable[..., Any], offload: bool = False) -> Callable[..., Any]:
    """``block(params, *args, **kw)`` through ``checkpoint``: its parameters and tensor
    arguments are the inputs kept (``offload``: its tensor arguments, not its parameters,
    in host memory); a keyed block's key goes in too."""
    key = block.key() if isinstance(block, Keyed) else None
    plain = block.block if key is not None else block

    def run(params: Any, *args: Any, **kw: Any) -> Any:
        leaves, pdef = optree.tree_flatten(params)
        extra, edef = optree.tree_flatten((args, kw))
        is_t = [isinstance(e, torch.Tensor) for e in extra]
        consts = [None if t else e for e, t in zip(extra, is_t)]  # (f keeps no tensor argument alive)
        n = len(leaves)

        def f(*tensors: torch.Tensor) -> Any:
            ts = iter(tensors[n:])
            a, k = optree.tree_unflatten(edef, [next(ts) if t else e for e, t in zip(consts, is_t)])
            return plain(optree.tree_unflatten(pdef, list(tensors[:n])), *a, **k)

        moved = (lambda i, _a: i >= n) if offload else False
        return checkpoint(f, key=key, offload=moved)(*leaves, *(e for e, t in zip(extra, is_t) if t))

    return run


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512 MB"``, ``"1e9"`` -> bytes (a ``ValueError`` otherwise)."""
    t = text.strip().lower().replace(" ", "")
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if t.endswith(u)), "b")
    number = t[: len(t) - len(unit)] if t.endswith(unit) else t
    value = float(number) * _UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"expected a positive size, got {text!r}")
    return int(value)


@dataclass(frozen=True)
class Budget:
    """The least recomputation whose step fits ``bytes`` per device: the step picks, at its
    first call, the first of none, one block, ... every block, every block with its input
    offloaded (``Blocks``) whose peak ``fs.estimate_memory`` puts at or under the budget,
    measuring the loss on that call's batch (``"budget:8GiB"``). What it changes,
    numerically: nothing (every candidate has the numbers of none)."""

    bytes: int

    def __post_init__(self) -> None:
        if isinstance(self.bytes, bool) or not isinstance(self.bytes, int) or self.bytes < 1:
            raise ValueError(f"remat.Budget: bytes must be a positive int, got {self.bytes!r}")

    def __str__(self) -> str:
        return f"budget:{self.bytes}"

    def candidates(self, n_blocks: int) -> list[Blocks | None]:
        """The policies tried, from the least recomputation to the most: none, then every
        K-th block for K from ``n_blocks`` down to 1 (each count of recomputed blocks once),
        then every block with its input in host memory."""
        out: list[Blocks | None] = [None]
        counts = set()
        for k in range(max(n_blocks, 1), 0, -1):
            c = -(-n_blocks // k)
            if c not in counts:
                counts.add(c)
                out.append(Blocks(k))
        return out + [Blocks(1, offload=True)]


def policy(spec: Any) -> Blocks | Budget | None:
    """A remat policy from what a user gives: None or ``"none"`` (keep every activation),
    ``"blocks"`` (recompute every block), ``"blocks:K"`` (every K-th block), either with
    ``",offload"`` (their inputs in host memory: ``"blocks:2,offload"``), a ``Blocks``, or a
    memory budget the step fits (``"budget:8GiB"``, ``Budget(bytes)``)."""
    if spec is None or isinstance(spec, (Blocks, Budget)):
        return spec
    if isinstance(spec, str):
        head, *opts = [t.strip() for t in spec.strip().lower().split(",")]
        name, _, k = head.partition(":")
        if name == "none" and not k and not opts:
            return None
        if name == "budget" and k and not opts:
            try:
                return Budget(parse_bytes(k))
            except ValueError:
                pass
        if name == "blocks" and set(opts) <= {"offload"} and len(opts) == len(set(opts)):
            try:
                return Blocks(int(k) if k else 1, offload=bool(opts))
            except ValueError:
                pass
    raise ValueError(f"remat: expected None, 'none', 'blocks', 'blocks:K' (every K-th block), either with "
                     f"',offload' (inputs kept in host memory), fs.parallel.remat.Blocks(every=K, "
                     f"offload=...), or 'budget:SIZE' (the least recomputation that fits SIZE per device, e.g. "
                     f"budget:8GiB), got {spec!r}")
