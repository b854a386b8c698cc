"""Ulysses sequence parallelism (DeepSpeed-Ulysses): attention on full sequences for a
slice of the heads.

Inside ``shard_map`` with the sequence sharded over ``axis`` (size ``n``), q, k and v
``(B, T/n, H, Dh)`` go to ``(B, T, H/n, Dh)`` — the whole sequence, ``H/n`` heads — in one
all-to-all (packed so that each rank's chunk holds its q, k and v heads: one collective
instead of DeepSpeed's three), the local attention runs unchanged, and one all-to-all
brings the output back to ``(B, T/n, H, Dh)``. Per layer each rank sends and receives
``4 * B * T * D / n`` elements (q, k, v and the output, ``(n - 1)/n`` of them leaving the rank),
against Megatron-SP's all-gather and reduce-scatter of the whole activations.

The degree is capped by the query heads (``H % n == 0``: beyond it use the hybrid). With
fewer key/value heads than the degree (GQA/MQA), each kv head is repeated just enough
(to a multiple of ``n`` that still divides ``H``) for every rank to get the kv heads its
query heads read; gradients of the copies add up in backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fsharded.spmd.collectives import all_to_all, axis_size

__all__ = ["ulysses_attention", "kv_heads_for"]


def kv_heads_for(heads: int, kv_heads: int, n: int) -> int:
    """How many kv heads Ulysses sends over ``n`` ranks: ``kv_heads`` when they split,
    else the fewest copies (a multiple of ``n`` and of ``kv_heads`` dividing ``heads``)."""
    if kv_heads % n == 0:
        return kv_heads
    m = math.lcm(kv_heads, n)
    return m if heads % m == 0 else heads


def ulysses_attention(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                      q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str) -> torch.Tensor:
    """``attend`` (causal attention on ``(B, T, h, Dh)`` q and ``(B, T, kv, Dh)`` k/v) over
    the whole sequence sharded over ``axis``; q ``(B, T/n, H, Dh)``, k/v ``(B, T/n, KV,
    Dh)`` in the contiguous layout; returns ``(B, T/n, H, Dh)``."""
    n = axis_size(axis)
    if n == 1:
        return attend(q, k, v)
    H, KV = q.shape[2], k.shape[2]
    if H % n:
        raise ValueError(f"Ulysses over {axis!r} (size {n}) splits the attention heads, but this shard "
                         f"has {H} query heads, which do not divide by {n}: use a degree dividing the "
                         f"heads, or the hybrid (Ulysses x ring) for a higher degree")
    m = kv_heads_for(H, KV, n)
    if m != KV:  # each kv head's copies stay next to each other: query head j still reads j // (H/m)
        k, v = (t.repeat_interleave(m // KV, dim=2) for t in (k, v))
    if q.dtype == k.dtype == v.dtype:
        # One copy packs q, k and v straight into send order (n, B, T/n, h + 2 mk, Dh):
        # destination r's chunk holds its q heads, then its k and v heads.
        h, mk = H // n, m // n
        send = torch.cat([x.unflatten(2, (n, w)).movedim(2, 0) for x, w in ((q, h), (k, mk), (v, mk))], dim=3)
        recv = all_to_all(send, axis, split_dim=0, concat_dim=0)  # (n source shards, B, T/n, ...)
        del send  # not kept through the attention
        whole = recv.movedim(0, 1).flatten(1, 2)  # (B, T, h + 2 mk, Dh), a view for B == 1
        q, k, v = whole.split([h, mk, mk], dim=2)  # (B, T, h | mk | mk, Dh)
    else:
        q, k, v = (all_to_all(x, axis, split_dim=2, concat_dim=1) for x in (q, k, v))
    o = attend(q, k, v)  # (B, T, H/n, Dh)
    return all_to_all(o, axis, split_dim=1, concat_dim=2)
