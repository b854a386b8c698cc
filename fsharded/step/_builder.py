"""``train_step``: the functional DeepSpeedEngine.

One call composes, per shard inside ``shard_map``: value_and_grad of the local loss (in
the compute dtype, over micro-batches when accumulating) -> the gradient reductions the
placements call for -> the gradient transformation (unscale and finite check for fp16, the
mesh-aware norm and clipping factor) -> the update -> the new state; then, on the host, the
guard against non-finite steps. State is data (a ``TrainState``), nothing is mutated.

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
import torch.distributed as dist

from fsharded import _memory_hooks as memory
from fsharded import checkpoint, optim
from fsharded import random as R
from fsharded.comm import _trace
from fsharded.mesh import Mesh, _tree
from fsharded.mesh._layout import dims
from fsharded.mesh._spec import PartitionSpec
from fsharded.parallel import offload as _offload
from fsharded.parallel.pipeline import Pipelined
from fsharded.parallel.remat import Budget
from fsharded.parallel.remat import policy as remat_policy
from fsharded.parallel.zero import Placement, ZeroPlan
from fsharded.precision import as_policy, cast_tree
from fsharded.spmd import _env, _schedule, _vma
from fsharded.spmd._manifest import Manifest
from fsharded.spmd._transfer import backend_for, local_shards, unshard
from fsharded.spmd.collectives import mark_varying, pmean
from fsharded.spmd.shard_map import shard_map
from fsharded.step import _agree as _step_agree
from fsharded.step import _held, _remat_budget
from fsharded.step import _memory_guard as _step_memory
from fsharded.step import _trainable as T
from fsharded.step._batch import _batch_axes, _count_tokens, local_batch
from fsharded.step._checks import (
    _check_batch_sizes,
    _check_grad_types,
    _check_local_shapes,
    _check_loss,
    _check_optimizer,
    _check_param_leaves,
)
from fsharded.step._compile import Captured, StepGraphs
from fsharded.step._gradients import GradientStrategy, Layout, choose_gradients, label
from fsharded.step._guards import choose_guard
from fsharded.step._keys import Keys
from fsharded.step._model_state import init_model_state, new_model_state
from fsharded.step._scaling import DynamicScaling, NoScaling
from fsharded.step._state import TrainState, counted, load_state
from fsharded.step._transform import ClipByGlobalNorm, GradientTransform, NoClip, Transformed
from fsharded.step._update import OffloadedUpdate, PureUpdate, choose_update, tiered, tiered_params
from fsharded.step._zenflow import ZenFlowUpdate

__all__ = ["TrainState", "TrainStep", "train_step"]


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
    seed: int | None = 0,
    on_nonfinite: str = "raise",
    check_memory: bool = True,
    update_model_state: Callable[[Any, Any], Any] | None = None,
    model_state_specs: Any = None,
    trainable: Any = None,
    remat: Any = None,
    compile: bool | str = False,  # noqa: A002 - the name users pass
) -> TrainStep:
    """Build a training step for ``loss_fn(params, batch) -> scalar``, written per shard.

    The step computes the loss and gradients on each shard's part of the batch, reduces
    the gradients as the parameters' specs ask (data parallelism, ZeRO 1-3), clips,
    scales and applies the optimizer, and returns ``(new_state, metrics)``. The options in
    depth: the training-step guide (``docs/guides/train-step.md``).

    >>> step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 2}),
    ...                      param_specs=fs.parallel.zero(1)(P(), params), clip=1.0)
    >>> state = step.init(params)
    >>> state, metrics = step(state, batch)

    :param loss_fn: ``(params, batch) -> loss`` on one shard (``(loss, metrics)`` or, with
        ``update_model_state``, ``(loss, metrics, stats)``); may call collectives.
    :param optimizer: an ``fs.optim`` transformation (``adamw``, ``chain(...)``, ...).
    :param mesh: the device mesh; ``None``: one device.
    :param param_specs: a spec tree (a prefix of the parameters) or a placement such as
        ``fs.parallel.zero(3)(P(), params)``.
    :param batch_spec: how the batch is split; default ``P("data")`` with a ``data`` axis.
    :param precision: ``"fp32"``, ``"bf16"``, ``"fp16"`` (dynamic loss scaling) or a
        ``precision.Policy``.
    :param accumulation: micro-batches per step, their gradients averaged.
    :param clip: the largest global gradient norm; ``None``: no clipping.
    :param check_finite: refuse (or skip) a step whose loss or gradients are not finite.
    :param donate: consume the state passed in and update it in place (fused kernels).
    :param backend: ``"virtual"`` or ``"distributed"``; default: real ranks when a process
        group is up.
    :param check_schedule: on real ranks, compare every rank's collectives before the
        first step of a layout.
    :param blocks: the dotted path of the block list, for ZeRO-3's per-block gathers.
    :param seed: the key random ops in the loss draw from; ``None``: torch's generators.
    :param on_nonfinite: ``"raise"`` or ``"skip"`` a refused step.
    :param check_memory: refuse a state or a step that does not fit the memory available.
    :param update_model_state: ``(model_state, stats) -> model_state`` for state the model
        reads but does not differentiate.
    :param model_state_specs: the specs of that state (default: replicated).
    :param trainable: which leaves train (default: the leaves' ``requires_grad``).
    :param remat: which of the model's blocks (``run_block``) are recomputed in backward
        instead of keeping their activations: ``None`` / ``"none"``, ``"blocks"`` (every
        block), ``"blocks:K"`` (every K-th), either with ``",offload"`` (their inputs in host
        memory), an ``fs.parallel.remat.Blocks``, or ``"budget:SIZE"`` (``Budget``: the least
        recomputation whose estimated peak fits SIZE per device, chosen at the first call;
        ``step.remat`` then holds the choice).
    :param compile: capture the whole step once per input signature as one graph and
        compile it with Inductor (``step.compile()`` the same; see ``_compile``): the
        numbers of the eager step to float rounding, faster. A string names another
        ``torch.compile`` backend for the captured graph (``"aot_eager"``: no code
        generation, for checking a capture quickly). Where it cannot apply (an optimizer
        state in a memory tier) the step says so once and runs eagerly; on real ranks it
        is built for the batch axes (data parallelism, ZeRO) only.
    :returns: a ``TrainStep``: ``init(params)``, ``step(state, batch)``, ``collectives``,
        ``save`` / ``load``.
    """
    return TrainStep(loss_fn, optimizer, mesh=mesh, param_specs=param_specs,
                     batch_spec=batch_spec, precision=precision, accumulation=accumulation,
                     clip=clip, check_finite=check_finite, donate=donate, backend=backend,
                     check_schedule=check_schedule, blocks=blocks, seed=seed,
                     on_nonfinite=on_nonfinite, check_memory=check_memory,
                     update_model_state=update_model_state, model_state_specs=model_state_specs,
                     trainable=trainable, remat=remat, compile=compile)


class _Plan(NamedTuple):
    """The pieces of one state layout's step (``_gradients``, ``_scaling``, ``_transform``,
    ``_update``)."""

    layout: Layout
    gradients: GradientStrategy
    scaling: Any  # NoScaling | DynamicScaling
    transform: GradientTransform  # unscale -> norm -> clipping factor -> fp16's verdict
    update: PureUpdate
    eager: bool  # nothing vmapped: one process per device, or a one-device mesh
    state_specs: list  # one spec per leaf of the state, to type the new state by
    keys: Keys  # the key scope around the loss, where it may draw


class TrainStep:
    """The object ``train_step`` returns: ``.init``, call, ``.collectives``, ``.params``."""

    def __init__(self, loss_fn, optimizer, *, mesh, param_specs, batch_spec, precision,
                 accumulation, clip, check_finite, donate, backend, check_schedule=True,
                 blocks=None, seed=0, on_nonfinite="raise", check_memory=True,
                 update_model_state=None, model_state_specs=None, trainable=None, remat=None,
                 compile=False):  # noqa: A002
        self.loss_fn = loss_fn
        if not isinstance(compile, (bool, str)) or compile == "":
            raise TypeError(f"train_step: compile must be True, False or a torch.compile backend name, "
                            f"got {compile!r}")
        self.compiling = bool(compile)
        self.compile_backend = compile if isinstance(compile, str) else "inductor"
        self._captured = StepGraphs()  # per state layout: the step captured and compiled
        self._eager_said = False
        self.remat = remat_policy(remat)
        self.trainable = trainable
        if update_model_state is not None and not callable(update_model_state):
            raise TypeError(f"train_step: update_model_state must be a function (model_state, stats) -> "
                            f"model_state, got {update_model_state!r}")
        if model_state_specs is not None and update_model_state is None:
            raise ValueError("train_step: model_state_specs without update_model_state: pass the function "
                             "that updates the model state")
        self.update_model_state = update_model_state
        self.model_state_specs = PartitionSpec() if model_state_specs is None else model_state_specs
        _check_optimizer(optimizer)
        self.optimizer = optimizer
        self.mesh = mesh if mesh is not None else Mesh({"data": 1})
        self.param_specs = PartitionSpec() if param_specs is None else param_specs
        if batch_spec is None:
            batch_spec = PartitionSpec("data") if "data" in self.mesh.shape else PartitionSpec()
        self.batch_spec = batch_spec
        self.policy = as_policy(precision)
        if not isinstance(accumulation, int) or accumulation < 1:
            raise ValueError(f"train_step: accumulation must be a positive int, got {accumulation!r}")
        self.accumulation = accumulation
        self._clipping = NoClip() if clip is None else ClipByGlobalNorm(clip)
        self.clip = clip
        self.guard = choose_guard(check_finite, on_nonfinite)  # what a non-finite step does
        self.check_finite, self.on_nonfinite = check_finite, on_nonfinite
        self.check_memory = check_memory
        self.backend = backend
        if donate and self.policy.loss_scaling:
            raise ValueError(
                "train_step: donate=True cannot be combined with fp16 loss scaling, which keeps "
                "the old state to skip overflowing steps"
            )
        self.donate = donate
        self._compiled: dict = {}
        # Elements per gradient all-reduce bucket (DeepSpeed's reduce_bucket_size default).
        self.bucket_elems = 500_000_000
        if blocks is not None and not isinstance(blocks, str):
            raise TypeError(f"train_step: blocks must be a dotted path such as 'blocks', got {blocks!r}")
        self.blocks = blocks
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise TypeError(f"train_step: seed must be an int or None, got {seed!r}")
        self.seed = seed
        self._warned_blocks = False
        self._placements: dict = {}
        self._holdings: dict = {}  # per parameter structure: which pipe ranks hold each leaf
        self._local_shapes: dict = {}
        self.batch_axes = _batch_axes(batch_spec, self.mesh)
        self._scaler = self.policy.loss_scaler()
        self.check_schedule = check_schedule
        self._agreed: set = set()
        self._own: dict = {}  # per layout and shapes: this rank's manifest (own_collectives)
        self._trainable_checked: set = set()  # states whose trained leaves match trainable=
        self.staging = checkpoint.Staging()  # save_async's host buffer, reused between saves
        # ZenFlow's updates (parallel.offload.ZenFlow), per parameter structure and backend:
        # each holds an update in flight between steps, so it outlives a rebuilt plan.
        self._zenflow: dict = {}

    @property
    def bucket_elems(self) -> int:
        """Elements per communication bucket (gradient reductions, ZeRO gathers)."""
        return self._bucket_elems

    @bucket_elems.setter
    def bucket_elems(self, n: int) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"train_step: bucket_elems must be a positive int, got {n!r}")
        self._bucket_elems = n
        self._compiled.clear()  # the plans hold the bucket size: rebuild them

    # -- state -------------------------------------------------------------------------

    @property
    def distributed(self) -> bool:
        return backend_for(self.mesh, self.backend) == "distributed"

    def placement(self, params: Any, mask: list[bool] | None = None):
        """The ``Placement`` this step uses for ``params`` (specs, ZeRO plan, or placement),
        with the leaves ``mask`` marks False frozen (None: all train)."""
        mask = None if mask is None or all(mask) else tuple(mask)
        key = optree.tree_structure(params), mask
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
        pl = pl.freeze(list(mask) if mask is not None else None)
        self._placements[key] = pl
        return pl

    def _mask(self, state: TrainState) -> list[bool] | None:
        """Which parameter leaves ``state`` trains (None: all)."""
        return T.from_tensor(state.trainable, optree.tree_structure(state.params).num_leaves)

    def init(self, params: Any, model_state: Any = None) -> TrainState:
        """State for global ``params``: master copies laid out by the placement (this
        rank's shards on the distributed backend), optimizer state, loss scale; and the
        global ``model_state`` (with ``update_model_state``), laid out by its specs."""
        _check_param_leaves(params)
        return self._init(params, model_state)

    def _init(self, params: Any, model_state: Any = None, mask: list[bool] | None = None) -> TrainState:
        """``init`` of a tree that may be meta tensors: ``load``'s template of a checkpoint's
        shapes, filled from the checkpoint (``mask``: its record of the trained leaves)."""
        ms = init_model_state(model_state, self.update_model_state, self.model_state_specs, self.mesh,
                              self.distributed)
        paths, leaves, _ = _tree.tree_flatten_with_paths(params)
        bad = [f"  {p}: {x.dtype}" for p, x in zip(paths, leaves)
               if isinstance(x, torch.Tensor) and not x.is_floating_point()]
        if bad:
            raise ValueError(
                "train_step.init: parameters must be real floating-point tensors (they are "
                "differentiated and updated); these are not:\n" + "\n".join(bad[:8])
                + ("\n  ..." if len(bad) > 8 else "")
                + "\nKeep integer tensors (ids, masks, counters) out of the parameter tree: pass "
                  "them in the batch or close over them in the loss. A complex parameter is not "
                  "updated correctly (its gradient's imaginary part would be dropped): store it as "
                  "real pairs (torch.view_as_real) and make it complex in the loss (view_as_complex)")
        if mask is None:
            mask = T.resolve(self.trainable, params)
        pl = self.placement(params, mask)
        if self.check_memory:
            _step_memory.check_init_memory(self, params, pl)
        # Master copies of the trained leaves; a frozen leaf is kept as given (its dtype).
        if self.distributed:  # copies of this rank's shards only (not of the whole model first)
            master = local_shards(optree.tree_map(lambda x: x.detach(), params), pl.master, self.mesh)
            master = T.merge(cast_tree(T.view(master, mask), self.policy.master_dtype), master, mask)
        else:  # validates every leaf against the mesh
            master = optree.tree_map(lambda x: x.detach().clone(), params)
            master = T.merge(cast_tree(T.view(master, mask), self.policy.master_dtype), master, mask)
            shard_map(lambda p: p, mesh=self.mesh, in_specs=(pl.master,),
                      out_specs=pl.master)._flat_in((master,))
        holding = self._holding(master)
        if holding is not None and holding.partial:  # per-stage storage: this rank's stages' leaves
            master, opt_state = _held.init_held(self.optimizer, master, mask, holding.here)
        else:
            opt_state = self.optimizer.init(T.view(master, mask))  # for the trained leaves only
        opt_state = tiered(self.optimizer, opt_state, pl.offload)  # its moments in their memory tier
        master = tiered_params(master, pl.offload)  # and the parameters, where they have one
        scale = self._scaler.init() if self._scaler is not None else None
        self._local_shapes[optree.tree_structure(master)] = [tuple(x.shape) for x in optree.tree_leaves(master)]
        rng = R.key(self.seed) if self.seed is not None else None
        return TrainState(torch.zeros((), dtype=torch.int64), master, opt_state, scale, rng, ms,
                          T.as_tensor(mask), torch.zeros((), dtype=torch.int64))

    def _tiered(self, state: TrainState) -> TrainState:
        """``state`` with its optimizer moments in the placement's memory tier (a state read
        back from a checkpoint arrives in memory)."""
        pl = self.placement(state.params, self._mask(state))
        if pl.offload is None or not pl.offload.active:
            return state
        return state._replace(opt_state=tiered(self.optimizer, state.opt_state, pl.offload),
                              params=tiered_params(state.params, pl.offload))

    def params(self, state: TrainState) -> Any:
        """Full (global) master parameters, on every rank; the frozen leaves marked as
        ``fs.nn.functional`` marks them (``step.init`` of them trains the same leaves)."""
        mask = self._mask(state)
        if self.distributed:
            full = unshard(state.params, self.placement(state.params, mask).master, self.mesh)
            holding = self._holding(state.params)
            if holding is not None and holding.partial:  # each leaf from a pipe rank that holds it
                leaves, tdef = optree.tree_flatten(full)
                full = optree.tree_unflatten(tdef, holding.broadcast(leaves))
            return T.mark(full, mask)
        return T.mark(state.params, mask)

    def _holding(self, params: Any) -> _held.Holding | None:
        """Which pipe ranks hold each leaf of ``params`` (a pipelined loss over an axis of
        size > 1; else None): on real ranks a rank keeps its own stages' state only."""
        pipe = self.loss_fn
        if not isinstance(pipe, Pipelined) or self.mesh.shape.get(pipe.axis, 1) < 2:
            return None
        key = optree.tree_structure(params)
        if key not in self._holdings:
            owners = pipe.owners(_tree.tree_flatten_with_paths(params)[0], self.mesh.shape[pipe.axis])
            self._holdings[key] = _held.Holding(owners, pipe.axis, self.mesh, self.distributed)
        return self._holdings[key]

    def model_state(self, state: TrainState) -> Any:
        """The full (global) model state (``update_model_state``), on every rank."""
        if state.model_state is None or not self.distributed:
            return state.model_state
        return unshard(state.model_state, _full_specs(self.model_state_specs, state.model_state), self.mesh)

    def state_specs(self, state: TrainState) -> TrainState:
        """The spec of every leaf of ``state``: master weights and optimizer-state subtrees
        shaped like them take the master placement; counters and scalars are replicated."""
        mask = self._mask(state)
        pspecs = self.placement(state.params, mask).master
        return TrainState(
            PartitionSpec(),
            pspecs,
            optim.state_specs(state.opt_state, T.view(state.params, mask), T.view(pspecs, mask)),
            optree.tree_map(lambda _: PartitionSpec(), state.loss_scale) if state.loss_scale is not None else None,
            PartitionSpec() if state.rng is not None else None,
            _full_specs(self.model_state_specs, state.model_state) if state.model_state is not None else None,
            PartitionSpec() if state.trainable is not None else None,
            PartitionSpec() if state.skipped is not None else None,
        )

    # -- checkpoints ---------------------------------------------------------------------

    def _owners(self, state: TrainState) -> list | None:
        """``checkpoint.save``'s ``owners`` of ``state``'s leaves (per-stage storage: a
        pipelined loss's leaves and their moments are held by their stages' pipe ranks);
        None where every rank holds every leaf."""
        holding = self._holding(state.params)
        if holding is None:
            return None
        return _held.state_owners(state, holding.checkpoint_owners(), self._mask(state))

    def settle(self, state: TrainState) -> TrainState:
        """Put into ``state`` what the step holds for it between steps: with ZenFlow
        (``parallel.offload.ZenFlow``), the host update in flight lands in the parameters,
        the cold gradients summed so far are applied, and the hot rows' moments go back to
        the tier; the next step selects afresh. A checkpoint does this first; read
        ``step.params(state)`` or ``state.opt_state`` after it (before, they are what the
        next forward sees, and the host thread may still be writing the moments). Nothing
        to do otherwise. Returns ``state`` (updated in place)."""
        for update in self._zenflow.values():
            update.settle(state.params)
        return state

    def save(self, state: TrainState, directory: Any, *, overwrite: bool = False) -> str:
        """Write ``state`` to ``directory`` (``fsharded.checkpoint``): every leaf under its
        path with its global shape and spec; on real ranks each rank writes its own shards
        (call it on every rank). Returns the directory. With ZenFlow the update in flight
        lands first (``settle``), in the running state too."""
        self.settle(state)
        with _step_agree.saving("save", int(state.step), directory, self.distributed):
            return checkpoint.save(directory, state, self.state_specs(state), self.mesh,
                                   overwrite=overwrite, owners=self._owners(state))

    def save_async(self, state: TrainState, directory: Any, *, overwrite: bool = False,
                   max_staged_bytes: int | None = None) -> checkpoint.PendingSave:
        """``save`` in the background (``fsharded.checkpoint.save_async``): returns once the
        state is copied (the next step may then overwrite it, donated), a thread writes it;
        ``.wait()`` on the result (on every rank) until the checkpoint is complete.
        ``max_staged_bytes`` bounds the copies held at once. The copy goes into host memory
        the step keeps for its next save (``step.staging``: this device's share of the
        state; ``step.staging.release()`` frees it)."""
        self.settle(state)
        with _step_agree.saving("save_async", int(state.step), directory, self.distributed):
            return checkpoint.save_async(directory, state, self.state_specs(state), self.mesh,
                                         overwrite=overwrite, max_staged_bytes=max_staged_bytes,
                                         staging=self.staging, owners=self._owners(state))

    def load(self, directory: Any, like: Any = None) -> TrainState:
        """The state saved at ``directory``, laid out for this step's mesh and placement,
        whatever mesh and placement it was saved from (optimizer moments, step, loss scale
        and key as saved). ``like``: a state of this step (``step.init(params)``), or the
        global params to make one from; by default the parameter tree as it was saved
        (``checkpoint.tree_like``: a flat dict of dotted names stays one). A checkpoint saved
        before the state counted skipped steps (``TrainState.skipped``) loads with 0. With
        ZenFlow, what the step held for the state it ran last is settled into that state
        first (``settle``): nothing of it is lost, and the loaded state starts afresh."""
        for update in self._zenflow.values():
            update.settle()
        return load_state(self, directory, like)

    # -- the step ----------------------------------------------------------------------

    def _body(self, state: TrainState, batch: Any, plans: Callable[[bool], _Plan]) -> tuple[TrainState, dict]:
        """One step on this shard: a straight line through the pieces of the plan for the
        backend running it (the shard_map frame says which: a step's manifest is computed
        on the virtual mesh even when the step runs on real ranks): gradients -> the
        gradient transformation -> the update -> the new state and the metrics."""
        frame = _env.current()
        eager = frame.backend == "distributed" or frame.mesh.size == 1
        plan = plans(eager)
        mem = memory.current() if eager else None
        if mem is not None:  # label what a tracker sees: state, then parameter gradients
            mem.register(state.params, "parameters")
            mem.register(state.opt_state, "optimizer state")
            mem.backward_category = "activations"
        g_leaves, loss, (extra, stats) = self._gradients(plan, state, batch)
        with _trace.phase("update"):  # the manifest's phase of what follows
            return self._update(plan, state, g_leaves, loss, extra, stats)

    def _update(self, plan: _Plan, state: TrainState, g_leaves: list, loss: torch.Tensor,
                extra: dict, stats: Any) -> tuple[TrainState, dict]:
        """The gradients' transformation and the update, the new state typed by its specs."""
        mask = plan.layout.updated
        # Master weights, in the master placement: the trained leaves this process holds (a
        # view of the tree with None at the others, which pass through untouched).
        params = T.view(state.params, mask)
        opt_in = state.opt_state
        if plan.layout.held_trained is not None:  # per-stage storage: the moments of those leaves
            opt_in = _held.view_state(opt_in, T.view(state.params, plan.layout.trainable), plan.layout.held_trained)
        new_ms = new_model_state(state.model_state, stats, self.update_model_state, self.model_state_specs,
                                 self.mesh, self.batch_axes) if state.model_state is not None else None
        grads = optree.tree_unflatten(optree.tree_structure(params), g_leaves)
        label(grads, "gradients")
        # From here on every value is a shard of a leaf laid out by its spec (gradients,
        # parameters, optimizer moments): check that the gradients are typed so (reduced
        # over every axis their parameter is not sharded on), then run the per-leaf
        # update untyped (hundreds of small ops) and type the new state by its specs.
        _check_grad_types(g_leaves, plan.layout.t_master, self.mesh, plan.layout.t_paths)
        vma = _env.current().vma
        with vma.paused() if vma is not None else contextlib.nullcontext():
            loss = pmean(loss, self.batch_axes) if self.batch_axes else loss
            t = plan.transform(grads, params, state.loss_scale)
            new_params, opt_state = plan.update(t.grads, t.factor, opt_in, params,
                                                ok=self.guard.verdict(loss, t))
            new_params = T.merge(new_params, state.params, mask)
            if plan.layout.held_trained is not None:
                opt_state = _held.merge_state(opt_state, state.opt_state, T.view(state.params, plan.layout.trainable),
                                              plan.layout.held_trained)
            label(new_params, "parameters")
            label(opt_state, "optimizer state")
            (new_params, opt_state, new_ms), new_scale, scale_metrics = plan.scaling.select(
                t.finite, (new_params, opt_state, new_ms), (state.params, state.opt_state, state.model_state),
                state.loss_scale)
            metrics = self._metrics(plan, state, loss, t, extra, scale_metrics)
        out = state._replace(step=state.step + 1, params=new_params, opt_state=opt_state, loss_scale=new_scale,
                             model_state=new_ms)
        if vma is not None:
            for x, spec in zip(optree.tree_leaves(out), plan.state_specs):
                if isinstance(x, torch.Tensor):
                    vma.set(x, _vma.axis_set(spec))
            # The same on every shard: reduced over the batch axes (the loss) or over every
            # axis (the norm), including axes of size 1, which the paused stretch left typed.
            for x in optree.tree_leaves(metrics):
                if isinstance(x, torch.Tensor):
                    vma.set(x, frozenset())
        return out, metrics

    def _metrics(self, plan: _Plan, state: TrainState, loss: torch.Tensor, t: Transformed, extra: dict,
                 scale_metrics: dict) -> dict:
        """The step's metrics, the same on every shard: the loss and what ``loss_fn``
        returned beside it (averaged over the batch shards), the gradient norm, the learning
        rate the update applied, the loss scale, and the steps not applied so far."""
        metrics = {"loss": loss, "grad_norm": t.norm}
        metrics.update(pmean(extra, self.batch_axes) if self.batch_axes and extra else extra)
        rates = optim.scheduled_lrs(self.optimizer, state.opt_state)
        if len(rates) == 1:  # the rate this update applied, from the optimizer's own counter
            metrics["lr"] = torch.as_tensor(rates[0][1])
        elif optim.get_lr_schedule(self.optimizer) is not None:
            metrics["lr"] = optim.get_lr(self.optimizer, plan.scaling.applied(state.step, state.loss_scale))
        metrics.update(scale_metrics)
        metrics["skipped"] = metrics["skipped"] + state.skipped  # the loss scale's, and the guard's
        return metrics

    def _gradients(self, plan: _Plan, state: TrainState, batch: Any) -> tuple[list, torch.Tensor, dict]:
        """This shard's gradient leaves, loss and the loss function's metrics, under this
        step's and this batch shard's key (random ops in the loss draw from it; derived at
        the first draw, so a loss without random ops pays nothing for it)."""
        varying = tuple(a for a in self.batch_axes if self.mesh.shape[a] > 1)

        def once():
            def run():
                return plan.gradients(state.params, batch, state.loss_scale, varying, mark_varying,
                                      model_state=state.model_state)
            if state.rng is None:
                return run()
            return plan.keys.run(functools.partial(_step_key, state.rng, state.step, self.batch_axes), run)
        try:
            return once()
        except _vma.NeedsTyping:  # the loss needs the varying-axes typing: again, typed (the same keys)
            return once()

    def _plan(self, state: TrainState, eager: bool) -> _Plan:
        """The step's pieces for this state layout and backend, chosen once. ``eager``: one
        process per device, or a one-device mesh (nothing vmapped)."""
        pl = self.placement(state.params, self._mask(state))
        # A real rank holds its own stages' leaves (per-stage storage); the virtual mesh all.
        holding = self._holding(state.params) if eager and self.distributed else None
        layout = Layout(pl, state.params, self.blocks, self.mesh, held=holding)
        scaling = DynamicScaling(self._scaler) if self._scaler is not None else NoScaling()
        # A step captured as one graph reduces after backward, in the graph (its collectives
        # functional; no hooks on real ranks' asynchronous transport).
        graph = self.compiling and self._graph_applies(pl, eager) is None
        gradients = choose_gradients(layout, self.loss_fn, policy=self.policy, scaling=scaling,
                                     batch_axes=self.batch_axes, accumulation=self.accumulation,
                                     eager=eager, distributed=self.distributed and eager, graph=graph,
                                     cap=self.bucket_elems,
                                     remat=self.remat,
                                     check_loss=functools.partial(_check_loss, self.batch_axes, self.mesh,
                                                                  with_stats=self.update_model_state is not None))
        if any(layout.moves.gather_in_loss) and self.blocks is None and not self._warned_blocks \
                and self.mesh.shape.get(layout.axis, 1) > 1 and not getattr(gradients, "gathers_by_stage", False):
            self._warned_blocks = True
            warnings.warn(
                "train_step: ZeRO stage 3 without blocks= gathers every parameter up front, "
                "so the full model is alive during forward and backward. Run the model's "
                "blocks through fs.parallel.run_block and pass train_step(..., "
                "blocks='<path of the block list>') (the bundled GPT: blocks='blocks'; an "
                "nn.Module: fs.nn.functional(module).blocks) to gather one block at a time",
                stacklevel=4)
        partial = None
        if holding is not None and holding.partial:  # the norm: each pipe rank's part, summed
            partial = (holding.axis, T.pick([holding.counted(i) for i in range(len(layout.paths))], layout.updated))
        transform = GradientTransform(scaling, self._clipping, layout.t_master, self.mesh.axis_names, partial=partial)
        update = choose_update(self.optimizer, donate=self.donate, eager=eager,
                               params=T.view(state.params, layout.updated), offload=pl.offload, graph=graph)
        if isinstance(update, OffloadedUpdate) and pl.offload.zenflow is not None:
            zkey = (optree.tree_structure(state.params), eager)
            if zkey not in self._zenflow:
                self._zenflow[zkey] = ZenFlowUpdate(self.optimizer, eager, pl.offload, self.donate)
            update = self._zenflow[zkey]
        specs = _tree.broadcast_prefix(self.state_specs(state), state)
        # The loss unscoped once it drew nothing (a run that drew after all redone scoped; on
        # real ranks by every rank together).
        # (A captured step is traced once per signature, scoped: no rank agreement on draws.)
        keys = Keys(watch=True, ranks=functools.partial(_step_agree.any_rank, self.mesh)) \
            if self.distributed and eager and not graph else Keys(watch=True)
        return _Plan(layout, gradients, scaling, transform, update, eager, specs, keys)

    def _shard_mapped(self, state: TrainState):
        key = optree.tree_structure(state), _mask_key(self._mask(state))
        if key not in self._compiled:
            # Both backends' plans (cheap: no tensors are held), so no state is kept alive.
            plans = {eager: self._plan(state, eager) for eager in (False, True)}
            self._compiled[key] = shard_map(
                lambda s, b: self._body(s, b, plans.__getitem__),
                mesh=self.mesh,
                in_specs=(self.state_specs(state), self.batch_spec),
                out_specs=(self.state_specs(state), PartitionSpec()),
                backend=self.backend,
            )
        return self._compiled[key]

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        state = counted(state)
        if isinstance(self.remat, Budget):  # the least recomputation that fits, chosen once
            self.remat = _remat_budget.choose(self, state, batch)
        self._validate(state, batch)
        self.guard.before(self, state)  # the learning rates the update is about to apply
        t0 = time.perf_counter()
        sm = self._shard_mapped(state)  # the plan of this state layout, built once
        new_state, metrics = self._run(sm, state, batch)
        new_state, metrics = self.guard.after(self, state, new_state, metrics, batch)
        tokens = _count_tokens(batch)
        if tokens is not None:  # host wall time of the step (the guard's finite check synced)
            metrics["tokens_per_s"] = torch.tensor(tokens / max(time.perf_counter() - t0, 1e-9))
        return new_state, metrics

    def _validate(self, state: TrainState, batch: Any) -> None:
        """The state is laid out for this step and trains its leaves; every batch leaf has rows."""
        if self.distributed:  # (the virtual mesh keeps global values: any placement reads them)
            _check_local_shapes(state.params, self._local_shapes.get(optree.tree_structure(state.params)),
                                lambda: f"{self.placement(state.params).describe()} on {self.mesh!r}")
        T.check_state(self.trainable, state, self._mask(state), self._trainable_checked)
        _check_batch_sizes(batch)

    def _run(self, sm: Any, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        """The shard-mapped step on this process's shards. On real ranks the batch is global
        (the same on every rank): first the ranks agree on the call (settings, step count,
        batch), and, before the first step of a layout, on the collectives it will run and
        the memory it needs (a dry run); then each takes its rows."""
        off = getattr(self.param_specs, "offload", None)  # (a ZeRO plan's or a placement's)
        if not self.distributed and off is not None and off.params == "nvme":
            _offload.verify(state.params)  # the forward reads the files through their maps: check them first
        if self.distributed:
            _step_agree.agree(self, state, batch)
            batch = local_batch(sm, batch)
            key = optree.tree_structure((state, batch)), _shapes((state, batch))
            if self.check_schedule and key not in self._agreed:
                with torch.no_grad():
                    entries, most = _schedule.dry_record(sm.local, state, batch, peak=self.check_memory)
                _schedule.agree(_schedule.schedule_of(entries), "train_step", self.mesh)
                if self.check_memory:  # the same dry run measured what the step allocates
                    _step_memory.check_step_memory(self, most, state, batch)
                self._agreed.add(key)
                self._own[key] = Manifest(entries)  # (own_collectives: this rank's, listed once)
        try:
            with torch.no_grad(), _trace.span("step"):
                if not self.compiling:
                    return sm.local(state, batch)
                return self._run_captured(sm, state, batch)
        except NotImplementedError:
            raise
        except RuntimeError as e:
            if not self.distributed:
                raise
            # A rank that died, timed out or ran other collectives: say which step it was.
            raise RuntimeError(f"train_step: step {int(state.step) + 1} on rank {dist.get_rank()}: {e}") from e

    # -- compile ----------------------------------------------------------------------------

    def compile(self, backend: str = "inductor") -> TrainStep:
        """This step, from now on captured once per input signature as one graph and
        compiled with ``backend`` (``train_step(..., compile=True)``); returns the step."""
        if not self.compiling:
            self.compiling = True
            self._compiled.clear()  # the plans take their graph forms
            self._agreed.clear()  # (their schedules checked, and listed, anew)
            self._own.clear()
        if backend != self.compile_backend:
            self.compile_backend = backend
            self._captured.clear()
        return self

    def eager(self) -> TrainStep:
        """This step, from now on run eagerly (``compile`` undone: its graphs dropped, its
        plans and, on real ranks, the agreement on its collectives made anew); returns
        the step."""
        if self.compiling:
            self.compiling = False
            self._compiled.clear()
            self._captured.clear()
            self._agreed.clear()
            self._own.clear()
        return self

    def _graph_applies(self, pl: Any, eager: bool) -> str | None:
        """Why this layout's step cannot be captured as one graph (None: it can)."""
        off = getattr(pl, "offload", None)
        if off is not None and off.active:
            return (f"the optimizer state in a memory tier ({off.describe()}) is streamed through host buffers and "
                    f"files between the step's ops")
        return None

    def _run_captured(self, sm: Any, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        """The step through its captured graph (``_compile.Captured``), or eagerly where the
        capture does not apply (said once)."""
        why = self._graph_applies(self.placement(state.params, self._mask(state)), self.mesh.size == 1)
        if why is not None:
            if not self._eager_said:
                self._eager_said = True
                warnings.warn(f"train_step(compile=True): {why}; this step runs eagerly", stacklevel=4)
            new_state, metrics = sm.local(state, batch)
            return new_state, {**metrics, "compile_s": torch.tensor(0.0)}
        run, rates = self._capture(sm, state)
        new_state, metrics = run(state, batch, rates)
        return new_state, {**metrics, "compile_s": torch.tensor(run.last_compile_s)}

    def _capture(self, sm: Any, state: TrainState) -> tuple[Captured, list]:
        """The captured form of ``sm`` and the learning rates to pass it for ``state``
        (``_compile.StepGraphs``)."""
        return self._captured.get(sm, state, optimizer=self.optimizer, backend=self.compile_backend,
                                  verdict=self.guard.graph_verdict if self.donate else None)

    @property
    def compiles(self) -> int:
        """How many input signatures this step captured and compiled so far."""
        return self._captured.compiles

    def graph(self, state: TrainState, batch: Any) -> Any:
        """The graph ``compile=True`` captures for ``(state, batch)`` (a ``torch.fx``
        GraphModule of aten ops: forward, backward, reductions and update). A pipelined
        step on real ranks exchanges its stages' shapes while tracing: call it on every
        rank."""
        state = counted(state)
        run, rates = self._capture(self._shard_mapped(state), state)
        with torch.no_grad():
            return run.graph(state, batch, rates)

    def collectives(self, state: TrainState, batch: Any):
        """The manifest of one step: every collective in order, with bytes per rank (on
        real ranks, as device 0 of the mesh runs it)."""
        state = counted(state)
        sm = self._shard_mapped(state)
        if self.distributed:
            specs = self.state_specs(state)
            state = _globalize(state, specs, self.mesh)
        return sm.collectives(state, batch)

    def own_collectives(self, state: TrainState, batch: Any):
        """The manifest of one step as this process runs it: on real ranks this rank's
        collectives (a pipeline's stages differ), listed by the dry run the first step of a
        layout runs for the cross-rank schedule check, else by one of its own; on the
        virtual mesh ``collectives``."""
        if not self.distributed:
            return self.collectives(state, batch)
        state = counted(state)
        sm = self._shard_mapped(state)
        batch = local_batch(sm, batch)
        key = optree.tree_structure((state, batch)), _shapes((state, batch))
        if key not in self._own:
            with torch.no_grad():
                self._own[key] = Manifest(_schedule.dry_record(sm.local, state, batch, what="own_collectives()",
                                                               fix=_schedule.FIX)[0])
        return self._own[key]


def _mask_key(mask: list[bool] | None) -> tuple | None:
    return tuple(mask) if mask is not None else None


def _shapes(tree: Any) -> tuple:
    return tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in optree.tree_leaves(tree))


def _step_key(rng: torch.Tensor, step: torch.Tensor, batch_axes: tuple[str, ...]) -> torch.Tensor:
    return R.shard_key(R.fold_in(rng, step), batch_axes)


def _full_specs(specs: Any, tree: Any) -> Any:
    flat = _tree.broadcast_prefix(specs, tree, what="param_specs")
    return optree.tree_unflatten(optree.tree_structure(tree), flat)


def _globalize(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """Meta tensors of the global shapes of a tree of local shards."""
    def full(x, s):
        if not isinstance(x, torch.Tensor):
            return x
        shape = [n * math.prod(mesh.shape[a] for a in ax) for n, ax in zip(x.shape, dims(s, x.dim()))]
        return torch.empty(shape, dtype=x.dtype, device="meta")

    leaves, tdef = optree.tree_flatten(tree)
    return optree.tree_unflatten(tdef, [full(x, s) for x, s in zip(leaves, _tree.broadcast_prefix(specs, tree))])
