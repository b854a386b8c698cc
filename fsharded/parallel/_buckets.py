"""Coalesced data movement between placements, inside shard_map.

Many small collectives become a few large ones over flat buffers (DeepSpeed's
``reduce_bucket_size`` / ``allgather_bucket_size``): each leaf is laid out as ``(n, -1)``
rows, row ``j`` being the piece that belongs to shard ``j`` along the axis, the rows of a
bucket's leaves are concatenated, and one collective moves the whole bucket.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from fsharded import _memory_hooks as memory
from fsharded import comm
from fsharded.comm import _shm
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec, _entry_axes
from fsharded.parallel import offload
from fsharded.spmd import _env, _manifest, _prims, _virtual
from fsharded.spmd.collectives import (
    all_gather,
    axis_index,
    is_bound,
    pmean,
    pmean_owned,
    psum_scatter,
)

__all__ = ["buckets", "split_dim", "gather_leaves", "scatter_leaves", "reduce_leaves", "slice_leaves",
           "HostSink", "InBackward", "InBackwardLayout", "InFlight", "issue"]


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
    # row j: the block of dim d owned by shard j (dim 0, ZeRO's usual split: no movedim,
    # one op fewer per leaf through the typing's mode)
    return x.reshape(n, -1) if d == 0 else x.movedim(d, 0).reshape(n, -1)


def _moved(shape: tuple, d: int) -> list[int]:
    """``shape`` with dim ``d`` first (what ``movedim(d, 0)`` gives), computed, not run."""
    return [shape[d], *(s for j, s in enumerate(shape) if j != d)]


def _unmoved(x: torch.Tensor, d: int) -> torch.Tensor:
    return x if d == 0 else x.movedim(0, d)


def _moving(leaves: list, from_specs: list, to_specs: list, axis: str,
            frozen: list[bool] | None) -> list[list[tuple[int, int]]]:
    """The leaves ``from_specs`` shards on ``axis`` and ``to_specs`` does not, as ``(index,
    the dim split)``, in groups that may share a bucket: one dtype and one set of sharded
    axes (concatenating leaves that vary over different axes would make every piece vary
    over all of them), and ``frozen`` leaves apart."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for i, (fs_, ts) in enumerate(zip(from_specs, to_specs)):
        d = split_dim(fs_, ts, axis) if axis in fs_.axes and axis not in ts.axes else None
        if d is not None:
            cold = bool(frozen[i]) if frozen is not None else False
            groups.setdefault((leaves[i].dtype, frozenset(fs_.axes), cold), []).append((i, d))
    return list(groups.values())


def gather_leaves(leaves: list, from_specs: list, to_specs: list, axis: str, mesh: Mesh,
                  cap: int, *, frozen: list[bool] | None = None) -> list:
    """All-gather over ``axis`` every leaf that ``from_specs`` shards on it and ``to_specs``
    does not, in buckets of at most ``cap`` elements. Differentiable (transpose:
    reduce-scatter). Leaves ``frozen`` marks (not trained) go in buckets of their own, so
    the transpose reduce-scatters no gradient of theirs."""
    out = list(leaves)
    n = mesh.shape[axis]
    groups = _moving(leaves, from_specs, to_specs, axis, frozen)
    if not groups or n == 1 or not is_bound(axis):
        return out
    for items in groups:
        dims = dict(items)
        for b in buckets([i for i, _ in items], [leaves[i].numel() for i, _ in items], cap):
            flat = torch.cat([(leaves[i] if dims[i] == 0 else leaves[i].movedim(dims[i], 0)).reshape(-1)
                              for i in b])
            full = all_gather(flat, axis, tiled=False)  # (n, bucket)
            for i, piece in zip(b, full.split([leaves[i].numel() for i in b], dim=1)):
                x, d = leaves[i], dims[i]
                moved = _moved(tuple(x.shape), d)  # (s_d, rest...)
                moved[0] *= n
                out[i] = _unmoved(piece.reshape(moved), d)  # (n * s_d, rest...) with dim d back
    return out


def scatter_leaves(grads: list, from_specs: list, to_specs: list, axis: str, mesh: Mesh, cap: int) -> list:
    """The transpose of ``gather_leaves(leaves, from_specs, to_specs, axis, mesh, cap)``:
    the gradients of the gathered leaves reduce-scattered over ``axis`` back to the shards
    (in the same buckets); the others as they are. For a gather whose transpose is run by
    hand (an asynchronous one, ``zero3.PendingGather``)."""
    out = list(grads)
    n = mesh.shape[axis]
    groups = _moving(grads, from_specs, to_specs, axis, None)
    if not groups or n == 1 or not is_bound(axis):
        return out
    for items in groups:
        dims = dict(items)
        for b in buckets([i for i, _ in items], [grads[i].numel() for i, _ in items], cap):
            rows = torch.cat([_rows(grads[i], dims[i], n) for i in b], dim=1)  # (n, bucket)
            memory.label(rows, "gradients")
            mine = psum_scatter(rows, axis, dim=0, tiled=False)
            del rows
            for i, piece in zip(b, mine.split([grads[i].numel() // n for i in b])):
                moved = _moved(tuple(grads[i].shape), dims[i])
                moved[0] //= n
                out[i] = _unmoved(piece.reshape(moved), dims[i])
    return out


def reduce_leaves(grads: list, param_specs: list, grad_specs: list, batch_axes: tuple[str, ...],
                  mesh: Mesh, cap: int) -> list:
    """Average gradients over the batch axes into their placement.

    For each leaf and batch axis: the gradient is already summed over an axis its parameter
    is sharded on (the all-gather's transpose) -> divide; reduce-scattered over an axis the
    gradient placement adds (ZeRO-2); all-reduced over the rest. Buckets of ``cap``.
    The list is consumed: each gradient is dropped from it once copied into its bucket,
    so a caller that holds no other reference frees it there.
    """
    # The per-leaf bookkeeping (sizes, flattening, cutting back) runs untyped, each result
    # typed as what it is cut from (the varying-axes mode would cost more per leaf than the
    # copies do); the collectives are typed as always.
    mode = _typing()
    quiet = mode.paused if mode is not None else contextlib.nullcontext
    with quiet():
        shapes = [g.shape for g in grads]
        numels = [g.numel() for g in grads]
        dtypes = [g.dtype for g in grads]
    out = list(grads)
    allreduce: dict[tuple, list[int]] = {}
    scatter: dict[tuple, list[tuple[int, int]]] = {}
    for i, (ps, gs) in enumerate(zip(param_specs, grad_specs)):
        live = [a for a in batch_axes if is_bound(a) and mesh.shape[a] > 1]
        summed = [a for a in live if a in ps.axes]
        if summed:  # in place where the step owns it (no second gradient-sized copy)
            k = math.prod(mesh.shape[a] for a in summed)
            g = out[i]
            owned = g.is_contiguous() and not (torch.is_grad_enabled() and g.requires_grad)
            out[i] = g.div_(k) if owned else g / k
            grads[i] = g = None
        rest = tuple(a for a in live if a not in ps.axes)
        extra = [a for a in rest if a in gs.axes]
        if len(extra) > 1:
            raise NotImplementedError(f"reduce-scattering one gradient over several axes {extra}")
        if extra:
            a = extra[0]
            d = split_dim(gs, ps, a)
            scatter.setdefault((a, tuple(x for x in rest if x != a), dtypes[i], frozenset(ps.axes)),
                               []).append((i, d))
        elif rest:  # buckets by dtype and by the axes the leaf varies over (see gather_leaves)
            allreduce.setdefault((rest, dtypes[i], frozenset(ps.axes)), []).append(i)

    def drop(b) -> None:  # copied into the bucket: free the gradient if nobody else holds it
        for i in b:
            out[i] = grads[i] = None

    for (over, _, _), idx in allreduce.items():
        for b in buckets(idx, [numels[i] for i in idx], cap):
            reduced = _virtual.pmean_beneath([out[i] for i in b], _env.bind(over, "pmean"))
            if reduced is not None:  # the virtual mesh: summed beneath the vmap levels
                memory.label(reduced, "gradients")
                drop(b)
                for i, y in zip(b, reduced):
                    out[i] = y
                continue
            # (as cat types it: the union of its operands')
            ty = frozenset().union(*(mode.get(out[i]) for i in b)) if mode is not None else None
            with quiet():
                flat = torch.cat([out[i].reshape(-1) for i in b])
            if mode is not None:
                mode.set(flat, ty)
            memory.label(flat, "gradients")  # the bucket (reduced out of place on the virtual mesh)
            drop(b)
            flat = pmean_owned(flat, over)
            memory.label(flat, "gradients")
            ty = mode.get(flat) if mode is not None else None
            with quiet():
                pieces = [piece.view(shapes[i]) for i, piece in zip(b, flat.split([numels[i] for i in b]))]
            for i, piece in zip(b, pieces):
                if mode is not None:
                    mode.set(piece, ty)
                out[i] = piece
    for (a, others, _, _), items in scatter.items():
        n = mesh.shape[a]
        dims = dict(items)
        for b in buckets([i for i, _ in items], [numels[i] for i, _ in items], cap):
            rows = torch.cat([_rows(out[i], dims[i], n) for i in b], dim=1)  # (n, bucket)
            memory.label(rows, "gradients")
            drop(b)
            mine = _divided(psum_scatter(rows, a, dim=0, tiled=False), n)  # (bucket,)
            memory.label(mine, "gradients")
            del rows
            if others:
                mine = pmean(mine, others)
            for i, piece in zip(b, mine.split([numels[i] // n for i in b])):
                d = dims[i]
                moved = _moved(tuple(shapes[i]), d)
                moved[0] //= n
                out[i] = _unmoved(piece.reshape(moved), d)
    return out


def _typing() -> Any:
    """The varying-axes mode typing the body here, if any."""
    frame = _env.current()
    return frame.vma if frame is not None and frame.vma is not None and not frame.vma.dispatching else None


def _divided(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x / n``, in place where ``x`` is a collective's new buffer nobody differentiates."""
    return x / n if torch.is_grad_enabled() and x.requires_grad else x.div_(n)


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
            moved = _moved(tuple(x.shape), d)
            moved[0] //= n
            out[i] = _unmoved(_rows(x, d, n).index_select(0, me).reshape(moved), d)
            if offload.on_host(x):  # (a gradient streamed to the host: its slice is there too)
                offload.mark_host(out[i])
    return out


# -- reducing in backward (real ranks) ---------------------------------------------------


class InFlight:
    """An asynchronous collective and the buffers it reads and writes, which must stay
    alive until it completes (gloo works on its own thread) and no longer."""

    def __init__(self, work: Any, *keep: torch.Tensor) -> None:
        self.work, self.keep = work, keep

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.work, self.keep = None, ()


def issue(pending: list, op: Any) -> None:
    """Add ``op`` to the in-flight list, first letting go of those already complete (their
    sources, a block's full gradient or a gathered bucket, would otherwise live until
    backward ends: on 2 ranks at 6.4M parameters, ~45 MiB above the model states)."""
    keep = []
    for p in pending:
        if p.done():
            p.finish()
        else:
            keep.append(p)
    pending[:] = keep
    pending.append(op)


class _Bucket:
    def __init__(self, idx: list[int], dims: dict[int, int] | None, numels: list[int], n: int) -> None:
        self.idx, self.dims, self.n = idx, dims, n  # dims: the scatter dim per leaf; None: all-reduce
        w = [k // n for k in numels] if dims is not None else numels
        self.offset = dict(zip(idx, [sum(w[:j]) for j in range(len(w))]))
        self.width = dict(zip(idx, w))
        self.cols, self.missing = sum(w), set(idx)
        self.buf: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self.flight: InFlight | None = None  # its reduce-scatter, while in flight
        self.host: torch.Tensor | None = None  # its reduced gradient, copied to the host


class InBackwardLayout:
    """The buckets ``InBackward`` fills, as ``reduce_leaves`` groups them: ``buckets`` of
    ``(leaf indices, scatter dim per leaf or None for an all-reduce, numels)``. It depends
    only on the leaves' shapes and specs, so a step builds it once (``of``) and a fresh
    ``InBackward`` per backward."""

    def __init__(self, shapes: list, param_specs: list, grad_specs: list, axis: str, mesh: Mesh,
                 cap: int) -> None:
        self.shapes, self.axis, self.mesh = shapes, axis, mesh
        self.n = mesh.shape[axis]
        numel = [math.prod(s) for s in shapes]
        # The groups reduce_leaves makes (one dtype here: every gradient is cast to it).
        allreduce: dict[frozenset, list[int]] = {}
        scatter: dict[frozenset, list[tuple[int, int]]] = {}
        for i, (ps, gs) in enumerate(zip(param_specs, grad_specs)):
            if axis in gs.axes:
                scatter.setdefault(frozenset(ps.axes), []).append((i, split_dim(gs, ps, axis)))
            else:
                allreduce.setdefault(frozenset(ps.axes), []).append(i)
        self.buckets: list[tuple[list[int], dict[int, int] | None, list[int]]] = []
        for idx in allreduce.values():
            for b in buckets(idx, [numel[i] for i in idx], cap):
                self.buckets.append((b, None, [numel[i] for i in b]))
        for items in scatter.values():
            dims = dict(items)
            for b in buckets([i for i, _ in items], [numel[i] for i, _ in items], cap):
                self.buckets.append((b, {i: dims[i] for i in b}, [numel[i] for i in b]))

    @classmethod
    def of(cls, shapes: list, param_specs: list, grad_specs: list, batch_axes: tuple[str, ...],
           mesh: Mesh, cap: int) -> InBackwardLayout | None:
        """None where ``reduce_leaves`` does more than one batch axis' reduction per leaf."""
        live = [a for a in batch_axes if is_bound(a) and mesh.shape[a] > 1]
        if len(live) != 1 or any(live[0] in ps.axes for ps in param_specs):
            return None
        return cls(shapes, param_specs, grad_specs, live[0], mesh, cap)


class InBackward:
    """``reduce_leaves`` run while backward produces the gradients (real ranks, plain
    autograd): a hook on each differentiated leaf copies its gradient into its bucket and
    hands autograd a stride-0 zero in its place, so the full gradient is freed at once; a
    bucket whose leaves are all in is reduced (reduce-scattered, ZeRO-2, asynchronously
    where the transport allows; all-reduced in place otherwise). ``finish()`` after
    backward completes every bucket and gives the reduced leaves, typed as ``reduce_leaves``
    types them. The same buckets, so the same collectives and bytes, in backward's order.

    ``InBackwardLayout.of`` gives None where ``reduce_leaves`` does more than one batch
    axis' reduction per leaf (a leaf also sharded over the batch axis, hybrid meshes): the
    step then reduces after backward.

    ``to_host`` (the optimizer state in a memory tier: the update runs on the host): each
    bucket's reduced gradient is copied to a host buffer as soon as its reduction is
    complete, while backward goes on (a reduce-scatter found complete at a later leaf's
    hook, or at ``finish``), and its device buffer is let go; ``finish`` gives views of the
    host buffers. Pinned host buffers and asynchronous copies where the device is a GPU
    (``pin``); on a CPU device the copies are real copies into buffers of their own, in
    the same order. The same values: a copy, and the division by the axis size done on
    the copy."""

    reduced = True  # its gradients come reduced

    def __init__(self, layout: InBackwardLayout, dtype: torch.dtype, vma: Any, *, to_host: bool = False,
                 pin: bool = True) -> None:
        self.shapes, self.axis, self.mesh, self.n = layout.shapes, layout.axis, layout.mesh, layout.n
        self.dtype, self.vma = dtype, vma
        self.to_host, self.pin = to_host, pin
        self.copies: list = []  # (event, device buffer) of copies to the host in flight (GPU)
        self.streamed = 0  # buckets copied to the host before backward ended
        self.buckets = [_Bucket(idx, dims, numels, self.n) for idx, dims, numels in layout.buckets]
        self.bucket_of = {i: b for b in self.buckets for i in b.idx}
        self.pending: list = []
        self.types: list = [frozenset()] * len(self.shapes)
        self.axes = _env.bind(self.axis, "the gradient reduction")  # for the manifest's entries

    def watch(self, leaves: list) -> None:
        """Hook the differentiated leaves (the step's parameters, before the loss runs)."""
        for i, x in enumerate(leaves):
            if self.vma is not None:  # the gradient's type: its primal's (JAX's rule)
                self.types[i] = self.vma.get(x)
        with torch._C.DisableTorchFunction():  # (a plain call: not through the modes, per leaf)
            for i, x in enumerate(leaves):
                x.register_hook(self._hook(i))

    def _hook(self, i: int):
        b, n = self.bucket_of[i], self.n
        o, w = b.offset[i], b.width[i]
        d = b.dims[i] if b.dims is not None else None
        zeros: dict = {}

        def hook(g: torch.Tensor) -> torch.Tensor:
            # A plain call (not through the typing's mode: the bucket is untyped until
            # ``finish``), a few ops per leaf: it runs once per leaf per step.
            if i not in b.missing:  # its bucket is in already (a second backward through it)
                raise RuntimeError(
                    f"train_step: the gradient of parameter leaf {i} came twice in one backward (a "
                    f"backward run inside the loss through the parameters?); its bucket is reduced already")
            with torch._C.DisableTorchFunction(), torch.no_grad():
                buf = self._buffer(b)
                if d is None:
                    buf[o:o + w].copy_(g.reshape(-1))
                else:
                    buf[:, o:o + w].copy_(_rows(g, d, n))
                b.missing.discard(i)
                if not b.missing:
                    self._reduce(b)
                if self.to_host:  # the reductions complete by now go to the host
                    self._drain(block=False)
                # Autograd keeps what a hook returns as the leaf's gradient: a zero of the
                # same shape and no memory (the value lives on in the bucket).
                z = zeros.get(g.dtype)
                if z is None:
                    z = zeros[g.dtype] = torch.zeros((), dtype=g.dtype, device=g.device)
                return z.expand(g.shape)
        return hook

    def _buffer(self, b: _Bucket) -> torch.Tensor:
        if b.buf is None:  # not zeroed: the columns of a leaf without a gradient are at _reduce
            shape = (self.n, b.cols) if b.dims is not None else (b.cols,)
            b.buf = torch.empty(shape, dtype=self.dtype)
            memory.label(b.buf, "gradients")  # the unreduced gradients of the bucket
        return b.buf

    def _reduce(self, b: _Bucket) -> None:
        g = comm.axis_group(self.mesh, (self.axis,))
        buf = self._buffer(b)
        with torch._C.DisableTorchFunction(), torch.no_grad():
            for i in b.missing:  # a leaf without a gradient contributes zero
                o, w = b.offset[i], b.width[i]
                (buf[o:o + w] if b.dims is None else buf[:, o:o + w]).zero_()
        b.missing.clear()
        # Recorded as the psum / psum_scatter that reduce_leaves runs after backward.
        _manifest.record(_prims.PSUM if b.dims is None else _prims.PSUM_SCATTER,
                         () if b.dims is None else (0,), self.axes, buf)
        with torch.no_grad(), memory.collective_scope():
            if b.dims is None:  # the bucket becomes the averaged gradient
                _shm.all_reduce_(buf, "sum", g, divisor=self.n)
                b.out = buf
            else:
                b.out = buf.new_empty(b.cols)
                memory.label(b.out, "gradients")
                b.flight = InFlight(_shm.reduce_scatter_into(b.out, buf, g, async_op=True), buf, b.out)
                issue(self.pending, b.flight)
        b.buf = None  # the in-flight entry keeps a scattered bucket until it completes

    def _drain(self, *, block: bool) -> None:
        """Copy to the host the reduced buckets whose reduction is complete (``block``:
        every reduced one, waiting for those in flight)."""
        for b in self.buckets:
            if b.out is None or b.host is not None:
                continue
            if b.flight is not None:
                if not (block or b.flight.done()):
                    continue
                b.flight.finish()
                b.flight = None
            b.host, event = offload.to_host(b.out, pin=self.pin)
            if event is not None:  # the device buffer lives until its copy is done
                self.copies.append((event, b.out))
            memory.label(b.host, "gradients")
            if not block:
                self.streamed += 1
            b.out = None

    def finish(self) -> list:
        """After backward: complete every bucket (those with unused leaves too, in the same
        order on every rank) and give the reduced gradient of every leaf."""
        for b in self.buckets:
            if b.out is None and b.host is None:
                self._reduce(b)
        if self.to_host:
            self._drain(block=True)
            for event, _ in self.copies:  # the host reads its copies from here on
                event.synchronize()
            self.copies.clear()
        for op in self.pending:
            op.finish()
        self.pending.clear()
        out: list = [None] * len(self.shapes)
        with torch.no_grad():
            for b in self.buckets:
                red = b.host if b.host is not None else b.out
                if b.dims is not None:
                    red.div_(self.n)  # psum_scatter(...) / n, as reduce_leaves rounds it
                for i in b.idx:
                    piece = red[b.offset[i]:b.offset[i] + b.width[i]]
                    if b.dims is None:
                        out[i] = piece.view(self.shapes[i])
                        t = self.types[i] - {self.axis}
                    else:
                        d = b.dims[i]
                        moved = _moved(tuple(self.shapes[i]), d)
                        moved[0] //= self.n
                        out[i] = _unmoved(piece.reshape(moved), d)
                        t = self.types[i]
                    if self.vma is not None:
                        self.vma.set(out[i], t)
                b.out = b.host = b.flight = None
        return out


class HostSink:
    """The gradients backward makes for the differentiated leaves ``watch`` marks, copied to
    the host as each becomes complete (real ranks, plain autograd; the optimizer state in a
    memory tier, so the update runs there): a hook on each leaf takes its gradient, hands
    autograd a stride-0 zero in its place, and copies it to a host buffer once the
    collective that makes it is done (``in_flight(g)``: ZeRO-3's reduce-scatters),
    at a later leaf's hook or at ``finish``; the device's copy is let go then. ``finish()``
    after backward gives every watched leaf's gradient (on the host), the others' as
    backward made them (``taken``). Its gradients are not reduced yet (``reduced``
    False): the step's reduction runs on them after backward, as on the device."""

    reduced = False

    def __init__(self, watched: list[bool], in_flight: Any, *, pin: bool = True) -> None:
        self.watched, self.in_flight, self.pin = watched, in_flight, pin
        self.waiting: dict[int, torch.Tensor] = {}  # leaf -> its gradient, not yet copied
        self.host: dict[int, torch.Tensor] = {}
        self.copies: list = []  # (event, device tensor) of copies in flight (GPU)
        self.streamed = 0  # gradients copied to the host before backward ended
        self.n = 0

    def watch(self, leaves: list) -> None:
        self.n = len(leaves)
        with torch._C.DisableTorchFunction():
            for i, x in enumerate(leaves):
                if self.watched[i]:
                    x.register_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(g: torch.Tensor) -> torch.Tensor:
            if i in self.waiting or i in self.host:
                raise RuntimeError(f"train_step: the gradient of parameter leaf {i} came twice in one backward (a "
                                   f"backward run inside the loss through the parameters?)")
            self.waiting[i] = g
            self._drain(block=False)
            with torch._C.DisableTorchFunction():
                return torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)
        return hook

    def _drain(self, *, block: bool) -> None:
        for i in [i for i, g in self.waiting.items() if block or not self.in_flight(g)]:
            g = self.waiting.pop(i)
            h, event = offload.to_host(g, pin=self.pin)
            if event is not None:  # the device's copy lives until its copy is done
                self.copies.append((event, g))
            memory.label(h, "gradients")
            self.host[i] = h
            if not block:
                self.streamed += 1

    def finish(self, taken: list | None = None) -> list:
        """Every watched leaf's gradient on the host (a zero where backward made none), the
        others' from ``taken`` (what autograd returned for them)."""
        self._drain(block=True)
        for event, _ in self.copies:  # the host reads its copies from here on
            event.synchronize()
        self.copies.clear()
        out = [self.host.get(i) if self.watched[i] else (taken[i] if taken is not None else None)
               for i in range(self.n)]
        # Let go of them here: the hooks keep this sink as long as the leaves they are on
        # live, which may be past the step (the gradients are the update's to free).
        self.host = {}
        return out
