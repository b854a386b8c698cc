"""``train_step``: the functional DeepSpeedEngine.

One call composes, per shard inside ``shard_map``: value_and_grad of the local loss (in
the compute dtype, over micro-batches when accumulating) -> the gradient reductions the
placements call for -> unscale / finite check (fp16) -> mesh-aware clipping -> the
optimizer -> the new state. State is data (a ``TrainState``), nothing is mutated.

>>> step = fs.train_step(gpt.loss, fs.optim.adamw(3e-4), mesh=fs.Mesh({"data": 2}),
...                      param_specs=P(), batch_spec=P("data"), precision="bf16", clip=1.0)
>>> state = step.init(params)
>>> state, metrics = step(state, batch)
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from fsharded import _tree, optim
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec
from fsharded.parallel.blocks import handling as run_blocks
from fsharded.spmd import _env, _manifest, _schedule
from fsharded.spmd._transfer import backend_for, local_shards, unshard
from fsharded.spmd.collectives import is_bound, mark_varying, pmean, varying_axes
from fsharded.spmd.shard_map import shard_map

__all__ = ["TrainState", "TrainStep", "train_step"]


class TrainState(NamedTuple):
    """Everything a training run carries from step to step."""

    step: torch.Tensor  # int64 0-d: optimizer steps taken (skipped fp16 steps included)
    params: Any  # master weights, laid out by the step's param_specs
    opt_state: Any
    loss_scale: Any  # precision.LossScaleState, or None without loss scaling


def train_step(
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Any,
    *,
    mesh: Mesh | None = None,
    param_specs: Any = None,
    batch_spec: Any = None,
    precision: Any = "fp32",
    accumulation: int = 1,
    clip: float | None = None,
    check_finite: bool = True,
    donate: bool = False,
    backend: str | None = None,
    check_schedule: bool = True,
    blocks: str | None = None,
) -> TrainStep:
    """Build a training step for ``loss_fn(params, batch) -> scalar``.

    ``loss_fn`` is written per shard: it sees the shard of each parameter its spec gives
    and the shard of the batch ``batch_spec`` gives, and may call collectives. The batch
    is split over the axes ``batch_spec`` names (default: ``P("data")`` when the mesh has
    a ``data`` axis); gradients of parameters not sharded over those axes are averaged
    over them, which is data parallelism. ``precision``: "fp32" | "bf16" | "fp16" or a
    ``precision.Policy``. ``accumulation=k`` splits each shard's batch into k
    micro-batches and averages their gradients (DeepSpeed's gradient_accumulation_steps).
    ``clip``: max global gradient norm (mesh-aware), None for no clipping.
    ``donate=True``: the state passed to a call is consumed — the optimizer updates the
    parameters and its moments in place (on one device and on real ranks), saving a copy
    of both at the update, like JAX's donated buffers. Keep the default when the old state
    must survive a call (it cannot be restored after a NaN stop), or with fp16 loss scaling.
    With donation, ``adamw``/``adam``/``lion`` (no mask) run as one fused in-place kernel
    (``fsharded.optim.fused_update_``: Triton on CUDA, the C++ optimizer on CPU).
    ``check_schedule`` (real ranks): before the first step for a state layout, every rank
    lists the collectives it will run (a dry run on meta tensors) and the ranks compare them;
    a mismatch is an error on every rank naming the first differing collective, not a hang.

    ``blocks``: the dotted path of the model's block list in the parameter tree (a list of
    per-block subtrees, e.g. ``"blocks"`` for the bundled GPT, ``"transformer.h"`` for a
    nanoGPT module through ``fs.nn.functional``, which finds it). The loss must run each
    block through ``fs.parallel.run_block(block_fn, block_params, x, ...)``; at ZeRO stage 3
    each block's parameters stay sharded until its ``run_block``, are gathered there, and
    are gathered again in backward, so about two blocks' full weights are alive at a time.
    Without ``blocks`` a ZeRO-3 step gathers every parameter up front (and warns once).
    """
    return TrainStep(loss_fn, optimizer, mesh=mesh, param_specs=param_specs,
                     batch_spec=batch_spec, precision=precision, accumulation=accumulation,
                     clip=clip, check_finite=check_finite, donate=donate, backend=backend,
                     check_schedule=check_schedule, blocks=blocks)


def _policy(precision: Any):
    from fsharded.precision import as_policy

    return as_policy(precision)


class TrainStep:
    """The object ``train_step`` returns: ``.init``, call, ``.collectives``, ``.params``."""

    def __init__(self, loss_fn, optimizer, *, mesh, param_specs, batch_spec, precision,
                 accumulation, clip, check_finite, donate, backend, check_schedule=True,
                 blocks=None):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.mesh = mesh if mesh is not None else Mesh({"data": 1})
        self.param_specs = PartitionSpec() if param_specs is None else param_specs
        if batch_spec is None:
            batch_spec = PartitionSpec("data") if "data" in self.mesh.shape else PartitionSpec()
        self.batch_spec = batch_spec
        self.policy = _policy(precision)
        if not isinstance(accumulation, int) or accumulation < 1:
            raise ValueError(f"train_step: accumulation must be a positive int, got {accumulation!r}")
        self.accumulation = accumulation
        if clip is not None and not clip > 0:
            raise ValueError(f"train_step: clip must be a positive max norm or None, got {clip!r}")
        self.clip = clip
        self.check_finite = check_finite
        self.backend = backend
        if donate and self.policy.loss_scaling:
            raise ValueError(
                "train_step: donate=True cannot be combined with fp16 loss scaling, which keeps "
                "the old state to skip overflowing steps"
            )
        self.donate = donate
        # Elements per gradient all-reduce bucket (DeepSpeed's reduce_bucket_size default).
        self.bucket_elems = 500_000_000
        if blocks is not None and not isinstance(blocks, str):
            raise TypeError(f"train_step: blocks must be a dotted path such as 'blocks', got {blocks!r}")
        self.blocks = blocks
        self._warned_blocks = False
        self._placements: dict = {}
        self._local_shapes: dict = {}
        self.batch_axes = _batch_axes(batch_spec, self.mesh)
        self._scaler = self.policy.loss_scaler()
        self._compiled: dict = {}
        self.check_schedule = check_schedule
        self._agreed: set = set()

    # -- state -------------------------------------------------------------------------

    @property
    def distributed(self) -> bool:
        return backend_for(self.mesh, self.backend) == "distributed"

    def placement(self, params: Any):
        """The ``Placement`` this step uses for ``params`` (specs, ZeRO plan, or placement)."""
        from fsharded.parallel.zero import Placement, ZeroPlan

        key = optree.tree_structure(params)
        hit = self._placements.get(key)
        if hit is not None:
            return hit
        raw = self.param_specs
        if isinstance(raw, Placement):
            pl = raw
        elif isinstance(raw, ZeroPlan):
            pl = raw.resolve(self.mesh)
        else:
            pl = Placement.replicated(_full_specs(raw, params))
        self._placements[key] = pl
        return pl

    def init(self, params: Any) -> TrainState:
        """State for global ``params``: master copies laid out by the placement (this
        rank's shards on the distributed backend), optimizer state, loss scale."""
        from fsharded.precision import cast_tree

        pl = self.placement(params)
        master = cast_tree(optree.tree_map(lambda x: x.detach().clone(), params), self.policy.master_dtype)
        if self.distributed:
            master = local_shards(master, pl.master, self.mesh)
        else:  # validates every leaf against the mesh
            shard_map(lambda p: p, mesh=self.mesh, in_specs=(pl.master,),
                      out_specs=pl.master)._flat_in((master,))
        opt_state = self.optimizer.init(master)
        scale = self._scaler.init() if self._scaler is not None else None
        self._local_shapes[optree.tree_structure(master)] = [tuple(x.shape) for x in optree.tree_leaves(master)]
        return TrainState(torch.zeros((), dtype=torch.int64), master, opt_state, scale)

    def params(self, state: TrainState) -> Any:
        """Full (global) master parameters, on every rank."""
        if self.distributed:
            return unshard(state.params, self.placement(state.params).master, self.mesh)
        return state.params

    def state_specs(self, state: TrainState) -> TrainState:
        """The spec of every leaf of ``state``: master weights and optimizer-state subtrees
        shaped like them take the master placement; counters and scalars are replicated."""
        pspecs = self.placement(state.params).master
        return TrainState(
            PartitionSpec(),
            pspecs,
            optim.state_specs(state.opt_state, state.params, pspecs),
            optree.tree_map(lambda _: PartitionSpec(), state.loss_scale) if state.loss_scale is not None else None,
        )

    # -- the step ----------------------------------------------------------------------

    def _body(self, state: TrainState, batch: Any, pl_flat: tuple) -> tuple[TrainState, dict]:
        from fsharded import memory, optim
        from fsharded.parallel import _buckets as B
        from fsharded.precision import all_finite, cast_tree, tree_where

        use, grad_specs, master_specs, stage, axis, block_mask, reshard, state_flat = pl_flat
        policy = self.policy
        mem = memory.current() if not torch._C._are_functorch_transforms_active() else None
        if mem is not None:  # label what a tracker sees: state, then parameter gradients
            mem.register(state.params, "parameters")
            mem.register(state.opt_state, "optimizer state")
            mem.backward_category = "activations"
        params = state.params  # master weights, in the master placement
        scale = state.loss_scale.scale if state.loss_scale is not None else None
        m_leaves, m_def = optree.tree_flatten(params)
        cap = self.bucket_elems

        def gather(leaves):  # master placement -> how the loss sees the parameters
            if axis is None:
                return list(leaves)
            return B.gather_leaves(list(leaves), master_specs, use, axis, self.mesh, cap)

        # ZeRO-3 gathers inside the differentiated function, so gradients come back
        # reduce-scattered by the all-gather's transpose; stages 0-2 gather outside it.
        through_gather = stage == 3

        # ZeRO-3 with a loss that runs its blocks through a ``block_fn`` hook: the leaves
        # under params["blocks"] stay sharded until their block runs, are gathered inside a
        # remat'ed block, and are gathered again in backward; the rest is gathered up front.
        per_block = through_gather and block_mask is not None

        def local_loss(p, micro):
            leaves = optree.tree_leaves(p)
            if per_block:
                keep = [m if b else u for m, u, b in zip(master_specs, use, block_mask)]
                leaves = B.gather_leaves(leaves, master_specs, keep, axis, self.mesh, cap)
            elif through_gather:
                leaves = gather(leaves)
            leaves = [cast_tree(x, policy.compute_dtype) for x in leaves]
            p = optree.tree_unflatten(m_def, leaves)
            if per_block:
                specs_of = {id(x): (m, u) for x, m, u, b in zip(leaves, master_specs, use, block_mask) if b}
                prefetch = _Prefetch(_tree.get_path(p, self.blocks), specs_of, axis, self.mesh) if self.distributed and \
                    not torch._C._are_functorch_transforms_active() and not _manifest.dry() else None
                # The last block's backward follows its forward at once: keep its weights.
                last = _tree.get_path(p, self.blocks)
                kept = {id(t) for t in optree.tree_leaves(last[-1])} if last else set()
                with run_blocks(functools.partial(
                        _zero3_block, specs_of, axis, self.mesh, cap, prefetch, reshard, kept)):
                    loss = self.loss_fn(p, micro)
            else:
                loss = self.loss_fn(p, micro)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(
                    f"train_step: loss_fn must return a scalar tensor, got "
                    f"{type(loss).__name__} of shape {tuple(getattr(loss, 'shape', ()))}"
                )
            _check_loss_type(loss, self.batch_axes, self.mesh)
            loss = loss.float()
            return (loss * scale if scale is not None else loss), loss

        if torch._C._are_functorch_transforms_active():  # the virtual mesh's vmap levels
            grad_fn = torch.func.grad_and_value(local_loss, has_aux=True)
        else:  # one device or a real rank: plain autograd skips functorch's wrapping (~8%)
            overlap = per_block and self.distributed and not _manifest.dry()
            grad_fn = functools.partial(_autograd_grad_and_value, local_loss, overlap=overlap)
        x0 = params if through_gather else optree.tree_unflatten(m_def, gather(m_leaves))
        varying = tuple(a for a in self.batch_axes if self.mesh.shape[a] > 1)
        if varying:
            # Data parallelism: mark the parameters varying over the batch axes before
            # differentiating (a type change, no data moves), so each shard's gradient is
            # its own contribution and the bucketed pmean below averages once. Left
            # invariant, each gradient would come back summed by the implicit pvary's
            # psum, one collective per leaf (JAX's rule). (Over a size-1 axis there is
            # nothing to average: the gradients stay invariant.)
            x0 = mark_varying(x0, varying)
        k = self.accumulation
        grads, loss = None, None
        for i in range(k):
            micro = batch if k == 1 else optree.tree_map(lambda x, i=i: _micro(x, i, k), batch)
            g, (_, l_i) = grad_fn(x0, micro)
            g = optree.tree_map(lambda t: t.to(policy.reduce_dtype), g)
            grads = g if grads is None else optree.tree_map(torch.add, grads, g)
            loss = l_i if loss is None else loss + l_i
        if k > 1:
            grads = optree.tree_map(lambda t: t / k, grads)
            loss = loss / k
        # Average over the batch axes into the gradient placement, in flat buckets
        # (DeepSpeed's reduce buckets) rather than one collective per leaf.
        g_leaves = optree.tree_leaves(grads)
        if through_gather:
            g_leaves = B.reduce_leaves(g_leaves, master_specs, master_specs, self.batch_axes, self.mesh, cap)
        else:
            g_leaves = B.reduce_leaves(g_leaves, use, grad_specs, self.batch_axes, self.mesh, cap)
            if axis is not None:  # ZeRO-1: each rank keeps its block of the full gradient
                g_leaves = B.slice_leaves(g_leaves, grad_specs, master_specs, axis, self.mesh)
        grads = optree.tree_unflatten(m_def, g_leaves)
        memory.label(grads, "gradients")
        # From here on every value is a shard of a leaf laid out by its spec (gradients,
        # parameters, optimizer moments): check that the gradients are typed so (reduced
        # over every axis their parameter is not sharded on), then run the per-leaf
        # update untyped (hundreds of small ops) and type the new state by its specs.
        _check_grad_types(g_leaves, master_specs, self.mesh, _tree.tree_flatten_with_paths(params)[0])
        vma = _env.current().vma
        pause = vma.paused() if vma is not None else contextlib.nullcontext()
        pause.__enter__()
        pspecs_flat = master_specs
        loss = pmean(loss, self.batch_axes) if self.batch_axes else loss
        if scale is not None:
            grads = optree.tree_map(lambda t: t / scale, grads)
        grads = optree.tree_map(lambda t, p: t.to(p.dtype), grads, params)
        gnorm = optim.global_norm(grads, flat_specs=pspecs_flat)
        if state.loss_scale is not None:  # every shard must agree to skip
            finite = all_finite(grads, axis=tuple(a for a in self.mesh.axis_names if is_bound(a)))
        # Donated state on plain tensors: adamw / adam / lion run as one fused in-place
        # kernel (Triton on CUDA, C++ on CPU) with the clipping factor applied on load.
        fused = (self.donate and optim.has_fused(self.optimizer) and not _manifest.dry()
                 and not torch._C._are_functorch_transforms_active()
                 and all(t.dtype == torch.float32 for t in optree.tree_leaves(params)))
        factor = torch.clamp(self.clip / (gnorm + 1e-6), max=1.0) if self.clip is not None else None
        if factor is not None and not fused:
            if torch._C._are_functorch_transforms_active():
                grads = optree.tree_map(lambda t: t * factor.to(t.dtype), grads)
            else:
                g_leaves, g_def = optree.tree_flatten(grads)
                grads = optree.tree_unflatten(g_def, torch._foreach_mul(g_leaves, factor))
        if fused:
            # No inf/nan check in the kernel: the other path does not skip non-finite steps
            # either, and donation is refused with fp16 loss scaling (which would need it).
            opt_state, _ = optim.fused_update_(self.optimizer, grads, state.opt_state, params,
                                               inv_scale=1.0 if factor is None else factor,
                                               check_finite=False)
            new_params = params
        else:
            with optim.donating() if self.donate else contextlib.nullcontext():
                updates, opt_state = self.optimizer.update(grads, state.opt_state, params)
                new_params = optim.apply_updates(params, updates)
        memory.label(new_params, "parameters")
        memory.label(opt_state, "optimizer state")
        # Skipped (overflowed) steps do not advance the schedule, as in DeepSpeed.
        applied = state.step - state.loss_scale.skipped if state.loss_scale is not None else state.step
        metrics = {"loss": loss, "grad_norm": gnorm}
        if optim.get_lr_schedule(self.optimizer) is not None:
            metrics["lr"] = optim.get_lr(self.optimizer, applied)
        if state.loss_scale is not None:
            new_params = tree_where(finite, new_params, params)
            opt_state = tree_where(finite, opt_state, state.opt_state)
            new_scale = self._scaler.update(state.loss_scale, finite)
            metrics.update(loss_scale=state.loss_scale.scale, skipped=new_scale.skipped)
        else:
            new_scale = None
            metrics.update(loss_scale=torch.ones(()), skipped=torch.zeros((), dtype=torch.int64))
        pause.__exit__(None, None, None)
        out = TrainState(state.step + 1, new_params, opt_state, new_scale)
        if vma is not None:
            for t, spec in zip(optree.tree_leaves(out), state_flat):
                if isinstance(t, torch.Tensor):
                    vma.set(t, frozenset(spec.axes))
        return out, metrics

    def _shard_mapped(self, state: TrainState):
        key = optree.tree_structure(state)
        if key not in self._compiled:
            specs = self.state_specs(state)
            pl = self.placement(state.params)
            flat = lambda t: optree.tree_leaves(t, is_leaf=lambda x: isinstance(x, PartitionSpec))  # noqa: E731
            if pl.stage == 3 and self.blocks is None and not self._warned_blocks \
                    and self.mesh.shape.get(pl.axis, 1) > 1:
                self._warned_blocks = True
                warnings.warn(
                    "train_step: ZeRO stage 3 without blocks= gathers every parameter up front, "
                    "so the full model is alive during forward and backward. Run the model's "
                    "blocks through fs.parallel.run_block and pass train_step(..., "
                    "blocks='<path of the block list>') (the bundled GPT: blocks='blocks'; an "
                    "nn.Module: fs.nn.functional(module).blocks) to gather one block at a time",
                    stacklevel=3)
            pl_flat = (flat(pl.use), flat(pl.grads), flat(pl.master), pl.stage,
                       pl.axis if pl.stage > 0 else None, _block_mask(state.params, self.blocks),
                       pl.reshard_after_forward, _tree.broadcast_prefix(specs, state))
            self._compiled[key] = shard_map(
                lambda s, b: self._body(s, b, pl_flat),
                mesh=self.mesh,
                in_specs=(specs, self.batch_spec),
                out_specs=(specs, PartitionSpec()),
                backend=self.backend,
            )
        return self._compiled[key]

    def _check_layout(self, state: TrainState) -> None:
        """On real ranks, a state laid out for another placement (another ZeRO stage or
        mesh) has other shard shapes: say so instead of computing garbage."""
        if not self.distributed:
            return  # the virtual mesh keeps global values: any placement reads them
        key = optree.tree_structure(state.params)
        expect = self._local_shapes.get(key)
        if expect is None:
            return  # the state was not made by this step's init: nothing to compare with
        paths, leaves, _ = _tree.tree_flatten_with_paths(state.params)
        bad = [f"  params.{p}: local shape {tuple(x.shape)}, this step's placement expects {e}"
               for p, x, e in zip(paths, leaves, expect) if tuple(x.shape) != e]
        if bad:
            stage = self.placement(state.params).stage
            raise ValueError(
                f"train_step: the state is laid out for another placement than this step's "
                f"(ZeRO stage {stage} on {self.mesh!r}):\n" + "\n".join(bad[:8])
                + ("\n  ..." if len(bad) > 8 else "")
                + "\nReshard it: full = old_step.params(state); state = step.init(full) "
                  "(optimizer moments are not carried over that way)"
            )

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        self._check_layout(state)
        t0 = time.perf_counter()
        sm = self._shard_mapped(state)
        if self.distributed:  # the batch is global (the same on every rank): take our rows
            batch = _local_batch(sm, batch)
            key = optree.tree_structure((state, batch)), _shapes((state, batch))
            if self.check_schedule and key not in self._agreed:
                with torch.no_grad():
                    schedule = _schedule.dry_run(sm.local, state, batch)
                _schedule.agree(schedule, "train_step")
                self._agreed.add(key)
        with torch.no_grad():
            new_state, metrics = sm.local(state, batch)
        if self.check_finite and state.loss_scale is None and not bool(torch.isfinite(metrics["loss"])):
            raise FloatingPointError(
                f"train_step: the loss is {metrics['loss'].item()} at step {int(state.step)}; "
                f"the state passed in (after {int(state.step)} steps) is unchanged. Lower the "
                f"learning rate, enable clipping, or use precision='fp16' loss scaling to skip such steps"
            )
        tokens = _count_tokens(batch)
        if tokens is not None:  # host wall time of the step (the finite check above synced)
            metrics["tokens_per_s"] = torch.tensor(tokens / max(time.perf_counter() - t0, 1e-9))
        return new_state, metrics

    def collectives(self, state: TrainState, batch: Any):
        """The manifest of one step: every collective in order, with bytes per rank."""
        sm = self._shard_mapped(state)
        if self.distributed:
            specs = self.state_specs(state)
            state = _globalize(state, specs, self.mesh)
        return sm.collectives(state, batch)


def _shapes(tree: Any) -> tuple:
    return tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in optree.tree_leaves(tree))


def _check_grad_types(grads: list, specs: list, mesh: Mesh, paths: list[str]) -> None:
    """Each reduced gradient may vary only over the axes its parameter is sharded on."""
    bad = [f"  params.{p}: varies over {extra}, its spec is {s!r}"
           for p, g, s in zip(paths, grads, specs)
           if (extra := [a for a in varying_axes(g) if a not in s.axes and mesh.shape[a] > 1])]
    if bad:
        raise ValueError("train_step: gradients left unreduced over mesh axes their parameters "
                         "are not sharded on:\n" + "\n".join(bad[:8]))


def _check_loss_type(loss: torch.Tensor, batch_axes: tuple[str, ...], mesh: Mesh) -> None:
    """A shard's loss may vary over the batch axes only: one that still varies over
    another axis is each shard's partial piece of a different model (its parameters are
    sharded over the axis and the model does not reduce over it)."""
    extra = [a for a in varying_axes(loss) if a not in batch_axes and mesh.shape[a] > 1]
    if extra:
        raise ValueError(
            f"train_step: the loss varies over mesh axis {extra[0]!r}"
            + (f" (and {extra[1:]})" if len(extra) > 1 else "")
            + f" after loss_fn, but only the batch axes {list(batch_axes)} may differ between "
            f"shards: parameters are sharded over {extra[0]!r} and the model does not reduce "
            f"over it (a missing psum). Tell the model the axis name (e.g. "
            f"functools.partial(gpt.loss, tensor_axis={extra[0]!r})), add the psum, or keep "
            f"the parameters replicated over {extra[0]!r}"
        )


def _block_mask(params: Any, path: str | None) -> list[bool] | None:
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
    paths = _tree.tree_flatten_with_paths(params)[0]
    return [p.startswith(path + ".") for p in paths]


class _Prefetch:
    """ZeRO-3 prefetch on real ranks. Forward: when block i starts, block i+1's gather is
    issued asynchronously, so it travels while block i computes. Backward (re-gather): when
    block i's backward begins (its output's gradient arrives), block i-1's gather is issued,
    so it travels while block i's backward computes. Two blocks' full weights are alive at
    most (three around the last block, which is kept from forward to backward)."""

    def __init__(self, blocks: list, specs_of: dict, axis: str, mesh: Mesh) -> None:
        self.order = [optree.tree_leaves(b) for b in blocks]
        self.index = {id(lv[0]): i for i, lv in enumerate(self.order) if lv}
        self.specs_of, self.axis, self.mesh = specs_of, axis, mesh
        self.pending: dict[int, Any] = {}
        self.backward: dict[int, Any] = {}

    def _gather(self, i: int) -> Any:
        from fsharded.parallel import _buckets as B

        leaves = self.order[i]
        specs = [self.specs_of[id(t)] for t in leaves]
        return B.PendingGather(leaves, [m for m, _ in specs], [u for _, u in specs], self.axis, self.mesh)

    def start(self, i: int) -> None:
        if 0 <= i < len(self.order) and i not in self.pending:
            self.pending[i] = self._gather(i)

    def _start_backward(self, i: int) -> None:
        from fsharded.parallel._zero3_hooks import track_pending

        if 0 <= i < len(self.order) and i not in self.backward:
            self.backward[i] = g = self._gather(i)
            track_pending(g)  # waited for when backward ends, even if no block takes it

    def on_backward(self, leaves: list) -> Callable[[torch.Tensor], None]:
        """A hook for a block's output: its gradient arriving means the block's backward
        begins, so the previous block's gather is issued to travel meanwhile."""
        i = self.index.get(id(leaves[0]), -1) if leaves else -1

        def hook(_grad: torch.Tensor) -> None:
            self._start_backward(i - 1)

        return hook

    def regather(self, leaves: list) -> Callable[[], list] | None:
        """For a block of the list: a function giving its full weights again in backward
        (from the gather issued when this block's backward began, or issued now)."""
        i = self.index.get(id(leaves[0])) if leaves else None
        if i is None:
            return None

        def fetch() -> list:
            self._start_backward(i)
            return self.backward.pop(i).wait()

        return fetch

    def take_pending(self, leaves: list) -> Any:
        """The in-flight gather of this block (issued now if not yet), after issuing the
        next block's; None for parameters that are not a block of the list."""
        i = self.index.get(id(leaves[0])) if leaves else None
        if i is None:
            return None
        self.start(i)
        self.start(i + 1)  # the next block's weights travel while this one computes
        return self.pending.pop(i)


def _zero3_block(specs_of: dict, axis: str, mesh: Mesh, cap: int, prefetch: _Prefetch | None,
                 reshard: bool, kept: set, block: Callable, p: Any, x: torch.Tensor,
                 **kw: Any) -> torch.Tensor:
    """Run ``block`` on its sharded parameters: gather them inside a remat, so only this
    block's full weights are alive while it runs, and they are gathered again in backward
    (``reshard``, except for the leaves in ``kept``: the last block, whose backward comes
    right after its forward); or gather them once and let autograd keep them until
    backward."""
    from fsharded.parallel import _buckets as B
    from fsharded.parallel.remat import checkpoint

    leaves, bdef = optree.tree_flatten(p)
    regather_any, reshard = reshard, reshard and not (leaves and id(leaves[0]) in kept)
    try:
        specs = [specs_of[id(t)] for t in leaves]
    except KeyError:
        raise ValueError(
            "ZeRO-3 block_fn: the block received parameters that are not leaves of "
            "params['blocks']; pass each block its own subtree unchanged"
        ) from None
    m_specs, u_specs = [m for m, _ in specs], [u for _, u in specs]

    if prefetch is not None:
        # Real ranks, plain autograd: saved-tensor hooks drop the gathered weights after the
        # block and gather them again in backward, without re-running the forward.
        from fsharded.parallel._zero3_hooks import run_block

        out = run_block(block, bdef, leaves, x, m_specs, u_specs, axis, mesh, cap,
                        prefetch.take_pending(leaves), regather=reshard,
                        fetch=prefetch.regather(leaves) if reshard else None, **kw)
        if regather_any and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(prefetch.on_backward(leaves))
        return out

    def run(*args: torch.Tensor) -> torch.Tensor:
        *shards, h = args
        full = B.gather_leaves(list(shards), m_specs, u_specs, axis, mesh, cap)
        return block(optree.tree_unflatten(bdef, full), h, **kw)

    return checkpoint(run)(*leaves, x) if reshard else run(*leaves, x)


def _local_batch(sm: Any, batch: Any) -> Any:
    """This rank's shard of a global batch, by the step's batch spec (validated against the
    global shapes, so a batch that does not divide over the data axis is a clear error)."""
    import torch.distributed as dist

    from fsharded.mesh._layout import check_tree, local_slice

    mesh, batch_spec = sm.mesh, sm.in_specs[1]
    paths, leaves, tdef = _tree.tree_flatten_with_paths(batch)
    specs = _tree.broadcast_prefix(batch_spec, batch, what="batch_spec")
    check_tree(leaves, specs, [f"batch.{p}" for p in paths], mesh, "train_step batch")
    coords = mesh.coords(dist.get_rank())
    out = [local_slice(x, s, mesh, coords) if isinstance(x, torch.Tensor) else x
           for x, s in zip(leaves, specs)]
    return optree.tree_unflatten(tdef, out)


def _count_tokens(batch: Any) -> int | None:
    """Tokens a language-model batch trains on: ``targets``, or ``tokens`` minus the shift."""
    if isinstance(batch, dict):
        if isinstance(batch.get("targets"), torch.Tensor):
            return batch["targets"].numel()
        t = batch.get("tokens")
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            return t.shape[0] * (t.shape[1] - 1)
    return None


def _autograd_grad_and_value(f, p, batch, *, overlap: bool = False):
    """``torch.func.grad_and_value(f, has_aux=True)(p, batch)`` with torch.autograd.

    ``overlap``: ZeRO-3 gradient reduce-scatters run asynchronously during backward and
    are all complete when this returns."""
    from fsharded.parallel._zero3_hooks import overlapped_backward

    leaves, tdef = optree.tree_flatten(p)
    with torch.enable_grad():
        req = [x.detach().requires_grad_() for x in leaves]
        out, aux = f(optree.tree_unflatten(tdef, req), batch)
        with overlapped_backward() if overlap else contextlib.nullcontext():
            grads = torch.autograd.grad(out, req, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]
    return optree.tree_unflatten(tdef, grads), optree.tree_map(torch.Tensor.detach, (out, aux))


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


def _batch_axes(batch_spec: Any, mesh: Mesh) -> tuple[str, ...]:
    named = set()
    for s in optree.tree_leaves(batch_spec, is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None,
                                none_is_leaf=True):
        if isinstance(s, PartitionSpec):
            named |= set(s.axes)
    return tuple(a for a in mesh.axis_names if a in named)


def _full_specs(specs: Any, tree: Any) -> Any:
    flat = _tree.broadcast_prefix(specs, tree, what="param_specs")
    return optree.tree_unflatten(optree.tree_structure(tree), flat)


def _globalize(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """Meta tensors of the global shapes of a tree of local shards."""
    from fsharded.mesh._layout import dims

    leaves, tdef = optree.tree_flatten(tree)
    flat_specs = _tree.broadcast_prefix(specs, tree)
    out = []
    for x, s in zip(leaves, flat_specs):
        if isinstance(x, torch.Tensor):
            shape = [n * math.prod(mesh.shape[a] for a in ax) for n, ax in zip(x.shape, dims(s, x.dim()))]
            out.append(torch.empty(shape, dtype=x.dtype, device="meta"))
        else:
            out.append(x)
    return optree.tree_unflatten(tdef, out)
