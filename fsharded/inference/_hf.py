"""Hugging Face causal LMs (GPT-2, Llama, ... built from a config) decoding with
fsharded's ``KVCache`` instead of their own ``past_key_values``.

The model runs as ``fs.nn.functional(model).apply(params, input_ids=..., position_ids=...,
use_cache=False)``, with its configs pointed at the attention ``"fsharded_kv_cache"``
(registered with transformers' ``AttentionInterface``; its mask function returns None):
each attention layer (``module.layer_idx``) writes the keys and values it computed for the
new tokens (after rotary, for Llama) into the cache's next slots and attends over the
cached ones with the cache's rows: a query in slot ``j`` of row ``b`` sees slots
``start[b]..j``. The positions are the cache's (``j - start[b]``), so left padding needs
no attention mask. Models whose attention does not dispatch through
``AttentionInterface`` are refused, naming the model.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import optree
import torch
from torch import nn

from fsharded.inference._cache import KVCache
from fsharded.inference._gpt import contiguous
from fsharded.nn import FunctionalModule, functional

__all__ = ["HFDecoder", "NAME"]

NAME = "fsharded_kv_cache"
_STATE: dict[str, Any] = {}  # the attend of the forward that runs (one at a time)


def _cached_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """q ``(B, H, T, Dh)``, k/v ``(B, KV, T, Dh)`` of the new tokens -> ``(B, T, H, Dh)``,
    by the ``attend`` of the forward that runs (its cache's writes and reads)."""
    attend = _STATE.get("attend")
    if attend is None:
        raise RuntimeError(f"{type(module).__name__}: attention {NAME!r} runs only inside fs.inference's forward")
    i = getattr(module, "layer_idx", None)
    if i is None:
        raise NotImplementedError(f"fs.inference: {type(module).__name__} has no layer_idx, so its keys and values "
                                  f"cannot be placed in the cache's layers")
    for k in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(k) is not None:
            raise NotImplementedError(f"fs.inference: {type(module).__name__} passes {k}={kwargs[k]!r}, which the "
                                      f"cached attention does not apply: generating with it would give other logits")
    q = query.transpose(1, 2)
    if scaling is not None:
        q = q * (scaling * q.shape[-1] ** 0.5)  # (the attention scales by Dh ** -0.5)
    return attend(i, q, key.transpose(1, 2), value.transpose(1, 2)), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, _cached_attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME


class HFDecoder:
    """A Hugging Face causal LM (an ``nn.Module``, or ``fs.nn.functional`` of one) as
    ``generate`` runs it: ``empty_cache`` and ``forward(tokens, cache)``."""

    def __init__(self, model: Any, params: Any = None) -> None:
        self.fm = model if isinstance(model, FunctionalModule) else functional(model)
        self.params = self.fm.params if params is None else params
        module = self.fm.module
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "_attn_implementation_internal"):
            raise NotImplementedError(f"fs.inference: {type(module).__name__} is not a Hugging Face model (no "
                                      f"config._attn_implementation); generation takes the bundled GPT's params or "
                                      f"a transformers causal LM")
        found: dict[int, Any] = {}
        for m in module.modules():
            c = getattr(m, "config", None)
            for sub in (c, *(getattr(c, k, None) for k in getattr(c, "sub_configs", {}) or {})):
                if sub is not None and hasattr(sub, "_attn_implementation_internal"):
                    found.setdefault(id(sub), sub)
        self.configs = list(found.values())
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, "model_type", "") == "gpt2" and (getattr(text, "scale_attn_by_inverse_layer_idx", False)
                                                         or not getattr(text, "scale_attn_weights", True)
                                                         or getattr(text, "reorder_and_upcast_attn", False)):
            raise NotImplementedError("fs.inference: this GPT-2 config scales its attention its own way "
                                      "(scale_attn_by_inverse_layer_idx, scale_attn_weights=False or "
                                      "reorder_and_upcast_attn), which the cached attention does not do")
        self.layers = text.num_hidden_layers
        heads = self.heads = text.num_attention_heads
        self.kv_heads = getattr(text, "num_key_value_heads", None) or heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        self.vocab = text.vocab_size
        self.keeps = "logits_to_keep" in inspect.signature(module.forward).parameters
        self.positions = getattr(text, "max_position_embeddings", None) if getattr(text, "model_type", "") == "gpt2" \
            else None
        register()

    @property
    def device(self) -> torch.device:
        return next(iter(_leaves(self.params))).device

    @contextlib.contextmanager
    def _attending(self) -> Iterator[None]:
        saved = [(c, c._attn_implementation_internal) for c in self.configs]
        try:
            for c in self.configs:
                c._attn_implementation_internal = NAME
            yield
        finally:
            for c, name in saved:
                c._attn_implementation_internal = name

    @property
    def dtype(self) -> torch.dtype:
        return next(x for x in _leaves(self.params) if x.is_floating_point()).dtype

    def empty_cache(self, batch: int, slots: int, start: torch.Tensor, dtype: torch.dtype | None) -> KVCache:
        leaf = next(x for x in _leaves(self.params) if x.is_floating_point())
        shape = (batch, slots, self.kv_heads, self.head_dim)
        k = [torch.zeros(shape, dtype=dtype or leaf.dtype, device=leaf.device) for _ in range(self.layers)]
        v = [torch.zeros(shape, dtype=dtype or leaf.dtype, device=leaf.device) for _ in range(self.layers)]
        return KVCache(k, v, start.to(torch.int64), 0)

    def check(self, cache: KVCache, new: int) -> None:
        if cache.length + new > cache.slots:
            raise ValueError(f"generate: {cache.length + new} tokens do not fit the cache's {cache.slots} slots per row")
        if self.positions is not None:
            longest = cache.length + new - int(cache.start.min())
            if longest > self.positions:
                raise ValueError(f"generate: a sequence of {longest} tokens (prompt and new tokens) exceeds the "
                                 f"model's context of {self.positions} learned positions (n_positions)")

    def run(self, tokens: torch.Tensor, pos: torch.Tensor, attend: Any, params: Any = None,
            keep: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, V)`` of ``tokens`` at positions ``pos``, each layer's attention by
        ``attend(layer, q, k, v)`` (as the GPT's ``forward`` takes it); with ``keep`` (token
        indices) those tokens' only (the model's ``logits_to_keep`` where it has one)."""
        kw = {"logits_to_keep": keep} if keep is not None and self.keeps else {}
        _STATE["attend"] = attend
        try:
            with self._attending():
                out = self.fm.apply(self.params if params is None else params, input_ids=tokens, position_ids=pos,
                                    use_cache=False, **kw)
        finally:
            _STATE.clear()
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[:, keep] if keep is not None and not self.keeps else logits

    def forward(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits ``(B, T, V)`` of ``tokens`` put in the cache's next slots."""
        self.check(cache, tokens.shape[1])
        pos, attend = contiguous(cache, tokens.shape[1], tokens.device)
        logits = self.run(tokens, pos, attend)
        cache.length += tokens.shape[1]
        return logits


def _leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
