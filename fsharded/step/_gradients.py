"""How a step computes and reduces its gradients: ``Layout`` (one state layout's specs,
flat, and where its blocks are) and ``Gradients`` (how the loss sees the parameters:
plain, ZeRO-3 gathered inside the differentiated function, or per block through
``fsharded.parallel.run_block``; accumulated over micro-batches; reduced into the
gradient placement, following the gathers). It does not ask which backend runs it: the
step says (``eager``: one process per device, or a one-device mesh; otherwise the virtual
mesh's vmap levels, where only torch.func transforms apply).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from fsharded import _memory_hooks as memory
from fsharded import _tree
from fsharded.comm import _trace
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec
from fsharded.parallel import _buckets as B
from fsharded.parallel import zero3
from fsharded.parallel.blocks import handling
from fsharded.precision import cast_tree
from fsharded.spmd import _env, _manifest, _vma
from fsharded.step import _trainable as T

__all__ = ["Layout", "Gradients", "block_mask", "label"]


class Layout:
    """One state layout's specs, flat (one per parameter leaf), and where its blocks are."""

    def __init__(self, pl: Any, params: Any, blocks: str | None, mesh: Mesh) -> None:
        def flat(t):
            return optree.tree_leaves(t, is_leaf=lambda x: isinstance(x, PartitionSpec))

        self.use, self.grads, self.master = flat(pl.use), flat(pl.grads), flat(pl.master)
        self.stage, self.reshard = pl.stage, pl.reshard_after_forward
        self.axis = pl.axis if pl.stage > 0 else None
        self.blocks = blocks
        self.block_mask = block_mask(params, blocks)
        self.paths = _tree.tree_flatten_with_paths(params)[0]
        self.mesh = mesh
        # Which leaves train (None: all). The gradient side (``t_*``: reductions, clipping,
        # the update) sees only those; the loss sees every leaf.
        self.trainable = list(pl.trainable) if pl.trainable is not None else None
        self.frozen = [not t for t in self.trainable] if self.trainable is not None else None
        self.t_use, self.t_grads, self.t_master = (T.pick(x, self.trainable)
                                                   for x in (self.use, self.grads, self.master))
        self.t_paths = T.pick(self.paths, self.trainable)


def block_mask(params: Any, path: str | None) -> list[bool] | None:
    """Which leaves live under the block list at ``path`` (a list of per-block subtrees)."""
    if path is None:
        return None
    try:
        node = _tree.get_path(params, path)
    except KeyError as e:
        raise ValueError(f"train_step(blocks={path!r}): {e.args[0]}") from None
    if not isinstance(node, (list, tuple)) or not node:
        raise ValueError(
            f"train_step(blocks={path!r}): the parameters there are a {type(node).__name__}, "
            f"not a non-empty list of per-block subtrees"
        )
    return [p.startswith(path + ".") for p in _tree.tree_flatten_with_paths(params)[0]]


# -- gradients ---------------------------------------------------------------------------


def _untyped(mode: Any) -> Any:
    """Around a backward pass run under ``VmaMode.assuming``: its ops are autograd's, not
    the program's, so they are not typed (as the typed mode's ``torch.autograd.grad`` rule
    does)."""
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
    gradients returned are then its reduced ones."""
    leaves, tdef = optree.tree_flatten(p)
    with torch.enable_grad():
        req = [x.detach().requires_grad_() for x in leaves]
        if reducer is not None:
            reducer.watch(req)
        with _trace.span("forward"):
            out, aux = f(optree.tree_unflatten(tdef, req), batch)
        with _trace.span("backward"), backward_ctx(), _untyped(mode):
            grads = torch.autograd.grad(out, req, allow_unused=True)
    if reducer is not None:
        del grads  # stride-0 stand-ins: the values are in the reducer's buckets
        grads = reducer.finish()
    else:  # what backward made for the parameters (the rest of it is activation gradients)
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
    re-gather, ``fs.parallel.checkpoint``): with ``remat``, or when the plain form meets
    the assert, ``grad_and_value`` runs instead (a remat's own backward builds no graph)."""
    if not remat:
        try:
            out, vjp_fn, aux = torch.func.vjp(lambda q: f(q, batch), p, has_aux=True)
            with _untyped(mode):
                (grads,) = vjp_fn(torch.ones_like(out), retain_graph=False, create_graph=False)
            return grads, (out, aux)
        except RuntimeError as e:
            if "INTERNAL ASSERT" not in str(e):
                raise
    return torch.func.grad_and_value(f, has_aux=True)(p, batch)


class Gradients:
    """How the loss sees the parameters, how their gradients are computed, and how they
    are reduced into the gradient placement.

    Stages 0-2 gather the master shards (ZeRO-1/2) before differentiating and reduce the
    full gradients after (all-reduce; reduce-scatter at stage 2; a slice at stage 1).
    Stage 3 gathers inside the differentiated function, so gradients come back
    reduce-scattered by the all-gather's transpose: every leaf up front, or, given the
    block list, the leaves outside it up front and each block's at its ``run_block``.
    """

    def __init__(self, layout: Layout, loss_fn: Callable, *, policy: Any, scaling: Any,
                 batch_axes: tuple[str, ...], accumulation: int, eager: bool, distributed: bool,
                 cap: int, check_loss: Callable) -> None:
        self.layout, self.loss_fn, self.policy, self.scaling = layout, loss_fn, policy, scaling
        self.batch_axes, self.k, self.eager, self.distributed = batch_axes, accumulation, eager, distributed
        self.cap, self.check_loss = cap, check_loss
        self.inside = layout.stage == 3
        self.per_block = self.inside and layout.block_mask is not None
        self.assume = _assumable(layout, self.inside, batch_axes)
        self._prefetch = None

    def _gather(self, leaves: list, to: list) -> list:
        lay = self.layout
        if lay.axis is None:
            return list(leaves)
        return B.gather_leaves(list(leaves), lay.master, to, lay.axis, lay.mesh, self.cap, frozen=lay.frozen)

    def _handler(self, p: Any) -> Any:
        """The run_block handler of a per-block ZeRO-3 step (prefetching on real ranks)."""
        lay = self.layout
        leaves = optree.tree_leaves(p)
        specs_of = {id(x): (m, u) for x, m, u, b in zip(leaves, lay.master, lay.use, lay.block_mask) if b}
        frozen = {id(x) for x, f in zip(leaves, lay.frozen or ()) if f}
        blocks = _tree.get_path(p, lay.blocks)
        prefetch = zero3.Prefetch(blocks, specs_of, lay.axis, lay.mesh) \
            if self.distributed and not _manifest.dry() else None
        self._prefetch = prefetch
        # The last block's backward follows its forward at once: keep its weights.
        kept = {id(t) for t in optree.tree_leaves(blocks[-1])}
        return zero3.block_handler(specs_of, lay.axis, lay.mesh, self.cap, prefetch, lay.reshard, kept,
                                   frozen=frozen)

    def _local_loss(self, p: Any, micro: Any, scale: Any, model_state: Any = None):
        lay = self.layout
        leaves, tdef = optree.tree_flatten(p)
        if self.per_block:  # blocks stay sharded until their run_block
            keep = [m if b else u for m, u, b in zip(lay.master, lay.use, lay.block_mask)]
            leaves = self._gather(leaves, keep)
        elif self.inside:
            leaves = self._gather(leaves, lay.use)
        if self.inside:  # the weights gathered for the whole step are parameters, too
            label(leaves, "parameters")
        p = optree.tree_unflatten(tdef, [cast_tree(x, self.policy.compute_dtype) for x in leaves])
        with handling(self._handler(p)) if self.per_block else contextlib.nullcontext():
            out = self.loss_fn(p, micro) if model_state is None else self.loss_fn(p, micro, model_state)
        loss, extra = self.check_loss(out)
        loss = loss.float()
        return self.scaling.scale(loss, scale), (loss, extra)

    def __call__(self, params: Any, batch: Any, scale: Any, varying: tuple[str, ...],
                 mark: Callable, model_state: Any = None) -> tuple[list, torch.Tensor, tuple]:
        """(reduced gradient leaves in the gradient placement, the mean local loss, the
        mean of (the metrics, the stats) the loss function returned beside it). The loss
        reads ``model_state`` where given (not differentiated)."""
        lay = self.layout
        m_leaves, m_def = optree.tree_flatten(params)
        x0 = params if self.inside else optree.tree_unflatten(m_def, self._gather(m_leaves, lay.use))
        if not self.inside and lay.axis is not None:  # ZeRO-1/2 hold the full parameters
            label(x0, "parameters")
        if varying:
            # Data parallelism: mark the parameters varying over the batch axes before
            # differentiating (a type change, no data moves), so each shard's gradient is
            # its own contribution and the bucketed pmean below averages once. Left
            # invariant, each gradient would come back summed by the implicit pvary's
            # psum, one collective per leaf (JAX's rule).
            x0 = mark(x0, varying)
        loss_fn = functools.partial(self._local_loss, scale=scale, model_state=model_state)
        if lay.trainable is not None:
            # Only the trainable leaves are differentiated (a list of them); the frozen ones
            # reach the loss as constants, so no gradient of theirs is ever computed.
            x_leaves, x_def = optree.tree_flatten(x0)
            kept = [None if t else x for x, t in zip(x_leaves, lay.trainable)]  # the frozen ones
            whole = functools.partial(_whole, kept, x_def, lay.trainable)
            loss_fn = functools.partial(_on_trainable, loss_fn, whole)
            x0 = T.pick(x_leaves, lay.trainable)
        real = self.distributed and self.eager and not _manifest.dry()
        reducer = self._in_backward(x0) if real else None
        frame = _env.current()
        mode = frame.vma if self.assume is not None and frame is not None and not _manifest.dry() else None
        if self.eager:
            grad_fn = functools.partial(_autograd_grad_and_value, loss_fn,
                                        backward_ctx=zero3.overlapped_backward if self.per_block and real
                                        else contextlib.nullcontext, reducer=reducer, mode=mode)
        else:
            grad_fn = functools.partial(_func_grad_and_value, loss_fn, mode=mode)
        if mode is not None:
            grad_fn = functools.partial(self._assuming, mode, grad_fn)
        if reducer is not None:  # reduced into the gradient placement during backward
            g, (_, (loss, extra)) = grad_fn(x0, batch)
            return self._place(optree.tree_leaves(g)), loss, extra
        grads, loss, extra = None, None, None
        for i in range(self.k):
            micro = batch if self.k == 1 else optree.tree_map(lambda x, i=i: _micro(x, i, self.k), batch)
            g, (_, (l_i, e_i)) = grad_fn(x0, micro)
            g = optree.tree_map(lambda t: t.to(self.policy.reduce_dtype), g)
            grads = g if grads is None else optree.tree_map(torch.add, grads, g)
            loss = l_i if loss is None else loss + l_i
            extra = e_i if extra is None else optree.tree_map(torch.add, extra, e_i)
        if self.k > 1:
            grads = optree.tree_map(lambda t: t / self.k, grads)
            loss = loss / self.k
            extra = optree.tree_map(lambda t: t / self.k, extra)
        leaves = optree.tree_leaves(grads)
        # The reduction consumes the list (each gradient freed once bucketed); the weights
        # gathered for the loss are not needed during it.
        del g, grads, x0
        return self._reduce(leaves), loss, extra

    def _assuming(self, mode: Any, grad_fn: Callable, x0: Any, micro: Any) -> Any:
        """``grad_fn(x0, micro)`` with the varying-axes typing off (``VmaMode.assuming``):
        every differentiated input varies over every axis of size > 1 (``_assumable``).
        Where the loss needs the typing after all (it reduces a differentiated value over
        such an axis, or asks the type of a value the assumption does not cover), this
        step's pieces are typed from then on and ``NeedsTyping`` tells the caller to run
        the step's gradients again (the same keys, the same collectives on every rank)."""
        try:
            with mode.assuming(self.assume):
                g, (out, aux) = grad_fn(x0, micro)
            if mode.assume_failed:  # raised, and caught inside the loss function
                raise _vma.NeedsTyping
        except _vma.NeedsTyping:
            self.assume = None
            self._drain()
            raise
        for t in optree.tree_leaves(g):  # a cotangent has its primal's type
            if not mode.known(t):  # (reduced in backward: typed by the reduction)
                mode.set(t, self.assume)
        mode.set(out, self.assume)
        return g, (out, aux)

    def _drain(self) -> None:
        """Wait for the gathers a stopped forward left in flight (every rank stopped at
        the same collective, so every rank waits for the same ones)."""
        pf, self._prefetch = self._prefetch, None
        if pf is not None:
            for g in (*pf.pending.values(), *pf.backward.values()):
                g.wait()

    def _in_backward(self, x0: Any) -> Any:
        """Stages 0-2 on real ranks, one micro-batch: the bucketed reduction run inside
        backward (``_buckets.InBackward``), so at stage 2 the full gradient never exists at
        once. With accumulation the micro-batches' gradients are summed in full first, as
        before (reducing each micro-batch would cost k times the communication)."""
        lay = self.layout
        if self.inside or self.k > 1:
            return None
        frame = _env.current()
        shapes = [tuple(x.shape) for x in optree.tree_leaves(x0)]
        return B.InBackward.plan(shapes, lay.t_use, lay.t_grads, self.batch_axes, lay.mesh, self.cap,
                                 self.policy.reduce_dtype, frame.vma if frame is not None else None)

    def _place(self, g: list) -> list:
        lay = self.layout
        if lay.axis is not None:  # ZeRO-1: this rank's block of the gradient (as _reduce)
            g = B.slice_leaves(g, lay.t_grads, lay.t_master, lay.axis, lay.mesh)
        return g

    def _reduce(self, g: list) -> list:
        """Average over the batch axes into the gradient placement, in flat buckets
        (DeepSpeed's reduce buckets) rather than one collective per leaf."""
        lay = self.layout
        if self.inside:
            return B.reduce_leaves(g, lay.t_master, lay.t_master, self.batch_axes, lay.mesh, self.cap)
        g = B.reduce_leaves(g, lay.t_use, lay.t_grads, self.batch_axes, lay.mesh, self.cap)
        if lay.axis is not None:  # ZeRO-1: each rank keeps its block of the full gradient
            g = B.slice_leaves(g, lay.t_grads, lay.t_master, lay.axis, lay.mesh)
        return g


def _assumable(layout: Layout, inside: bool, batch_axes: tuple[str, ...]) -> frozenset | None:
    """The axes of size > 1, where every differentiated parameter varies over all of them
    once marked varying over the batch axes (its spec's axes plus the batch axes): the
    typing may then be assumed while the loss runs (``VmaMode.assuming``). None where some
    parameter is invariant over such an axis (tensor parallelism: implicit pvarys arise)."""
    mesh = layout.mesh
    full = frozenset(a for a in mesh.axis_names if mesh.shape[a] > 1)
    if not full:
        return None  # one device: nothing is typed
    marked = {a for a in batch_axes if mesh.shape[a] > 1}
    specs = layout.t_master if inside else layout.t_use
    if all(full <= marked | set(s.axes) for s in specs):
        return full
    return None


def _whole(leaves: list, tdef: Any, mask: list[bool], trained: list) -> Any:
    """The parameter tree of ``leaves`` with its trainable ones replaced by ``trained``."""
    it = iter(trained)
    return optree.tree_unflatten(tdef, [next(it) if t else x for x, t in zip(leaves, mask)])


def _on_trainable(loss_fn: Callable, whole: Callable, trained: list, micro: Any) -> Any:
    return loss_fn(whole(trained), micro)


def _micro(x: Any, i: int, k: int) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    if x.shape[0] % k:
        raise ValueError(
            f"train_step(accumulation={k}): each shard's batch has {x.shape[0]} rows, not "
            f"divisible into {k} micro-batches"
        )
    m = x.shape[0] // k
    return x[i * m:(i + 1) * m]


def label(tree: Any, category: str) -> None:
    """Name ``tree``'s storages in an active memory tracker (vmap-batched values on the
    virtual mesh by the tensors beneath them; see ``memory.label``)."""
    memory.label(tree, category)
