"""The pipeline gradient strategy: the loss is a ``parallel.pipeline.Pipelined`` (a model cut
into stages and a schedule), and ``parallel.pipeline.run`` executes the schedule for the
ranks along the pipe axis on this shard's batch, cut into micro-batches:

- on the virtual mesh every pipe rank runs in this process, interleaved (the pipe axis'
  vmap level sees nothing batched), differentiating with ``torch.func`` inside the other
  axes' levels;
- on real ranks this rank runs its own actions, with point-to-point sends to its
  neighbours on the pipe axis' group and plain autograd (a dry run of the step, which
  checks the ranks' collectives agree, runs every pipe rank here, sending nothing).

On real ranks each pipe rank stores the state of its own stages' leaves (``_held``): it
computes, reduces and updates their gradients only. A leaf several pipe ranks hold (a tied
embedding) has its gradient parts summed over the pipe axis; the last stage's loss and
the metrics are summed over it too. The gradients are then reduced over the batch axes as
their specs say, as the plain strategy's are. On the virtual mesh the process holds every
leaf and the merged gradients are every stage's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from fsharded import comm
from fsharded.mesh._mesh import Mesh
from fsharded.parallel import _buckets as B
from fsharded.parallel import zero3
from fsharded.parallel.blocks import current as current_handler
from fsharded.parallel.blocks import handling
from fsharded.parallel.pipeline import (
    Mailbox,
    Pipelined,
    PointToPoint,
    run,
    split_batch,
)
from fsharded.parallel.zero3 import PendingGather
from fsharded.spmd import _env, _manifest, _vma
from fsharded.spmd.collectives import psum, pvary, varying_axes
from fsharded.step import _held
from fsharded.step._checks import _check_loss_type
from fsharded.step._differentiate import Inputs
from fsharded.step._layout import Layout
from fsharded.step._reduce import Reduction

__all__ = ["PipelineGradients", "check_pipelined"]


def check_pipelined(pipe: Pipelined, layout: Layout, *, accumulation: int) -> None:
    """Refuse what the pipeline strategy does not run (yet), naming what to change."""
    mesh = layout.mesh
    if pipe.axis not in mesh.shape:
        raise ValueError(f"train_step: the loss is pipelined over the axis {pipe.axis!r}, which {mesh!r} does not "
                         f"have; add it (e.g. fs.Mesh({{{pipe.axis!r}: 2, ...}})) or pipelined(..., axis=) another")
    pipe.table(mesh.shape[pipe.axis])  # the stages fit the axis
    if accumulation > 1:
        raise ValueError(f"train_step(accumulation={accumulation}) with a pipelined loss: the pipeline's "
                         f"micro-batches are the accumulation; set pipelined(..., microbatches=) instead")
    named = [p for p, s in zip(layout.paths, layout.params) if pipe.axis in s.axes]
    if named:
        raise ValueError(f"train_step: a pipelined loss keeps every parameter whole along {pipe.axis!r}; "
                         f"these specs shard over it: {named[:4]}")


class PipelineGradients:
    """``__call__(params, batch, scale, varying, mark, model_state=None) -> (placed gradient
    leaves, this shard's loss, (metrics, stats))`` by the pipeline's executor.
    ``functional``: differentiate with torch.func (the virtual mesh); ``distributed``: run
    this rank's actions only, sending to the other pipe ranks; ``graph``: the step is
    captured as one graph (ZeRO-3's stage gathers traced, not issued ahead)."""

    gathers_by_stage = True  # ZeRO-3 gathers this rank's stages' weights, not the model's: no blocks= needed

    def __init__(self, pipe: Pipelined, inputs: Inputs, reduction: Reduction, layout: Layout, *, policy: Any,
                 scaling: Any, batch_axes: tuple[str, ...], functional: bool, distributed: bool, cap: int,
                 remat: Any = None, graph: bool = False) -> None:
        self.pipe, self.inputs, self.reduction, self.mesh = pipe, inputs, reduction, layout.mesh
        self.remat = remat  # the step's remat policy, applied to the stages' blocks per micro-batch
        self.policy, self.scaling, self.functional, self.distributed = policy, scaling, functional, distributed
        self.graph = graph
        self.table = pipe.table(self.mesh.shape[pipe.axis])
        self.assumed = _assumable(layout, batch_axes, pipe.axis)
        self.batch_axes = batch_axes
        self._p2p: PointToPoint | None = None
        self.layout, self.cap = layout, cap
        self.held = pipe.stages.holders(layout.paths)
        # ZeRO-3 with reshard_after_forward=True: the leaves of the block list are gathered
        # per micro-batch, block by block, by run_block (not at the stage's GATHER).
        under = pipe.stages.blocks + "."
        self.per_block = [layout.regather_blocks and g and p.startswith(under)
                          for p, g in zip(layout.paths, layout.moves.gather_in_loss)]

    def __call__(self, params: Any, batch: Any, scale: Any, varying: tuple[str, ...], mark: Callable,
                 model_state: Any = None) -> tuple[list, torch.Tensor, tuple]:
        if model_state is not None and self.pipe.stages.block_state is None:
            raise ValueError("train_step: a model state (update_model_state) with a pipelined loss whose Stages read "
                             "none: give Stages(..., block_state=, stats=) (gpt_stages.pipeline_stages does for a "
                             "GPT with routing biases, MoEConfig(bias_update_rate=...))")
        leaves, tdef = optree.tree_flatten(params)
        x0 = optree.tree_unflatten(tdef, self.inputs.gather(leaves))
        if varying:  # each shard's gradient its own contribution, as in the plain strategy
            x0 = mark(x0, varying)
        stages, sched, axis = self.pipe.stages, self.table, self.pipe.axis
        mine = self._mine()
        counted = self._counted_rank()
        if self.remat is not None:
            stages = _Recomputed(stages, self.remat)
        # ZeRO-3: a stage's sharded leaves are gathered at its GATHER action of the table
        # and their gradients reduce-scattered at its RELEASE (``with_gathers``).
        weights, uncast = None, None
        if any(g and self.held[i] & set(mine) for i, g in enumerate(self.layout.moves.gather_in_loss)):
            sched = self.gathers_table
            index = optree.tree_unflatten(tdef, list(range(len(leaves))))  # each stage's leaves by index
            index = {s: optree.tree_leaves(stages.params_of(index, s)) for s in mine}
            weights = functools.partial(self._gather_stage, counted, index)
            if any(self.per_block):  # the blocks of the stages counted here: gathered by run_block
                own = {s for s in mine if counted is None or sched.rank_of(s) == counted}
                stages = _BlocksGathered(stages, self, index, own)
                # (in the master dtype: their run_block casts them before they travel)
                uncast = {s: [self.per_block[i] for i in index[s]] for s in own}
        micro = split_batch(batch, sched.microbatches)
        trained = None
        if self.layout.trainable is not None:  # frozen leaves enter their stages as constants
            marks = optree.tree_unflatten(tdef, self.layout.trainable)
            trained = {s: optree.tree_leaves(stages.params_of(marks, s)) for s in mine}
        if self._local():
            g = comm.axis_group(self.mesh, (axis,))
            ranks = [g.index]
            if self._p2p is None:  # kept from step to step: the shapes it learnt carry over
                self._p2p = PointToPoint(g.group, g.ranks, sched.microbatches, types=_types(self.mesh))
            transport = self._p2p
        else:  # the virtual mesh, or a dry run of a real rank's step: every pipe rank here
            ranks, transport = list(range(sched.ranks)), Mailbox()
        # A dry run of a real rank's step measures what this rank allocates: the other pipe
        # ranks' actions run for their values only.
        counted = [counted] if counted is not None else None
        frame = _env.current()
        mode = frame.vma if frame is not None and self.assumed is not None and not _manifest.active() else None
        with mode.assuming(self.assumed) if mode is not None else contextlib.nullcontext():
            try:
                # One loss scale for every stage (fp16): the last stage's losses scaled
                # before backward, every gradient unscaled by the step's transformation.
                res = run(sched, stages, {s: stages.params_of(x0, s) for s in mine}, micro, ranks=ranks,
                          transport=transport, functional=self.functional,
                          scale=lambda y: self.scaling.scale(y, scale), trained=trained,
                          compute_dtype=self.policy.compute_dtype, counted=counted, state=model_state,
                          weights=weights, uncast=uncast)
            except _vma.NeedsTyping:  # the pipe ranks may stand at different actions: no rerun
                raise RuntimeError("pipeline: a stage asked for the varying-axes typing the step assumed "
                                   "away (a collective or a type question inside the model); please "
                                   "report it") from None
        names = stages.metrics  # what every rank reports, in one order (zeros for stages not its own)
        unknown = sorted(set(res.metrics) - set(names))
        if unknown and model_state is None:
            raise ValueError(f"pipeline: the stages report metrics {unknown} their Stages do not name; add them to "
                             f"Stages(..., metrics=...) (now {list(names)})")
        metrics = torch.stack([res.metrics[k].reshape(()).float() if k in res.metrics else torch.zeros(())
                               for k in names]) if names else None
        # With a model state the rest is the blocks' stats (mean over the micro-batches):
        # the tree update_model_state takes, zeros for the blocks of other pipe ranks.
        stats = stages.stats(model_state, {k: res.metrics[k] for k in unknown}) if model_state is not None else None
        if mode is not None:
            for t in optree.tree_leaves(res.grads):  # a cotangent has its primal's type
                mode.set(t, self.assumed)
            for t in (res.loss, metrics, *optree.tree_leaves(stats)):
                if t is not None:
                    mode.set(t, self.assumed)
        elif res.loss is not None and frame is not None and frame.vma is not None and not self._local():
            # The stages' loss may vary over the batch axes only (as train_step checks a loss),
            # checked where every pipe rank runs here (a rank alone would stop without its peers).
            _check_loss_type(res.loss, self.batch_axes, self.mesh)
        # A dry run measuring one rank's memory keeps that rank's gradients alone: the others'
        # are zeros it makes, as it does running alone.
        held = res.grads if counted is None else {s: g for s, g in res.grads.items() if sched.rank_of(s) in counted}
        grads, loss = stages.merge(held, x0), res.loss
        g_leaves = optree.tree_leaves(grads)
        del grads, x0
        # The gradient side sees the trained leaves this rank holds (all of them on the
        # virtual mesh); on a real rank the others' gradients are zeros it never stores.
        if self.layout.updated is not None:
            g_leaves = [g for g, t in zip(g_leaves, self.layout.updated) if t]
        g_leaves = [t.to(self.policy.reduce_dtype) for t in g_leaves]
        # Reduced over the batch axes first: a rank that is done reduces while the pipe
        # ranks before it are still in their cooldown; the sums over the pipe axis after.
        placed = self.reduction(g_leaves)
        if self.distributed and sched.ranks > 1:
            placed = self._shared_sum(placed, leaves)
            # The loss is the last stage's: one psum gives every pipe rank the loss and metrics.
            if loss is None:
                loss = torch.zeros((), dtype=torch.float32)
            if frame is not None and frame.vma is not None:  # a shard's loss varies over the batch axes,
                frame.vma.set(loss, frozenset(varying))       # on every pipe rank alike
                if metrics is not None:
                    frame.vma.set(metrics, frozenset(varying))
                for t in optree.tree_leaves(stats):
                    frame.vma.set(t, frozenset(varying))
            loss = psum(pvary(loss, axis), axis)
            metrics = psum(pvary(metrics, axis), axis) if metrics is not None else None
            stats = optree.tree_map(lambda t: psum(pvary(t, axis), axis), stats) if stats is not None else None
        reported = dict(zip(names, metrics.unbind())) if metrics is not None else {}
        return placed, loss, (reported, stats)

    @functools.cached_property
    def gathers_table(self) -> Any:
        """The table with ZeRO-3's weight actions (``Pipelined.gathers_table``)."""
        return self.pipe.gathers_table(self.mesh.shape[self.pipe.axis])

    def _gather_stage(self, counted: int | None, index: dict[int, list[int]], s: int, params: Any
                      ) -> tuple[Any, Callable | None]:
        """Stage ``s``'s weights whole, and the transpose of that (``run(weights=)``): its
        leaves sharded over the ZeRO axis all-gathered (bucketed by dtype and sharded axes;
        the transpose reduce-scatters the trained leaves' gradients, the frozen leaves get
        none). ``index[s]``: the stage's leaves' indices among the parameters'. In a dry run
        of one rank's step, the other pipe ranks' stages get zeros of the gathered shapes
        and communicate nothing."""
        lay = self.layout
        leaves, stdef = optree.tree_flatten(params)
        glob = index[s]
        pos = [k for k, i in enumerate(glob) if lay.moves.gather_in_loss[i]]
        if not pos:
            return params, None
        whole = list(leaves)
        if counted is None or self.table.rank_of(s) == counted:  # its blocks' leaves: at their run_block
            pos = [k for k in pos if not self.per_block[glob[k]]]
            if not pos:
                return params, None
        else:
            frame = _env.current()
            mode = frame.vma if frame is not None else None
            for k in pos:
                i = glob[k]
                whole[k] = _held.stand_in(leaves[k], lay.params[i], lay.use[i], self.mesh)
                if mode is not None:  # typed as this rank's gathers are: no implicit psum in its backward
                    mode.set(whole[k], mode.get(leaves[k]) | {lay.axis})

            def dropped(grads: list) -> list:
                return [None] * len(grads)
            return optree.tree_unflatten(stdef, whole), dropped
        cold = [k for k in pos if lay.frozen is not None and lay.frozen[glob[k]]]
        pos = [k for k in pos if k not in cold]  # the trained ones: their gradients are transposed
        specs = {k: (lay.params[glob[k]], lay.use[glob[k]]) for k in pos + cold}
        src, dst = [specs[k][0] for k in pos], [specs[k][1] for k in pos]
        frame = _env.current()
        mode = frame.vma if frame is not None else None
        if cold:  # frozen leaves: gathered, never differentiated
            got = B.gather_leaves([leaves[k] for k in cold], [specs[k][0] for k in cold], [specs[k][1] for k in cold],
                                  lay.axis, lay.mesh, self.cap)
            for k, f in zip(cold, got):
                whole[k] = f
        if not pos:
            return optree.tree_unflatten(stdef, whole), None
        if self._local() and not self.functional and not self.graph and not _manifest.active():
            # Real ranks: the all-gathers issued now, one compute action ahead, and waited for
            # at the stage's first use; their transpose (a reduce-scatter in the same buckets)
            # run by hand at the release. (A recorded step gathers as the dry run does.)
            typed = mode is not None and mode.assumed is None  # (assumed: every stage value varies over all)
            types = {k: mode.get(leaves[k]) | {lay.axis} if typed else None for k in pos}
            sel = [leaves[k] for k in pos]
            pending = [([pos[i] for i, _ in bucket],
                        PendingGather([sel[i] for i, _ in bucket], [src[i] for i, _ in bucket],
                                      [dst[i] for i, _ in bucket], lay.axis, lay.mesh))
                       for group in B._moving(sel, src, dst, lay.axis, None)
                       for bucket in _bucketed(group, [x.numel() for x in sel], self.cap)]
            arriving = _Arriving(pending, whole, stdef, types, mode)

            def scattered(grads: list) -> list:
                g = [grads[k].to(leaves[k].dtype) if grads[k] is not None else
                     leaves[k].new_zeros(_held.gathered_shape(leaves[k], a, b, self.mesh))
                     for k, a, b in zip(pos, src, dst)]
                return self._placed(grads, pos, B.scatter_leaves(g, src, dst, lay.axis, lay.mesh, self.cap), mode)
            return arriving, scattered
        full, untransposed = torch.func.vjp(
            lambda xs: B.gather_leaves(list(xs), src, dst, lay.axis, lay.mesh, self.cap), [leaves[k] for k in pos])
        for k, f in zip(pos, full):
            whole[k] = f

        def transpose(grads: list) -> list:
            g = [grads[k].to(leaves[k].dtype) if grads[k] is not None else torch.zeros_like(full[j])
                 for j, k in enumerate(pos)]
            (sharded,) = untransposed(g)
            return self._placed(grads, pos, sharded, mode)
        return optree.tree_unflatten(stdef, whole), transpose

    @staticmethod
    def _placed(grads: list, pos: list[int], sharded: list, mode: Any) -> list:
        """``grads`` with the reduce-scattered ones at ``pos``, typed as the stages run
        (varying over the assumed axes) where the typing is assumed."""
        out = list(grads)
        for k, t in zip(pos, sharded):
            if mode is not None and mode.assumed is not None:
                mode.set(t, mode.assumed)
            out[k] = t
        return out

    def _shared_sum(self, placed: list, master: list) -> list:
        """``placed`` (the reduced gradients of the leaves this rank updates) with those of
        the trained leaves several pipe ranks hold (a tied embedding on the first and the
        last stage) each the sum of its holders' parts, one buffer per set of holders:
        held by every pipe rank, a psum over the pipe axis; by some of them, a sum among
        those alone (a group of theirs: the ranks between send nothing), which a dry run
        leaves out (it is not a collective of the mesh's axes). Untyped (every holder sends
        the same buffer whatever its stages' types); each holder's sum takes the type of
        its own part."""
        hold, updated = self.layout.holding, self.layout.updated
        trained = self.layout.trainable
        idx = [i for i, sh in enumerate(hold.shared) if sh and (trained is None or trained[i])]
        if not idx:
            return placed
        at = {i: k for k, i in enumerate(i for i, u in enumerate(updated or [True] * len(master)) if u)}
        dtype = self.policy.reduce_dtype
        axis, n = self.pipe.axis, self.mesh.shape[self.pipe.axis]
        by_holders: dict[tuple[int, ...], list[int]] = {}
        for i in idx:
            by_holders.setdefault(tuple(sorted(hold.owners[i])), []).append(i)
        vma = _env.current().vma if _env.current() is not None else None
        out = list(placed)
        for holders, group in sorted(by_holders.items()):
            among = None
            if len(holders) < n and not _manifest.dry():
                among = comm.axis_subgroup(self.mesh, axis, holders)  # (made by every rank)
                if among is None:
                    continue  # not a holder: nothing of these leaves is here, and it sends nothing
            parts = [placed[at[i]].to(dtype).reshape(-1) if i in at else torch.zeros(master[i].numel(), dtype=dtype)
                     for i in group]
            if len(holders) == n:
                with vma.paused() if vma is not None else contextlib.nullcontext():
                    flat = psum(torch.cat(parts), axis)
            elif among is None:  # a dry run: no group is made, nothing is sent
                flat = torch.cat(parts)
            else:
                flat = comm.all_reduce(torch.cat(parts), "sum", among)
            for i, piece in zip(group, flat.split([p.numel() for p in parts])):
                if i in at:
                    own = placed[at[i]]
                    g = piece.view(own.shape).to(own.dtype)
                    if vma is not None:
                        vma.set(g, varying_axes(own))
                    out[at[i]] = g
        return out

    def _counted_rank(self) -> int | None:
        """In a dry run of a real rank's step, that rank's index along the pipe axis."""
        return comm.axis_group(self.mesh, (self.pipe.axis,)).index if self.distributed and not self._local() else None

    def _local(self) -> bool:
        """This rank's actions alone (real ranks, not a dry run), else every pipe rank's."""
        return self.distributed and not _manifest.dry()

    def _mine(self) -> list[int]:
        """The stages this process runs."""
        sched = self.table
        if self._local():
            me = comm.axis_group(self.mesh, (self.pipe.axis,)).index
            return [s for s in range(sched.stages) if sched.rank_of(s) == me]
        return list(range(sched.stages))


class _BlocksGathered:
    """``Stages`` whose forward runs its blocks on weights gathered block by block
    (ZeRO-3 with ``reshard_after_forward=True`` under a pipeline): each ``run_block`` of a
    stage in ``own`` gathers that block's leaves, frees them after the block's forward and
    gathers them again in its backward (saved-tensor hooks with plain autograd, a remat of
    the block under torch.func), and its backward reduce-scatters their gradients, for
    every micro-batch. The stages' other leaves are gathered by the table's actions."""

    def __init__(self, stages: Any, grads: PipelineGradients, index: dict[int, list[int]], own: set[int]) -> None:
        self.stages, self.grads, self.index, self.own = stages, grads, index, own

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stages, name)

    def forward(self, s: int, params: dict, x: Any, batch: Any, state: Any = None) -> Any:
        if s not in self.own:
            return self.stages.forward(s, params, x, batch, state=state)
        g, lay = self.grads, self.grads.layout
        specs_of, frozen = {}, set()
        blocks = {id(t) for t in optree.tree_leaves(params[self.stages.blocks])}
        for t, i in zip(optree.tree_leaves(params), self.index[s]):
            if id(t) in blocks:
                specs_of[id(t)] = (lay.params[i], lay.use[i])
                if lay.frozen is not None and lay.frozen[i]:
                    frozen.add(id(t))
        # Plain autograd re-gathers by saved-tensor hooks; torch.func, a dry run (whose
        # manifest then lists backward's gathers as they run) and a graph's capture (whose
        # traced values have no storage to key the hooks on), by a remat of the block.
        hooks = not g.functional and not g.graph and not _manifest.dry()
        handler = zero3.block_handler(specs_of, lay.axis, lay.mesh, g.cap, None, True, set(), frozen=frozen,
                                      hooks=hooks, dtype=g.policy.compute_dtype, reduce_dtype=g.policy.reduce_dtype)
        handler.recomputes = not hooks  # (a remat policy inside it does not recompute its blocks twice)
        with handling(handler):
            return self.stages.forward(s, params, x, batch, state=state)


class _Recomputed:
    """``Stages`` whose blocks follow the step's remat policy (``train_step(remat=...)``),
    in every stage's forward, per micro-batch: the policy's handler is installed around the
    stage's forward, handing its blocks on to the handler already there (ZeRO-3's per-block
    gathers, which recompute the blocks themselves under torch.func: not twice). The policy
    counts the blocks of each stage's forward (``"blocks:K"``: every K-th of the stage's)."""

    def __init__(self, stages: Any, policy: Any) -> None:
        self.stages, self.policy = stages, policy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stages, name)

    def forward(self, s: int, params: dict, x: Any, batch: Any, state: Any = None) -> Any:
        inner = current_handler()
        done = (lambda _p: True) if getattr(inner, "recomputes", False) else None
        with handling(self.policy.handler(inner, done=done)):
            return self.stages.forward(s, params, x, batch, state=state)


class _Arriving:
    """A stage's gathers in flight on a real rank (``(positions, PendingGather)`` per
    bucket): ``wait()`` gives its whole weights (``whole`` with the gathered leaves put in),
    each gathered leaf typed as ``all_gather``'s result would be (``types``: the shard's
    axes and the gather's; None: untyped, where the typing is assumed)."""

    def __init__(self, pending: list, whole: list, tdef: Any, types: dict, mode: Any) -> None:
        self.pending, self.whole, self.tdef, self.types, self.mode = pending, whole, tdef, types, mode

    def wait(self) -> Any:
        whole = list(self.whole)
        for pos, gather in self.pending:
            for k, full in zip(pos, gather.wait()):
                if self.types[k] is not None:
                    self.mode.set(full, self.types[k])
                whole[k] = full
        self.pending = []
        return optree.tree_unflatten(self.tdef, whole)


def _bucketed(group: list[tuple[int, int]], sizes: list[int], cap: int) -> list[list[tuple[int, int]]]:
    """A group of ``_buckets._moving`` in the buckets ``gather_leaves`` cuts it into."""
    dims = dict(group)
    return [[(i, dims[i]) for i in b] for b in B.buckets([i for i, _ in group], [sizes[i] for i, _ in group], cap)]


def _assumable(layout: Layout, batch_axes: tuple[str, ...], pipe: str) -> frozenset | None:
    """The axes the stages run assuming every differentiated value varies over (the
    typing off torch's stack, as ``_assume`` does for a plain step): every axis of size > 1
    but the pipe axis, when each parameter varies over all of them once marked varying
    over the batch axes (data parallelism, ZeRO); else None (tensor parallelism: typed)."""
    mesh = layout.mesh
    full = frozenset(a for a in mesh.axis_names if mesh.shape[a] > 1 and a != pipe)
    marked = {a for a in batch_axes if mesh.shape[a] > 1}
    if all(full <= marked | set(s.axes) for s in layout.params):
        return full
    return None


def _types(mesh: Mesh) -> tuple[Callable, Callable]:
    """How a value's varying axes travel with it between pipe ranks: a bit per mesh axis.
    A received activation varies over the batch axes as the one sent did; typed as
    invariant it would take an implicit pvary, whose backward sums its gradient over them."""
    names = mesh.axis_names

    def encode(t: torch.Tensor) -> int:
        mode = _env.current().vma
        # Under the assumed typing an activation or a gradient varies over the assumed axes.
        axes = mode.assumed if mode is not None and mode.assumed is not None else varying_axes(t)
        return sum(1 << names.index(a) for a in axes)

    def decode(t: torch.Tensor, code: int) -> torch.Tensor:
        mode = _env.current().vma
        if mode is not None:
            mode.set(t, frozenset(a for i, a in enumerate(names) if code >> i & 1))
        return t
    return encode, decode
