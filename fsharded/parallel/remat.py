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

Selective remat (``save="dots"``, JAX's ``checkpoint_policies.dots_saveable``, torch's
selective activation checkpointing): the outputs of the matrix products are kept too, and
the recomputation takes them instead of multiplying again, so backward re-runs only the
cheap element-wise ops (norms, activations, residual adds).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsharded import _memory_hooks
from fsharded import random as R
from fsharded.parallel.blocks import Keyed
from fsharded.spmd import _env
from fsharded.spmd.collectives import all_gather_invariant, axis_index, axis_size, is_bound

__all__ = ["checkpoint", "Blocks", "Budget", "policy", "parse_bytes", "SAVEABLE"]


class _Remat(torch.autograd.Function):
    generate_vmap_rule = True
    vma_typed = True  # inside a shard_map body, its insides are typed (see _typed)

    # apply(fn, rng, moved, kept, *args, *copies): ``moved`` (a ``_Stand``) names the
    # arguments kept as stand-ins between forward and backward (``copies``, one per name,
    # made by the caller: host copies, this shard's part, or both); ``kept`` (a ``_Kept``
    # or None) holds the saved op outputs (selective remat).

    @staticmethod
    def forward(fn, rng, moved, kept, *tensors):
        args = tensors[:len(tensors) - len(moved)]
        with torch.no_grad(), _keyed(rng), (kept.recording() if kept is not None else contextlib.nullcontext()):
            return _typed(fn, args, None)

    @staticmethod
    def setup_context(ctx, inputs, output):
        fn, rng, moved, kept, *tensors = inputs
        n = len(tensors) - len(moved)
        args, copies = tensors[:n], dict(zip(moved, tensors[n:]))
        ctx.fn, ctx.keyed, ctx.n, ctx.kept = fn, rng is not None, n, kept
        # How each stand-in becomes its argument again: its device, shape, and how it was made.
        ctx.moved = {i: (args[i].device, tuple(args[i].shape), how) for i, how in zip(moved, moved.hows)}
        ctx.axis = moved.axis
        mode = _mode()
        ctx.types = [mode.get(a) for a in args] if mode is not None else None
        # The host copies instead of the arguments they stand for: those are not kept.
        ctx.save_for_backward(*((rng,) if rng is not None else ()),
                              *(copies.get(i, a) for i, a in enumerate(args)))

    @staticmethod
    def backward(ctx, *gs):
        saved = ctx.saved_tensors
        rng, args = (saved[0], saved[1:]) if ctx.keyed else (None, saved)
        if ctx.moved:  # back from host memory (a real copy, on a CPU device too), gathered whole
            args = tuple(_restore(a, *ctx.moved[i], ctx.axis) if i in ctx.moved else a for i, a in enumerate(args))
        extra = (None,) * len(ctx.moved)  # the copies get no gradient
        # Differentiate only the floating inputs autograd wants a gradient for: integer
        # inputs (positions, masks) and constants ride along as they are.
        want = [i for i, a in enumerate(args) if ctx.needs_input_grad[4 + i] and a.is_floating_point()]
        if not want:
            return (None, None, None, None, *(None for _ in args), *extra)
        kept, ctx.kept = ctx.kept, None  # taken once: a second backward recomputes all

        def f(*diff):
            full = list(args)
            for i, d in zip(want, diff):
                full[i] = d
            with kept.replaying() if kept is not None else contextlib.nullcontext():
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
        return (None, None, None, None, *(grads.get(i) for i in range(len(args))), *extra)


SAVEABLE: dict[str, frozenset] = {
    # JAX's dots_saveable: the matrix products (what ``matmul``, ``linear`` and ``einsum``
    # become below autograd), batched or not.
    "dots": frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                       torch.ops.aten.baddbmm.default}),
}
"""The op sets a selective remat can keep, by the name ``checkpoint(save=...)`` takes."""


class _Kept:
    """The outputs of one remat's saveable ops, in the order its forward ran them, and the
    recomputation's use of them: each saveable op there takes the next kept output of the
    same op, shapes and dtype instead of running. The recomputation runs the forward's ops
    in the forward's order (the same function on the same inputs); should it not, the
    first op that differs ends the replay and every op from there runs (``misses``), so a
    divergence costs time, not numbers. A kept output changed in place after it was made
    (its version moved: an in-place op in the forward) is not taken either. The ops sit below autograd and the torch.func
    transforms (a dispatch mode), so the recomputation still records each product's
    backward, which needs its inputs, not its output."""

    def __init__(self, ops: frozenset) -> None:
        self.ops, self.outs = ops, []
        self.recorded = self.hits = self.misses = 0  # outputs kept; taken, run again in recomputation

    def recording(self) -> Any:
        return _KeepMode(self, replay=False)

    def replaying(self) -> Any:
        return _KeepMode(self, replay=True)


def _signature(func: Any, args: tuple) -> tuple:
    return (func, tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else None for a in args))


class _KeepMode(TorchDispatchMode):
    def __init__(self, kept: _Kept, replay: bool) -> None:
        super().__init__()
        self.kept, self.replay = kept, replay
        self.queue = list(reversed(kept.outs)) if replay else None
        if replay:
            kept.outs = []  # each kept output leaves with its use (freed as backward goes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kept = self.kept
        if func not in kept.ops:
            return func(*args, **kwargs)
        sig = _signature(func, args)
        if not self.replay:
            out = func(*args, **kwargs)
            kept.outs.append((sig, out, out._version))
            kept.recorded += 1
            return out
        # The next kept output, if it is this op's and unchanged since (an in-place op on
        # it in the forward, e.g. an in-place activation, would make it another value).
        if self.queue and self.queue[-1][0] == sig and self.queue[-1][1]._version == self.queue[-1][2]:
            kept.hits += 1
            return self.queue.pop()[1]
        kept.misses += 1
        self.queue = []  # out of step with the forward: run everything from here
        return func(*args, **kwargs)


_SAVE: contextvars.ContextVar[frozenset | None] = contextvars.ContextVar("fsharded_remat_save", default=None)
_INHERIT: Any = object()


def _save_ops(save: Any) -> frozenset | None:
    if save is _INHERIT:
        return _SAVE.get()
    if save is None:
        return None
    if isinstance(save, str) and save in SAVEABLE:
        return SAVEABLE[save]
    raise ValueError(f"remat: save must be None or one of {sorted(SAVEABLE)}, got {save!r}")


class _Stand(tuple):
    """The positions of the arguments a remat keeps as stand-ins (a tuple of ints), with
    ``hows``: per position, what its stand-in is (``"part"``: this shard's part of it over
    ``axis``, gathered back in backward; ``"host"``: a host-memory copy; or both)."""

    def __new__(cls, positions: tuple, hows: tuple = (), axis: str | None = None) -> _Stand:
        out = super().__new__(cls, positions)
        out.hows, out.axis = hows, axis
        return out


def _part(t: torch.Tensor, axis: str, n: int) -> torch.Tensor:
    """This shard's ``1/n`` of ``t`` (invariant over ``axis``), flattened and padded: a new
    tensor, so the whole one is not kept alive by it."""
    flat = t.detach().reshape(-1)
    pad = (-flat.numel()) % n
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    me = axis_index(axis).reshape(1).to(flat.device)
    return flat.view(n, -1).index_select(0, me).reshape(-1)


def _restore(t: torch.Tensor, device: torch.device, shape: tuple, how: tuple, axis: str | None) -> torch.Tensor:
    """A stand-in made its argument again: back to ``device`` from host memory, and the
    parts of every shard over ``axis`` gathered whole."""
    if "host" in how:
        t = _to_device(t, device)
    if "part" in how:
        t = all_gather_invariant(t, axis, dim=0, tiled=True)[:math.prod(shape)].view(shape)
    return t


def _partitioned(axis: str | None) -> int:
    """Shards over ``axis`` a remat's inputs are split into (1: not split)."""
    if axis is None:
        return 1
    if not is_bound(axis):
        raise ValueError(f"remat: partition axis {axis!r} is not an axis of the mesh this runs on")
    return axis_size(axis)


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
               offload: Callable[[int, torch.Tensor], bool] | bool = False,
               save: str | None = _INHERIT,
               partition: str | tuple[str, Callable[[int, torch.Tensor], bool]] | None = None) -> Callable[..., Any]:
    """``fn`` (tensors in; a tensor or a pytree of tensors out, e.g. a block's ``(x, aux)``)
    recomputed in backward instead of stored.

    ``key``: run both passes under ``fs.random.scope(key)`` (a block's own key, see
    ``run_block``) instead of a key forked from the enclosing scope. It travels as an
    input of the recomputation, not captured (torch.func cannot lift captured tensors).

    ``offload``: keep the inputs it names (True: every floating one; or a predicate of the
    argument's position and value) in host memory between forward and backward, as
    DeepSpeed's ``cpu_checkpointing`` does: a copy is made in forward, the argument itself
    is not kept, and backward copies it back before recomputing. The numbers do not change
    (the copies are exact).

    ``save``: keep the outputs of these ops as well (``"dots"``: the matrix products, see
    ``SAVEABLE``), so backward recomputes only the ops between them. The same numbers: a
    kept output is the value the recomputation would compute. Not given: what the
    enclosing ``Blocks`` policy says (a block another handler recomputes, as ZeRO-3 does
    to gather its weights again, follows the step's policy); None: keep nothing.

    ``partition`` (a mesh axis, or ``(axis, predicate)`` naming the inputs as ``offload``
    does; DeepSpeed's ``partition_activations``): keep only this shard's part of each such
    input that is the same on every shard of ``axis`` (a tensor-parallel block's input),
    and gather the parts whole in backward before recomputing. With ``offload`` the part
    is what goes to host memory. The same numbers; 1/n of those inputs kept per shard, one
    all-gather of them in backward. An input that varies over the axis (or any input where
    the varying axes are not typed) is kept whole."""
    ops = _save_ops(save)
    axis, parted = (partition, True) if isinstance(partition, str) or partition is None else partition

    def wrapped(*args: torch.Tensor) -> Any:
        bad = [type(a).__name__ for a in args if not isinstance(a, torch.Tensor)]
        if bad:
            raise TypeError(f"checkpoint: arguments must be tensors (close over the rest), got {bad}")
        n = _partitioned(axis)
        mode = _mode()
        stands: dict[int, tuple[torch.Tensor, tuple]] = {}
        for i, a in enumerate(args):
            if not a.is_floating_point():
                continue
            how = ()
            t = a
            if n > 1 and mode is not None and axis not in mode.get(a) and (parted(i, a) if callable(parted) else parted):
                t, how = _part(a, axis, n), ("part",)
            if offload(i, a) if callable(offload) else offload:
                t, how = _to_host(t), (*how, "host")
                _memory_hooks.label([t], "offloaded activations")
            if how:
                stands[i] = (t, how)
        moved = _Stand(tuple(stands), tuple(h for _, h in stands.values()), axis)
        copies = [t for t, _ in stands.values()]
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

        kept = _Kept(ops) if ops else None
        out = _Remat.apply(flat, key if key is not None else R.fork(), moved, kept, *args, *copies)
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

    save: str | None = None
    """Selective remat (``"blocks,dots"``): keep the outputs of these ops too (``"dots"``:
    the matrix products, JAX's ``dots_saveable``), so backward recomputes only the
    element-wise ops between them. The same numbers; more memory than recomputing all of a
    block, far less time."""

    partition: str | None = None
    """Keep only this shard's part of each recomputed block's inputs over this mesh axis
    (``"blocks,partition"``: the ``tensor`` axis; DeepSpeed's ``partition_activations``),
    where they are the same on every shard of it (a tensor-parallel block's input), and
    gather them whole in backward before the block runs again. The same numbers; 1/n of
    the block inputs kept, one all-gather each in backward."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"remat.Blocks: every must be an int >= 1, got {self.every!r}")
        if self.partition is not None and (not isinstance(self.partition, str) or not self.partition):
            raise ValueError(f"remat.Blocks: partition must be a mesh axis name, got {self.partition!r}")
        if not isinstance(self.offload, bool):
            raise ValueError(f"remat.Blocks: offload must be a bool, got {self.offload!r}")
        if self.save is not None and self.save not in SAVEABLE:
            raise ValueError(f"remat.Blocks: save must be None or one of {sorted(SAVEABLE)}, got {self.save!r}")

    def __str__(self) -> str:
        part = "" if self.partition is None else (",partition" if self.partition == "tensor"
                                                  else f",partition:{self.partition}")
        return (("blocks" if self.every == 1 else f"blocks:{self.every}") + (f",{self.save}" if self.save else "")
                + part + (",offload" if self.offload else ""))

    def handler(self, inner: Callable[..., Any] | None = None,
                done: Callable[[Any], bool] | None = None) -> Callable[..., Any]:
        """A ``run_block`` handler for one forward: the chosen blocks rematerialised, then
        handed to ``inner`` (the step's own handler; None: run as they are). ``done(params)``:
        whether ``inner`` recomputes that block already (then it is not done twice)."""
        count = itertools.count()

        def handle(block: Callable[..., Any], params: Any, *args: Any, **kw: Any) -> Any:
            chosen = next(count) % self.every == 0
            recomputed = done is not None and done(params)
            if chosen and not recomputed:
                block = _rematerialised(block, self.offload, self.save, self.partition)
            if inner is None:
                return block(params, *args, **kw)
            # A chosen block ``inner`` recomputes itself keeps what this policy keeps.
            tok = _SAVE.set(SAVEABLE[self.save] if chosen and recomputed and self.save else None)
            try:
                return inner(block, params, *args, **kw)
            finally:
                _SAVE.reset(tok)

        return handle


def _rematerialised(block: Callable[..., Any], offload: bool = False, save: str | None = None,
                    partition: str | None = None) -> Callable[..., Any]:
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
        parted = None if partition is None else (partition, lambda i, _a: i >= n)
        return checkpoint(f, key=key, offload=moved, save=save, partition=parted)(
            *leaves, *(e for e, t in zip(extra, is_t) if t))

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
    first call, the first of none, every block selectively (its matrix products kept), one
    block, ... every block, every block with its input offloaded (``Blocks``) whose peak ``fs.estimate_memory`` puts at or under the budget,
    measuring the loss on that call's batch (``"budget:8GiB"``). What it changes,
    numerically: nothing (every candidate has the numbers of none)."""

    bytes: int

    def __post_init__(self) -> None:
        if isinstance(self.bytes, bool) or not isinstance(self.bytes, int) or self.bytes < 1:
            raise ValueError(f"remat.Budget: bytes must be a positive int, got {self.bytes!r}")

    def __str__(self) -> str:
        return f"budget:{self.bytes}"

    def candidates(self, n_blocks: int) -> list[Blocks | None]:
        """The policies tried, from the least recomputation to the most: none, every block
        selectively (only element-wise ops recomputed, no product), then every K-th block
        for K from ``n_blocks`` down to 1 (each count of recomputed blocks once), then every
        block with its input in host memory."""
        out: list[Blocks | None] = [None, Blocks(1, save="dots")]
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
    ``",dots"`` (selective: the matrix products' outputs kept, ``"selective"`` for
    ``"blocks,dots"``), ``",partition"`` (their inputs split over the ``tensor`` axis;
    ``",partition:AXIS"`` another) and/or ``",offload"`` (their inputs in host memory:
    ``"blocks:2,offload"``), a ``Blocks``, or a memory budget the step fits
    (``"budget:8GiB"``, ``Budget(bytes)``)."""
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
        if name == "selective" and not k:
            name, opts = "blocks", ["dots", *opts]
        parts = [o.partition(":")[2] or "tensor" for o in opts if o.partition(":")[0] == "partition"]
        rest = [o for o in opts if o.partition(":")[0] != "partition"]
        if name == "blocks" and set(rest) <= {"offload", *SAVEABLE} and len(rest) == len(set(rest)) \
                and len(set(rest) & set(SAVEABLE)) <= 1 and len(parts) <= 1:
            try:
                save = next((o for o in rest if o in SAVEABLE), None)
                return Blocks(int(k) if k else 1, offload="offload" in rest, save=save,
                              partition=parts[0] if parts else None)
            except ValueError:
                pass
    raise ValueError(f"remat: expected None, 'none', 'blocks', 'blocks:K' (every K-th block), either with "
                     f"',dots' (selective: matrix products kept; 'selective' = 'blocks,dots'), ',partition[:AXIS]' "
                     f"(inputs split over the tensor axis) and/or ',offload' (inputs kept in host memory), "
                     f"fs.parallel.remat.Blocks(every=K, save=..., partition=..., offload=...), or 'budget:SIZE' (the least recomputation that fits SIZE per device, e.g. "
                     f"budget:8GiB), got {spec!r}")
