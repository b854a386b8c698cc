"""The eager and traceable collective calls under fsharded's collectives, per axis group.

Under ``make_fx`` / fake tensors the functional (traceable) c10d ops are used; in eager
mode the same-host shared-memory transport (``_shm``) where a group uses it, else
torch.distributed's own calls. Every function returns a new tensor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from fsharded.comm import _graph_ops, _shm, _trace

__all__ = ["tracing", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv",
           "send_recv_start", "Pending", "all_gather_dim", "reduce_scatter_dim", "all_to_all_dims"]


def tracing() -> bool:
    """Under make_fx / fake tensors the functional (traceable) collectives are used;
    in eager mode the c10d calls, which skip a dispatcher round trip and a copy."""
    return is_in_torch_dispatch_mode() or torch.compiler.is_compiling()


def all_reduce(x: torch.Tensor, op: str, g: Any) -> torch.Tensor:
    """``x`` reduced with ``op`` over the process group ``g`` (a new tensor; traceable)."""
    if tracing():
        if _graph_ops.uses_shm(g, x.dtype):
            return _graph_ops.collective(op, x, g)
        fc = torch.ops._c10d_functional
        return fc.wait_tensor(fc.all_reduce(x.contiguous(), op, g.group_name))
    y = x.clone(memory_format=torch.contiguous_format)
    _shm.all_reduce_(y, op, g)
    return y


def all_gather(x: torch.Tensor, g: Any) -> torch.Tensor:
    """(s, ...) -> (n * s, ...) in group-rank order."""
    if tracing():
        if _graph_ops.uses_shm(g, x.dtype):
            return _graph_ops.collective("all_gather", x, g)
        fc = torch.ops._c10d_functional
        return fc.wait_tensor(fc.all_gather_into_tensor(x.contiguous(), g.size, g.group_name))
    out = x.new_empty((g.size * x.shape[0], *x.shape[1:]))
    _shm.all_gather_into(out, x.contiguous(), g)
    return out


def reduce_scatter(x: torch.Tensor, g: Any) -> torch.Tensor:
    """(n * c, ...) -> (c, ...), summed, chunk = group rank."""
    if tracing():
        if _graph_ops.uses_shm(g, x.dtype):
            return _graph_ops.collective("reduce_scatter", x, g)
        fc = torch.ops._c10d_functional
        return fc.wait_tensor(fc.reduce_scatter_tensor(x.contiguous(), "sum", g.size, g.group_name))
    out = x.new_empty((x.shape[0] // g.size, *x.shape[1:]))
    _shm.reduce_scatter_into(out, x.contiguous(), g)
    return out


def all_to_all(x: torch.Tensor, g: Any) -> torch.Tensor:
    """(n * c, ...) -> (n * c, ...): chunk i goes to group rank i."""
    if tracing():
        if _graph_ops.uses_shm(g, x.dtype):
            return _graph_ops.collective("all_to_all", x, g)
        fc = torch.ops._c10d_functional
        splits = [x.shape[0] // g.size] * g.size
        return fc.wait_tensor(fc.all_to_all_single(x.contiguous(), splits, splits, g.group_name))
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _shm.all_to_all_into(out, x.contiguous(), g)
    return out


def send_recv(x: torch.Tensor, g: Any, perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Point-to-point exchange along ``perm`` (``(src, dst)`` axis positions); positions
    that receive nothing get zeros."""
    out, pending = send_recv_start(x, g, perm)
    pending.wait()
    return out


class Pending:
    """The requests of a started exchange; ``wait()`` once before the received buffer is
    read (and before the sent tensor is written)."""

    def __init__(self, reqs: list, keep: torch.Tensor | None = None, g: Any = None) -> None:
        self._reqs, self._keep, self._g = reqs, keep, g
        self._t0 = time.monotonic()

    def wait(self) -> None:
        reqs, self._reqs, self._keep = self._reqs, [], None
        try:
            for req in reqs:
                req.wait()
        except RuntimeError as e:  # a peer that exited, or the timeout: named
            if self._g is None:
                raise
            raise _shm.transport_error(self._g, "ppermute", e, self._t0) from None


@_trace.traced("send_recv", 0, 1, started=True)
def send_recv_start(x: torch.Tensor, g: Any, perm: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, Pending]:
    """``send_recv`` started, not finished: returns the receive buffer (zeros where
    nothing comes; its contents are undefined until ``wait()``) and the ``Pending``
    requests. The transfer proceeds in the transport's own threads meanwhile."""
    xs = x.contiguous()
    if tracing():
        return _traced_send_recv(xs, g, perm), Pending([])
    _shm.check_permute(xs, g, perm)  # every rank at this ppermute, with this shape and perm
    out = torch.zeros_like(xs)
    ops = []
    for s, d in perm:
        if s == g.index:
            ops.append(dist.P2POp(dist.isend, xs, g.ranks[d], group=g.group))
        if d == g.index:
            ops.append(dist.P2POp(dist.irecv, out, g.ranks[s], group=g.group))
    return out, Pending(dist.batch_isend_irecv(ops) if ops else [], xs, g)


def _traced_send_recv(xs: torch.Tensor, g: Any, perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """``send_recv`` in the graph as one all-to-all over the group: a collective, so every
    rank issues it in the graph's order of collectives, where point-to-point ops, matched
    by the order each rank's compiler scheduled them in, could pair up or wait crosswise.
    Over shared memory (where the group runs there) its blocks are equal, zeros to the
    positions not in a pair; else it is ``all_to_all_single`` with a chunk only for each
    pair of ``perm``."""
    if _graph_ops.uses_shm(g, xs.dtype):
        dst = {g.to_group[d] for s, d in perm if s == g.index}
        zero = torch.zeros_like(xs)
        got = _graph_ops.collective("all_to_all", torch.stack([xs if r in dst else zero for r in range(g.size)]), g)
        src = [s for s, d in perm if d == g.index]
        return got[g.to_group[src[0]]] if src else zero
    fc = torch.ops._c10d_functional
    n, send, recv = xs.numel(), [0] * g.size, [0] * g.size  # (indexed by group rank)
    for s, d in perm:
        if s == g.index:
            send[g.to_group[d]] = n
        if d == g.index:
            recv[g.to_group[s]] = n
    flat = xs.reshape(-1)[:sum(send)]  # (empty where this position sends nothing)
    out = fc.wait_tensor(fc.all_to_all_single(flat, recv, send, g.group_name))
    return out.view(xs.shape) if sum(recv) else torch.zeros_like(xs)


def _inverse(order: Sequence[int]) -> list[int]:
    inv = [0] * len(order)
    for i, r in enumerate(order):
        inv[r] = i
    return inv


def all_gather_dim(x: torch.Tensor, g: Any, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in the group's axis order."""
    if dim == 0 and g.identity_order:
        return all_gather(x, g)
    xs = x.movedim(dim, 0).contiguous()  # (s, rest...)
    out = all_gather(xs, g).view(g.size, *xs.shape)  # (n, s, rest...) in group-rank order
    if not g.identity_order:
        out = out[list(g.to_group)]
    return out.movedim((0, 1), (dim, dim + 1)).flatten(dim, dim + 1)


def reduce_scatter_dim(x: torch.Tensor, g: Any, dim: int) -> torch.Tensor:
    """Sum over the group and keep this rank's chunk (its axis position) of ``dim``."""
    if dim == 0 and g.identity_order:
        return reduce_scatter(x, g)
    xs = x.movedim(dim, 0)
    xs = xs.unflatten(0, (g.size, xs.shape[0] // g.size))  # (n, c, rest...)
    if not g.identity_order:
        xs = xs[_inverse(g.to_group)]
    return reduce_scatter(xs.flatten(0, 1).contiguous(), g).movedim(0, dim)


def all_to_all_dims(x: torch.Tensor, g: Any, split: int, concat: int) -> torch.Tensor:
    """Chunk ``i`` of ``split`` goes to axis position ``i``; received chunks are
    concatenated along ``concat`` in axis order."""
    if split == 0 and concat == 0 and g.identity_order:
        return all_to_all(x, g)
    xs = x.movedim(split, 0)
    xs = xs.unflatten(0, (g.size, xs.shape[0] // g.size))  # (n_dst, c, ...)
    if not g.identity_order:
        xs = xs[_inverse(g.to_group)]
    chunk_shape = xs.shape[1:]
    flat = xs.flatten(0, 1).contiguous()
    out = all_to_all(flat, g).view(g.size, *chunk_shape)  # (n_src in group order, c, ...)
    if not g.identity_order:
        out = out[list(g.to_group)]
    out = out.movedim(1, split + 1)  # (n_src, per-shard dims with split size c)
    out = out.movedim(0, concat)
    return out.flatten(concat, concat + 1)
