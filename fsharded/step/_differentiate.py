"""What every gradient strategy shares: how the parameters reach the differentiated
function (``Inputs``), the local loss it differentiates (``LocalLoss``), and the two ways
of differentiating it (plain autograd, or torch.func on the virtual mesh's vmap levels:
the step says which, ``differentiator(eager=...)``; nothing here asks which backend runs).

The strategies (``_grad_plain``, ``_grad_accumulate``; ``_grad_blocks`` for the per-block
loss) compose these with the spec-derived reduction (``_reduce``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from fsharded import _memory_hooks as memory
from fsharded.comm import _trace
from fsharded.parallel import _buckets as B
from fsharded.parallel import offload as _offload
from fsharded.parallel.blocks import handling
from fsharded.precision import cast_tree
from fsharded.spmd import _manifest
from fsharded.step import _held
from fsharded.step._layout import Layout

__all__ = ["Inputs", "LocalLoss", "differentiator", "gatherer", "label"]


def label(tree: Any, category: str) -> None:
    """Name ``tree``'s storages in an active memory tracker (vmap-batched values on the
    virtual mesh by the tensors beneath them; see ``memory.label``)."""
    memory.label(tree, category)


# -- differentiating -----------------------------------------------------------------------


def _untyped(mode: Any) -> Any:
    """Around a backward pass run with the typing assumed (``_assume``): its ops are
    autograd's, not the program's, so they are not typed (as the typed mode's
    ``torch.autograd.grad`` rule does)."""
    if mode is None or mode.assumed is None:
        return contextlib.nullcontext()
    return _dispatching(mode)


@contextlib.contextmanager
def _dispatching(mode: Any):
    mode.dispatching += 1
    try:
        yield
    finally:
        mode.dispatching -= 1


def _autograd_grad_and_value(f, p, batch, *, backward_ctx=contextlib.nullcontext, reducer=None, mode=None):
    """``torch.func.grad_and_value(f, has_aux=True)(p, batch)`` with plain autograd, which
    skips functorch's wrapping (~8%) where nothing is transformed. ``backward_ctx``: around
    the backward pass (ZeRO-3's overlapped reduce-scatters complete on its exit).
    ``reducer`` (``_buckets.InBackward``): reduces the gradients while backward runs; the
    gradients returned are then its reduced ones. Or a ``_buckets.HostSink``: the gradients
    of the leaves it watches are returned from the host, copied there as backward made them."""
    leaves, tdef = optree.tree_flatten(p)
    with torch.enable_grad():
        req = [x.detach().requires_grad_() for x in leaves]
        if reducer is not None:
            reducer.watch(req)
        with _trace.span("forward"):
            out, aux = f(optree.tree_unflatten(tdef, req), batch)
        with _trace.span("backward"), backward_ctx(), _untyped(mode):
            grads = torch.autograd.grad(out, req, allow_unused=True)
    if reducer is not None and reducer.reduced:
        del grads  # stride-0 stand-ins: the values are in the reducer's buckets
        with _trace.phase("reduce"):  # the buckets backward left: reduced after it
            grads = reducer.finish()
    else:  # what backward made for the parameters (the rest of it is activation gradients)
        if reducer is not None:  # (those it watched: copied to the host as they were made)
            grads = reducer.finish(list(grads))
        memory.label([g for g in grads if g is not None], "gradients")
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]
    return optree.tree_unflatten(tdef, grads), optree.tree_map(torch.Tensor.detach, (out, aux))


def _func_grad_and_value(f, p, batch, *, remat: bool = False, mode=None):
    """``torch.func.grad_and_value(f, has_aux=True)(p, batch)`` (the virtual mesh's vmap
    levels need torch.func) with a backward that builds no graph of itself.
    ``grad_and_value`` differentiates with ``create_graph=True`` (for transforms stacked
    above it), and that graph keeps every activation and activation gradient alive until
    backward ends (+60% of the GPT's virtual step peak per device); nothing differentiates
    a step, so its vjp runs with ``create_graph=False``. Under vmap, torch 2.13 fails an
    internal assert in that backward when remats are chained (ZeRO-3's per-block
    re-gather, ``fs.parallel.remat.checkpoint``): with ``remat``, or when the plain form meets
    the assert, ``grad_and_value`` runs instead (a remat's own backward builds no graph)."""
    if not remat:
        at = _manifest.mark()
        try:
            out, vjp_fn, aux = torch.func.vjp(lambda q: f(q, batch), p, has_aux=True)
            with _untyped(mode):
                (grads,) = vjp_fn(torch.ones_like(out), retain_graph=False, create_graph=False)
            return grads, (out, aux)
        except RuntimeError as e:
            if "INTERNAL ASSERT" not in str(e):
                raise
            _manifest.rewind(at)  # the collectives of the abandoned attempt are not the step's
    return torch.func.grad_and_value(f, has_aux=True)(p, batch)


def differentiator(*, eager: bool, backward_ctx: Callable = contextlib.nullcontext) -> Callable:
    """``grad(f, x0, batch) -> (gradients, (value, aux))`` for ``f(x0, batch) -> (value,
    aux)``. ``eager``: nothing is vmapped (one process per device, or a one-device mesh),
    so plain autograd runs, with ``backward_ctx`` around backward; it also takes a
    ``reducer=``. Otherwise torch.func (the virtual mesh's vmap levels)."""
    if eager:
        return functools.partial(_autograd_grad_and_value, backward_ctx=backward_ctx)
    return _func_grad_and_value


# -- the parameters as the loss sees them ----------------------------------------------------


class _Gather:
    """All-gathers the leaves that ``src`` shards over the layout's axis and ``dst`` does
    not (``_buckets.gather_leaves``, bucketed; differentiable: its transpose reduce-scatters)."""

    def __init__(self, src: list, dst: list, layout: Layout, cap: int) -> None:
        self.src, self.dst, self.layout, self.cap = src, dst, layout, cap

    def __call__(self, leaves: list) -> list:
        lay = self.layout
        here = lay.holding.here if lay.holding is not None else None
        if here is not None and not all(here):  # per-stage storage: the leaves held here
            return _held.on_held(self, leaves, here)
        if lay.params_in_files:  # shards in NVMe files: read through the tier's checked I/O
            leaves = _offload.read(list(leaves))
        out = B.gather_leaves(list(leaves), self.src, self.dst, lay.axis, lay.mesh, self.cap, frozen=lay.frozen)
        label(out, "parameters")  # the gathered weights are parameters, too
        return out

    def part(self, leaves: list, idx: list[int]) -> list:
        """The gather of the leaves at ``idx`` alone."""
        lay = self.layout
        frozen = [lay.frozen[i] for i in idx] if lay.frozen is not None else None
        if lay.params_in_files:
            leaves = _offload.read(list(leaves))
        out = B.gather_leaves(list(leaves), [self.src[i] for i in idx], [self.dst[i] for i in idx], lay.axis,
                              lay.mesh, self.cap, frozen=frozen)
        label(out, "parameters")
        return out


def _as_is(leaves: list) -> list:
    return list(leaves)


def gatherer(src: list, dst: list, moving: list[bool] | tuple[bool, ...], layout: Layout,
             cap: int) -> Callable[[list], list]:
    """The gather from the ``src`` layout to ``dst`` (leaf lists), or nothing where no leaf
    ``moving`` marks moves: chosen when the plan is built."""
    return _Gather(src, dst, layout, cap) if any(moving) else _as_is


def _whole(leaves: list, tdef: Any, mask: list[bool], trained: list) -> Any:
    """The parameter tree of ``leaves`` with its trainable ones replaced by ``trained``."""
    it = iter(trained)
    return optree.tree_unflatten(tdef, [next(it) if t else x for x, t in zip(leaves, mask)])


def _on_trainable(loss_fn: Callable, whole: Callable, trained: list, micro: Any) -> Any:
    return loss_fn(whole(trained), micro)


def _every_leaf(x0: Any, loss_fn: Callable) -> tuple[Any, Callable]:
    return x0, loss_fn


def _trainable_leaves(mask: list[bool], x0: Any, loss_fn: Callable) -> tuple[list, Callable]:
    """Only the trainable leaves are differentiated (a list of them); the frozen ones reach
    the loss as constants, so no gradient of theirs is ever computed."""
    x_leaves, x_def = optree.tree_flatten(x0)
    kept = [None if t else x for x, t in zip(x_leaves, mask)]  # the frozen ones
    whole = functools.partial(_whole, kept, x_def, mask)
    return [x for x, t in zip(x_leaves, mask) if t], functools.partial(_on_trainable, loss_fn, whole)


class Inputs:
    """What a strategy differentiates: the state's master leaves brought to the ``params``
    layout (the master shards ``Moves.gather_before`` marks gathered: ZeRO-1/2), marked
    varying over the batch axes, and of them the trainable ones."""

    def __init__(self, layout: Layout, cap: int) -> None:
        self.gather = gatherer(layout.master, layout.params, layout.moves.gather_before, layout, cap)
        self.select = _every_leaf if layout.trainable is None else \
            functools.partial(_trainable_leaves, layout.trainable)

    def __call__(self, params: Any, loss_fn: Callable, varying: tuple[str, ...],
                 mark: Callable) -> tuple[Any, Callable]:
        """``(x0, f)``: what to differentiate and ``f(x0, micro) -> (scaled loss, aux)``."""
        leaves, tdef = optree.tree_flatten(params)
        x0 = optree.tree_unflatten(tdef, self.gather(leaves))
        if varying:
            # Data parallelism: mark the parameters varying over the batch axes before
            # differentiating (a type change, no data moves), so each shard's gradient is
            # its own contribution and the bucketed pmean of the reduction averages once.
            # Left invariant, each gradient would come back summed by the implicit pvary's
            # psum, one collective per leaf (JAX's rule).
            x0 = mark(x0, varying)
        return self.select(x0, loss_fn)


class LocalLoss:
    """One shard's loss as the strategies differentiate it: the leaves ``Moves.gather_in_loss``
    marks gathered for use inside it (ZeRO-3: their gradients come back reduce-scattered
    by the gather's transpose), every leaf cast to the compute dtype, the loss run and
    checked, scaled. ``bind(scale, model_state)`` gives ``f(params, micro)``.

    ``to``: the layout the loss gathers the leaves to (default: ``use``, every leaf whole;
    the per-block loss leaves its blocks' leaves to their ``run_block``)."""

    backward_ctx = staticmethod(contextlib.nullcontext)  # around backward (eager): nothing
    # Leaves the loss hands on in their own dtype (None: none), to be cast where they are
    # gathered (the per-block loss's block leaves: ZeRO-3 casts them before they travel).
    uncast: list[bool] | None = None

    def __init__(self, layout: Layout, loss_fn: Callable, *, policy: Any, scaling: Any,
                 check_loss: Callable, cap: int, to: list | None = None, remat: Any = None) -> None:
        to = layout.use if to is None else to
        moving = [m and p != t for m, p, t in zip(layout.moves.gather_in_loss, layout.params, to)]
        self.gather = gatherer(layout.params, to, moving, layout, cap)
        self.loss_fn, self.policy, self.scaling, self.check_loss = loss_fn, policy, scaling, check_loss
        self.remat = remat  # which blocks are recomputed in backward (parallel.remat.Blocks), or None

    def running(self, p: Any) -> Any:
        """The context the loss runs in: the remat policy's run_block handler (the per-block
        loss installs its own, the policy's inside it)."""
        return handling(self.remat.handler()) if self.remat is not None else contextlib.nullcontext()

    def drain(self) -> None:
        """Wait for what a forward stopped midway left in flight (nothing here)."""

    def bind(self, scale: Any, model_state: Any) -> Callable:
        return functools.partial(self, scale=scale, model_state=model_state)

    def __call__(self, p: Any, micro: Any, *, scale: Any, model_state: Any = None) -> tuple:
        leaves, tdef = optree.tree_flatten(p)
        leaves = self.gather(leaves)
        keep = self.uncast or [False] * len(leaves)
        p = optree.tree_unflatten(tdef, [x if k else cast_tree(x, self.policy.compute_dtype)
                                         for x, k in zip(leaves, keep)])
        with self.running(p):
            out = self.loss_fn(p, micro) if model_state is None else self.loss_fn(p, micro, model_state)
        loss, extra = self.check_loss(out)
        loss = loss.float()
        return self.scaling.scale(loss, scale), (loss, extra)
