"""The bundled GPT's forward over new tokens with a key/value cache (``KVCache``).

``extend(params, tokens, cache)`` runs the tokens ``(B, T)`` that fill the cache's next
``T`` slots (a prompt: prefill; one token per row: a decode step) and returns their
logits. Each block is the training block's own pieces (norms, projections, rotary or
learned positions, the MLP or the mixture of experts) with the attention over the
cached keys: a query in slot ``j`` of row ``b`` reads the keys of slots ``start[b]..j``.
A mixture of experts routes dropless here (no capacity), so a token's output does not
depend on what else is in the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from fsharded.inference._cache import KVCache
from fsharded.inference._int8 import Int8Weight
from fsharded.inference._stream import StreamedBlocks, block_meta
from fsharded.kernels.weight_int8 import rows_matmul
from fsharded.models import gpt
from fsharded.models._gpt_config import MoEConfig

__all__ = ["extend", "forward", "check_context", "decode_step", "compiled_decode"]


def _rotary_tables(pos: torch.Tensor, Dh: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``gpt._rotary``'s cos and sin for a position per row and token, pos (B, T) ->
    (B, T, 1, Dh) each: computed once per forward, shared by every layer."""
    dt = torch.promote_types(dtype, torch.float32)
    inv_freq = gpt.ROPE_THETA ** (-torch.arange(0, Dh, 2, dtype=dt, device=pos.device) / Dh)
    ang = pos.to(dt)[..., None] * inv_freq  # (B, T, Dh/2)
    return (ang.cos().repeat(1, 1, 2)[:, :, None, :].to(dtype), ang.sin().repeat(1, 1, 2)[:, :, None, :].to(dtype))


def _rotary_rows(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``gpt._rotary`` with a position per row and token: x (B, T, h, Dh)."""
    cos, sin = tables
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q (B, T, h, Dh) over k, v (B, S, KV, Dh) where ``allowed`` (B, T, S); the einsum
    form of the training attention (grouped-query heads alike)."""
    B, T, h, Dh = q.shape
    kv = k.shape[2]
    q = q.reshape(B, T, kv, h // kv, Dh)
    s = torch.einsum("btkgd,bskd->bkgts", q, k) * (Dh**-0.5)  # (B, kv, g, T, S)
    s = s.masked_fill(~allowed[:, None, None], float("-inf"))
    o = torch.einsum("bkgts,bskd->btkgd", s.softmax(dim=-1), v)
    return o.reshape(B, T, h, Dh)


def _proj(h: torch.Tensor, w: Any) -> torch.Tensor:
    """(B, T, D) through a (D, heads, Dh) projection, float or int8."""
    if isinstance(w, Int8Weight):
        return w.matmul(h)
    return rows_matmul(h, w.reshape(w.shape[0], -1)).unflatten(-1, w.shape[1:])  # (one GEMM, not a batched one)


def _mlp(p: dict, x: torch.Tensor, tensor_axis: str | None) -> torch.Tensor:
    """The dense MLP: the training one's math (``gpt._mlp``) spelled out, each product
    through the int8 product or, for a few rows (decoding), fsharded's row product, so that
    torch.compile sees those calls."""

    def lin(x: torch.Tensor, w: Any, b: str | None) -> torch.Tensor:
        y = w.matmul(x) if isinstance(w, Int8Weight) else rows_matmul(x, w)
        return y + p[b] if b in p else y

    x = gpt._enter_tp(x, tensor_axis, _tensor_of(p["w_gate"] if "w_gate" in p else p["w_in"]))
    if "w_gate" in p:
        y = lin(F.silu(lin(x, p["w_gate"], "b_gate")) * lin(x, p["w_up"], "b_up"), p["w_down"], None)
        b = "b_down"
    else:
        y, b = lin(F.gelu(lin(x, p["w_in"], "b_in")), p["w_out"], None), "b_out"
    y = gpt._exit_tp(y, tensor_axis)
    return y + p[b] if b in p else y


def _tensor_of(w: Any) -> torch.Tensor:
    """A weight's tensor (an int8 weight's ``q``), for the checks of how it is split."""
    return w.q if isinstance(w, Int8Weight) else w


def _unembed(params: dict, x: torch.Tensor) -> torch.Tensor:
    head = params.get("head")
    if isinstance(head, Int8Weight):
        return head.matmul(gpt._norm(params["final_norm"], x))
    return gpt.unembed(params, x)


def _rows(cache: KVCache, T: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions ``(B, T)`` of the next ``T`` slots of each row (padding at 0) and which
    cached slots each of them reads, ``(B, T, L + T)``: its row's from ``start`` to itself."""
    L = cache.length
    slots = torch.arange(L, L + T, device=dev)
    start = cache.start.to(dev)
    pos = (slots[None, :] - start[:, None]).clamp(min=0)
    keys = torch.arange(L + T, device=dev)
    allowed = (keys[None, None, :] >= start[:, None, None]) & (keys[None, None, :] <= slots[None, :, None])
    allowed |= keys[None, None, :] == slots[None, :, None]  # (a padding slot reads itself: no empty row)
    return pos, allowed


def check_context(params: dict, cache: KVCache, new: int) -> None:
    """A clear error where ``new`` more tokens do not fit: the cache's slots, or (learned
    positions) the position table."""
    if cache.length + new > cache.slots:
        raise ValueError(f"generate: {cache.length + new} tokens do not fit the cache's {cache.slots} slots per row")
    if "pos" in params:
        longest = cache.length + new - int(cache.start.min())  # the longest row's length
        if longest > params["pos"].shape[0]:
            raise ValueError(f"generate: a sequence of {longest} tokens (prompt and new tokens) exceeds the model's "
                             f"context of {params['pos'].shape[0]} learned positions (params['pos']); give a shorter "
                             f"prompt or fewer new tokens")


def extend(params: dict, tokens: torch.Tensor, cache: KVCache, *, moe: MoEConfig | None = None,
           model_state: Any = None, tensor_axis: str | None = None, expert_axis: str | None = None,
           _unchecked: bool = False) -> torch.Tensor:
    """Logits ``(B, T, V)`` of ``tokens`` ``(B, T)`` put in the cache's next ``T`` slots
    (written there, ``cache.length`` advanced). Inside a ``shard_map`` whose ``tensor_axis``
    splits the heads and the MLP's hidden units (``gpt.tensor_parallel_specs``, the
    cache's heads alike) and whose ``expert_axis`` splits the experts, it runs as the
    training forward does: one ``psum`` per attention and per MLP."""
    B, T = tokens.shape
    if not _unchecked:  # (inside a shard_map the caller checks: no host reads in the body)
        check_context(params, cache, T)
    pos, attend = contiguous(cache, T, tokens.device)
    logits = forward(params, tokens, pos, attend, moe=moe, model_state=model_state, tensor_axis=tensor_axis,
                     expert_axis=expert_axis)
    cache.length += T
    return logits


def contiguous(cache: KVCache, T: int, dev: torch.device) -> tuple[torch.Tensor, Any]:
    """The positions ``(B, T)`` of the cache's next ``T`` slots, and the ``attend`` that
    writes each layer's new keys and values there and attends over the filled slots."""
    L = cache.length
    pos, allowed = _rows(cache, T, dev)

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache.k[i][:, L:L + T] = k.to(cache.k[i].dtype)
        cache.v[i][:, L:L + T] = v.to(cache.v[i].dtype)
        return _attention(q, cache.k[i][:, :L + T].to(q.dtype), cache.v[i][:, :L + T].to(q.dtype), allowed)

    return pos, attend


def forward(params: dict, tokens: torch.Tensor, pos: torch.Tensor, attend: Any, *, moe: MoEConfig | None = None,
            model_state: Any = None, tensor_axis: str | None = None, expert_axis: str | None = None,
            keep: torch.Tensor | None = None) -> torch.Tensor:
    """The GPT's forward over ``tokens`` ``(B, T)`` at positions ``pos`` ``(B, T)``, each
    layer's attention given by ``attend(layer, q, k, v)`` (``(B, T, heads, Dh)`` each, after
    the biases and rotary; it stores ``k``, ``v`` where its cache keeps them and returns
    the attention output ``(B, T, heads, Dh)``): the logits ``(B, T, V)``, or with ``keep``
    (token indices) those tokens' only, ``(B, len(keep), V)``. A mixture of experts routes
    dropless."""
    if moe is not None and moe.eval_capacity_factor is not None:  # generation routes dropless: a
        moe = dataclasses.replace(moe, eval_capacity_factor=None)  # token's experts not the batch's doing
    x = params["emb"][tokens]
    if "pos" in params:
        x = x + params["pos"][pos]
    tables = None
    meta = block_meta(params)
    if "pos" not in params and len(meta):  # rotary: the angles of these positions, once
        tables = _rotary_tables(pos, meta[0]["attn"]["wq"].shape[-1], x.dtype)
    biases = gpt._routing_biases({**params, "blocks": meta}, moe, model_state)  # (streamed blocks: not read)
    if isinstance(params["blocks"], StreamedBlocks):
        blocks = iter(params["blocks"])
        try:
            x = _blocks(blocks, x, tables, biases, moe, attend, tensor_axis, expert_axis)
        finally:  # the pass closed (its reads waited, its buffers free) even where a layer raised
            blocks.close()
    else:
        x = _blocks(params["blocks"], x, tables, biases, moe, attend, tensor_axis, expert_axis)
    return _unembed(params, x if keep is None else x[:, keep])


def _blocks(blocks: Any, x: torch.Tensor, tables: Any, biases: Any, moe: MoEConfig | None, attend: Any,
            tensor_axis: str | None, expert_axis: str | None) -> torch.Tensor:
    n_moe = 0
    for i, p in enumerate(blocks):
        a = p["attn"]
        h = gpt._norm(p["norm1"], x)
        if tensor_axis is not None:
            h = gpt._enter_tp(h, tensor_axis, _tensor_of(a["wq"]))
        q, k, v = _proj(h, a["wq"]), _proj(h, a["wk"]), _proj(h, a["wv"])
        if "bq" in a:
            q, k, v = q + a["bq"], k + a["bk"], v + a["bv"]
        if tables is not None:
            q, k = _rotary_rows(q, tables), _rotary_rows(k, tables)
        o = attend(i, q, k, v)
        wo = a["wo"]
        y = wo.matmul(o) if isinstance(wo, Int8Weight) else rows_matmul(o.flatten(-2), wo.reshape(-1, wo.shape[-1]))
        y = gpt._exit_tp(y, tensor_axis)
        x = x + (y + a["bo"] if "bo" in a else y)
        if gpt._is_moe(p):
            bias = biases[n_moe] if biases is not None else None
            x, _ = gpt._moe_mlp(p["mlp"], gpt._norm(p["norm2"], x), x, moe, expert_axis, False, False, bias,
                                tensor_axis)
            n_moe += 1
        else:
            x = x + _mlp(p["mlp"], gpt._norm(p["norm2"], x), tensor_axis)
    return x


def decode_step(params: dict, tokens: torch.Tensor, k: list[torch.Tensor], v: torch.Tensor, length: torch.Tensor,
                start: torch.Tensor, moe: MoEConfig | None = None, model_state: Any = None) -> torch.Tensor:
    """One decode step with static shapes, for ``torch.compile``: ``tokens`` ``(B, 1)`` into
    slot ``length`` (an int64 0-d tensor) of the caches ``k``, ``v`` (one ``(B, S, KV, Dh)``
    per layer, written in place), attending over all ``S`` slots with each row's mask
    (``start[b]..length``). The last logits ``(B, V)``; ``extend``'s numbers."""
    S = k[0].shape[1]
    pos = (length - start).clamp(min=0)[:, None]  # (B, 1)
    keys = torch.arange(S, device=tokens.device)
    allowed = ((keys[None, :] >= start[:, None]) & (keys[None, :] <= length))[:, None, :]  # (B, 1, S)
    allowed = allowed | (keys == length)[None, None, :]  # (a padding row reads its own slot)

    def attend(i: int, q: torch.Tensor, kn: torch.Tensor, vn: torch.Tensor) -> torch.Tensor:
        k[i].index_copy_(1, length.view(1), kn.to(k[i].dtype))
        v[i].index_copy_(1, length.view(1), vn.to(v[i].dtype))
        return _attention(q, k[i].to(q.dtype), v[i].to(q.dtype), allowed)

    return forward(params, tokens, pos, attend, moe=moe, model_state=model_state)[:, -1]


_COMPILED: list = []


def compiled_decode() -> Any:
    """``decode_step`` through ``torch.compile`` (made once; it recompiles per shape)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(decode_step, fullgraph=True, dynamic=False))
    return _COMPILED[0]
