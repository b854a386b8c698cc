"""Analytic per-device memory of a training layout, in the spirit of DeepSpeed's
``estimate_zero3_model_states_mem_needs``, but read off the actual placement, optimizer
and precision (and including gathered weights and communication buckets).

>>> est = fs.estimate_memory(params, fs.parallel.zero(3)(P(), params), fs.optim.adamw(1e-3),
...                          precision="bf16", mesh=fs.Mesh({"data": 8}))
>>> print(est)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from fsharded import _tree
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec, shard_shape
from fsharded.spmd._transfer import backend_for

__all__ = ["MemoryEstimate", "estimate_memory"]


def _local_numel(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> int:
    return math.prod(shard_shape(spec, shape, mesh))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device by category (the largest device, which all are with even shards)."""

    master: int  # master weights (optimizer precision), in their placement
    compute_params: int  # low-precision copies / gathered full weights alive at once
    grads: int  # gradients at their largest (before the reduction shrinks them)
    optimizer: int  # optimizer state
    activations: int  # measured on a meta run of the loss, or as given
    buffers: int  # communication buckets
    placed_grads: int = 0  # gradients once reduced into their placement
    notes: tuple[str, ...] = field(default=())

    @property
    def model_states(self) -> int:
        """Master weights + reduced gradients + optimizer state: what stays per device
        through a step with donated (in-place) updates; ``fs.memory`` measures the same."""
        return self.master + self.placed_grads + self.optimizer

    @property
    def total(self) -> int:
        """Sum of every category at its own peak: an upper bound on the device's peak (the
        categories peak at different moments of the step)."""
        return self.master + self.compute_params + self.grads + self.optimizer + self.activations + self.buffers

    def __str__(self) -> str:
        rows = [("master weights", self.master), ("compute params", self.compute_params),
                ("gradients", self.grads), ("optimizer state", self.optimizer),
                ("activations", self.activations), ("comm buffers", self.buffers),
                ("total", self.total), ("model states", self.model_states)]
        w = max(len(r[0]) for r in rows)
        out = [f"{name.ljust(w)}  {b / 2**20:12,.2f} MiB" for name, b in rows]
        return "\n".join(out + [f"- {n}" for n in self.notes])


def estimate_memory(params: Any, specs: Any, optimizer: Any, *, precision: Any = "fp32",
                    mesh: Mesh, loss: Any = None, batch: Any = None, batch_spec: Any = None,
                    activation_bytes: int | None = None,
                    bucket_elems: int = 500_000_000) -> MemoryEstimate:
    """Per-device bytes of training ``params`` laid out by ``specs`` (a spec tree, a ZeRO
    plan or a ``Placement``) with ``optimizer`` under ``precision`` on ``mesh``.

    The optimizer's state size comes from running its ``init`` on meta tensors of the
    master shards, so any ``fsharded.optim`` transformation is counted exactly.

    Activations: give the per-shard ``loss(params, batch)`` and a global ``batch`` (split
    by ``batch_spec``, default ``P("data")`` when the mesh has ``data``, as in
    ``train_step``). One device's forward and backward then run on meta tensors (sizes, no
    data) of its parameter and batch shards, with collectives left unbound (as model code
    written with ``fsharded.collectives.is_bound`` allows), and the memory tracker reports
    the peak of everything they allocate except the parameter gradients: saved
    activations, temporaries and activation gradients. At ZeRO stage 3 each block runs
    under the same remat as in ``train_step``, so only block inputs are kept. Or pass
    ``activation_bytes`` yourself.
    """
    from fsharded.parallel.zero import Placement, ZeroPlan
    from fsharded.precision import as_policy

    policy = as_policy(precision)
    if isinstance(specs, ZeroPlan):
        pl = specs.resolve(mesh)
    elif isinstance(specs, Placement):
        pl = specs
    else:
        full = optree.tree_unflatten(optree.tree_structure(params), _tree.broadcast_prefix(specs, params))
        pl = Placement.replicated(full)
    paths, leaves, tdef = _tree.tree_flatten_with_paths(params)
    flat = lambda t: optree.tree_leaves(t, is_leaf=lambda x: isinstance(x, PartitionSpec))  # noqa: E731
    use, grads, master = flat(pl.use), flat(pl.grads), flat(pl.master)
    mb = _itemsize(policy.master_dtype)
    cb = _itemsize(policy.compute_dtype)
    rb = _itemsize(policy.reduce_dtype)
    shapes = [tuple(x.shape) for x in leaves]
    master_n = [_local_numel(s, m, mesh) for s, m in zip(shapes, master)]
    use_n = [_local_numel(s, u, mesh) for s, u in zip(shapes, use)]
    grad_n = [_local_numel(s, g, mesh) for s, g in zip(shapes, grads)]
    notes = []
    in_blocks = [p.startswith("blocks.") for p in paths]
    if pl.stage == 3 and any(in_blocks) and pl.reshard_after_forward:
        # Outside the blocks everything is gathered for the step; inside, one block's full
        # weights at a time (plus the next one's in backward, when it is re-gathered).
        per_block: dict[str, int] = {}
        for p, n, b in zip(paths, use_n, in_blocks):
            if b:
                key = ".".join(p.split(".")[:2])
                per_block[key] = per_block.get(key, 0) + n
        largest = max(per_block.values())
        outside = sum(n for n, b in zip(use_n, in_blocks) if not b)
        compute = (outside + 2 * largest) * cb
        grad_peak = sum(grad_n) * rb + (outside + largest) * rb
        notes.append(f"ZeRO-3: full weights of at most 2 blocks alive ({largest:,d} elements per block)")
    else:
        compute = sum(use_n) * cb if (pl.stage or policy.compute_dtype != policy.master_dtype) else 0
        grad_peak = sum(use_n) * rb  # autograd produces full-size gradients, then reduces
    meta = optree.tree_unflatten(tdef, [
        torch.empty(shard_shape(m, s, mesh), dtype=policy.master_dtype, device="meta")
        for s, m in zip(shapes, master)
    ])
    opt_bytes = sum(x.numel() * x.element_size() for x in optree.tree_leaves(optimizer.init(meta))
                    if isinstance(x, torch.Tensor))
    if activation_bytes is not None:
        activations = int(activation_bytes)
    elif loss is not None:
        if batch is None:
            raise ValueError("estimate_memory: loss= needs a batch= (a global batch, as train_step takes)")
        activations = _measure_activations(loss, params, pl, mesh, policy, batch, batch_spec)
        notes.append("activations measured on a meta run of one device's forward + backward")
    else:
        activations = 0
    buffers = 0
    if pl.stage or mesh.size > 1:
        buffers = min(sum(use_n), bucket_elems) * rb * 2
    return MemoryEstimate(
        master=sum(master_n) * mb, compute_params=compute, grads=grad_peak, optimizer=opt_bytes,
        activations=activations, buffers=buffers,
        placed_grads=sum(master_n) * mb,
        notes=tuple(notes),
    )


def _measure_activations(loss: Any, params: Any, pl: Any, mesh: Mesh, policy: Any, batch: Any,
                         batch_spec: Any) -> int:
    """Peak bytes of one device's forward + backward other than parameters and their
    gradients, on meta tensors."""
    from fsharded import memory
    from fsharded.parallel.blocks import handling
    from fsharded.parallel.remat import checkpoint

    use = optree.tree_leaves(pl.use, is_leaf=lambda x: isinstance(x, PartitionSpec))
    leaves, tdef = optree.tree_flatten(params)
    local = [
        torch.empty(shard_shape(u, x.shape, mesh), dtype=policy.compute_dtype,
                    device="meta", requires_grad=True)
        for x, u in zip(leaves, use)
    ]
    if batch_spec is None:
        batch_spec = PartitionSpec("data") if "data" in mesh.shape else PartitionSpec()
    b_leaves, b_def = optree.tree_flatten(batch)
    b_specs = _tree.broadcast_prefix(batch_spec, batch, what="batch_spec")
    local_batch = optree.tree_unflatten(b_def, [
        torch.empty(shard_shape(s, x.shape, mesh), dtype=x.dtype, device="meta")
        if isinstance(x, torch.Tensor) else x
        for x, s in zip(b_leaves, b_specs)
    ])
    handler = None
    # ZeRO-3 on the virtual mesh re-gathers through a remat of each block (activations of a
    # block are recomputed); on real ranks saved-tensor hooks re-gather only the weights.
    virtual = backend_for(mesh, None) == "virtual"
    if pl.stage == 3 and virtual:
        def handler(block, p, x, *args, **kw):
            ps, pdef = optree.tree_flatten(p)
            run = lambda x, *ps: block(optree.tree_unflatten(pdef, list(ps)), x, *args, **kw)  # noqa: E731
            return checkpoint(run)(x, *ps)
    p_local = optree.tree_unflatten(tdef, local)
    try:
        with memory.track(include_meta=True) as mem:
            mem.backward_category = "activations"
            mem.register(local, "parameters")
            with handling(handler):
                out = loss(p_local, local_batch)
            grads = torch.autograd.grad(out, local, allow_unused=True)
            mem.reclassify([g for g in grads if g is not None], "gradients")
    except Exception as e:
        raise RuntimeError(
            f"estimate_memory: could not run the loss on meta tensors of one device's shards "
            f"({type(e).__name__}: {e}); pass activation_bytes= instead"
        ) from e
    return mem.peak_of(("activations",))
