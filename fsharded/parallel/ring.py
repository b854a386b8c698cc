"""Ring attention (context parallelism): the sequence stays sharded; key/value blocks go
around the ring.

Inside ``shard_map`` with the sequence sharded over ``axis`` (size ``n``), each shard keeps
its queries and, over ``n`` rounds, attends to every shard's keys and values: round ``s``
works on the block that started on shard ``i - s`` (passed one step around the ring with
``ppermute`` between rounds, ``(n - 1)/n`` of K and V received per layer), and the partial
results are merged with their log-sum-exp (``fsharded.kernels.merge_attention``), so the
result is exact attention over the whole sequence. No head-count cap.

The causal mask compares global positions (``fsharded.parallel.sequence.positions``), so
either layout works: ``"contiguous"``, or ``"zigzag"`` (shard ``i`` holds chunks ``i`` and
``2n - 1 - i`` of ``2n``), where every shard has the same number of unmasked (query, key)
pairs in total — the causal load balance (``causal_pairs`` counts them).
"""

from __future__ import annotations

import torch

from fsharded.kernels.attention import merge_attention
from fsharded.parallel import sequence
from fsharded.spmd.collectives import axis_index, axis_size, ppermute

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


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str, *,
                   layout: str = "contiguous", scale: float | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence sharded over ``axis`` in ``layout``: q
    ``(B, T/n, H, Dh)``, k/v ``(B, T/n, KV, Dh)`` (``H % KV == 0``); returns ``(B, T/n,
    H, Dh)`` in q's dtype."""
    T, Dh = q.shape[1], q.shape[3]
    scale = Dh**-0.5 if scale is None else scale
    n = axis_size(axis)
    q_pos = sequence.positions(T, axis, layout, device=q.device)
    if n == 1:
        o, _ = _block(q, k, v, q_pos, q_pos, scale)
        return o.transpose(1, 2).to(q.dtype)
    me = axis_index(axis).to(q.device)
    forward = [(j, (j + 1) % n) for j in range(n)]  # after s rounds, shard i holds shard i - s's block
    o = lse = None
    for s in range(n):
        if s:
            k, v = ppermute(k, axis, forward), ppermute(v, axis, forward)
        k_pos = sequence.positions_of(T, (me - s) % n, n, layout)
        ob, lb = _block(q, k, v, q_pos, k_pos, scale)
        if o is None:
            o, lse = ob.to(lb.dtype), lb
        else:
            o, lse = merge_attention(o, lse, ob.to(lb.dtype), lb)
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
