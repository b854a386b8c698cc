"""Differentiable collectives over mesh axes, for use inside ``shard_map``.

Each works under ``torch.func.grad``, ``vjp``, ``jvp``, ``jacrev``, ``jacfwd``, ``vmap`` and
plain ``.backward()``, on the virtual mesh and on real ranks; the transposes and the
varying-axes rules are JAX's (see ``fsharded.spmd._prims``). Like JAX's, they accept a
pytree (mapped leaf by leaf) and Python numbers (``psum(1, "i")`` is the axis size).

Over an axis of size 1 each collective is the identity, so per-shard code runs unsharded.
Booleans are summed as int32 (``pmean`` gives float32), integer dtypes are kept.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from fsharded import _memory_hooks as memory
from fsharded import comm
from fsharded.comm import _shm
from fsharded.spmd import _env, _manifest, _prims
from fsharded.spmd._env import Axes
from fsharded.spmd._prims import (
    ALL_GATHER,
    ALL_GATHER_INVARIANT,
    ALL_TO_ALL,
    PMAX,
    PPERMUTE,
    PSUM,
    PSUM_SCATTER,
    PVARY,
    run,
)

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "pvary",
    "all_gather",
    "all_gather_invariant",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "ppermute_start",
    "PendingPermute",
    "axis_index",
    "axis_size",
    "is_bound",
    "varying_axes",
]

AxisName = str | Sequence[str]


def _treewise(fn: Callable) -> Callable:
    """Map a one-tensor collective over a pytree of tensors, as JAX's do."""

    @functools.wraps(fn)
    def wrapper(x: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, torch.Tensor) or isinstance(x, numbers.Number):
            return _typed_call(fn, x, args, kwargs)
        return optree.tree_map(lambda leaf: _typed_call(fn, leaf, args, kwargs), x)

    return wrapper


def _typed_call(fn: Callable, x: Any, args: tuple, kwargs: dict) -> Any:
    """Run one collective with its own tensor ops (casts, new dims, the division of
    pmean) off the varying-axes table and off Python's __torch_function__ path: the
    primitive (``_prims.run``) types its result, and the collective's result (that value,
    reshaped or cast) gets that type."""
    frame = _env.current()
    mode = frame.vma if frame is not None else None
    if mode is None or mode.dispatching or mode.assumed is not None:
        with torch._C.DisableTorchFunction():
            return fn(x, *args, **kwargs)
    mode.last = None
    with torch._C.DisableTorchFunction():
        y = fn(x, *args, **kwargs)
    if isinstance(y, torch.Tensor) and mode.last is not None:
        mode.set(y, mode.last)
    return y


def _tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def _summable(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32) if x.dtype == torch.bool else x  # JAX sums booleans as int32


@_treewise
def psum(x: torch.Tensor, axis: AxisName) -> torch.Tensor:
    """Sum over ``axis``; the result is invariant over it. Dual: ``pvary``.

    The transpose is the identity (the cotangent of an invariant value is invariant),
    Megatron's "g" operator. An operand already invariant over ``axis`` is summed over its
    ``n`` equal copies (``n * x``), and ``psum(1, axis)`` is the axis size, as in JAX.
    """
    axes = _env.bind(axis, "psum")
    if isinstance(x, numbers.Number) and not isinstance(x, bool):
        return x * axes.size
    x = _tensor(x)
    return run(PSUM, (), axes, _summable(x), like=x)


@_treewise
def pmean(x: torch.Tensor, axis: AxisName) -> torch.Tensor:
    """Mean over ``axis``: ``psum(x, axis) / axis_size(axis)`` (integers give float32)."""
    axes = _env.bind(axis, "pmean")
    if isinstance(x, numbers.Number) and not isinstance(x, bool):
        return x
    x = _tensor(x)
    return run(PSUM, (), axes, _summable(x), like=x) / axes.size


def pmean_owned(x: torch.Tensor, axis: AxisName) -> torch.Tensor:
    """``pmean`` of a buffer the caller owns and does not differentiate (a gradient bucket):
    on real ranks in eager mode it is reduced in place with the division folded in (no
    copy, no second pass); elsewhere (virtual mesh, tracing, autograd) exactly ``pmean``.
    Same values and the same varying axes either way."""
    axes = _env.bind(axis, "pmean")
    mode = axes.frame.vma
    if (axes.virtual or axes.size == 1 or not x.is_floating_point() or not x.is_contiguous()
            or (torch.is_grad_enabled() and x.requires_grad) or comm.tracing()
            or torch._C._functorch.is_functorch_wrapped_tensor(x) or _manifest.dry()
            or (mode is not None and (mode.dispatching or mode.assumed is not None))):
        y = run(PSUM, (), axes, x)
        # The sum is a new buffer (or, on one device, the caller's own): divide it in place
        # unless it is differentiated.
        return y / axes.size if torch.is_grad_enabled() and y.requires_grad else y.div_(axes.size)
    _manifest.record(PSUM, (), axes, x)
    have = mode.get(x) if mode is not None else frozenset()
    group = comm.axis_group(axes.frame.mesh, axes.names)
    with memory.collective_scope():
        _shm.all_reduce_(x, "sum", group, divisor=axes.size)
    if mode is not None:
        mode.set(x, have - set(axes.names))
    return x


@_treewise
def pmax(x: torch.Tensor, axis: AxisName) -> torch.Tensor:
    """Elementwise max over ``axis``; the gradient goes to the shard(s) holding the max
    (split evenly between ties). JAX has no derivative for pmax; this is torch.amax's."""
    axes = _env.bind(axis, "pmax")
    if isinstance(x, numbers.Number):
        return x
    x = _tensor(x)
    if x.dtype == torch.bool:
        return run(PMAX, (), axes, x.to(torch.uint8), like=x).to(torch.bool)
    return run(PMAX, (), axes, x)


@_treewise
def pmin(x: torch.Tensor, axis: AxisName) -> torch.Tensor:
    """Elementwise min over ``axis`` (``-pmax(-x)``; booleans: logical and)."""
    axes = _env.bind(axis, "pmin")
    if isinstance(x, numbers.Number):
        return x
    x = _tensor(x)
    if x.dtype == torch.bool:
        return run(PMAX, (), axes, (~x).to(torch.uint8), like=x) == 0
    if not x.dtype.is_signed and not x.is_floating_point():
        top = torch.iinfo(x.dtype).max
        return (top - run(PMAX, (), axes, top - x, like=x)).to(x.dtype)
    return -run(PMAX, (), axes, -x, like=x)


@_treewise
def pvary(x: torch.Tensor, axis: AxisName) -> torch.Tensor:
    """Mark a value invariant over ``axis`` as varying from here on: identity forward,
    ``psum`` backward. Megatron's "f" operator; the dual of ``psum``; JAX's
    ``pcast(x, axis, to="varying")``. Axes the value already varies over are left as they
    are (JAX raises there)."""
    return run(PVARY, (), _env.bind(axis, "pvary"), _tensor(x))


def mark_varying(tree: Any, axis: AxisName) -> Any:
    """The leaves of ``tree`` typed varying over ``axis`` as well, with no collective and
    nothing recorded in the manifest: how a training step makes each shard's gradient its
    own contribution before it differentiates (under ``torch.no_grad``: no autograd node,
    only the type changes)."""
    axes = _env.bind(axis, "mark_varying")
    mode = axes.frame.vma
    if mode is None:
        return tree
    return optree.tree_map(
        lambda t: mode.pvary(t, mode.ordered(set(axes.names) - mode.get(t))), tree)


def pvary_to_union(*xs: torch.Tensor | None) -> tuple:
    """``xs`` each ``pvary``-ed to the union of their varying axes (None passes through):
    what the varying-axes typing does implicitly for the operands of an op, done by hand
    for the inputs of an autograd Function on real ranks, whose application the typing
    does not see (see ``fsharded.spmd._vma``). Outside shard_map, ``xs`` unchanged."""
    union = tuple(dict.fromkeys(a for x in xs if x is not None for a in varying_axes(x)))
    if not union:
        return xs
    return tuple(x if x is None or not (missing := tuple(a for a in union if a not in varying_axes(x)))
                 else pvary(x, missing) for x in xs)


def _gather_dim(x: torch.Tensor, dim: int, tiled: bool, op: str) -> int:
    if tiled and x.dim() == 0:
        raise ValueError(
            f"{op}(tiled=True): a 0-d value has no dim to concatenate along; pass "
            f"tiled=False to stack the shards' values in a new dim"
        )
    return _dim(dim, x.dim() + (0 if tiled else 1), op)


@_treewise
def all_gather(x: torch.Tensor, axis: AxisName, *, dim: int = 0, tiled: bool = True,
               to: str = "varying") -> torch.Tensor:
    """Gather every shard of ``x`` along ``axis``. Dual: ``psum_scatter``.

    ``tiled=True`` concatenates along ``dim`` (size ``n * x.shape[dim]``); ``tiled=False``
    stacks in a new dim at ``dim``. Shards are ordered by axis index, major axis first.
    As in JAX the result still varies over ``axis`` (``to="varying"``, the default; its
    transpose is a psum_scatter); ``to="invarying"`` types it invariant, so that
    ``out_specs`` may leave the axis out, as ``all_gather_invariant`` does (its transpose
    takes this shard's slice). JAX's third target, ``"reduced"``, is a type fsharded does
    not have (a ``NotImplementedError``). (``fsharded.lax.all_gather`` has JAX's defaults.)
    """
    prim, op = _gather_target(to)
    return _all_gather(prim, op, x, axis, dim, tiled)


_GATHER_TARGETS = ("varying", "invarying", "reduced")


def _gather_target(to: str) -> tuple[Any, str]:
    if to == "varying":
        return ALL_GATHER, "all_gather"
    if to == "invarying":
        return ALL_GATHER_INVARIANT, "all_gather_invariant"
    if to == "reduced":
        raise NotImplementedError(
            "all_gather(to='reduced'): fsharded types values as varying or invariant over an "
            "axis and has no 'reduced' type; to='invarying' gives the same values (every shard "
            "holds the whole gather), with the gradient of this shard's slice")
    raise ValueError(f"all_gather: to={to!r}; allowed values are {list(_GATHER_TARGETS)} (as in JAX)")


@_treewise
def all_gather_invariant(x: torch.Tensor, axis: AxisName, *, dim: int = 0,
                         tiled: bool = True) -> torch.Tensor:
    """``all_gather`` whose result is invariant over ``axis`` (every shard holds the same
    whole value): its transpose takes this shard's slice of the cotangent."""
    return _all_gather(ALL_GATHER_INVARIANT, "all_gather_invariant", x, axis, dim, tiled)


def _all_gather(prim, op, x, axis, dim, tiled):
    axes = _env.bind(axis, op)
    x = _tensor(x)
    d = _gather_dim(x, dim, tiled, op)
    return run(prim, (d,), axes, x if tiled else x.unsqueeze(d), like=x)


@_treewise
def psum_scatter(x: torch.Tensor, axis: AxisName, *, dim: int = 0, tiled: bool = True) -> torch.Tensor:
    """Sum over ``axis`` and keep this shard's chunk of ``dim``. Dual: ``all_gather``.

    ``tiled=True`` needs ``x.shape[dim]`` divisible by the axis size; ``tiled=False``
    needs it equal to the axis size and removes ``dim``. Integer dtypes are kept.
    """
    axes = _env.bind(axis, "psum_scatter")
    src = _tensor(x)
    x = _summable(src)
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
    y = run(PSUM_SCATTER, (d,), axes, x, like=src)
    return y if tiled else y.squeeze(d)


@_treewise
def all_to_all(x: torch.Tensor, axis: AxisName, *, split_dim: int, concat_dim: int,
               tiled: bool = True) -> torch.Tensor:
    """Split ``split_dim`` into ``n`` chunks, send chunk ``i`` to shard ``i``, and
    concatenate the received chunks along ``concat_dim``. Dual: itself, dims swapped.

    ``tiled=False`` (JAX's default): ``split_dim`` must have size ``n``; it is removed
    and the received values are stacked in a new dim at ``concat_dim``.
    """
    axes = _env.bind(axis, "all_to_all")
    x = _tensor(x)
    s = _dim(split_dim, x.dim(), "all_to_all")
    if not tiled:
        if x.shape[s] != axes.size:
            raise ValueError(
                f"all_to_all(tiled=False): split_dim {s} has size {x.shape[s]}, it must "
                f"equal the size {axes.size} of axis {axes.label!r}"
            )
        c = _dim(concat_dim, x.dim(), "all_to_all")
        y = run(ALL_TO_ALL, (s, s), axes, x)  # chunk i (size 1) to shard i, stacked at s
        return y.movedim(s, c)
    c = _dim(concat_dim, x.dim(), "all_to_all")
    if x.shape[s] % axes.size:
        raise ValueError(
            f"all_to_all: split_dim {s} of size {x.shape[s]} is not divisible by the size "
            f"{axes.size} of axis {axes.label!r}"
        )
    return run(ALL_TO_ALL, (s, c), axes, x)


def _perm(perm: Sequence[tuple[int, int]], axes: Axes, op: str) -> tuple[tuple[int, int], ...]:
    n = axes.size
    pairs = tuple((int(s), int(d)) for s, d in perm)
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    bad = [p for p in pairs if not (0 <= p[0] < n and 0 <= p[1] < n)]
    if bad or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(
            f"{op}: perm {list(pairs)} must be (src, dst) pairs in [0, {n}) with each "
            f"src and each dst at most once (axis {axes.label!r} has size {n})"
        )
    return pairs


@_treewise
def ppermute(x: torch.Tensor, axis: AxisName, perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Send this shard's ``x`` to shard ``dst`` for each ``(src, dst)`` in ``perm``;
    shards that receive nothing get zeros. Dual: ``ppermute`` with the inverse perm."""
    axes = _env.bind(axis, "ppermute")
    return run(PPERMUTE, (_perm(perm, axes, "ppermute"),), axes, _tensor(x))


class PendingPermute:
    """A ``ppermute`` under way (``ppermute_start``); ``wait()`` returns its result, the
    same value and type ``ppermute`` gives. Call it exactly once."""

    def __init__(self, value: Any = None, started: list | None = None, treedef: Any = None) -> None:
        self._value, self._started, self._treedef = value, started, treedef

    def wait(self) -> Any:
        if self._started is not None:
            done = [_prims.finish_ppermute(buf, ex) for buf, ex in self._started]
            self._value = optree.tree_unflatten(self._treedef, done)
            self._started = None
        if self._value is None:
            raise RuntimeError("PendingPermute.wait(): called twice")
        out, self._value = self._value, None
        return out


def ppermute_start(x: Any, axis: AxisName, perm: Sequence[tuple[int, int]]) -> PendingPermute:
    """``ppermute`` split in two, so communication overlaps computation: posts the
    exchange of ``x`` (a tensor or a pytree of tensors) and returns at once; the
    returned ``PendingPermute``'s ``wait()`` gives ``ppermute(x, axis, perm)``.

    On real ranks (eager) the transfer runs in the transport's threads (gloo) or stream
    (NCCL) while the caller computes, and in the backward pass the cotangent's exchange is
    posted and awaited around the same computation. Recorded in the manifest as the
    ``ppermute`` it is. On the virtual mesh, in a dry run, under tracing or torch.func
    transforms it is the plain ``ppermute``, computed at once.

    >>> nxt = ppermute_start(kv, "seq", ring)
    >>> out = attend(q, kv)        # runs while kv moves to the next shard
    >>> kv = nxt.wait()
    """
    axes = _env.bind(axis, "ppermute_start")
    pairs = _perm(perm, axes, "ppermute_start")
    leaves, treedef = optree.tree_flatten(x)
    if not leaves or not all(isinstance(t, torch.Tensor) and _prims.can_overlap(axes, t) for t in leaves):
        return PendingPermute(value=ppermute(x, axis, pairs))
    return PendingPermute(started=[_prims.start_ppermute((pairs,), axes, t) for t in leaves],
                          treedef=treedef)


def axis_index(axis: AxisName) -> torch.Tensor:
    """This shard's index along ``axis`` (major axis first for a tuple), an int64 scalar
    that varies over ``axis``."""
    axes = axis if isinstance(axis, Axes) else _env.bind(axis, "axis_index")
    idx = _prims.axis_position(axes)
    mode = axes.frame.vma
    if mode is not None and not mode.dispatching:
        idx = idx.view_as(idx)  # its own value, typed; the token stays untyped
        mode.set(idx, frozenset(axes.names))
    return idx


def varying_axes(x: torch.Tensor) -> tuple[str, ...]:
    """The mesh axes ``x`` varies over (mesh order), JAX's ``jax.typeof(x).vma``: inside
    ``shard_map`` its type by the rules of ``fsharded.spmd._vma``; outside, ``()``.

    Model code can reduce exactly where its values are split:

    >>> y = psum(y, "tensor") if "tensor" in varying_axes(y) else y
    """
    frame = _env.current()
    if frame is None or frame.vma is None:
        return ()
    return frame.vma.ordered(frame.vma.get(x))


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


def _dim(d: int, rank: int, op: str) -> int:
    if not -rank <= d < max(rank, 1):
        raise ValueError(f"{op}: dim {d} is out of range for a tensor of rank {rank}")
    return d % max(rank, 1)
