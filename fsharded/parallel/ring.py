"""Ring attention (context parallelism): the sequence stays sharded; key/value blocks go
around the ring.

Inside ``shard_map`` with the sequence sharded over ``axis`` (size ``n``), each shard keeps
its queries and, over ``n`` rounds, attends to every shard's keys and values: round ``s``
works on the block that started on shard ``i - s`` (passed one step around the ring with
``ppermute`` between rounds, ``(n - 1)/n`` of K and V received per layer), and the partial
results are merged with their log-sum-exp (``fsharded.kernels.merge_attention``), so the
result is exact attention over the whole sequence. No head-count cap.

On real ranks the whole ring is one autograd Function (``_Ring``): the forward merges
each block into a running (out, lse) in place and keeps only this shard's q, k, v and the
final out and lse, and the backward sends k and v round once more (the other way) with
their gradients, running each block's flash backward against the final out and lse, so
memory per shard stays O(T/n). On the virtual mesh (and under torch.func transforms) the
blocks and their merges are plain differentiable ops.

The causal mask compares global positions (``fsharded.parallel.sequence.positions``), so
either layout works: ``"contiguous"``, or ``"zigzag"`` (shard ``i`` holds chunks ``i`` and
``2n - 1 - i`` of ``2n``), where every shard has the same number of unmasked (query, key)
pairs in total — the causal load balance (``causal_pairs`` counts them).
"""

from __future__ import annotations

import torch

from fsharded import _memory_hooks as memory
from fsharded import comm
from fsharded.kernels.attention import (
    flash_attention_backward,
    flash_attention_with_lse,
    merge_attention,
)
from fsharded.parallel import sequence
from fsharded.spmd import _env, _manifest, _prims
from fsharded.spmd._wrappers import transforms_active
from fsharded.spmd.collectives import axis_index, axis_size, ppermute_start, pvary_to_union

__all__ = ["ring_attention", "causal_pairs"]


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``(B, Tq, H, Dh)`` over one key block ``(B, Tk, KV, Dh)`` under the
    causal mask of their global positions: out ``(B, H, Tq, Dh)``, lse ``(B, H, Tq)`` (at
    least float32). Rows with no visible key get a huge negative lse (weight 0 when
    merged), not -inf, so no NaN reaches the gradients."""
    B, Tq, H, Dh = q.shape
    KV = k.shape[2]
    ct = torch.promote_types(q.dtype, torch.float32)
    s = torch.einsum("btkgd,bskd->bkgts", q.reshape(B, Tq, KV, H // KV, Dh), k).to(ct) * scale
    visible = q_pos[:, None] >= k_pos[None, :]  # (Tq, Tk)
    s = s.masked_fill(~visible, torch.finfo(ct).min)
    lse = torch.logsumexp(s, dim=-1)  # (B, KV, g, Tq)
    p = torch.exp(s - lse.unsqueeze(-1))
    o = torch.einsum("bkgts,bskd->bkgtd", p.to(v.dtype), v)  # (B, KV, g, Tq, Dh)
    return o.reshape(B, H, Tq, Dh), lse.reshape(B, H, Tq)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``_block`` for a block whose mask is plain causal (the diagonal) or empty, through
    ``flash_attention_with_lse`` (Triton on CUDA; on CPU its reference, which keeps no
    score matrix for the backward)."""
    o, lse = flash_attention_with_lse(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                      causal=causal, scale=scale)
    return o, lse


class _Anchor(torch.autograd.Function):
    """Identity on ``o`` that ties ``k`` and ``v`` into the graph with a zero cotangent: a
    skipped block's keys and values still get their (zero) gradient, so the backward of
    the ppermute that brought them runs on this rank as on its peers (a ppermute is a
    collective: every shard of the ring sends and receives in it)."""

    @staticmethod
    def forward(o, k, v):
        return o.view_as(o)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, k, v = inputs
        ctx.kv = (k.shape, k.dtype, v.shape, v.dtype, k.device)

    @staticmethod
    def backward(ctx, g):
        ks, kd, vs, vd, dev = ctx.kv
        return g, torch.zeros(ks, dtype=kd, device=dev), torch.zeros(vs, dtype=vd, device=dev)


def _merge(o, lse, ob, lb, rows: slice | None = None):
    """Merge a block's partial attention into the running one (``rows``: the query rows
    the block covers, all if None)."""
    ob = ob.to(lb.dtype)
    if o is None:
        return ob, lb
    if rows is None:
        return merge_attention(o, lse, ob, lb)
    om, lm = merge_attention(o[:, :, rows], lse[:, :, rows], ob, lb)
    return (torch.cat([o[:, :, :rows.start], om], dim=2),
            torch.cat([lse[:, :, :rows.start], lm], dim=2))


def _part(j: int, mine: int, layout: str, T: int) -> tuple[slice, slice, bool] | None:
    """The visible part of shard ``j``'s key block for shard ``mine``'s queries, as
    (query rows, key columns, causal) on real ranks, None if it sees none of it: the diagonal block is causal; in the
    contiguous layout an earlier shard's block is all visible and a later one's hidden; in
    the zigzag layout an earlier shard's first chunk is seen by every query and a later
    shard's block by the second chunk of queries."""
    whole, c = slice(None), T // 2
    if j == mine:
        return whole, whole, True
    if layout == "contiguous":
        return (whole, whole, False) if j < mine else None
    return (whole, slice(0, c), False) if j < mine else (slice(c, T), whole, False)


class _Send:
    """The ppermute of one tensor over ``axes`` along ``pairs``, posted now (recorded in an
    open manifest as the ppermute it is); ``wait()`` gives the received tensor. In a dry
    run the local answer, at once."""

    def __init__(self, x: torch.Tensor, axes, pairs: tuple) -> None:
        if _prims.can_overlap(axes, x):
            _manifest.record(_prims.PPERMUTE, (pairs,), axes, x)
            with memory.collective_scope():
                self.buf, self.pending = comm.send_recv_start(x, comm.axis_group(axes.frame.mesh, axes.names), pairs)
        else:
            self.buf, self.pending = _prims._dispatch(_prims.PPERMUTE, (pairs,), axes, x), None

    def wait(self) -> torch.Tensor:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        return self.buf


def _merge_into(out: torch.Tensor, lse: torch.Tensor, ob: torch.Tensor, lb: torch.Tensor) -> None:
    """Merge a block's (out, lse) into the running ones in place (every row of a block sees
    a key, so ``lb`` is finite; the running lse starts at -inf with out 0)."""
    new = torch.logaddexp(lse, lb)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(ob.to(out.dtype) * torch.exp(lb - new).unsqueeze(-1))
    lse.copy_(new)


class _Ring(torch.autograd.Function):
    """Ring attention on real ranks as one Function (as ring flash attention implementations
    do), so that memory per shard stays O(T/n): the forward merges each visible block into a
    running (out, lse) in place and keeps only q, k, v of this shard and the final out and
    lse; the backward passes the key/value blocks around the ring once more, in the other
    direction, runs each block's flash backward against the final out and lse
    (``flash_attention_backward``: exactly the block's share), and sends each block's
    key/value gradients along with it, every shard adding its part, so they reach their
    owner with its own block in the last round. No per-block outputs are kept, no lse
    gradient is formed; the exchanges overlap the blocks' attention. Per layer each shard
    sends ``n - 1`` blocks of k and v forward, and ``n - 1`` of k and v and of their
    gradients backward."""

    @staticmethod
    def forward(ctx, q, k, v, axes, mine, layout, scale):
        n, T = axes.size, q.shape[1]
        B, _, H, Dh = q.shape
        ahead = tuple((j, (j + 1) % n) for j in range(n))
        ct = torch.promote_types(q.dtype, torch.float32)
        acc = q.new_zeros((B, T, H, Dh), dtype=ct)  # stored as the output is returned
        out = acc.transpose(1, 2)  # (B, H, T, Dh)
        lse = q.new_full((B, H, T), float("-inf"), dtype=ct)
        q0, k0, v0 = q, k, v
        for s in range(n):
            nxt = (_Send(k, axes, ahead), _Send(v, axes, ahead)) if s + 1 < n else None
            if (part := _part((mine - s) % n, mine, layout, T)) is not None:
                rows, cols, causal = part
                ob, lb = _flash(q[:, rows], k[:, cols], v[:, cols], causal, scale)
                _merge_into(out[:, :, rows], lse[:, :, rows], ob, lb)
            if nxt is not None:
                k, v = nxt[0].wait(), nxt[1].wait()
        result = acc.to(q.dtype)  # (B, T, H, Dh), not a view: the caller may write to it
        ctx.save_for_backward(q0, k0, v0, result, lse)  # version-checked, the output included
        ctx.info = (axes, mine, layout, scale)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, result, lse = ctx.saved_tensors
        out = result.transpose(1, 2)  # (B, H, T, Dh)
        axes, mine, layout, scale = ctx.info
        n, T = axes.size, q.shape[1]
        behind = tuple(((j + 1) % n, j) for j in range(n))
        ct = lse.dtype
        qt, do = q.transpose(1, 2), dout.transpose(1, 2)  # (B, H, T, Dh)
        dq = torch.zeros(qt.shape, dtype=ct, device=q.device)
        # Round s (from n - 1 down to 0) works on shard (mine - s)'s block, received from the
        # next shard, which worked on it in round s + 1, with the gradients summed so far.
        nxt = (_Send(k, axes, behind), _Send(v, axes, behind))
        acc = None
        for s in reversed(range(n)):
            if s > 0:
                kb, vb = nxt[0].wait(), nxt[1].wait()
                nxt = (_Send(kb, axes, behind), _Send(vb, axes, behind)) if s > 1 else None
            else:
                kb, vb = k, v
            if (part := _part((mine - s) % n, mine, layout, T)) is None:  # contiguous: a later shard's
                dk, dv = kb.new_zeros(kb.shape, dtype=ct), vb.new_zeros(vb.shape, dtype=ct)
            else:
                rows, cols, causal = part
                gq, gk, gv = flash_attention_backward(do[:, :, rows], qt[:, :, rows], kb[:, cols].transpose(1, 2),
                                                      vb[:, cols].transpose(1, 2), out[:, :, rows], lse[:, :, rows],
                                                      causal=causal, scale=scale)
                dq[:, :, rows] += gq
                gk, gv = gk.transpose(1, 2).to(ct), gv.transpose(1, 2).to(ct)
                if cols == slice(None):  # the whole block: its gradient as the kernel gave it
                    dk, dv = gk, gv
                else:
                    dk, dv = kb.new_zeros(kb.shape, dtype=ct), vb.new_zeros(vb.shape, dtype=ct)
                    dk[:, cols], dv[:, cols] = gk, gv
            if acc is not None:  # out of place: dk may be a view of the kernel's output
                dk = dk + acc[0].wait()
                dv = dv + acc[1].wait()
            if s > 0:
                acc = (_Send(dk.to(k.dtype), axes, behind), _Send(dv.to(v.dtype), axes, behind))
        return dq.to(q.dtype).transpose(1, 2), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str, *,
                   layout: str = "contiguous", scale: float | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence sharded over ``axis`` in ``layout``: q
    ``(B, T/n, H, Dh)``, k/v ``(B, T/n, KV, Dh)`` (``H % KV == 0``); returns ``(B, T/n,
    H, Dh)`` in q's dtype.

    On real ranks the next block's transfer runs while the current block's attention is
    computed, forward and backward (the backward passes k and v round again, with their
    gradients: per layer ``n - 1`` hops of k and v forward, ``2 (n - 1)`` of k, v and their
    gradients backward), and only the visible part of each block is computed, by the
    flash kernels (every visible part is then causal or unmasked): in the contiguous layout a block from a later shard is skipped and
    one from an earlier shard needs no mask; in the zigzag layout a block from an earlier
    shard is seen only through its first chunk and one from a later shard only by the
    second chunk of queries, half the work each. (On the virtual mesh every shard's block
    index differs inside one vmap, so every block is computed whole under the mask; the
    numbers are the same.)
    """
    T, Dh = q.shape[1], q.shape[3]
    scale = Dh**-0.5 if scale is None else scale
    n = axis_size(axis)
    q_pos = sequence.positions(T, axis, layout, device=q.device)
    if n == 1:
        o, _ = _block(q, k, v, q_pos, q_pos, scale)
        return o.transpose(1, 2).to(q.dtype)
    axes = _env.bind(axis, "ring_attention")
    mine = _prims.static_position(axes)  # None on the virtual mesh
    # mine: None on the virtual mesh; on real ranks remat's vjp in backward is a transform too.
    if mine is not None and not torch.compiler.is_compiling() and not transforms_active():
        return _Ring.apply(*pvary_to_union(q, k, v), axes, mine, layout, scale)  # (see _vma: Functions)
    me = axis_index(axis).to(q.device)
    forward = [(j, (j + 1) % n) for j in range(n)]  # after s rounds, shard i holds shard i - s's block
    c = T // 2
    o = lse = None
    for s in range(n):
        nxt = ppermute_start((k, v), axis, forward) if s + 1 < n else None
        k_pos = sequence.positions_of(T, (me - s) % n, n, layout)
        if mine is None:
            o, lse = _merge(o, lse, *_block(q, k, v, q_pos, k_pos, scale))
        elif (j := (mine - s) % n) == mine:
            # Both in the shard's own (increasing) positions: the plain causal mask.
            o, lse = _merge(o, lse, *_flash(q, k, v, True, scale))
        elif layout == "contiguous":
            if j < mine:  # an earlier shard's block: all visible
                o, lse = _merge(o, lse, *_flash(q, k, v, False, scale))
            else:  # a later shard's block is all masked: nothing to compute
                o = _Anchor.apply(o, k, v)
        elif j < mine:  # zigzag, earlier shard: every query sees its first chunk only
            o, lse = _merge(o, lse, *_flash(q, k[:, :c], v[:, :c], False, scale))
        else:  # zigzag, later shard: only the second chunk of queries sees it, all of it
            o, lse = _merge(o, lse, *_flash(q[:, c:], k, v, False, scale), rows=slice(c, T))
        if nxt is not None:
            k, v = nxt.wait()
    return o.transpose(1, 2).to(q.dtype)


def causal_pairs(length: int, n: int, layout: str) -> list[int]:
    """For a sequence of ``length`` tokens over ``n`` shards, the (query, key) pairs each
    shard's queries see under the causal mask: the attention work per shard (equal for
    every shard in the zigzag layout, growing with the shard index in the contiguous one)."""
    sequence.check_layout(layout)
    t = length // n
    out = []
    for i in range(n):
        q = sequence.positions_of(t, torch.tensor(i), n, layout)
        out.append(int((q + 1).sum()))  # query at position p sees keys 0..p
    return out
