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

from typing import Any

import torch

from fsharded.mesh._mesh import Mesh
from fsharded.parallel import _buckets as B

__all__ = ["run_block"]


class _Gathered(torch.autograd.Function):
    """Shards -> full weights (from a prefetch, or gathered here); backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, info, pending, *shards):
        m_specs, u_specs, axis, mesh, cap = info
        ctx.info = info
        if pending is not None:
            fulls = pending.wait()
        else:
            fulls = B.gather_leaves([s.detach() for s in shards], m_specs, u_specs, axis, mesh, cap)
        # Independent tensors (not views of one gather buffer, nor of the inputs), so the
        # block may use them like any parameter.
        return tuple(f if (f._base is None and f is not s) else f.clone() for f, s in zip(fulls, shards))

    @staticmethod
    def backward(ctx, *grads):
        from fsharded.collectives import psum_scatter

        m_specs, u_specs, axis, mesh, cap = ctx.info
        out = []
        for g, m, u in zip(grads, m_specs, u_specs):
            d = B.split_dim(m, u, axis) if axis in m.axes and axis not in u.axes else None
            if g is None:
                out.append(None)
            elif d is None:  # a leaf that was not sharded: its gradient is already whole
                out.append(g)
            else:  # the gather's transpose: summed over the axis, our block kept
                out.append(psum_scatter(g.contiguous(), axis, dim=d))
        return (None, None, *out)


def run_block(block, p_tree_def, shards: list, x: torch.Tensor, m_specs: list, u_specs: list,
              axis: str, mesh: Mesh, cap: int, pending: Any, **kw: Any) -> torch.Tensor:
    """Forward of one block on gathered weights whose saved copies are dropped and gathered
    again in backward."""
    import optree

    fulls = _Gathered.apply((m_specs, u_specs, axis, mesh, cap), pending, *shards)
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
        with torch.no_grad():
            (full,) = B.gather_leaves([shard_refs[i]], [m_specs[i]], [u_specs[i]], axis, mesh, cap)
        return full.contiguous().as_strided(shape, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return block(optree.tree_unflatten(p_tree_def, list(fulls)), x, **kw)
