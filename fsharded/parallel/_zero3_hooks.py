"""ZeRO-3 on real ranks without recomputation: gather a block's weights for its forward,
free them after it, and gather them again when backward needs them.

The weights an op saves for backward (a matmul saves its weight) are packed by a
``saved_tensors_hooks`` pair into a note of which weight and which view; unpacking gathers
that weight again. Activations are saved as usual, so backward does not re-run the block's
forward (what the remat path on the virtual mesh does, where saved-tensor hooks do not
work under ``torch.func``). The gradient of the gathered weights comes back
reduce-scattered to the shards. Plain autograd only (real ranks, one process per device).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import torch

from fsharded.mesh._mesh import Mesh
from fsharded.parallel import _buckets as B

__all__ = ["run_block", "overlapped_backward"]

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
        for work, _keep in pending:
            work.wait()


def track_pending(gather: Any) -> None:
    """Have ``overlapped_backward`` wait for an asynchronous gather issued in backward (a
    prefetch that no block took is still completed before the step goes on)."""
    pending = _PENDING.get()
    if pending is not None and gather.work is not None:
        pending.append((gather.work, gather.out))


def _reduce_scatter_async(rows: torch.Tensor, axis: str, mesh: Mesh, pending: list) -> torch.Tensor:
    from fsharded import comm
    from fsharded.comm import _shm

    g = comm.axis_group(mesh, (axis,))
    flat = rows.contiguous().reshape(-1)
    out = flat.new_empty(rows.shape[1])
    pending.append((_shm.reduce_scatter_into(out, flat, g, async_op=True), flat))
    return out


class _Gathered(torch.autograd.Function):
    """Shards -> full weights (from a prefetch, or gathered here); backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, info, pending, cache, *shards):
        m_specs, u_specs, axis, mesh, cap = info
        ctx.info, ctx.cache = info, cache
        if pending is not None:
            fulls = pending.wait()
        else:
            fulls = B.gather_leaves([s.detach() for s in shards], m_specs, u_specs, axis, mesh, cap)
        # Independent tensors (not views of one gather buffer, nor of the inputs), so the
        # block may use them like any parameter.
        return tuple(f if (f._base is None and f is not s) else f.clone() for f, s in zip(fulls, shards))

    @staticmethod
    def backward(ctx, *grads):
        from fsharded.spmd.collectives import psum_scatter

        m_specs, u_specs, axis, mesh, cap = ctx.info
        if ctx.cache is not None:  # the block's backward is over: drop its re-gathered weights
            ctx.cache.clear()
        n = mesh.shape[axis]
        out: list = list(grads)
        dims = {}
        for i, (g, m, u) in enumerate(zip(grads, m_specs, u_specs)):
            if g is not None and axis in m.axes and axis not in u.axes:
                dims[i] = B.split_dim(m, u, axis)
        if dims:
            # The gather's transpose for the whole block in one reduce-scatter: each
            # gradient's row j is the block of its dim owned by shard j.
            idx = list(dims)
            rows = torch.cat([grads[i].movedim(dims[i], 0).reshape(n, -1) for i in idx], dim=1)
            pending = _PENDING.get()
            if pending is not None:
                # Issued without waiting: the rest of backward runs while it travels. The
                # gradients handed to autograd are views of the output buffer, which nothing
                # reads before the step waits on every pending reduce-scatter.
                mine = _reduce_scatter_async(rows, axis, mesh, pending)
            else:
                mine = psum_scatter(rows, axis, dim=0, tiled=False)
            for i, piece in zip(idx, mine.split([grads[i].numel() // n for i in idx])):
                moved = list(grads[i].movedim(dims[i], 0).shape)
                moved[0] //= n
                out[i] = piece.reshape(moved).movedim(0, dims[i])
        return (None, None, None, *out)


def run_block(block, p_tree_def, shards: list, x: torch.Tensor, m_specs: list, u_specs: list,
              axis: str, mesh: Mesh, cap: int, pending: Any, *, regather: bool = True,
              fetch: Any = None, **kw: Any) -> torch.Tensor:
    """Forward of one block on gathered weights whose saved copies are dropped and gathered
    again in backward (``regather``: by ``fetch()``, a prefetching gatherer, or here), or
    kept by autograd until backward."""
    import optree

    cache: dict[int, torch.Tensor] = {}
    fulls = _Gathered.apply((m_specs, u_specs, axis, mesh, cap), pending, cache, *shards)
    if not regather:
        return block(optree.tree_unflatten(p_tree_def, list(fulls)), x, **kw)
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
                    B.gather_leaves(shard_refs, m_specs, u_specs, axis, mesh, cap)
            cache.update({j: f.contiguous() for j, f in enumerate(full)})
        return cache[i].as_strided(shape, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return block(optree.tree_unflatten(p_tree_def, list(fulls)), x, **kw)
