"""Hugging Face models' default attention (``attn_implementation="sdpa"``) through
fsharded's flash attention, and switching a model's attention implementation.

A ``transformers`` model built from a config gets SDPA attention by default: it calls
``torch.nn.functional.scaled_dot_product_attention``, whose CPU kernel has no batching
rule, so under ``torch.vmap`` (every axis of the virtual mesh) torch runs it sample by
sample and warns each time; and HF's SDPA mask decides whether a padding mask can be
skipped by reading its values (``attention_mask.all()``), which a vmapped program cannot
do. While ``fs.nn.functional(model).apply`` runs, configs that read ``"sdpa"`` read
``"fsharded_sdpa"`` instead (restored on exit; ``uses``), registered with transformers'
``AttentionInterface`` and ``AttentionMaskInterface``:

- causal or full attention without a mask or dropout (training on unpadded batches) runs
  ``fsharded.kernels.attention.flash_attention``, which has fake, autograd and vmap rules;
  on CPU it is the same fused kernel SDPA runs, so the numbers are SDPA's;
- anything the fused kernel cannot take runs the eager form, torch's documented SDPA math
  with explicit weights (the same numbers, up to the order of fp32 sums): a padding or
  custom mask, attention dropout (``F.dropout`` on the weights, which inside a
  ``train_step`` or ``fs.random.scope`` draws from fsharded's keys: reproducible, the same
  on the virtual mesh and on real ranks), ``head_mask``, ``output_attentions``.

The mask function is HF's ``sdpa_mask``, except that a given ``attention_mask`` is always
built into the mask instead of being tested for all ones (the test reads values). Rows a
mask leaves without any key give zeros, as SDPA does (eager attention would average all
keys there). Models whose attention does not dispatch through ``AttentionInterface``
keep their own. With ``output_attentions=True`` or a ``head_mask``, ``apply`` switches to
HF's ``"eager"`` instead, which is what HF asks for (its SDPA returns no weights and
ignores a head mask).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsharded.kernels.attention import flash_attention

__all__ = ["NAME", "HFAttention", "hf_attention", "sdpa_attention", "switch"]

NAME = "fsharded_sdpa"


def _hf_config(module: nn.Module) -> Any:
    config = getattr(module, "config", None)
    return config if config is not None and hasattr(config, "_attn_implementation") else None


def switch(module: nn.Module, name: str) -> None:
    """Point ``module``'s attention at ``name`` for good (``set_attn_implementation``), or
    say why it cannot be (``fs.nn.sequence_parallel``)."""
    config = _hf_config(module)
    if config is None:
        raise NotImplementedError(
            f"fs.nn.sequence_parallel: {type(module).__name__} is not a Hugging Face model (no "
            f"config._attn_implementation): its attention must dispatch through transformers' "
            f"AttentionInterface. For the bundled GPT use fsharded.models.gpt.loss(seq_axis=..., "
            f"seq_parallel=...)")
    setter = getattr(module, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:
        config._attn_implementation = name
    if config._attn_implementation != name:
        raise NotImplementedError(
            f"fs.nn.sequence_parallel: {type(module).__name__} kept attn_implementation "
            f"{config._attn_implementation!r}: it does not dispatch its attention through transformers' "
            f"AttentionInterface, so the sequence-parallel attention cannot be plugged in")


class HFAttention:
    """The configs of a Hugging Face model whose attention ``fs.nn`` may switch while it
    runs the model (``hf_attention``)."""

    def __init__(self, configs: list) -> None:
        self.configs = configs
        register()

    def choose(self, kwargs: Mapping[str, Any]) -> str:
        """The implementation a call with ``kwargs`` runs SDPA layers as: HF's eager form
        when it asks for the attention weights or passes a head mask (they need the weights
        formed; HF's own SDPA gives no weights and drops the head mask), else ours."""
        wants = kwargs.get("output_attentions")
        if wants is None:
            wants = any(getattr(c, "output_attentions", False) for c in self.configs)
        return "eager" if wants or kwargs.get("head_mask") is not None else NAME

    @contextlib.contextmanager
    def uses(self, name: str) -> Iterator[None]:
        """While entered, configs that read ``"sdpa"`` read ``name``; others (eager, a
        sequence-parallel name) are left alone. Not thread-safe, as ``apply`` is not."""
        saved = []
        try:
            for config in self.configs:
                if config._attn_implementation == "sdpa":
                    saved.append(config)
                    # the internal field: the property's setter would recurse into sub-configs
                    config._attn_implementation_internal = name
            yield
        finally:
            for config in saved:
                config._attn_implementation_internal = "sdpa"


def hf_attention(module: nn.Module) -> HFAttention | None:
    """``HFAttention`` for a Hugging Face model whose attention dispatches through
    ``AttentionInterface`` (its sub-models' and sub-configs' too), else None."""
    configs: dict[int, Any] = {}
    for m in module.modules():
        config = _hf_config(m)
        can = getattr(type(m), "_can_set_attn_implementation", None)
        if config is None or can is None or not hasattr(config, "_attn_implementation_internal") or not can():
            continue
        for c in [config, *(getattr(config, k, None) for k in getattr(config, "sub_configs", {}))]:
            if c is not None and hasattr(c, "_attn_implementation_internal"):
                configs.setdefault(id(c), c)
    return HFAttention(list(configs.values())) if configs else None


def register() -> str:
    """Register ``NAME`` with transformers (idempotent) and return it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, sdpa_attention)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME


def _mask(*args: Any, attention_mask: torch.Tensor | None = None, allow_is_causal_skip: bool = True,
          **kwargs: Any) -> Any:
    """HF's ``sdpa_mask``, without its skip of an all-ones padding mask: the skip reads the
    mask's values (``.all()``), which fails under vmap. No mask at all still gives None."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask,
                     allow_is_causal_skip=allow_is_causal_skip and attention_mask is None, **kwargs)


def sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF's ``sdpa_attention_forward`` by fsharded's kernels: q ``(B, H, Tq, Dh)``, k/v
    ``(B, KV, Tk, Dh)`` (GQA unrepeated), a bool (True: attend) or additive mask broadcast
    to ``(B, H, Tq, Tk)`` -> ``((B, Tq, H, Dh), weights or None)``.

    The scale is ``scaling`` or ``1/sqrt(Dh)``, as in SDPA: GPT-2's
    ``scale_attn_by_inverse_layer_idx`` and ``scale_attn_weights=False`` reach only its eager
    attention, in HF too."""
    name = type(module).__name__
    for k in ("s_aux", "softcap"):
        if kwargs.get(k) is not None:
            raise NotImplementedError(f"fs.nn attention: {name} passes {k}= (attention sinks / logit "
                                      f"soft-capping), which HF's SDPA attention does not apply either; "
                                      f"build the model with attn_implementation='eager'")
    head_mask, weights = kwargs.get("head_mask"), bool(kwargs.get("output_attentions"))
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if is_causal is None:  # SDPA's rule: causal self-attention unless a mask says otherwise
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    is_causal = bool(is_causal)
    if (attention_mask is None and not dropout and head_mask is None and not weights
            and (not is_causal or query.shape[2] == key.shape[2])):
        # flash's causal mask is aligned at the last key, SDPA's at the first: equal for Tq == Tk
        out = flash_attention(query, key, value, causal=is_causal, scale=scaling)
        return out.transpose(1, 2), None
    # The eager form: a mask of any shape, dropout and head_mask act on weights the fused kernel never forms.
    out, w = _eager(query, key, value, attention_mask, dropout, scaling, is_causal, head_mask)
    return out.transpose(1, 2).contiguous(), (w if weights else None)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float,
           scale: float | None, causal: bool, head_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's documented SDPA math (its order of operations, as ``fsharded.random``'s
    keyed SDPA has it), with SDPA's softmax: a row without any visible key gives zeros."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (B, H, Tk, Dh)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale  # (B, H, Tq, Tk)
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    seen = (scores > float("-inf")).any(-1, keepdim=True)  # (B, H, Tq, 1)
    w = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen  # no NaN in value or gradient
    if dropout:
        w = F.dropout(w, dropout, training=True)  # keyed under fs.random.scope / train_step
    if head_mask is not None:
        w = w * head_mask
    return w @ v, w
