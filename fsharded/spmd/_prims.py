"""The collective primitives: each one a unit, as in JAX's ``lax/parallel.py``.

A ``_Prim`` keeps side by side what the collective does at the vmap level of its axis on
the virtual mesh (``virtual``), how it composes over several axes (``virtual_multi``),
what it does on this rank's tensor on real ranks (``dist``), its transpose (the VJP),
its tangent rule (JVP), its varying-axes rule (``reduces``: whether the axes leave the
value's type) and the bytes one rank sends. ``run`` is the one place every collective
goes through: manifest, varying-axes typing (with the implicit ``pvary`` JAX inserts in
front of a collective over an axis its operand is invariant over), then dispatch.

Transposes (JAX's, with Megatron's f/g pair):

=====================  ===========================  =================================
collective             forward                      transpose
=====================  ===========================  =================================
psum                   sum over the axis            identity (cotangent invariant)
pvary                  identity                     psum
pmax                   max over the axis            cotangent to the arg-max shards
all_gather             concatenate shards           psum_scatter
all_gather_invariant   concatenate shards           this shard's slice
psum_scatter           sum, keep own chunk          all_gather
all_to_all             chunk i to shard i           all_to_all with dims swapped
ppermute               send to perm[src]            ppermute with the inverse perm
=====================  ===========================  =================================
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fsharded import _memory_hooks as memory
from fsharded import comm
from fsharded.spmd import _manifest
from fsharded.spmd._env import Axes

__all__ = ["run", "PSUM", "PMAX", "PVARY", "ALL_GATHER", "ALL_GATHER_INVARIANT",
           "PSUM_SCATTER", "ALL_TO_ALL", "PPERMUTE", "REPLICA", "Collective", "dist_call"]

_F = torch._C._functorch


def _expand0(x: torch.Tensor, bdim: int | None, n: int) -> torch.Tensor:
    """Physical view with the axis dim first; an unbatched (invariant) value is broadcast."""
    if bdim is None:
        return x.unsqueeze(0).expand(n, *x.shape)
    return x.movedim(bdim, 0)


# ``virtual(x, bdim, n, p)`` runs at the vmap level of the collective's axis: ``x`` is
# physical with the axis at ``bdim`` (None: the value does not vary along the axis) and
# returns ``(y, out_bdim)``. ``dist(x, g, p)`` runs on this rank's local tensor.
# ``transpose(ctx, g)`` is the VJP, ``tangent(ctx, t)`` the JVP; ``shift(p)`` renumbers
# dims when a batch dim is prepended; ``sent(shape, itemsize, n, p)`` is the bytes one
# rank sends (ring algorithms).


class _Prim:
    name = ""
    reduces = False  # the axes leave the result's varying axes (psum), or join them
    order = "major"  # several axes: compose one axis at a time, major first

    def shift(self, p: tuple) -> tuple:
        return p

    def save(self, ctx: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        pass

    def tangent(self, ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return _dispatch(self, ctx.params, ctx.axes, t)

    def virtual_multi(self, params: tuple, axes: Axes, x: torch.Tensor) -> torch.Tensor:
        names = axes.names if self.order == "major" else tuple(reversed(axes.names))
        for a in names:
            x = Collective.apply(self, params, axes.single(a), x, axes.frame.tokens[a])
        return x

    def __repr__(self) -> str:
        return self.name


class _Psum(_Prim):
    name, reduces = "psum", True

    def virtual(self, x, bdim, n, p):
        return (x * n if bdim is None else x.sum(bdim, dtype=x.dtype)), None

    def dist(self, x, g, p):
        return comm.all_reduce(x, "sum", g)

    def transpose(self, ctx, g):
        # A new value: the cotangent of the (varying) operand is not the invariant
        # cotangent object itself, which keeps its own type.
        return g.view_as(g)

    def sent(self, shape, itemsize, n, p):
        return 2 * (n - 1) * math.prod(shape) * itemsize // n


class _Pmax(_Prim):
    name, reduces = "pmax", True

    def virtual(self, x, bdim, n, p):
        return (x if bdim is None else x.amax(bdim)), None

    def dist(self, x, g, p):
        return comm.all_reduce(x, "max", g)

    def save(self, ctx, x, y):
        ctx.save_for_backward(x, y)
        ctx.save_for_forward(x, y)

    def _share(self, ctx):
        # The cotangent goes evenly to every shard holding the max (torch.amax's rule).
        x, y = ctx.saved_tensors
        hit = (x == y).to(y.dtype if y.is_floating_point() else torch.float32)
        return hit / _dispatch(PSUM, (), ctx.axes, hit, record=False)

    def transpose(self, ctx, g):
        return g * self._share(ctx).to(g.dtype)

    def tangent(self, ctx, t):
        return _dispatch(PSUM, (), ctx.axes, t * self._share(ctx).to(t.dtype))

    def sent(self, shape, itemsize, n, p):
        return 2 * (n - 1) * math.prod(shape) * itemsize // n


class _Pvary(_Prim):
    name = "pvary"

    def virtual(self, x, bdim, n, p):
        return x.view_as(x), bdim

    def dist(self, x, g, p):
        return x.view_as(x)

    def transpose(self, ctx, g):
        return _dispatch(PSUM, (), ctx.axes, g)

    def tangent(self, ctx, t):
        return t.view_as(t)

    def sent(self, shape, itemsize, n, p):
        return 0


class _AllGather(_Prim):
    name = "all_gather"  # params: (dim,), always tiled; stacking is unsqueeze + tiled
    order = "minor"  # so that chunks end up major-first

    def shift(self, p):
        return (p[0] + 1,)

    def virtual(self, x, bdim, n, p):
        (dim,) = p
        return _expand0(x, bdim, n).movedim(0, dim).flatten(dim, dim + 1), None

    def dist(self, x, g, p):
        return comm.all_gather_dim(x, g, p[0])

    def transpose(self, ctx, g):
        return _dispatch(PSUM_SCATTER, ctx.params, ctx.axes, g)

    def sent(self, shape, itemsize, n, p):
        return (n - 1) * math.prod(shape) * itemsize


class _AllGatherInvariant(_AllGather):
    """all_gather whose result is invariant over the axes: its transpose keeps this
    shard's slice of the (invariant) cotangent instead of reduce-scattering."""

    name, reduces = "all_gather_invariant", True

    def transpose(self, ctx, g):
        (dim,) = ctx.params
        i = int(axis_position(ctx.axes)) if not ctx.axes.virtual else None
        size = g.shape[dim] // ctx.axes.size
        if i is not None:
            return g.narrow(dim, i * size, size)
        idx = axis_position(ctx.axes) * size + torch.arange(size, device=g.device)
        return g.index_select(dim, idx)


class _PsumScatter(_Prim):
    name = "psum_scatter"  # params: (dim,), always tiled

    def shift(self, p):
        return (p[0] + 1,)

    def virtual(self, x, bdim, n, p):
        (dim,) = p
        s = x * n if bdim is None else x.sum(bdim, dtype=x.dtype)
        return s.unflatten(dim, (n, s.shape[dim] // n)).movedim(dim, 0), 0

    def dist(self, x, g, p):
        return comm.reduce_scatter_dim(x, g, p[0])

    def transpose(self, ctx, g):
        return _dispatch(ALL_GATHER, ctx.params, ctx.axes, g)

    def sent(self, shape, itemsize, n, p):
        return (n - 1) * math.prod(shape) * itemsize // n


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

    def virtual_multi(self, params, axes, x):
        # Stack the chunks in new leading dims, exchange each with its axis, unstack.
        split, concat = params
        n = axes.sizes
        xs = x.unflatten(split, (math.prod(n), x.shape[split] // math.prod(n))).movedim(split, 0)
        xs = xs.unflatten(0, n)  # (n_a, n_b, ..., chunk...)
        for i, a in enumerate(axes.names):
            xs = Collective.apply(self, (i, i), axes.single(a), xs, axes.frame.tokens[a])
        xs = xs.flatten(0, len(n) - 1)  # (n_src major-first, chunk...)
        return xs.movedim(0, concat).flatten(concat, concat + 1)

    def dist(self, x, g, p):
        return comm.all_to_all_dims(x, g, *p)

    def transpose(self, ctx, g):
        split, concat = ctx.params
        return _dispatch(ALL_TO_ALL, (concat, split), ctx.axes, g)

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

    def virtual_multi(self, params, axes, x):
        # Every shard's value stacked (an all_gather over the axes), then each shard
        # picks its source's.
        (perm,) = params
        n = axes.size
        stacked = ALL_GATHER.virtual_multi((0,), axes, x.unsqueeze(0))  # (n, ...)
        src = [-1] * n
        for s, d in perm:
            src[d] = s
        me = axis_position(axes).reshape(1)
        table = torch.tensor([max(s, 0) for s in src], device=x.device)
        keep = torch.tensor([float(s >= 0) for s in src], device=x.device, dtype=x.dtype)
        y = stacked.index_select(0, table.index_select(0, me)).squeeze(0)
        return y * keep.index_select(0, me).reshape(())

    def dist(self, x, g, p):
        return comm.send_recv(x, g, p[0])

    def transpose(self, ctx, g):
        (perm,) = ctx.params
        return _dispatch(PPERMUTE, (tuple((d, s) for s, d in perm),), ctx.axes, g)

    def sent(self, shape, itemsize, n, p):
        return math.prod(shape) * itemsize


class _Replica(_Prim):
    """Internal: the value of shard 0 along the axis (shard_map's outputs declared
    replicated under ``check_vma=False``)."""

    name, reduces = "replica", True

    def virtual(self, x, bdim, n, p):
        return (x.view_as(x) if bdim is None else x.select(bdim, 0)), None

    def dist(self, x, g, p):
        return comm.all_gather_dim(x.unsqueeze(0), g, 0)[0]

    def transpose(self, ctx, g):
        return g.view_as(g) if ctx.axes.virtual else g * (axis_position(ctx.axes) == 0).to(g.dtype)

    def sent(self, shape, itemsize, n, p):
        return 0


PSUM, PMAX, PVARY, REPLICA = _Psum(), _Pmax(), _Pvary(), _Replica()
ALL_GATHER, ALL_GATHER_INVARIANT = _AllGather(), _AllGatherInvariant()
PSUM_SCATTER, ALL_TO_ALL, PPERMUTE = _PsumScatter(), _AllToAll(), _Ppermute()


def axis_position(axes: Axes) -> torch.Tensor:
    """This shard's index along ``axes`` (major first), an int64 scalar tensor."""
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


def static_position(axes: Axes) -> int | None:
    """This shard's index along ``axes`` as a Python int on real ranks (also in dry runs
    and under tracing: the rank's mesh coordinates); None on the virtual mesh, where it
    differs from shard to shard inside one computation."""
    frame = axes.frame
    if frame.backend == "virtual":
        return None
    i = 0
    for a in axes.names:
        i = i * frame.mesh.shape[a] + frame.coords[a]
    return i


class Collective(torch.autograd.Function):
    """One autograd Function for every primitive: forward = the real-rank call, vmap =
    the virtual mesh (find the token's level), backward = the transpose, jvp = the
    tangent rule."""

    @staticmethod
    def forward(prim, params, axes, x, token):
        if axes.virtual:
            raise RuntimeError(
                f"{prim.name}: the virtual-mesh axis {axes.label!r} was not bound by a vmap "
                f"level; call collectives only from inside the shard_map'ed function"
            )
        return dist_call(prim, params, axes, x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        prim, params, axes, x, token = inputs
        ctx.prim, ctx.params, ctx.axes = prim, params, axes
        prim.save(ctx, x, output)

    @staticmethod
    def backward(ctx, g):
        return None, None, None, ctx.prim.transpose(ctx, g), None

    @staticmethod
    def jvp(ctx, _p, _params, _axes, t, _token):
        return ctx.prim.tangent(ctx, t)

    @staticmethod
    def vmap(info, in_dims, prim, params, axes, x, token):
        xd, td = in_dims[3], in_dims[4]
        if td is None:
            # Not this collective's level (a user's vmap, or real ranks): carry the batch
            # dim along as a leading dim.
            x = x.movedim(xd, 0)
            return Collective.apply(prim, prim.shift(params), axes, x, token), 0
        mem = memory.per_device()
        if mem is None:
            return prim.virtual(x, xd, axes.size, params)
        since = mem.clock
        with memory.collective_scope():  # what the real-rank call allocates is its buffers
            y, yd = prim.virtual(x, xd, axes.size, params)
            px, py = _physical(x), _physical(y)
            if prim is not PVARY and py.untyped_storage().data_ptr() == px.untyped_storage().data_ptr():
                # A view of the operand here (an all-gather of a stacked value is a reshape)
                # is a new buffer on every device of a real mesh: a per-device count needs one.
                y = y.clone()
                py = _physical(y)
        # Per-device memory: the result holds one copy per device along the operand's
        # axes, less this axis if it came back unbatched (a psum, an all-gather), plus it
        # if batched.
        ax = mem.axes_of(px)
        ax = ax | {axes.names[0]} if yd is not None else ax - {axes.names[0]}
        mem.tag(py, ax, since=since)
        return y, yd


def _physical(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under ``t``'s torch.func wrappers (what a dispatch mode sees)."""
    while _F.is_functorch_wrapped_tensor(t):
        t = _F.get_unwrapped(t)
    return t


def dist_call(prim: _Prim, params: tuple, axes: Axes, x: torch.Tensor) -> torch.Tensor:
    """The real-rank call on this rank's tensor (no autograd). In a dry run, a local
    answer (``dry_answer``), without touching a process group."""
    if _manifest.dry():
        return dry_answer(prim, params, axes, x)
    with memory.collective_scope():
        return prim.dist(x, comm.axis_group(axes.frame.mesh, axes.names), params)


def dry_answer(prim: _Prim, params: tuple, axes: Axes, x: torch.Tensor) -> torch.Tensor:
    """What the collective returns on this shard if every shard along ``axes`` held ``x``:
    its virtual rule on an invariant operand, at this shard's position. The shape is the
    real result's (the manifest and the schedule need nothing else: on meta and fake
    tensors that is all it computes); a dry run on real values gets plausible values too
    (psum: n·x, all_gather: x tiled, psum_scatter: n times this shard's chunk of x)."""
    y, bdim = prim.virtual(x, None, axes.size, params)
    if bdim is not None:
        i = 0
        for a in axes.names:
            i = i * axes.frame.mesh.shape[a] + axes.frame.coords[a]
        y = y.select(bdim, i)
    # A new buffer, as a real collective returns (pvary is a view there too).
    return y if prim is PVARY else y.clone()


def _dispatch(prim: _Prim, params: tuple, axes: Axes, x: torch.Tensor, *,
              record: bool = True) -> torch.Tensor:
    """Run ``prim`` untyped (transposes, tangents, internals); ``record``: list it in an
    open manifest."""
    if record:
        _manifest.record(prim, params, axes, x)
    if axes.virtual and axes.frame.mesh.size > 1:
        # Also over an axis of size 1 (where the value is unchanged): a value batched at an
        # axis' vmap level is read as varying over it, so a reduction must leave its result
        # unbatched there, as at any size, for the types to be those of real ranks. (A
        # one-device mesh has no levels: there every collective is the identity.)
        if len(axes.names) == 1:
            return Collective.apply(prim, params, axes, x, axes.frame.tokens[axes.names[0]])
        return prim.virtual_multi(params, axes, x)
    if axes.size == 1:
        return x
    if (x.requires_grad and torch.is_grad_enabled()) or _F.is_functorch_wrapped_tensor(x):
        return Collective.apply(prim, params, axes, x, None)
    return dist_call(prim, params, axes, x)  # nothing to differentiate: skip the Function


def run(prim: _Prim, params: tuple, axes: Axes, x: torch.Tensor, *,
        like: torch.Tensor | None = None, dispatch: Any = None) -> torch.Tensor:
    """A collective called by the program: recorded, typed, dispatched. ``like``: the
    program's value ``x`` was derived from inside the collective's wrapper (a dtype cast,
    a new dim), whose type ``x`` has. ``dispatch``: what runs it instead of ``_dispatch``
    (same signature; the started exchange of ``ppermute_start``)."""
    call = _dispatch if dispatch is None else dispatch
    mode = axes.frame.vma
    if mode is None or mode.dispatching:
        return call(prim, params, axes, x)
    if mode.assumed is not None:
        return _run_assumed(mode, call, prim, params, axes, x)
    x_in = x
    have = mode.get(like if like is not None else x)
    missing = mode.ordered(set(axes.names) - have)
    if prim is PVARY:
        _manifest.record(prim, params, axes, x)
        y = mode.pvary(x, missing)
        mode.last = mode.get(y)
        return y
    typed_operand = mode.known(like if like is not None else x_in)
    if missing and prim.reduces and prim is not ALL_GATHER_INVARIANT and typed_operand:
        # Over axes the operand is invariant over a reduction needs no communication: a
        # sum of n equal copies is n times the value, their max the value itself. (JAX
        # inserts a pvary and all-reduces; the numbers and the gradient are the same.)
        # Only for operands the table has typed: one whose history it did not see (made
        # where the table cannot look) is reduced for real, which is right either way.
        if prim is PSUM:
            x = x * math.prod(axes.frame.mesh.shape[a] for a in missing)
        rest = tuple(a for a in axes.names if a not in missing)
        if not rest:
            y = x if x is not x_in else x.view_as(x)
            mode.set(y, have)
            mode.last = have
            return y
        axes = Axes(rest, tuple(axes.frame.mesh.shape[a] for a in rest), axes.frame)
        missing = ()
    if missing:  # JAX's implicit pvary in front of a collective over an invariant operand
        x = mode.pvary(x, missing)
        have = have | set(missing)
    mode.dispatching += 1
    try:
        # The collective's own ops are not the program's: keep them off the table (and
        # off Python's __torch_function__ path, tens of microseconds per call).
        with torch._C.DisableTorchFunction():
            y = call(prim, params, axes, x)
            if y is x:
                y = x.view_as(x)  # a new value, so it can have its own type
    finally:
        mode.dispatching -= 1
    mode.last = frozenset(have - set(axes.names) if prim.reduces else have | set(axes.names))
    mode.set(y, mode.last)
    return y


def _run_assumed(mode: Any, call: Any, prim: _Prim, params: tuple, axes: Axes,
                 x: torch.Tensor) -> torch.Tensor:
    """``run`` under ``VmaMode.assuming``: a differentiated operand varies over every axis
    of size > 1, so no implicit pvary is due, and the collective runs untyped unless it
    would make a differentiated value invariant over such an axis (then the caller runs
    the stretch again typed). An operand that is not differentiated is left untyped: the
    numbers do not depend on its type, and a later question about it stops the stretch."""
    differentiated = x.requires_grad and torch.is_grad_enabled()
    if differentiated and prim.reduces and mode.assumed.intersection(axes.names):
        mode.stop_assuming()
    if prim is PVARY:  # over axes it already varies over (or of size 1): the identity
        _manifest.record(prim, params, axes, x)
        return x.view_as(x)
    mode.dispatching += 1
    try:
        with torch._C.DisableTorchFunction():
            y = call(prim, params, axes, x)
            if y is x:
                y = x.view_as(x)
    finally:
        mode.dispatching -= 1
    if differentiated:
        mode.set(y, mode.assumed | set(axes.names))
    return y


# Overlapped ppermute on real ranks ------------------------------------------------------
#
# ``start_ppermute`` posts the sends and receives and returns the receive buffer at once;
# ``finish_ppermute`` waits for them. Both are autograd nodes, and the backward reverses
# the pair: the finish's backward posts the cotangent's exchange (the inverse perm) and
# the start's backward waits for it, so in the backward pass too the transfer runs while
# autograd computes whatever lies between them (ring attention: one block's attention).
# The receive buffer is only ever read through ``finish_ppermute``, never by the program.


class _Exchange:
    """One overlapped ppermute in flight: forward requests, then the backward's."""

    __slots__ = ("axes", "pairs", "pending", "back")

    def __init__(self, axes: Axes, pairs: tuple) -> None:
        self.axes, self.pairs = axes, pairs
        self.pending = self.back = None

    def group(self) -> Any:
        return comm.axis_group(self.axes.frame.mesh, self.axes.names)


class _StartPermute(torch.autograd.Function):
    @staticmethod
    def forward(x, ex):
        with memory.collective_scope():
            out, ex.pending = comm.send_recv_start(x, ex.group(), ex.pairs)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ex = inputs[1]

    @staticmethod
    def backward(ctx, g):
        # ``g`` is the buffer the finish's backward is receiving into.
        ex = ctx.ex
        ex.back.wait()
        ex.back = None
        return g, None


class _FinishPermute(torch.autograd.Function):
    @staticmethod
    def forward(buf, ex):
        ex.pending.wait()
        ex.pending = None
        return buf.view_as(buf)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.ex = inputs[1]

    @staticmethod
    def backward(ctx, g):
        ex = ctx.ex
        inverse = tuple((d, s) for s, d in ex.pairs)
        _manifest.record(PPERMUTE, (inverse,), ex.axes, g)
        with memory.collective_scope():
            out, ex.back = comm.send_recv_start(g, ex.group(), inverse)
        return out, None


def can_overlap(axes: Axes, x: torch.Tensor) -> bool:
    """Whether a ppermute over ``axes`` can run in the background: on real ranks, eager
    (not a dry run, not traced), outside torch.func transforms. Elsewhere it is the plain
    ppermute (the virtual mesh computes it at once anyway)."""
    return (not axes.virtual and axes.size > 1 and not _manifest.dry() and not comm.tracing()
            and not _F.is_functorch_wrapped_tensor(x))


def start_ppermute(params: tuple, axes: Axes, x: torch.Tensor) -> tuple[torch.Tensor, _Exchange]:
    """Post the ppermute of ``x`` (typed and recorded as ``ppermute``); returns the receive
    buffer (to be passed to ``finish_ppermute`` only) and its exchange."""
    ex = _Exchange(axes, params[0])

    def dispatch(prim, params, axes, x):
        _manifest.record(prim, params, axes, x)
        return _StartPermute.apply(x, ex)

    return run(PPERMUTE, params, axes, x, dispatch=dispatch), ex


def finish_ppermute(buf: torch.Tensor, ex: _Exchange) -> torch.Tensor:
    """Wait for the exchange ``start_ppermute`` posted; its result, typed as the buffer."""
    mode = ex.axes.frame.vma
    if mode is None or mode.dispatching or mode.assumed is not None:
        return _FinishPermute.apply(buf, ex)
    typ = mode.get(buf)
    mode.dispatching += 1
    try:
        with torch._C.DisableTorchFunction():
            y = _FinishPermute.apply(buf, ex)
    finally:
        mode.dispatching -= 1
    mode.set(y, typ)
    return y


def implicit_pvary(frame: Any):
    """The pvary a varying-axes table inserts where an invariant value being
    differentiated meets a varying one (an autograd node whose backward is a psum)."""

    def pvary(x: torch.Tensor, names: tuple[str, ...]) -> torch.Tensor:
        axes = Axes(names, tuple(frame.mesh.shape[a] for a in names), frame)
        y = _dispatch(PVARY, (), axes, x, record=False)
        return x.view_as(x) if y is x else y

    return pvary
