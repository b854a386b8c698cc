"""Differentiable collectives over mesh axes, for use inside ``shard_map``.

Each collective is one unit (a ``_Prim``) holding, side by side: its virtual-mesh rule
(what it does at the vmap level of its axis), its torch.distributed implementation, its
transpose (the VJP rule) and its shape/bytes rule. One ``torch.autograd.Function``
dispatches all of them, so every collective works under ``torch.func.grad``, ``vjp``,
``vmap`` and plain ``.backward()``.

Transposes (JAX's, with Megatron's f/g pair):

===============  ============================  ============================
collective       forward                       transpose
===============  ============================  ============================
psum             sum over the axis             identity (cotangent replicated)
pvary            identity                      psum
pmean            psum / n                      identity / n
pmax             max over the axis             cotangent to the arg-max shards
all_gather       concatenate shards            psum_scatter
psum_scatter     sum, keep own chunk           all_gather
all_to_all       chunk i to shard i            all_to_all with dims swapped
ppermute         send to perm[src]             ppermute with inverse perm
===============  ============================  ============================

Over an axis of size 1 each collective is the identity, so per-shard code runs unsharded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from fsharded import _env, _manifest
from fsharded._env import Axes

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pvary",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "axis_index",
    "axis_size",
    "is_bound",
]

def _tracing() -> bool:
    """Under make_fx / fake tensors the functional (traceable) collectives are used;
    in eager mode the c10d calls, which skip a dispatcher round trip and a copy."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    return is_in_torch_dispatch_mode() or torch.compiler.is_compiling()


def _c10d_all_reduce(x: torch.Tensor, op: str, g: Any) -> torch.Tensor:
    if _tracing():
        fc = torch.ops._c10d_functional
        return fc.wait_tensor(fc.all_reduce(x.contiguous(), op, g.group_name))
    from fsharded import _shm

    y = x.clone(memory_format=torch.contiguous_format)
    _shm.all_reduce_(y, op, g)
    return y


def _c10d_all_gather(x: torch.Tensor, g: Any) -> torch.Tensor:
    """(s, ...) -> (n * s, ...) in group-rank order."""
    if _tracing():
        fc = torch.ops._c10d_functional
        return fc.wait_tensor(fc.all_gather_into_tensor(x.contiguous(), g.size, g.group_name))
    from fsharded import _shm

    out = x.new_empty((g.size * x.shape[0], *x.shape[1:]))
    _shm.all_gather_into(out, x.contiguous(), g)
    return out


def _c10d_reduce_scatter(x: torch.Tensor, g: Any) -> torch.Tensor:
    """(n * c, ...) -> (c, ...), summed, chunk = group rank."""
    if _tracing():
        fc = torch.ops._c10d_functional
        return fc.wait_tensor(fc.reduce_scatter_tensor(x.contiguous(), "sum", g.size, g.group_name))
    from fsharded import _shm

    out = x.new_empty((x.shape[0] // g.size, *x.shape[1:]))
    _shm.reduce_scatter_into(out, x.contiguous(), g)
    return out


def _c10d_all_to_all(x: torch.Tensor, g: Any) -> torch.Tensor:
    """(n * c, ...) -> (n * c, ...): chunk i goes to group rank i."""
    if _tracing():
        fc = torch.ops._c10d_functional
        splits = [x.shape[0] // g.size] * g.size
        return fc.wait_tensor(fc.all_to_all_single(x.contiguous(), splits, splits, g.group_name))
    from fsharded import _shm

    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _shm.all_to_all_into(out, x.contiguous(), g)
    return out


def _dim(d: int, rank: int, op: str) -> int:
    if not -rank <= d < max(rank, 1):
        raise ValueError(f"{op}: dim {d} is out of range for a tensor of rank {rank}")
    return d % max(rank, 1)


def _expand0(x: torch.Tensor, bdim: int | None, n: int) -> torch.Tensor:
    """Physical view with the axis dim first; an unbatched (replicated) value is broadcast."""
    if bdim is None:
        return x.unsqueeze(0).expand(n, *x.shape)
    return x.movedim(bdim, 0)


# --------------------------------------------------------------------------------------
# Primitives. ``virtual(x, bdim, n, p)`` runs at the vmap level of the collective's axis:
# ``x`` is physical with the axis at ``bdim`` (None: the value does not vary along the
# axis), and returns ``(y, out_bdim)``. ``dist(x, g, p)`` runs on this rank's local tensor.
# ``transpose(ctx, g)`` is the VJP; ``shift(p)`` renumbers dims when a batch dim is
# prepended; ``sent(shape, itemsize, n, p)`` is the bytes one rank sends (ring algorithms).
# --------------------------------------------------------------------------------------


class _Prim:
    name = ""

    def shift(self, p: tuple) -> tuple:
        return p

    def save(self, ctx: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        pass


class _Psum(_Prim):
    name = "psum"

    def virtual(self, x, bdim, n, p):
        return (x * n if bdim is None else x.sum(bdim)), None

    def dist(self, x, g, p):
        return _c10d_all_reduce(x, "sum", g)

    def transpose(self, ctx, g):
        return g

    def sent(self, shape, itemsize, n, p):
        return 2 * (n - 1) * math.prod(shape) * itemsize // n


class _Pmax(_Prim):
    name = "pmax"

    def virtual(self, x, bdim, n, p):
        return (x if bdim is None else x.amax(bdim)), None

    def dist(self, x, g, p):
        return _c10d_all_reduce(x, "max", g)

    def save(self, ctx, x, y):
        ctx.save_for_backward(x, y)

    def transpose(self, ctx, g):
        # Split the cotangent evenly between every shard holding the max (torch.amax's rule).
        x, y = ctx.saved_tensors
        hit = (x == y).to(g.dtype)
        return g * hit / _run(PSUM, (), ctx.axes, hit, record=False)

    def sent(self, shape, itemsize, n, p):
        return 2 * (n - 1) * math.prod(shape) * itemsize // n


class _Pvary(_Prim):
    name = "pvary"

    def virtual(self, x, bdim, n, p):
        return x.view_as(x), bdim

    def dist(self, x, g, p):
        return x.view_as(x)

    def transpose(self, ctx, g):
        return _run(PSUM, (), ctx.axes, g)

    def sent(self, shape, itemsize, n, p):
        return 0


class _AllGather(_Prim):
    name = "all_gather"  # params: (dim,), always tiled; stacking is unsqueeze + tiled

    def shift(self, p):
        return (p[0] + 1,)

    def virtual(self, x, bdim, n, p):
        (dim,) = p
        return _expand0(x, bdim, n).movedim(0, dim).flatten(dim, dim + 1), None

    def dist(self, x, g, p):
        (dim,) = p
        if dim == 0 and g.identity_order:
            return _c10d_all_gather(x, g)
        xs = x.movedim(dim, 0).contiguous()  # (s, rest...)
        out = _c10d_all_gather(xs, g)
        out = out.view(g.size, *xs.shape)  # (n, s, rest...) in group-rank order
        if not g.identity_order:
            out = out[list(g.to_group)]
        return out.movedim((0, 1), (dim, dim + 1)).flatten(dim, dim + 1)

    def transpose(self, ctx, g):
        return _run(PSUM_SCATTER, ctx.params, ctx.axes, g)

    def sent(self, shape, itemsize, n, p):
        return (n - 1) * math.prod(shape) * itemsize


class _PsumScatter(_Prim):
    name = "psum_scatter"  # params: (dim,), always tiled

    def shift(self, p):
        return (p[0] + 1,)

    def virtual(self, x, bdim, n, p):
        (dim,) = p
        s = x * n if bdim is None else x.sum(bdim)
        return s.unflatten(dim, (n, s.shape[dim] // n)).movedim(dim, 0), 0

    def dist(self, x, g, p):
        (dim,) = p
        if dim == 0 and g.identity_order:
            return _c10d_reduce_scatter(x, g)
        xs = x.movedim(dim, 0)
        xs = xs.unflatten(0, (g.size, xs.shape[0] // g.size))  # (n, c, rest...)
        if not g.identity_order:
            xs = xs[_inverse(g.to_group)]
        flat = xs.flatten(0, 1).contiguous()
        out = _c10d_reduce_scatter(flat, g)
        return out.movedim(0, dim)

    def transpose(self, ctx, g):
        return _run(ALL_GATHER, ctx.params, ctx.axes, g)

    def sent(self, shape, itemsize, n, p):
        return (n - 1) * math.prod(shape) * itemsize // n


def _inverse(order: Sequence[int]) -> list[int]:
    inv = [0] * len(order)
    for i, r in enumerate(order):
        inv[r] = i
    return inv


class _AllToAll(_Prim):
    name = "all_to_all"

    def shift(self, p):
        return (p[0] + 1, p[1] + 1)

    def virtual(self, x, bdim, n, p):
        split, concat = p
        X = _expand0(x, bdim, n)  # (n_src, ...)
        X = X.unflatten(split + 1, (n, X.shape[split + 1] // n))  # (n_src, .., n_dst, c, ..)
        X = X.movedim(split + 1, 0)  # (n_dst, n_src, ...)
        X = X.movedim(1, 1 + concat)  # (n_dst, .., n_src, d_concat, ..)
        return X.flatten(1 + concat, 2 + concat), 0

    def dist(self, x, g, p):
        split, concat = p
        if split == 0 and concat == 0 and g.identity_order:
            return _c10d_all_to_all(x, g)
        xs = x.movedim(split, 0)
        xs = xs.unflatten(0, (g.size, xs.shape[0] // g.size))  # (n_dst, c, ...)
        if not g.identity_order:
            xs = xs[_inverse(g.to_group)]
        chunk_shape = xs.shape[1:]
        flat = xs.reshape(-1, *chunk_shape[1:]).contiguous()
        out = _c10d_all_to_all(flat, g).view(g.size, *chunk_shape)  # (n_src in group order, c, ...)
        if not g.identity_order:
            out = out[list(g.to_group)]
        out = out.movedim(1, split + 1)  # (n_src, per-shard dims with split size c)
        out = out.movedim(0, concat)
        return out.flatten(concat, concat + 1)

    def transpose(self, ctx, g):
        split, concat = ctx.params
        return _run(ALL_TO_ALL, (concat, split), ctx.axes, g)

    def sent(self, shape, itemsize, n, p):
        return (n - 1) * math.prod(shape) * itemsize // n


class _Ppermute(_Prim):
    name = "ppermute"

    def virtual(self, x, bdim, n, p):
        (perm,) = p
        X = _expand0(x, bdim, n)
        src = [-1] * n
        for s, d in perm:
            src[d] = s
        idx = torch.tensor([max(s, 0) for s in src], device=X.device)
        Y = X.index_select(0, idx)
        if min(src) < 0:
            keep = torch.tensor([s >= 0 for s in src], device=X.device, dtype=X.dtype)
            Y = Y * keep.view(n, *([1] * (Y.dim() - 1)))
        return Y, 0

    def dist(self, x, g, p):
        import torch.distributed as dist

        (perm,) = p
        xs = x.contiguous()
        out = torch.zeros_like(xs)
        ops = []
        for s, d in perm:
            if s == g.index:
                ops.append(dist.P2POp(dist.isend, xs, g.ranks[d], group=g.group))
            if d == g.index:
                ops.append(dist.P2POp(dist.irecv, out, g.ranks[s], group=g.group))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return out

    def transpose(self, ctx, g):
        (perm,) = ctx.params
        return _run(PPERMUTE, (tuple((d, s) for s, d in perm),), ctx.axes, g)

    def sent(self, shape, itemsize, n, p):
        return math.prod(shape) * itemsize


class _Replica(_Prim):
    """Internal: the value of shard 0 along the axis (shard_map's replicated outputs)."""

    name = "replica"

    def virtual(self, x, bdim, n, p):
        return (x.view_as(x) if bdim is None else x.select(bdim, 0)), None

    def dist(self, x, g, p):
        return x.view_as(x)

    def transpose(self, ctx, g):
        return g

    def sent(self, shape, itemsize, n, p):
        return 0


class _AllGatherInvariant(_AllGather):
    """all_gather whose result is treated as replicated: its transpose keeps this shard's
    slice of a replicated cotangent. Used when differentiating through shard_map on the
    distributed backend (see ``_vma``); the virtual mesh gets this from vmap itself."""

    def transpose(self, ctx, g):
        (dim,) = ctx.params
        axes = ctx.axes
        i = int(axis_index(axes))
        size = g.shape[dim] // axes.size
        return g.narrow(dim, i * size, size)


PSUM, PMAX, PVARY, _REPLICA = _Psum(), _Pmax(), _Pvary(), _Replica()
ALL_GATHER_INVARIANT = _AllGatherInvariant()
ALL_GATHER, PSUM_SCATTER, ALL_TO_ALL, PPERMUTE = _AllGather(), _PsumScatter(), _AllToAll(), _Ppermute()


class _Collective(torch.autograd.Function):
    """One autograd Function for every primitive: forward = distributed base case,
    vmap = the virtual mesh (find the token's level), backward = the primitive's transpose."""

    @staticmethod
    def forward(prim, params, axes, x, token):
        if axes.virtual:
            raise RuntimeError(
                f"{prim.name}: the virtual-mesh axis {axes.label!r} was not bound by a vmap "
                f"level; call collectives only from inside the shard_map'ed function"
            )
        from fsharded import distributed
        from fsharded.memory import collective_scope

        with collective_scope():
            return prim.dist(x, distributed.axis_group(axes.frame.mesh, axes.names), params)

    @staticmethod
    def setup_context(ctx, inputs, output):
        prim, params, axes, x, token = inputs
        ctx.prim, ctx.params, ctx.axes = prim, params, axes
        prim.save(ctx, x, output)

    @staticmethod
    def backward(ctx, g):
        return None, None, None, ctx.prim.transpose(ctx, g), None

    @staticmethod
    def vmap(info, in_dims, prim, params, axes, x, token):
        xd, td = in_dims[3], in_dims[4]
        if td is None:
            # Not this collective's level: carry the batch dim along as a leading dim.
            x = x.movedim(xd, 0)
            return _Collective.apply(prim, prim.shift(params), axes, x, token), 0
        return prim.virtual(x, xd, axes.size, params)


def _run(prim: _Prim, params: tuple, axes: Axes, x: torch.Tensor, *, record: bool = True) -> torch.Tensor:
    if record:
        _manifest.record(prim, params, axes, x)
    if axes.size == 1:
        return x
    if not axes.virtual:
        from fsharded import _vma

        return _vma.apply_collective(prim, params, axes, x)
    return _virtual(prim, params, axes, x)


def _virtual(prim: _Prim, params: tuple, axes: Axes, x: torch.Tensor) -> torch.Tensor:
    tokens = axes.frame.tokens
    if len(axes.names) == 1:
        return _Collective.apply(prim, params, axes, x, tokens[axes.names[0]])
    # Several axes: compose single-axis collectives (major axis first where order matters).
    names = axes.names
    if prim is PSUM or prim is PMAX or prim is PVARY:
        for a in names:
            x = _Collective.apply(prim, params, axes.single(a), x, tokens[a])
        return x
    if prim is ALL_GATHER:
        for a in reversed(names):  # minor axis first, so chunks end up major-first
            x = _Collective.apply(prim, params, axes.single(a), x, tokens[a])
        return x
    if prim is PSUM_SCATTER:
        for a in names:
            x = _Collective.apply(prim, params, axes.single(a), x, tokens[a])
        return x
    if prim is ALL_TO_ALL:
        split, concat = params
        n = axes.sizes
        # Stack the chunks in a new leading dim, exchange it with each axis, unstack.
        xs = x.unflatten(split, (math.prod(n), x.shape[split] // math.prod(n))).movedim(split, 0)
        xs = xs.unflatten(0, n)  # (n_a, n_b, ..., chunk...)
        for i, a in enumerate(names):
            xs = _Collective.apply(prim, (i, i), axes.single(a), xs, tokens[a])
        xs = xs.flatten(0, len(n) - 1)  # (n_src major-first, chunk...)
        return xs.movedim(0, concat).flatten(concat, concat + 1)
    if prim is PPERMUTE:
        (perm,) = params
        stacked = _virtual(ALL_GATHER, (0,), axes, x.unsqueeze(0))  # (n, ...) every shard's value
        return _select_perm(stacked, perm, axis_index(axes.names), math.prod(axes.sizes))
    raise NotImplementedError(prim.name)


def _select_perm(stacked, perm, me, n):
    src = [-1] * n
    for s, d in perm:
        src[d] = s
    table = torch.tensor([max(s, 0) for s in src], device=stacked.device)
    keep = torch.tensor([float(s >= 0) for s in src], device=stacked.device, dtype=stacked.dtype)
    y = stacked.index_select(0, table.index_select(0, me.reshape(1))).squeeze(0)
    return y * keep.index_select(0, me.reshape(1)).reshape(())


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------

AxisName = str | Sequence[str]


def psum(x: torch.Tensor, axis: AxisName) -> torch.Tensor:
    """Sum over ``axis``; the result is replicated along it. Dual: ``pvary``.

    The transpose is the identity (the cotangent of a replicated value is replicated),
    Megatron's "g" operator.
    """
    return _run(PSUM, (), _env.bind(axis, "psum"), x)


def pmean(x: torch.Tensor, axis: AxisName) -> torch.Tensor:
    """Mean over ``axis``: ``psum(x, axis) / axis_size(axis)``."""
    axes = _env.bind(axis, "pmean")
    return _run(PSUM, (), axes, x) / axes.size


def pmean_owned(x: torch.Tensor, axis: AxisName) -> torch.Tensor:
    """``pmean`` of a buffer the caller owns and does not differentiate (a gradient bucket):
    on real ranks in eager mode it is reduced in place with the division folded in (no
    copy, no second pass); elsewhere (virtual mesh, tracing, autograd, the VMA checker)
    exactly ``pmean``. Same values either way."""
    from fsharded import _vma

    axes = _env.bind(axis, "pmean")
    if (axes.virtual or axes.size == 1 or not x.is_floating_point() or not x.is_contiguous()
            or (torch.is_grad_enabled() and x.requires_grad) or _vma.active() is not None
            or _tracing() or torch._C._are_functorch_transforms_active()):
        return _run(PSUM, (), axes, x) / axes.size
    from fsharded import _shm, distributed
    from fsharded.memory import collective_scope

    _manifest.record(PSUM, (), axes, x)
    with collective_scope():
        _shm.all_reduce_(x, "sum", distributed.axis_group(axes.frame.mesh, axes.names),
                         divisor=axes.size)
    return x


def pmax(x: torch.Tensor, axis: AxisName) -> torch.Tensor:
    """Elementwise max over ``axis``; the gradient goes to the shard(s) holding the max."""
    return _run(PMAX, (), _env.bind(axis, "pmax"), x)


def pvary(x: torch.Tensor, axis: AxisName) -> torch.Tensor:
    """Mark a value replicated along ``axis`` as varying from here on: identity forward,
    ``psum`` backward. Megatron's "f" operator; the dual of ``psum``."""
    return _run(PVARY, (), _env.bind(axis, "pvary"), x)


def all_gather(x: torch.Tensor, axis: AxisName, *, dim: int = 0, tiled: bool = True) -> torch.Tensor:
    """Gather every shard of ``x`` along ``axis``. Dual: ``psum_scatter``.

    ``tiled=True`` concatenates along ``dim`` (size ``n * x.shape[dim]``); ``tiled=False``
    stacks in a new dim at ``dim``. Shards are ordered by axis index, major axis first.
    """
    axes = _env.bind(axis, "all_gather")
    if not tiled:
        d = _dim(dim, x.dim() + 1, "all_gather")
        return _run(ALL_GATHER, (d,), axes, x.unsqueeze(d))
    return _run(ALL_GATHER, (_dim(dim, x.dim(), "all_gather"),), axes, x)


def psum_scatter(x: torch.Tensor, axis: AxisName, *, dim: int = 0, tiled: bool = True) -> torch.Tensor:
    """Sum over ``axis`` and keep this shard's chunk of ``dim``. Dual: ``all_gather``.

    ``tiled=True`` needs ``x.shape[dim]`` divisible by the axis size; ``tiled=False``
    needs it equal to the axis size and removes ``dim``.
    """
    axes = _env.bind(axis, "psum_scatter")
    d = _dim(dim, x.dim(), "psum_scatter")
    n = axes.size
    if tiled and x.shape[d] % n:
        raise ValueError(
            f"psum_scatter: dim {d} of size {x.shape[d]} is not divisible by the size {n} "
            f"of axis {axes.label!r}"
        )
    if not tiled and x.shape[d] != n:
        raise ValueError(
            f"psum_scatter(tiled=False): dim {d} has size {x.shape[d]}, it must equal the "
            f"size {n} of axis {axes.label!r}"
        )
    y = _run(PSUM_SCATTER, (d,), axes, x)
    return y if tiled else y.squeeze(d)


def all_to_all(x: torch.Tensor, axis: AxisName, *, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Split ``split_dim`` into ``n`` chunks, send chunk ``i`` to shard ``i``, and
    concatenate the received chunks along ``concat_dim``. Dual: itself, dims swapped."""
    axes = _env.bind(axis, "all_to_all")
    s = _dim(split_dim, x.dim(), "all_to_all")
    c = _dim(concat_dim, x.dim(), "all_to_all")
    if x.shape[s] % axes.size:
        raise ValueError(
            f"all_to_all: split_dim {s} of size {x.shape[s]} is not divisible by the size "
            f"{axes.size} of axis {axes.label!r}"
        )
    return _run(ALL_TO_ALL, (s, c), axes, x)


def ppermute(x: torch.Tensor, axis: AxisName, perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Send this shard's ``x`` to shard ``dst`` for each ``(src, dst)`` in ``perm``;
    shards that receive nothing get zeros. Dual: ``ppermute`` with the inverse perm."""
    axes = _env.bind(axis, "ppermute")
    n = axes.size
    pairs = tuple((int(s), int(d)) for s, d in perm)
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    bad = [p for p in pairs if not (0 <= p[0] < n and 0 <= p[1] < n)]
    if bad or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(
            f"ppermute: perm {list(pairs)} must be (src, dst) pairs in [0, {n}) with each "
            f"src and each dst at most once (axis {axes.label!r} has size {n})"
        )
    return _run(PPERMUTE, (pairs,), axes, x)


def axis_index(axis: AxisName) -> torch.Tensor:
    """This shard's index along ``axis`` (major axis first for a tuple), an int64 scalar."""
    axes = axis if isinstance(axis, Axes) else _env.bind(axis, "axis_index")
    frame = axes.frame
    if frame.backend == "virtual":
        idx = None
        for a in axes.names:
            t = frame.tokens[a]
            idx = t if idx is None else idx * frame.mesh.shape[a] + t
        return idx
    i = 0
    for a in axes.names:
        i = i * frame.mesh.shape[a] + frame.coords[a]
    return torch.tensor(i, dtype=torch.int64)


def axis_size(axis: AxisName) -> int:
    """Number of shards along ``axis`` (product for a tuple)."""
    return _env.bind(axis, "axis_size").size




def is_bound(axis: AxisName) -> bool:
    """Whether every axis in ``axis`` is bound by an enclosing ``shard_map``.

    Model code uses it to skip collectives over axes the current mesh does not have, so
    the same per-shard function runs unsharded, data-parallel only, or tensor-parallel:

    >>> def tp_psum(x):
    ...     return psum(x, "tensor") if is_bound("tensor") else x
    """
    frame = _env.current()
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    return frame is not None and all(a in frame.mesh.shape for a in names)
