"""ZeRO-3's runtime in one place: parameters stay sharded until the block that uses them
runs, are gathered there (prefetched one block ahead on real ranks), freed after it, and
gathered again in backward, where their gradients are reduce-scattered back to the shards.

Two forms of the re-gather: on real ranks (plain autograd) saved-tensor hooks drop the
gathered weights a block saved for backward and gather them again when backward unpacks
them, so the forward is not re-run; on the virtual mesh (torch.func, where saved-tensor
hooks do not apply) the block is remat'ed (``fsharded.parallel.remat.checkpoint``). The
step reaches this module through ``block_handler``, installed as the handler of
``fsharded.parallel.run_block`` while the loss runs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import Any

import optree
import torch

from fsharded import _memory_hooks as memory
from fsharded import comm
from fsharded.comm import _shm
from fsharded.mesh._mesh import Mesh
from fsharded.parallel import offload
from fsharded.parallel._buckets import InFlight, gather_leaves, issue, scatter_leaves, split_dim
from fsharded.parallel.blocks import Keyed
from fsharded.parallel.remat import _mode, checkpoint
from fsharded.precision import cast_tree
from fsharded.spmd.collectives import psum_scatter

__all__ = ["PendingGather", "Prefetch", "block_handler", "in_flight", "overlapped_backward", "run_regathered"]


class PendingGather:
    """An all-gather issued without waiting (ZeRO-3 prefetch on real ranks): ``wait()``
    gives the gathered leaves. Not differentiable: for forward passes under no_grad."""

    def __init__(self, leaves: list, from_specs: list, to_specs: list, axis: str, mesh: Mesh,
                 reading: offload.Reading | None = None, dtype: torch.dtype | None = None) -> None:
        # ``dtype``: the shards are cast to it before they travel (the gathered weights' dtype).
        raw = [x.detach() for x in leaves]
        self.n = mesh.shape[axis]
        self.dims = [split_dim(f, t, axis) if axis in f.axes and axis not in t.axes else None
                     for f, t in zip(from_specs, to_specs)]
        moving = [i for i, d in enumerate(self.dims) if d is not None]
        self.moving = moving
        self.work = None
        with torch.no_grad():
            # A shard in an NVMe tier: read from its file (posted earlier by the prefetch).
            values = (reading or offload.Reading(raw)).wait()
            if not moving or self.n == 1:  # nothing to gather: the shards are the whole weights
                self.leaves = [cast_tree(v, dtype) for v in values]
                return
            # (the gathered ones' shapes are read off the shards; the others as they are used)
            self.leaves = [x if d is not None else cast_tree(v, dtype) for x, v, d in zip(raw, values, self.dims)]
            g = comm.axis_group(mesh, (axis,))
            src = [cast_tree(values[i], dtype) for i in moving]
            del values
            flat = torch.cat([x.movedim(self.dims[i], 0).reshape(-1) for i, x in zip(moving, src)])
            del src
            out = flat.new_empty(self.n * flat.numel())
        # The source must outlive the asynchronous collective (gloo reads it on its own
        # thread): freed early, its memory is reused and the gather returns other data.
        self._src = flat
        self.work = _shm.all_gather_into(out, flat, g, async_op=True)
        self.out = out.view(self.n, flat.numel())

    def wait(self) -> list:
        with torch.no_grad():
            return self._wait()

    def finish(self) -> None:
        """Complete the gather and let go of its source (the output stays for ``wait``)."""
        if self.work is not None:
            self.work.wait()
            self.work, self._src = None, None

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()

    def _wait(self) -> list:
        out = list(self.leaves)
        if not hasattr(self, "out"):
            return out
        self.finish()
        sizes = [self.leaves[i].numel() for i in self.moving]
        for i, piece in zip(self.moving, self.out.split(sizes, dim=1)):
            x, d = self.leaves[i], self.dims[i]
            moved = x.movedim(d, 0).shape
            y = piece.reshape(self.n * moved[0], *moved[1:])  # a column block: copied, own storage
            out[i] = y if d == 0 else y.movedim(0, d)
        # The leaves are copies: drop the gather buffer now, not when this object dies (a
        # backward gather is referenced until backward ends; its buffer must not be).
        del self.out
        return out


_PENDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("fsharded_zero3_pending", default=None)


@contextlib.contextmanager
def overlapped_backward():
    """Within the block, ZeRO-3 gradient reduce-scatters are issued asynchronously; on exit
    every one has completed (call it around ``torch.autograd.grad`` only)."""
    pending: list = []
    tok = _PENDING.set(pending)
    try:
        yield
    finally:
        _PENDING.reset(tok)
        for op in pending:
            op.finish()


def in_flight(t: torch.Tensor) -> bool:
    """Whether ``t`` (a gradient backward made) is a view of a reduce-scatter still in
    flight (inside ``overlapped_backward``); False for anything else."""
    pending = _PENDING.get()
    if not pending:
        return False
    ptr = t.untyped_storage().data_ptr()
    return any(not op.done() and any(k.untyped_storage().data_ptr() == ptr for k in getattr(op, "keep", ()))
               for op in pending)


def track_pending(gather: Any) -> None:
    """Have ``overlapped_backward`` wait for an asynchronous gather issued in backward (a
    prefetch that no block took is still completed before the step goes on)."""
    pending = _PENDING.get()
    if pending is not None and gather.work is not None:
        issue(pending, gather)


def _reduce_scatter_async(rows: torch.Tensor, axis: str, mesh: Mesh, pending: list) -> torch.Tensor:
    g = comm.axis_group(mesh, (axis,))
    flat = rows.contiguous().reshape(-1)
    out = flat.new_empty(rows.shape[1])
    issue(pending, InFlight(_shm.reduce_scatter_into(out, flat, g, async_op=True), flat, out))
    return out


class _Gathered(torch.autograd.Function):
    """Shards -> full weights (from a prefetch, or gathered here); backward: reduce-scatter.
    ``info``'s ``dtype``: the shards are cast to it before they travel (the full weights'
    dtype; None: as they are); ``reduce_dtype``: the gradients are reduce-scattered in it
    (None: as they come) and handed back in the shards' dtype."""

    @staticmethod
    def forward(ctx, info, pending, cache, frozen, *shards):
        m_specs, u_specs, axis, mesh, cap, dtype, _ = info
        ctx.info, ctx.cache = info, cache
        ctx.dtypes = [s.dtype for s in shards]
        if pending is not None:
            fulls = pending.wait()
        else:
            fulls = gather_leaves([cast_tree(offload.fetch(s.detach()), dtype) for s in shards], m_specs, u_specs, axis,
                                  mesh, cap)
        # Independent tensors (not views of one gather buffer, nor of the inputs), so the
        # block may use them like any parameter.
        out = tuple(f if (f._base is None and f is not s) else f.clone() for f, s in zip(fulls, shards))
        memory.label(list(out), "parameters")  # the block's full weights, while it runs
        if frozen is not None:  # no gradient is made for what is not trained
            ctx.set_materialize_grads(False)
            ctx.mark_non_differentiable(*(o for o, f in zip(out, frozen) if f))
        return out

    @staticmethod
    def backward(ctx, *grads):
        m_specs, u_specs, axis, mesh, cap, _, reduce_dtype = ctx.info
        if ctx.cache is not None:  # the block's backward is over: drop its re-gathered weights
            ctx.cache.clear()
        n = mesh.shape[axis]
        out: list = list(grads)
        dims = {}
        for i, (g, m, u) in enumerate(zip(grads, m_specs, u_specs)):
            if g is not None and axis in m.axes and axis not in u.axes:
                dims[i] = split_dim(m, u, axis)
        if dims:
            # The gather's transpose for the whole block in one reduce-scatter: each
            # gradient's row j is the block of its dim owned by shard j.
            idx = list(dims)
            # What a memory tracker sees: the block's full parameter gradients (made in
            # backward, where the rest is activation gradients) and the bucket sent.
            memory.label([grads[i] for i in idx], "gradients")
            rows = torch.cat([cast_tree(grads[i], reduce_dtype).movedim(dims[i], 0).reshape(n, -1) for i in idx], dim=1)
            memory.label(rows, "gradients")
            pending = _PENDING.get()
            # Handed back in another dtype than reduced in: converted once it has arrived.
            back = any(rows.dtype != ctx.dtypes[i] for i in idx)
            if pending is not None and not back:
                # Issued without waiting: the rest of backward runs while it travels. The
                # gradients handed to autograd are views of the output buffer, which nothing
                # reads before the step waits on every pending reduce-scatter.
                mine = _reduce_scatter_async(rows, axis, mesh, pending)
            else:
                mine = psum_scatter(rows, axis, dim=0, tiled=False)
            for i, piece in zip(idx, mine.split([grads[i].numel() // n for i in idx])):
                moved = list(grads[i].movedim(dims[i], 0).shape)
                moved[0] //= n
                out[i] = cast_tree(piece.reshape(moved).movedim(0, dims[i]), ctx.dtypes[i])
            memory.label(mine, "gradients")
        return (None, None, None, None, *out)


def run_regathered(block, p_tree_def, shards: list, args: tuple, kw: dict, m_specs: list, u_specs: list,
                   axis: str, mesh: Mesh, cap: int, pending: Any, *, regather: bool = True,
                   fetch: Any = None, frozen: list[bool] | None = None, dtype: torch.dtype | None = None,
                   reduce_dtype: torch.dtype | None = None) -> Any:
    """Forward of one block on gathered weights whose saved copies are dropped and gathered
    again in backward (``regather``: by ``fetch()``, a prefetching gatherer, or here), or
    kept by autograd until backward. ``dtype``: the weights' dtype (the shards cast to it
    before they travel); ``reduce_dtype``: their gradients' reduce-scatter's."""
    cache: dict[int, torch.Tensor] = {}
    fulls = _Gathered.apply((m_specs, u_specs, axis, mesh, cap, dtype, reduce_dtype), pending, cache, frozen, *shards)
    if not regather:
        return block(optree.tree_unflatten(p_tree_def, list(fulls)), *args, **kw)
    ptrs = {f.untyped_storage().data_ptr(): i for i, f in enumerate(fulls)}
    shard_refs = [s.detach() for s in shards]

    def pack(t: torch.Tensor):
        i = ptrs.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if i is None:
            return t
        return ("zero3-regather", i, t.shape, t.stride(), t.storage_offset())

    def unpack(packed):
        if not (isinstance(packed, tuple) and packed and packed[0] == "zero3-regather"):
            return packed
        _, i, shape, stride, offset = packed
        if i not in cache:  # first weight backward needs: gather the block's in one bucket
            with torch.no_grad():
                full = fetch() if fetch is not None else \
                    gather_leaves([cast_tree(offload.fetch(x), dtype) for x in shard_refs], m_specs, u_specs, axis, mesh,
                                  cap)
            cache.update({j: f.contiguous() for j, f in enumerate(full)})
            memory.label(list(cache.values()), "parameters")  # gathered again for backward
        return cache[i].as_strided(shape, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return block(optree.tree_unflatten(p_tree_def, list(fulls)), *args, **kw)


class Prefetch:
    """ZeRO-3 prefetch on real ranks. Forward: when block i starts, block i+1's gather is
    issued asynchronously, so it travels while block i computes. Backward (re-gather): when
    block i's backward begins (its output's gradient arrives), block i-1's gather is issued,
    so it travels while block i's backward computes. Two blocks' full weights are alive at
    most (three around the last block, which is kept from forward to backward)."""

    def __init__(self, blocks: list, specs_of: dict, axis: str, mesh: Mesh, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype  # the shards are cast to it before they travel
        self.order = [optree.tree_leaves(b) for b in blocks]
        self.index = {id(lv[0]): i for i, lv in enumerate(self.order) if lv}
        self.specs_of, self.axis, self.mesh = specs_of, axis, mesh
        self.pending: dict[int, Any] = {}
        self.backward: dict[int, Any] = {}
        # Blocks whose shards live in an NVMe tier are read a block before their gather is
        # issued (aio's threads read them while the blocks before compute).
        self.reads: dict[int, offload.Reading] = {}

    def _read(self, i: int) -> None:
        if 0 <= i < len(self.order) and i not in self.reads:
            self.reads[i] = offload.Reading(self.order[i])

    def _gather(self, i: int, ahead: int) -> Any:
        leaves = self.order[i]
        specs = [self.specs_of[id(t)] for t in leaves]
        g = PendingGather(leaves, [m for m, _ in specs], [u for _, u in specs], self.axis, self.mesh,
                          reading=self.reads.pop(i, None), dtype=self.dtype)
        self._read(i + ahead)  # the block after it in this pass
        return g

    def start(self, i: int) -> None:
        if 0 <= i < len(self.order) and i not in self.pending:
            self.pending[i] = self._gather(i, 1)

    def _start_backward(self, i: int) -> None:
        if 0 <= i < len(self.order) and i not in self.backward:
            self.backward[i] = g = self._gather(i, -1)
            track_pending(g)  # waited for when backward ends, even if no block takes it

    def drain_reads(self) -> None:
        """Wait for the reads posted and not taken (a stopped forward, the pass's end)."""
        reads, self.reads = self.reads, {}
        for r in reads.values():
            r.wait()

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


class _CastGathered(torch.autograd.Function):
    """``gather_leaves`` of shards cast to ``dtype`` first (the wire carries ``dtype``),
    whose transpose reduce-scatters the gradients in ``reduce_dtype`` and hands them back
    in the shards' dtype: the virtual mesh's form of ``_Gathered``'s casts (under
    torch.func, vmapped by its generated rule). It types its own insides: each gathered
    leaf has the type the gather gives it, not the union of every shard's."""

    generate_vmap_rule = True
    vma_typed = True

    @staticmethod
    def forward(info, types, *shards):
        m_specs, u_specs, axis, mesh, cap, dtype, _, frozen = info
        mode = _mode()
        with mode.typing() if mode is not None and mode.dispatching else contextlib.nullcontext():
            if mode is not None and types is not None:  # the shards' types as the body has them
                for x, t in zip(shards, types):
                    mode.set(x, t)
            out = tuple(gather_leaves([cast_tree(s, dtype) for s in shards], m_specs, u_specs, axis, mesh, cap,
                                      frozen=frozen))
        if mode is not None:
            mode.carry(out)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        info, _, *shards = inputs
        ctx.info, ctx.dtypes = info, [s.dtype for s in shards]
        frozen = info[-1]
        if frozen is not None:  # no gradient is made for what is not trained
            ctx.set_materialize_grads(False)
            ctx.mark_non_differentiable(*(o for o, f in zip(output, frozen) if f))

    @staticmethod
    def backward(ctx, *grads):
        m_specs, u_specs, axis, mesh, cap, _, reduce_dtype, _ = ctx.info
        idx = [i for i, g in enumerate(grads) if g is not None]
        got = scatter_leaves([cast_tree(grads[i], reduce_dtype) for i in idx], [m_specs[i] for i in idx],
                             [u_specs[i] for i in idx], axis, mesh, cap)
        out: list = [None] * len(grads)
        for i, g in zip(idx, got):
            out[i] = cast_tree(g, ctx.dtypes[i])
        return (None, None, *out)


def block_handler(specs_of: dict, axis: str, mesh: Mesh, cap: int, prefetch: Prefetch | None,
                  reshard: bool, kept: set, *, frozen: set | frozenset = frozenset(),
                  hooks: bool = False, dtype: torch.dtype | None = None,
                  reduce_dtype: torch.dtype | None = None) -> Callable[..., Any]:
    """The ``run_block`` handler of a ZeRO-3 step: run each block on its gathered weights.
    ``frozen``: ids of the leaves that are not trained (gathered for use; no gradient of
    theirs is computed or reduce-scattered). ``dtype``: the weights' dtype as the block
    uses them (the shards, in the master dtype, cast to it before they travel; None: as
    they are); ``reduce_dtype``: the dtype their gradients are reduce-scattered in (None:
    the weights'), handed back in the shards' dtype (a policy's fp32 reduction of bf16
    weights: gathered in bf16, reduced in fp32, as FSDP2's ``reduce_dtype`` does).

    With ``reshard`` the full weights live only while the block runs and are gathered
    again in backward (except for the leaves in ``kept``: the last block, whose backward
    comes right after its forward): with plain autograd by saved-tensor hooks
    (``prefetch`` given, or ``hooks``: gathered where they are needed, nothing in
    flight; no forward re-run), under torch.func by a remat of the block. Without it they
    are gathered once and autograd keeps them until backward."""

    def handle(block: Callable, p: Any, *args: Any, **kw: Any) -> Any:
        leaves, bdef = optree.tree_flatten(p)
        regather_any, again = reshard, reshard and not (leaves and id(leaves[0]) in kept)
        try:
            specs = [specs_of[id(t)] for t in leaves]
        except KeyError:
            raise ValueError(
                "ZeRO-3 run_block: the block received parameters that are not leaves of the "
                "step's block list (train_step(blocks=...)); pass each block its own subtree of "
                "the params the loss was given, unchanged"
            ) from None
        m_specs, u_specs = [m for m, _ in specs], [u for _, u in specs]
        cold = [id(t) in frozen for t in leaves] if frozen else None
        if prefetch is not None:
            out = run_regathered(block, bdef, leaves, args, kw, m_specs, u_specs, axis, mesh, cap,
                                 prefetch.take_pending(leaves), regather=again,
                                 fetch=prefetch.regather(leaves) if again else None, frozen=cold, dtype=dtype,
                                 reduce_dtype=reduce_dtype)
            first = optree.tree_leaves(out)[0] if optree.tree_leaves(out) else None
            if regather_any and isinstance(first, torch.Tensor) and first.requires_grad:
                first.register_hook(prefetch.on_backward(leaves))
            return out
        if hooks:
            return run_regathered(block, bdef, leaves, args, kw, m_specs, u_specs, axis, mesh, cap, None,
                                  regather=again, frozen=cold, dtype=dtype, reduce_dtype=reduce_dtype)
        # Tensors among the block's other arguments go through the remat as inputs, so
        # their gradients (a residual stream, position embeddings) are not lost.
        extra, edef = optree.tree_flatten((args, kw))
        is_t = [isinstance(e, torch.Tensor) for e in extra]
        n = len(leaves)

        def run(*tensors: torch.Tensor) -> Any:
            shards, ts = list(tensors[:n]), iter(tensors[n:])
            casts = dtype is not None and any(s.is_floating_point() and s.dtype != dtype for s in shards)
            if not casts and reduce_dtype in (None, dtype):  # the weights travel and reduce as they are
                full = gather_leaves(shards, m_specs, u_specs, axis, mesh, cap, frozen=cold)
            else:
                mode = _mode()
                types = [mode.get(x) for x in shards] if mode is not None else None
                full = list(_CastGathered.apply((m_specs, u_specs, axis, mesh, cap, dtype, reduce_dtype, cold),
                                                types, *shards))
            memory.label(full, "parameters")  # the block's full weights, while it runs
            a, k = optree.tree_unflatten(edef, [next(ts) if t else e for e, t in zip(extra, is_t)])
            return block(optree.tree_unflatten(bdef, full), *a, **k)

        inputs = (*leaves, *(e for e, t in zip(extra, is_t) if t))
        # run_block keyed the block already: its recomputation draws the forward's masks.
        if not again:
            return run(*inputs)
        # A keyed block's key goes into the remat as an input: the recomputation in
        # backward draws the forward's masks.
        key = block.key() if isinstance(block, Keyed) else None
        block = block.block if key is not None else block
        return checkpoint(run, key=key)(*inputs)

    return handle
