"""Analytic per-device memory of a training layout, in the spirit of DeepSpeed's
``estimate_zero3_model_states_mem_needs``, but read off the actual placement, optimizer
and precision (and including gathered weights and communication buckets).

>>> est = fs.estimate_memory(params, fs.parallel.zero(3)(P(), params), fs.optim.adamw(1e-3),
...                          precision="bf16", mesh=fs.Mesh({"data": 8}))
>>> print(est)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from fsharded import _memory_hooks
from fsharded import _memory_tracker as memory
from fsharded.mesh import _tree
from fsharded.mesh._layout import local_slice
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec, shard_shape
from fsharded.parallel.blocks import current as current_handler
from fsharded.parallel.blocks import handling
from fsharded.parallel.pipeline import Pipelined, check, split_batch
from fsharded.parallel.pipeline._execute import HEADER_BYTES
from fsharded.parallel.remat import checkpoint
from fsharded.parallel.remat import policy as remat_policy
from fsharded.parallel.zero import Placement, ZeroPlan
from fsharded.precision import as_policy
from fsharded.spmd import _env, _manifest, _prims, _schedule, _vma
from fsharded.spmd._transfer import backend_for
from fsharded.step import _trainable as T
from fsharded.step._layout import Moves

__all__ = ["MemoryEstimate", "estimate_memory", "pipeline_activations", "placement_of", "available_memory",
           "check_fits", "InsufficientMemoryError"]


def _local_numel(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> int:
    return math.prod(shard_shape(spec, shape, mesh))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device by category (the largest device, which all are with even shards)."""

    master: int  # master weights (optimizer precision), in their placement
    compute_params: int  # gathered full weights alive at the peak beyond ``params`` (ZeRO-3: two blocks)
    grads: int  # gradients at their largest: reduced ones + unreduced buckets + a block's full ones
    optimizer: int  # optimizer state (the moments; the master weights are ``master``)
    activations: int  # measured on a dry run of the loss (see estimate_memory), or as given
    buffers: int  # communication buckets
    placed_grads: int = 0  # gradients once reduced into their placement
    notes: tuple[str, ...] = field(default=())
    params: int = 0  # parameters in their dtype as held through the step (0: the master weights are used)
    update_copy: int = 0  # a pure (not donated) update's new master weights + moments beside the old
    backward_grads: int = 0  # gradient bytes alive beside the activations in backward (buckets, a block's)
    gather_transient: int = 0  # ZeRO-1/2's gather of the master shards: the gathered bucket and its copies
    offloaded: int = 0  # optimizer moments kept in a memory tier (host memory or NVMe), not on the device
    staging: int = 0  # the offloaded update's host staging buffers and the gradients it reads there (host memory)
    tier: str | None = None  # where ``offloaded`` lives: "cpu" (host memory) or "nvme" (files)
    offloaded_params: int = 0  # master parameters kept in a memory tier (ZeRO-3 parameter offload)
    params_tier: str | None = None  # where ``offloaded_params`` lives

    @property
    def host(self) -> int:
        """Host memory the tiers take: what is offloaded to the host tier (moments,
        parameters), and the update's staging buffers (where the device is the CPU, this is
        the same memory)."""
        return ((self.offloaded if self.tier == "cpu" else 0) + self.staging
                + (self.offloaded_params if self.params_tier == "cpu" else 0))

    @property
    def model_states(self) -> int:
        """Model states as the ZeRO paper counts them (its Figure 1): parameters as held
        (fp16 / bf16 copies: full at stages 0-2; none at 3, whose shards are cast block by
        block as they are gathered) + gradients in their placement + optimizer state with
        the fp32 master weights: (2+2+K)P, 2P+2P+KP/N, 2P+(2+K)P/N, (2+K)P/N for fp16 Adam
        (K=12; the paper's stage 3 keeps a fp16 shard too, (2+2+K)P/N)."""
        return self.params + self.placed_grads + self.master + self.optimizer

    @property
    def peak(self) -> int:
        """The device's peak in a step with donated updates: the state and gathered weights,
        plus the largest of three moments: in backward (activations and the gradients being
        reduced beside them), after it (every gradient reduced, the activations freed), or
        at ZeRO-1/2's gather before the forward (the gathered bucket beside the full
        parameters copied out of it)."""
        base = self.master + self.params + self.compute_params + self.optimizer + self.buffers
        return base + max(self.activations + self.backward_grads, self.grads, self.gather_transient)

    def breakdown(self) -> tuple[str, dict[str, int]]:
        """The peak by category: ``(moment, {category: bytes})`` whose bytes add up to
        ``peak`` exactly. The state (parameters, master weights, optimizer state, gathered
        weights, buffers) is always there; the rest is the largest of the three moments
        ``peak`` takes: ``"backward"`` (activations and the gradients beside them),
        ``"after backward"`` (every gradient) or ``"gather"`` (ZeRO-1/2's gather)."""
        parts = {"parameters": self.params, "master weights": self.master, "optimizer state": self.optimizer,
                 "gathered weights": self.compute_params, "comm buffers": self.buffers}
        moments = [("backward", {"activations": self.activations, "gradients": self.backward_grads}),
                   ("after backward", {"gradients": self.grads}),
                   ("gather", {"ZeRO gather": self.gather_transient})]
        moment, extra = max(moments, key=lambda m: sum(m[1].values()))  # the first of equals
        parts.update(extra)
        return moment, parts

    @property
    def total(self) -> int:
        """``peak`` plus the new state of a pure (not donated) update: an upper bound."""
        return self.peak + self.update_copy

    def __str__(self) -> str:
        rows = [("master weights", self.master), ("compute params", self.compute_params),
                ("gradients", self.grads), ("optimizer state", self.optimizer),
                ("activations", self.activations), ("comm buffers", self.buffers),
                ("parameters", self.params), ("peak", self.peak), ("total", self.total),
                ("model states", self.model_states)]
        w = max(len(r[0]) for r in rows)
        out = [f"{name.ljust(w)}  {b / 2**20:12,.2f} MiB" for name, b in rows]
        return "\n".join(out + [f"- {n}" for n in self.notes])


def estimate_memory(params: Any, specs: Any, optimizer: Any, *, precision: Any = "fp32",
                    mesh: Mesh, loss: Any = None, batch: Any = None, batch_spec: Any = None,
                    activation_bytes: int | None = None,
                    bucket_elems: int = 500_000_000, blocks: str | None = "blocks",
                    trainable: Any = None, remat: Any = None) -> MemoryEstimate:
    """Per-device bytes of training ``params`` laid out by ``specs`` (a spec tree, a ZeRO
    plan or a ``Placement``) with ``optimizer`` under ``precision`` on ``mesh``.

    The optimizer's state size comes from running its ``init`` on meta tensors of the
    master shards, so any ``fsharded.optim`` transformation is counted exactly.

    Activations: give the per-shard ``loss(params, batch)`` and a global ``batch`` (split
    by ``batch_spec``, default ``P("data")`` when the mesh has ``data``, as in
    ``train_step``). One device's forward and backward then run on meta tensors (sizes, no
    data) of its parameter and batch shards, with the mesh's axes bound as device 0 alone
    binds them (collectives answer locally with that device's shapes and send nothing, so
    an expert-parallel layer runs its all-to-alls on its share of the experts), and the
    memory tracker reports
    the peak of everything they allocate except the parameter gradients: saved
    activations, temporaries and activation gradients. At ZeRO stage 3 each block runs
    under the same remat as in ``train_step``, so only block inputs are kept. Code meta
    tensors cannot run gets fake tensors, and a loss that reads tensor values on the host
    (``.item()``, ``if mask.all():``) runs on copies of the shards' values on CPU: one real
    forward and backward of compute (``fsharded.spmd._schedule``; the notes say which
    ran). Or pass ``activation_bytes`` yourself. ``remat``: the step's remat policy
    (``train_step(remat=...)``): the measured forward recomputes the blocks it names.

    ``trainable``: which leaves train, as ``train_step`` takes it (by default the leaves'
    own flags: see ``fsharded.step._trainable.resolve``; a ``Placement`` from a step carries
    its own). A frozen leaf counts as stored in its own dtype, with no gradient, no master
    copy and no optimizer state.

    A pipelined ``loss`` (``parallel.pipeline.pipelined``) over an axis of size > 1: each
    rank along it stores the state of its own stages' leaves (``train_step`` on real
    ranks) and holds its schedule's bound of micro-batches; the estimate is that of the
    rank with the largest total, the notes give every rank's.
    """
    policy = as_policy(precision)
    remat = remat_policy(remat)
    pl = placement_of(specs, params, mesh)
    if pl.trainable is None or trainable is not None:
        pl = pl.freeze(T.resolve(trainable, params))
    kw = dict(policy=policy, mesh=mesh, bucket_elems=bucket_elems, blocks=blocks)
    if isinstance(loss, Pipelined) and mesh.shape.get(loss.axis, 1) > 1:
        if activation_bytes is None and batch is None:
            raise ValueError("estimate_memory: loss= needs a batch= (a global batch, as train_step takes)")
        n = mesh.shape[loss.axis]
        acts = [int(activation_bytes)] * n if activation_bytes is not None else \
            pipeline_activations(loss, params, pl, mesh, policy, batch, batch_spec, remat)
        owners = loss.owners(_tree.tree_flatten_with_paths(params)[0], n)
        # ZeRO-3 gathers each stage's weights once per step (the table's GATHER), or its
        # blocks one at a time per micro-batch (reshard_after_forward=True).
        kw["blocks"] = loss.stages.blocks if pl.reshard_after_forward is True else None
        ests = [_estimate(params, pl, optimizer, here=[r in o for o in owners], activations=acts[r], **kw)
                for r in range(n)]
        worst = max(range(n), key=lambda r: ests[r].total)
        note = (f"pipelined over {loss.axis!r}: each rank stores its stages' state and holds the schedule's bound "
                f"of micro-batches (activations per rank {[f'{a / 2**20:,.2f} MiB' for a in acts]}, totals "
                f"{[f'{e.total / 2**20:,.2f} MiB' for e in ests]}); the largest, rank {worst}'s, counted")
        return dataclasses.replace(ests[worst], notes=ests[worst].notes + (note,))
    if activation_bytes is not None:
        activations = int(activation_bytes)
        notes = []
    elif isinstance(loss, Pipelined):
        if batch is None:
            raise ValueError("estimate_memory: loss= needs a batch= (a global batch, as train_step takes)")
        activations, notes = _pipeline_activations(loss, params, pl, mesh, policy, batch, batch_spec, remat)
    elif loss is not None:
        if batch is None:
            raise ValueError("estimate_memory: loss= needs a batch= (a global batch, as train_step takes)")
        return _estimate(params, pl, optimizer, measure=(loss, batch, batch_spec, remat), **kw)
    else:
        activations, notes = 0, []
    est = _estimate(params, pl, optimizer, activations=activations, **kw)
    return dataclasses.replace(est, notes=est.notes + tuple(notes))


def _estimate(params: Any, pl: Any, optimizer: Any, *, policy: Any, mesh: Mesh, bucket_elems: int,
              blocks: str | None, activations: int = 0, measure: tuple | None = None,
              here: list[bool] | None = None) -> MemoryEstimate:
    """``estimate_memory`` of one device: ``activations`` as given, or measured on a dry
    run of ``measure`` (``(loss, batch, batch_spec, remat)``); ``here``: the leaves it stores
    (per-stage storage; None: all)."""
    mask = list(pl.trainable) if pl.trainable is not None else None
    paths, leaves, tdef = _tree.tree_flatten_with_paths(params)
    # What the step does with the leaves, read off the specs as the step reads them.
    mv = Moves.of(pl)
    use, grads, master = mv.use, mv.grads, mv.master
    in_loss = any(mv.gather_in_loss)  # parameters sharded, gathered for use (ZeRO-3)
    before = any(mv.gather_before)  # master shards gathered to full parameters (ZeRO-1/2)
    mb = _itemsize(policy.master_dtype)
    rb = _itemsize(policy.reduce_dtype)
    shapes = [tuple(x.shape) for x in leaves]
    stored = here if here is not None else [True] * len(shapes)
    master_n = [_local_numel(s, m, mesh) if h else 0 for s, m, h in zip(shapes, master, stored)]
    use_n = [_local_numel(s, u, mesh) if h else 0 for s, u, h in zip(shapes, use, stored)]
    grad_n = [_local_numel(s, g, mesh) if h else 0 for s, g, h in zip(shapes, grads, stored)]
    notes = []
    frozen_bytes = 0
    if mask is not None:  # frozen leaves: stored as given, no gradient or master copy
        frozen_bytes = sum(n * _itemsize(x.dtype) for n, x, t in zip(master_n, leaves, mask) if not t)
        master_n, grad_n = T.pick(master_n, mask), T.pick(grad_n, mask)
        notes.append(f"{mask.count(False)} of {len(mask)} parameter leaves frozen: no gradient, no "
                     f"optimizer state, stored in their own dtype ({frozen_bytes / 2**20:,.2f} MiB)")
    trained_n = T.pick(use_n, mask)
    S_t = sum(trained_n)
    # ``blocks``: where the block list is (train_step's blocks=; the bundled GPT's by default,
    # ignored when params have no list there). What the step holds, on real ranks:
    pb = _itemsize(policy.param_dtype)
    S = sum(use_n)
    block_of = _block_index(params, paths, blocks)
    per_block: dict[int, int] = {}
    for j, n in zip(block_of, use_n):
        if j is not None:
            per_block[j] = per_block.get(j, 0) + n
    largest = max(per_block.values(), default=0)
    outside = sum(n for n, j in zip(use_n, block_of) if j is None)
    # Gradients exist for the trained leaves only: a block's, the rest's.
    per_block_t: dict[int, int] = {}
    for j, n in zip(T.pick(block_of, mask), trained_n):
        if j is not None:
            per_block_t[j] = per_block_t.get(j, 0) + n
    largest_t = max(per_block_t.values(), default=0)
    outside_t = sum(n for n, j in zip(trained_n, T.pick(block_of, mask)) if j is None)
    placed = sum(grad_n) * rb
    host_grads = 0  # gradients the update reads in host memory (the optimizer state in a tier)
    biggest_leaf = max(trained_n, default=0)
    compute, buffers, gather = 0, 0, 0
    bucket_in_flight = 0  # (ZeRO 1-2) the gradient bucket being reduced, and its shard
    if in_loss and per_block and pl.reshards:
        # The rest gathered for the whole step (the block shards are cast to the param dtype
        # block by block, as they travel); two blocks' full weights at a time (one
        # computing, the next one's gather in flight: its buffer is one of the two). The
        # peak is where backward starts, all activations alive and the last block's
        # gradient being made (measured on 2 gloo ranks).
        held = outside * pb
        compute = 2 * largest * pb
        grad_peak, in_backward = placed, largest_t * rb + outside_t * rb
        notes.append(f"ZeRO-3: full weights of at most 2 blocks alive ({largest:,d} elements per block)")
    elif in_loss:  # every parameter gathered up front, its gradient reduce-scattered by the transpose
        held = S * pb
        grad_peak, in_backward = placed, S * pb + S_t * rb
    else:
        # The full parameters are held (gathered from the master shards where those are
        # sharded, ZeRO-1/2, in the master dtype, then cast). The gradients are reduced
        # bucket by bucket as backward makes them: all-reduced buckets are the full averaged
        # gradient (of which ZeRO-1 then keeps its slice); reduce-scattered ones (ZeRO-2)
        # are unreduced one bucket at a time beside the shards.
        # (Frozen leaves are stored for use as they are: counted with the master weights.)
        held = S_t * pb if (before or policy.param_dtype != policy.master_dtype) else 0
        if before and policy.param_dtype != policy.master_dtype:
            compute = S_t * mb
        bucket = min(S_t, bucket_elems) * rb  # the first bucket is made as backward begins
        if before:  # a bucket of master shards, gathered (n of them), copied out per leaf
            n = mesh.shape[mv.axis]
            gather = min(S_t, bucket_elems) * mb
            gather += gather // n
        in_backward = bucket + biggest_leaf * pb
        if any(mv.scatter):  # the last bucket beside the shards reduced out of it
            grad_peak = placed + bucket
        else:  # the averaged buckets, and with ZeRO-1 this rank's slice taken out of them
            grad_peak = S_t * rb + (sum(master_n) * rb if any(mv.slice) else 0)
        bucket_in_flight = bucket + (bucket // mesh.shape[mv.axis] if any(mv.scatter) else 0)
    off_ = getattr(pl, "offload", None)
    if off_ is not None and off_.active and off_.zenflow is None:
        # The update runs on the host: the reduced gradients are copied there as backward
        # goes on (ZeRO 1-2: bucket by bucket, the device holding the buckets in flight and
        # a reduce-scattered one's shard beside it until copied; ZeRO-3: each leaf's once
        # its reduce-scatter is done).
        host_grads, placed = grad_peak, 0
        grad_peak = 0 if in_loss else bucket_in_flight  # (the update reads them there: no staging of its own)
        notes.append(f"gradients copied to the host in backward as they are reduced: {host_grads / 2**20:,.2f} MiB "
                     f"there")
    meta = optree.tree_unflatten(tdef, [
        torch.empty(shard_shape(m, s, mesh), dtype=policy.master_dtype, device="meta")
        for s, m in zip(shapes, master)
    ])
    # The optimizer holds state for the trained leaves (that this device stores) only.
    meta = T.view(meta, [t and h for t, h in zip(mask or stored, stored)])
    opt_bytes = sum(x.numel() * x.element_size() for x in optree.tree_leaves(optimizer.init(meta))
                    if isinstance(x, torch.Tensor))
    if measure is not None:
        loss, batch, batch_spec, remat = measure
        activations, with_grads, ran_on, _ = _measure_activations(loss, params, pl, mesh, policy, batch,
                                                               batch_spec, remat)
        if remat is not None:
            notes.append(f"activations measured with the blocks remat {remat} recomputes")
        if not in_loss and backend_for(mesh, None) == "virtual":
            # The virtual mesh reduces after backward (no buckets inside it, where torch.func
            # runs no hooks): the gradients pile up as the activations are freed, so the
            # peak in backward is that of the two together, as the dry run measured it.
            in_backward = with_grads - activations
            notes.append("virtual mesh: gradients reduced after backward (the peak of activations "
                         "and gradients together, measured)")
        notes.append(f"activations measured on one device's forward + backward, run on {ran_on}")
    offloaded = staging = 0
    off = getattr(pl, "offload", None)
    if off is not None and off.active:  # the moments live in their tier; the update streams them
        offloaded = sum(x.numel() * x.element_size() for x in optree.tree_leaves(optimizer.init(meta))
                        if isinstance(x, torch.Tensor) and x.dim() > 0)
        opt_bytes -= offloaded
        total = max(sum(master_n), 1)
        width = min(off.bucket_elems, total)
        sets = min(off.buffer_count, -(-total // width))
        # Per set: parameters, gradients (none where they were streamed to the host), and
        # the NVMe tier's two moments.
        staging = sets * width * mb * (1 + (0 if host_grads else 1) + (2 if off.optimizer == "nvme" else 0))
        notes.append(f"optimizer moments offloaded ({off.describe()}): {offloaded / 2**20:,.2f} MiB off the device; "
                     f"the update's host staging buffers {staging / 2**20:,.2f} MiB")
        if off.zenflow is not None:  # the hot rows' moments on the device; host copies for the thread
            shards = [x for x in optree.tree_leaves(meta) if isinstance(x, torch.Tensor)]
            rows = [x.shape[0] if x.dim() >= 2 else 1 for x in shards]
            hot = sum(off.zenflow.rows(r) * (x.numel() // max(r, 1)) for x, r in zip(shards, rows))
            hot_bytes = hot * mb * (1 if optimizer.fused.kind == "lion" else 2)
            opt_bytes += hot_bytes
            staging += 3 * sum(x.numel() for x in shards) * mb
            notes.append(f"zenflow: the hot rows' moments on the device {hot_bytes / 2**20:,.2f} MiB; host copies "
                         f"of the parameters and gradients (the update in flight, the next interval's sums)")
    off_params = 0
    if off is not None and off.params is not None and policy.master_dtype == torch.float32:
        off_params = sum(T.pick(master_n, mask)) * mb  # the trained (fp32) master shards
        if off.params == "nvme":
            staging += sets * width * mb
        when = "each block's shards read back just before its gather" if in_loss else \
            "the shards read back at the step's start, before its gather"
        notes.append(f"master parameters offloaded: {off_params / 2**20:,.2f} MiB off the device ({when})")
    return MemoryEstimate(
        master=sum(master_n) * mb + frozen_bytes - off_params, offloaded_params=off_params,
        params_tier=off.params if off is not None else None, compute_params=compute, grads=grad_peak, optimizer=opt_bytes,
        offloaded=offloaded, staging=staging + host_grads, tier=off.optimizer if off is not None else None,
        activations=activations, buffers=buffers, placed_grads=placed, notes=tuple(notes),
        params=held, update_copy=sum(master_n) * mb + opt_bytes, backward_grads=in_backward,
        gather_transient=gather,
    )


@contextlib.contextmanager
def _as_device_0(mesh: Mesh, coords: dict) -> Iterator[Any]:
    """The mesh's axes bound as device 0 alone binds them (``fsharded.spmd._schedule.run_shard``):
    collectives answer locally, with this device's shapes (an all-to-all's buffer, a
    psum's result), and send nothing; yields the varying-axes table (None on a mesh of one
    device)."""
    frame = _env.AxisFrame(mesh, "distributed", coords=coords)
    with _manifest.recording(dry=True):
        if mesh.size == 1:
            with _env.enter(frame):
                yield None
            return
        mode = _vma.VmaMode(mesh.axis_names, _prims.implicit_pvary(frame))
        with _env.enter(dataclasses.replace(frame, vma=mode)), mode:
            yield mode


def _block_index(params: Any, paths: list[str], blocks: str | None) -> list[int | None]:
    """For each leaf, the index of its block in the list at ``blocks``, or None."""
    if blocks is None:
        return [None] * len(paths)
    try:
        node = _tree.get_path(params, blocks)
    except KeyError:
        if blocks == "blocks":  # the default: a tree without the bundled GPT's list
            return [None] * len(paths)
        raise ValueError(f"estimate_memory(blocks={blocks!r}): no such path in the parameters") from None
    if not isinstance(node, (list, tuple)):
        raise ValueError(f"estimate_memory(blocks={blocks!r}): a {type(node).__name__}, not a list of blocks")
    pre = blocks + "."
    return [int(p[len(pre):].split(".")[0]) if p.startswith(pre) else None for p in paths]


def _measure_activations(loss: Any, params: Any, pl: Any, mesh: Mesh, policy: Any, batch: Any,
                         batch_spec: Any, remat: Any = None) -> tuple[int, int, str, int]:
    """Peak bytes of one device's forward + backward other than parameters and their
    gradients, the peak with their gradients, what they were measured on, and the bytes
    the forward leaves for backward (held from its end until backward): stand-ins
    for device 0's shards, tried in
    turn (``fsharded.spmd._schedule``): meta tensors, fake tensors, and for a loss that
    reads values on the host, copies of the shards' values on CPU (one real forward and
    backward of compute)."""
    mv = Moves.of(pl)
    use = mv.use
    leaves, tdef = optree.tree_flatten(params)
    coords = mesh.coords(0)
    # Device 0's shards: views of the global values (the stand-ins copy only what they need).
    p_views = [
        local_slice(x, u, mesh, coords) if isinstance(x, torch.Tensor)
        else torch.empty(shard_shape(u, tuple(x.shape), mesh), dtype=policy.compute_dtype, device="meta")
        for x, u in zip(leaves, use)
    ]
    if batch_spec is None:
        batch_spec = PartitionSpec("data") if "data" in mesh.shape else PartitionSpec()
    b_leaves, b_def = optree.tree_flatten(batch)
    b_specs = _tree.broadcast_prefix(batch_spec, batch, what="batch_spec")
    b_views = optree.tree_unflatten(b_def, [
        local_slice(x, s, mesh, coords) if isinstance(x, torch.Tensor) else x
        for x, s in zip(b_leaves, b_specs)
    ])
    handler = None
    # ZeRO-3 on the virtual mesh re-gathers through a remat of each block (activations of a
    # block are recomputed); on real ranks saved-tensor hooks re-gather only the weights.
    virtual = backend_for(mesh, None) == "virtual"
    if any(mv.gather_in_loss) and virtual:
        def handler(block, p, x, *args, **kw):
            ps, pdef = optree.tree_flatten(p)
            run = lambda x, *ps: block(optree.tree_unflatten(pdef, list(ps)), x, *args, **kw)  # noqa: E731
            return checkpoint(run)(x, *ps)
    if remat is not None:  # the policy's blocks, not recomputed twice
        handler = remat.handler(handler, done=(lambda p: True) if handler is not None else None)

    def attempt(kind: _schedule.Kind) -> tuple[int, int]:
        with _schedule.stand_ins(kind) as convert, _as_device_0(mesh, coords) as mode:
            local = [convert(v).to(policy.compute_dtype).requires_grad_() for v in p_views]
            local_batch = convert(b_views)
            if mode is not None:  # the inputs' varying axes, as train_step's in_specs give them
                for t, u in zip(local, use):
                    mode.set(t, frozenset(u.axes))
                for t, s in zip(optree.tree_leaves(local_batch), b_specs):
                    if isinstance(t, torch.Tensor):
                        mode.set(t, frozenset(s.axes))
            with memory.track(include_meta=True) as mem:
                mem.backward_category = "activations"
                mem.register(local, "parameters")
                with handling(handler):
                    out = loss(optree.tree_unflatten(tdef, local), local_batch)
                held = mem.live_bytes().get("activations", 0)  # what waits for backward
                if isinstance(out, tuple):  # (loss, metrics[, stats]), as train_step takes it
                    out = out[0]
                grads = torch.autograd.grad(out, local, allow_unused=True)
                mem.reclassify([g for g in grads if g is not None], "gradients")
            return mem.peak_of(("activations",)), mem.peak_of(("activations", "gradients")), held

    try:
        kind, (peak, with_grads, held) = _schedule.first_run(attempt, what="estimate_memory", fix=_FIX)
    except _schedule.DryRunError:
        raise
    except Exception as e:
        raise RuntimeError(
            f"estimate_memory: could not run the loss on one device's shards "
            f"({type(e).__name__}: {e}); pass activation_bytes= instead"
        ) from e
    return peak, with_grads, kind.name, held


def placement_of(specs: Any, params: Any, mesh: Mesh) -> Placement:
    """The ``Placement`` of ``specs`` (a spec tree or prefix, a ZeRO plan, or a placement)."""
    if isinstance(specs, ZeroPlan):
        return specs.resolve(mesh)
    if isinstance(specs, Placement):
        return specs
    return Placement.replicated(optree.tree_unflatten(optree.tree_structure(params),
                                                      _tree.broadcast_prefix(specs, params)))


def pipeline_activations(pipe: Pipelined, params: Any, pl: Any, mesh: Mesh, policy: Any, batch: Any,
                         batch_spec: Any, remat: Any = None) -> list[int]:
    """Per rank along the pipe axis, the activation bytes it holds at its peak: of the
    table's bound of micro-batches held at once (``check(...).peak_activations``), one at
    the peak of its backward and the others holding what their forward left for backward,
    the most of any of the rank's stages, and the gradient arriving from the next stage
    (each stage measured alone, on meta tensors, from its input as received to its
    backward; with ``remat``, the step's remat policy, its
    blocks recomputed as the step's stage forward recomputes them: only their inputs wait)."""
    if pipe.axis not in mesh.shape:
        raise ValueError(f"estimate_memory: the loss is pipelined over {pipe.axis!r}, which {mesh!r} does not have")
    sched = pipe.table(mesh.shape[pipe.axis])
    bound = check(sched).peak_activations
    st = pipe.stages

    def stage_loss(s: int, p: Any, shard: Any) -> torch.Tensor:
        micro = split_batch(shard, sched.microbatches)[0]
        x = None
        if s > 0:
            with _memory_hooks.paused(), torch.no_grad():  # the stages before: not this one's
                for t in range(s):
                    x = st.forward(t, st.params_of(p, t), x, micro)
                    x = x[0] if isinstance(x, tuple) else x  # (its own loss terms and metrics aside)
            x = x.clone().requires_grad_()  # as received: a buffer of this stage's
        if remat is None:
            y = st.forward(s, st.params_of(p, s), x, micro)
        else:  # as the step's stage forward: the policy's handler around it, over the one there
            inner = current_handler()
            with handling(remat.handler(inner, done=(lambda _p: True) if inner is not None else None)):
                y = st.forward(s, st.params_of(p, s), x, micro)
        if isinstance(y, tuple):  # (activation or loss, the stage's own loss terms, metrics)
            y, extra, _ = y
            if extra is not None:
                return y.float().sum() + extra.float()
        if s < st.n - 1:  # its gradient arrives from the next stage: a buffer of its size
            arriving[s] = y.numel() * y.element_size()
        return y.float() if s == st.n - 1 else y.float().sum()

    arriving = [0] * st.n

    one = [_measure_activations(functools.partial(stage_loss, s), params, pl, mesh, policy, batch, batch_spec)
           for s in range(st.n)]
    out = []
    for r in range(sched.ranks):
        mine = [one[s] for s in range(st.n) if sched.rank_of(s) == r]
        # One micro-batch in its backward (its peak) and the others in flight waiting for
        # theirs, each holding what its forward left (with remat, its blocks' inputs).
        grad_in = max(arriving[s] for s in range(st.n) if sched.rank_of(s) == r)
        # (and the transport's header buffer: the first value of a kind comes with one)
        out.append((bound[r] - 1) * max(m[3] for m in mine) + max(m[0] for m in mine) + grad_in + HEADER_BYTES)
    return out


def _pipeline_activations(pipe: Pipelined, params: Any, pl: Any, mesh: Mesh, policy: Any, batch: Any,
                          batch_spec: Any, remat: Any = None) -> tuple[int, list[str]]:
    per_rank = pipeline_activations(pipe, params, pl, mesh, policy, batch, batch_spec, remat)
    worst = max(range(len(per_rank)), key=per_rank.__getitem__)
    return per_rank[worst], [
        f"pipelined over {pipe.axis!r}: activations per rank {[f'{b / 2**20:,.2f} MiB' for b in per_rank]} "
        f"(the schedule's bound of micro-batches held x one micro-batch of the rank's stages); the largest, "
        f"rank {worst}'s, counted"]


_FIX = (_schedule.FIX + " Or pass activation_bytes= to estimate_memory: measure them with "
        "fs.memory.track() around one real step (tracker.peak_of(('activations',))).")


# -- does it fit? ---------------------------------------------------------------------------


class InsufficientMemoryError(MemoryError):
    """A training layout estimated not to fit the memory available, refused before it is
    allocated (``check_memory=False`` / ``fsharded train --force`` tries anyway)."""


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory(device: str = "cpu") -> tuple[int, str]:
    """(bytes this process can still allocate on ``device`` ("cpu" or "cuda"), where the
    number comes from). CPU: ``MemAvailable`` of /proc/meminfo, lowered to what this
    cgroup's memory limit leaves; elsewhere (no procfs) ``os.sysconf`` of the physical
    pages, or no limit."""
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return int(free), "free device memory (torch.cuda.mem_get_info)"
    avail, source = None, ""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail, source = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
                    break
    except OSError:
        pass
    if avail is None:
        try:
            import os

            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            source = "available physical pages (sysconf)"
        except (ValueError, OSError, AttributeError):
            return 1 << 62, "unknown (not checked)"
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, used = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and used is not None and limit - used < avail:
            avail, source = max(limit - used, 0), f"this cgroup's memory limit ({limit_path})"
    return avail, source


def check_fits(need: int, *, who: str, what: str, device: str = "cpu", processes: int = 1,
               hints: tuple[str, ...] = (), lead: str = "Would fit") -> None:
    """Raise ``InsufficientMemoryError`` when ``processes`` x ``need`` bytes exceed the
    memory available on ``device``, with the numbers and what would fit."""
    avail, source = available_memory(device)
    total = need * processes
    if total <= avail:
        return
    gib = lambda b: f"{b / 2**30:,.2f} GiB"  # noqa: E731
    each = f" ({processes} processes of {gib(need)} on this host)" if processes > 1 else ""
    raise InsufficientMemoryError(
        f"{who}: {what} needs about {gib(total)}{each}, but {gib(avail)} is available "
        f"({source}). " + (f"{lead}: {'; '.join(hints)}. " if hints else "")
        + "Or try anyway (train_step(check_memory=False), fsharded train --force).")
