"""Coalesced data movement between placements, inside shard_map.

Many small collectives become a few large ones over flat buffers (DeepSpeed's
``reduce_bucket_size`` / ``allgather_bucket_size``): each leaf is laid out as ``(n, -1)``
rows, row ``j`` being the piece that belongs to shard ``j`` along the axis, the rows of a
bucket's leaves are concatenated, and one collective moves the whole bucket.
"""

from __future__ import annotations

import math

import torch

from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec, _entry_axes
from fsharded.spmd.collectives import (
    all_gather,
    axis_index,
    is_bound,
    pmean,
    pmean_owned,
    psum_scatter,
)

__all__ = ["buckets", "split_dim", "gather_leaves", "reduce_leaves", "slice_leaves"]


def buckets(idx: list[int], sizes: list[int], cap: int) -> list[list[int]]:
    """Consecutive groups of leaves of at most ``cap`` elements (a larger leaf goes alone)."""
    out: list[list[int]] = []
    cur: list[int] = []
    n = 0
    for i, k in zip(idx, sizes):
        if cur and n + k > cap:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += k
    if cur:
        out.append(cur)
    return out


def split_dim(outer: PartitionSpec, inner: PartitionSpec, axis: str) -> int | None:
    """The dim on which ``outer`` shards ``axis`` beyond ``inner``, or None.

    Only ``axis`` as the minor (last) axis of that dim is supported: then, inside a shard
    of the other axes, the ``axis`` pieces are contiguous blocks of the dim.
    """
    for d, e in enumerate(outer):
        axes = _entry_axes(e)
        if axis in axes:
            if axes[-1] != axis or _entry_axes(inner[d] if d < len(inner) else None) != axes[:-1]:
                raise NotImplementedError(
                    f"moving {axis!r} between specs {inner!r} and {outer!r}: only {axis!r} "
                    f"as the minor axis of a dim is supported (what fsharded.parallel.zero makes)"
                )
            return d
    return None


def _rows(x: torch.Tensor, d: int, n: int) -> torch.Tensor:
    return x.movedim(d, 0).reshape(n, -1)  # row j: the block of dim d owned by shard j


def gather_leaves(leaves: list, from_specs: list, to_specs: list, axis: str, mesh: Mesh,
                  cap: int) -> list:
    """All-gather over ``axis`` every leaf that ``from_specs`` shards on it and ``to_specs``
    does not, in buckets of at most ``cap`` elements. Differentiable (transpose:
    reduce-scatter)."""
    out = list(leaves)
    n = mesh.shape[axis]
    todo = []
    for i, (fs_, ts) in enumerate(zip(from_specs, to_specs)):
        d = split_dim(fs_, ts, axis) if axis in fs_.axes and axis not in ts.axes else None
        if d is not None:
            todo.append((i, d))
    if not todo or n == 1 or not is_bound(axis):
        return out
    # One bucket holds leaves of one dtype and one set of sharded axes: concatenating
    # leaves that vary over different axes would make every piece vary over all of them.
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for i, d in todo:
        groups.setdefault((leaves[i].dtype, frozenset(from_specs[i].axes)), []).append((i, d))
    for items in groups.values():
        dims = dict(items)
        for b in buckets([i for i, _ in items], [leaves[i].numel() for i, _ in items], cap):
            flat = torch.cat([leaves[i].movedim(dims[i], 0).reshape(-1) for i in b])
            full = all_gather(flat, axis, tiled=False)  # (n, bucket)
            for i, piece in zip(b, full.split([leaves[i].numel() for i in b], dim=1)):
                x, d = leaves[i], dims[i]
                moved = x.movedim(d, 0).shape  # (s_d, rest...)
                y = piece.reshape(n, *moved).flatten(0, 1)  # (n * s_d, rest...)
                out[i] = y.movedim(0, d)
    return out


def reduce_leaves(grads: list, param_specs: list, grad_specs: list, batch_axes: tuple[str, ...],
                  mesh: Mesh, cap: int) -> list:
    """Average gradients over the batch axes into their placement.

    For each leaf and batch axis: the gradient is already summed over an axis its parameter
    is sharded on (the all-gather's transpose) -> divide; reduce-scattered over an axis the
    gradient placement adds (ZeRO-2); all-reduced over the rest. Buckets of ``cap``.
    """
    out = list(grads)
    allreduce: dict[tuple, list[int]] = {}
    scatter: dict[tuple, list[tuple[int, int]]] = {}
    for i, (g, ps, gs) in enumerate(zip(grads, param_specs, grad_specs)):
        live = [a for a in batch_axes if is_bound(a) and mesh.shape[a] > 1]
        summed = [a for a in live if a in ps.axes]
        if summed:
            out[i] = g / math.prod(mesh.shape[a] for a in summed)
        rest = tuple(a for a in live if a not in ps.axes)
        extra = [a for a in rest if a in gs.axes]
        if len(extra) > 1:
            raise NotImplementedError(f"reduce-scattering one gradient over several axes {extra}")
        if extra:
            a = extra[0]
            d = split_dim(gs, ps, a)
            scatter.setdefault((a, tuple(x for x in rest if x != a), g.dtype, frozenset(ps.axes)),
                               []).append((i, d))
        elif rest:  # buckets by dtype and by the axes the leaf varies over (see gather_leaves)
            allreduce.setdefault((rest, g.dtype, frozenset(ps.axes)), []).append(i)
    for (over, _, _), idx in allreduce.items():
        for b in buckets(idx, [grads[i].numel() for i in idx], cap):
            flat = pmean_owned(torch.cat([out[i].reshape(-1) for i in b]), over)
            for i, piece in zip(b, flat.split([grads[i].numel() for i in b])):
                out[i] = piece.view(grads[i].shape)
    for (a, others, _, _), items in scatter.items():
        n = mesh.shape[a]
        dims = dict(items)
        for b in buckets([i for i, _ in items], [grads[i].numel() for i, _ in items], cap):
            rows = torch.cat([_rows(out[i], dims[i], n) for i in b], dim=1)  # (n, bucket)
            mine = psum_scatter(rows, a, dim=0, tiled=False) / n  # (bucket,)
            if others:
                mine = pmean(mine, others)
            for i, piece in zip(b, mine.split([grads[i].numel() // n for i in b])):
                g, d = grads[i], dims[i]
                moved = list(g.movedim(d, 0).shape)
                moved[0] //= n
                out[i] = piece.reshape(moved).movedim(0, d)
    return out


def slice_leaves(leaves: list, from_specs: list, to_specs: list, axis: str, mesh: Mesh) -> list:
    """This shard's block of every leaf ``to_specs`` shards on ``axis`` and ``from_specs``
    does not (ZeRO-1: the full, all-reduced gradient -> the optimizer's shard)."""
    out = list(leaves)
    if not is_bound(axis) or mesh.shape[axis] == 1:
        return out
    n = mesh.shape[axis]
    me = axis_index(axis).reshape(1)
    for i, (x, fs_, ts) in enumerate(zip(leaves, from_specs, to_specs)):
        if axis in ts.axes and axis not in fs_.axes:
            d = split_dim(ts, fs_, axis)
            moved = list(x.movedim(d, 0).shape)
            moved[0] //= n
            out[i] = _rows(x, d, n).index_select(0, me).reshape(moved).movedim(0, d)
    return out
