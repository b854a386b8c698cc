"""The pieces a training step is composed of, each chosen once when the step is built.

``train_step`` composes, per shard: how the loss sees the parameters and how their
gradients are computed (``Gradients``: plain, ZeRO-3 gathered inside the differentiated
function, or per block through ``fsharded.parallel.run_block``; accumulated over
micro-batches), how the gradients are reduced into their placement (part of the same
piece: it follows the gathers), loss scaling (``NoScaling`` or ``DynamicScaling``: unscale,
the finite check every shard agrees on, skip-or-apply), and the update (``PureUpdate``,
``DonatedUpdate`` or ``FusedUpdate``, the in-place multi-tensor kernel), with clipping by
the mesh-aware global norm inside it. None of them asks which backend runs it: the step
knows (``eager``: one process per device, or a one-device mesh; otherwise the virtual
mesh's vmap levels, where only torch.func transforms apply).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from fsharded import _step_trainable as T
from fsharded import _tree, memory, optim
from fsharded.comm import _trace
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec
from fsharded.parallel import _buckets as B
from fsharded.parallel import zero3
from fsharded.parallel.blocks import handling
from fsharded.precision import all_finite, cast_tree, tree_where, unscale
from fsharded.spmd import _env, _manifest
from fsharded.spmd._virtual import beneath
from fsharded.spmd.collectives import is_bound

__all__ = ["Layout", "Gradients", "NoScaling", "DynamicScaling", "PureUpdate", "DonatedUpdate",
           "FusedUpdate", "StackedFusedUpdate", "choose_update"]


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


def _autograd_grad_and_value(f, p, batch, *, backward_ctx=contextlib.nullcontext, reducer=None):
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
        with _trace.span("backward"), backward_ctx():
            grads = torch.autograd.grad(out, req, allow_unused=True)
    if reducer is not None:
        del grads  # stride-0 stand-ins: the values are in the reducer's buckets
        grads = reducer.finish()
    else:  # what backward made for the parameters (the rest of it is activation gradients)
        memory.label([g for g in grads if g is not None], "gradients")
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]
    return optree.tree_unflatten(tdef, grads), optree.tree_map(torch.Tensor.detach, (out, aux))


def _func_grad_and_value(f, p, batch, *, remat: bool = False):
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
        if self.eager:
            grad_fn = functools.partial(_autograd_grad_and_value, loss_fn,
                                        backward_ctx=zero3.overlapped_backward if self.per_block and real
                                        else contextlib.nullcontext, reducer=reducer)
        else:
            grad_fn = functools.partial(_func_grad_and_value, loss_fn)
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


# -- loss scaling ------------------------------------------------------------------------


class NoScaling:
    """fp32 / bf16: the loss is differentiated as is and every step is applied."""

    def scale(self, loss: torch.Tensor, state: Any) -> torch.Tensor:
        return loss

    def unscale(self, grads: Any, state: Any) -> Any:
        return grads

    def finite(self, grads: Any, axes: tuple[str, ...]) -> Any:
        return None

    def select(self, finite: Any, new: tuple, old: tuple, state: Any) -> tuple[tuple, Any, dict]:
        return new, None, {"loss_scale": torch.ones(()), "skipped": torch.zeros((), dtype=torch.int64)}

    def applied(self, step: torch.Tensor, state: Any) -> torch.Tensor:
        return step


class DynamicScaling:
    """fp16: the loss is multiplied by the scale, gradients divided by it; a step whose
    gradients overflowed on any shard is skipped by every shard (the old parameters and
    optimizer state are kept, as in DeepSpeed), and the scale adapts (``scaler.update``)."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    def scale(self, loss: torch.Tensor, state: Any) -> torch.Tensor:
        return loss * state.scale

    def unscale(self, grads: Any, state: Any) -> Any:
        return unscale(grads, state, dtype=None)

    def finite(self, grads: Any, axes: tuple[str, ...]) -> torch.Tensor:
        return all_finite(grads, axis=tuple(a for a in axes if is_bound(a)))

    def select(self, finite: torch.Tensor, new: tuple, old: tuple, state: Any) -> tuple[tuple, Any, dict]:
        kept = tuple(tree_where(finite, n, o) for n, o in zip(new, old))
        new_state = self.scaler.update(state, finite)
        return kept, new_state, {"loss_scale": state.scale, "skipped": new_state.skipped}

    def applied(self, step: torch.Tensor, state: Any) -> torch.Tensor:
        # Skipped (overflowed) steps do not advance the schedule, as in DeepSpeed.
        return step - state.skipped


# -- the update --------------------------------------------------------------------------


class PureUpdate:
    """``optimizer.update`` + ``apply_updates`` on gradients clipped to ``clip`` (the
    mesh-aware global norm, as ``torch.nn.utils.clip_grad_norm_``): new tensors, the old
    state stays valid."""

    def __init__(self, optimizer: Any, clip: float | None, eager: bool) -> None:
        self.optimizer, self.clip, self.eager = optimizer, clip, eager

    def _clip(self, grads: Any, gnorm: torch.Tensor) -> Any:
        if self.clip is None:
            return grads
        factor = torch.clamp(self.clip / (gnorm + 1e-6), max=1.0)
        if not self.eager:  # per leaf: foreach kernels have no batching rule
            return optree.tree_map(lambda t: t * factor.to(t.dtype), grads)
        leaves, tdef = optree.tree_flatten(grads)
        return optree.tree_unflatten(tdef, torch._foreach_mul(leaves, factor))

    def __call__(self, grads: Any, gnorm: torch.Tensor, opt_state: Any, params: Any, *,
                 ok: torch.Tensor | None = None) -> tuple[Any, Any]:
        """``ok``: the step's finite verdict (the same on every shard), for the in-place
        forms to skip on; the pure form's result is dropped by the caller instead."""
        updates, opt_state = self.optimizer.update(self._clip(grads, gnorm), opt_state, params)
        return optim.apply_updates(params, updates), opt_state


def _skip(ok: torch.Tensor | None) -> bool:
    """Whether an in-place update must not run: a non-finite step (a host read of a 0-d
    flag; the fused kernels read the clipping factor on the host anyway)."""
    if ok is None or _manifest.dry():
        return False
    return not bool(beneath(ok)[0].reshape(-1)[0])  # every device's copy is the same verdict


class DonatedUpdate(PureUpdate):
    """The pure update allowed to overwrite the parameters and moments in place (the state
    passed in is consumed, like JAX's donated buffers): for optimizers without a fused form."""

    def __call__(self, grads: Any, gnorm: torch.Tensor, opt_state: Any, params: Any, *,
                 ok: torch.Tensor | None = None) -> tuple[Any, Any]:
        if _skip(ok):  # the state stays the last good one
            return params, opt_state
        with optim.donating():
            return super().__call__(grads, gnorm, opt_state, params)


class FusedUpdate(PureUpdate):
    """Donated fp32 state with adamw / adam / lion: one fused in-place multi-tensor kernel
    (Triton on CUDA, C++ on CPU) with the clipping factor applied as the gradients load.
    A dry run takes the pure form, which communicates the same."""

    def __call__(self, grads: Any, gnorm: torch.Tensor, opt_state: Any, params: Any, *,
                 ok: torch.Tensor | None = None) -> tuple[Any, Any]:
        if _manifest.dry():
            return super().__call__(grads, gnorm, opt_state, params)
        if _skip(ok):
            return params, opt_state
        factor = torch.clamp(self.clip / (gnorm + 1e-6), max=1.0) if self.clip is not None else 1.0
        # No inf/nan check in the kernel: the pure form does not skip non-finite steps
        # either, and donation is refused with fp16 loss scaling (which would need it).
        opt_state, _ = optim.fused_update_(self.optimizer, grads, opt_state, params,
                                           inv_scale=factor, check_finite=False)
        return params, opt_state


class StackedFusedUpdate(FusedUpdate):
    """``FusedUpdate`` on the virtual mesh: the same in-place kernel on the tensors beneath
    the vmap levels (``_virtual.beneath``), each holding every device's shard of a leaf,
    so one call updates all devices' shards as each device updates its own (the update is
    elementwise). The state passed in is consumed, as on real ranks, and the step holds
    what a device holds instead of the old and new state side by side.

    A leaf whose gradient is laid out otherwise than its parameter takes the parameter's
    levels: a gradient copy per device that the typing says is invariant is read once; one
    invariant where the parameter varies is broadcast. Moments laid out otherwise than
    their parameter (not made by this step's init) take the pure form."""

    def __call__(self, grads: Any, gnorm: torch.Tensor, opt_state: Any, params: Any, *,
                 ok: torch.Tensor | None = None) -> tuple[Any, Any]:
        if _manifest.dry():
            return PureUpdate.__call__(self, grads, gnorm, opt_state, params)
        if _skip(ok):
            return params, opt_state
        p_leaves, p_def = optree.tree_flatten(params)
        s_leaves, s_def = optree.tree_flatten(opt_state)
        p_base = [beneath(x) for x in p_leaves]
        g_base = [_aligned(beneath(g), b) for g, b in zip(optree.tree_leaves(grads), p_base)]
        s_base = [beneath(x) if isinstance(x, torch.Tensor) else (x, ()) for x in s_leaves]
        of = {id(x): b for x, b in zip(s_leaves, s_base)}
        moments = opt_state[self.optimizer.fused.moments]
        fields = [moments.mu] + ([moments.nu] if hasattr(moments, "nu") else [])
        for tree in fields:
            for m, (b, lv) in zip(optree.tree_leaves(tree), p_base):
                mb, m_lv = of[id(m)]
                if m_lv != lv or mb.shape != b.shape:
                    return PureUpdate.__call__(self, grads, gnorm, opt_state, params)
        # The kernel wants contiguous tensors: a strided view (a leaf sharded on an inner
        # dim) is updated in a contiguous copy and written back.
        back: list[tuple[torch.Tensor, torch.Tensor]] = []

        def dense(b: torch.Tensor) -> torch.Tensor:
            if b.is_contiguous():
                return b
            c = b.contiguous()
            back.append((b, c))
            return c

        plain_p = [dense(b) for b, _ in p_base]
        plain_s = [dense(b) if isinstance(b, torch.Tensor) and b.dim() > 0 else b for b, _ in s_base]
        factor = 1.0
        if self.clip is not None:  # invariant: every device's copy is the same number
            norm = beneath(gnorm)[0].reshape(-1)[0]
            factor = float(torch.clamp(self.clip / (norm + 1e-6), max=1.0))
        new_s, _ = optim.fused_update_(
            self.optimizer, optree.tree_unflatten(p_def, g_base), optree.tree_unflatten(s_def, plain_s),
            optree.tree_unflatten(p_def, plain_p), inv_scale=factor, check_finite=False)
        for b, c in back:
            b.copy_(c)
        # Hand back the wrappers of what was updated in place, and the new counters.
        ids = {id(c): w for c, w in zip(plain_s, s_leaves)}
        out = [ids.get(id(x), x) for x in optree.tree_leaves(new_s)]
        return params, optree.tree_unflatten(optree.tree_structure(new_s), out)


def _aligned(g: tuple[torch.Tensor, tuple[int, ...]], p: tuple[torch.Tensor, tuple[int, ...]]) -> torch.Tensor:
    """The gradient beneath its levels, with its parameter's levels (a view: the fused
    update copies strided gradients a group at a time)."""
    (gb, g_lv), (pb, p_lv) = g, p
    for i in reversed(range(len(g_lv))):
        if g_lv[i] not in p_lv:  # copies of an invariant gradient: one of them
            gb = gb.select(i, 0)
    kept = [lv for lv in g_lv if lv in p_lv]
    for i, lv in enumerate(p_lv):
        if lv not in kept:  # invariant where the parameter varies: the same for every shard
            gb = gb.unsqueeze(i)
            kept.insert(i, lv)
    return gb.expand(pb.shape)


def choose_update(optimizer: Any, *, clip: float | None, donate: bool, eager: bool,
                  params: Any) -> PureUpdate:
    """The update a step runs: fused where the state is donated, plain fp32 tensors and
    the optimizer has a fused form (beneath the vmap levels on the virtual mesh); in place
    where donated; else pure."""
    if donate and optim.has_fused(optimizer) and \
            all(t.dtype == torch.float32 for t in optree.tree_leaves(params)):
        return FusedUpdate(optimizer, clip, eager) if eager else StackedFusedUpdate(optimizer, clip, eager)
    if donate and eager:
        return DonatedUpdate(optimizer, clip, eager)
    return PureUpdate(optimizer, clip, eager)


def label(tree: Any, category: str) -> None:
    """Name ``tree``'s storages in an active memory tracker (vmap-batched values on the
    virtual mesh by the tensors beneath them; see ``memory.label``)."""
    memory.label(tree, category)


def _count_tokens(batch: Any) -> int | None:
    """Tokens a language-model batch trains on: ``targets``, or ``tokens`` minus the shift."""
    if isinstance(batch, dict):
        if isinstance(batch.get("targets"), torch.Tensor):
            return batch["targets"].numel()
        t = batch.get("tokens")
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            return t.shape[0] * (t.shape[1] - 1)
    return None


def _batch_axes(batch_spec: Any, mesh: Mesh) -> tuple[str, ...]:
    named = set()
    for s in optree.tree_leaves(batch_spec, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None,
                                none_is_leaf=True):
        if isinstance(s, PartitionSpec):
            named |= set(s.axes)
    return tuple(a for a in mesh.axis_names if a in named)
