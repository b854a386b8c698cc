"""The bundled GPT's weights as the matching ``transformers`` model, to check generation
against transformers' own ``generate`` or to hand a trained model on.

- learned positions, LayerNorm, GELU, biases, a tied head: ``GPT2LMHeadModel``
  (``activation_function="gelu"``, the exact GELU the GPT uses; Conv1D weights ``(in,
  out)``: ``c_attn`` the query, key and value projections side by side);
- rotary positions, RMSNorm, SwiGLU, no biases (``GPTConfig.llama_style``):
  ``LlamaForCausalLM`` (grouped-query heads, a tied or untied head; the same half-split
  rotary layout and ``ROPE_THETA``).

Other combinations have no stock transformers model and are refused, naming what does not
map. The weights are copied (the model owns its tensors).
"""

from __future__ import annotations

from typing import Any

import torch

from fsharded.models import gpt
from fsharded.models._gpt_config import GPTConfig

__all__ = ["to_transformers"]


def _flat_in(w: torch.Tensor) -> torch.Tensor:
    """(D, h, Dh) -> (D, h * Dh)."""
    return w.reshape(w.shape[0], -1)


def to_transformers(params: dict, config: GPTConfig) -> Any:
    """A ``transformers`` causal LM holding ``params`` of a GPT built with ``config``."""
    import transformers

    c = config
    if c.moe is not None:
        raise ValueError("to_transformers: a mixture-of-experts GPT has no stock transformers model here")
    gpt2 = dict(positions="learned", norm="layernorm", activation="gelu", bias=True, tied_embeddings=True)
    llama = dict(positions="rotary", norm="rmsnorm", activation="swiglu", bias=False)
    if all(getattr(c, k) == v for k, v in gpt2.items()) and c.n_kv_heads in (None, c.n_heads):
        return _gpt2(params, c, transformers)
    if all(getattr(c, k) == v for k, v in llama.items()):
        return _llama(params, c, transformers)
    raise ValueError(f"to_transformers: {c} matches neither GPT-2 ({gpt2}, no grouped-query heads) nor Llama "
                     f"({llama}); build the GPT as one of them")


def _load(model: Any, state: dict[str, torch.Tensor]) -> Any:
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith(".attn.bias") and not k.endswith("masked_bias")
               and "rotary_emb" not in k and k != "lm_head.weight"]
    if missing:
        raise RuntimeError(f"to_transformers: no weights for {missing[:4]}")
    with torch.no_grad():
        for k, v in state.items():
            if own[k].shape != v.shape:
                raise RuntimeError(f"to_transformers: {k} is {tuple(own[k].shape)} in the model, {tuple(v.shape)} here")
            own[k].copy_(v)
    return model.eval()


def _gpt2(p: dict, c: GPTConfig, transformers: Any) -> Any:
    cfg = transformers.GPT2Config(vocab_size=c.vocab_size, n_positions=p["pos"].shape[0], n_embd=c.d_model,
                                  n_layer=c.n_layers, n_head=c.n_heads, n_inner=c.d_ff, activation_function="gelu",
                                  layer_norm_epsilon=gpt.NORM_EPS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  tie_word_embeddings=True)
    model = transformers.GPT2LMHeadModel(cfg)
    s = {"transformer.wte.weight": p["emb"], "transformer.wpe.weight": p["pos"],
         "transformer.ln_f.weight": p["final_norm"]["w"], "transformer.ln_f.bias": p["final_norm"]["b"]}
    for i, b in enumerate(p["blocks"]):
        a, m, pre = b["attn"], b["mlp"], f"transformer.h.{i}."
        s.update({
            pre + "ln_1.weight": b["norm1"]["w"], pre + "ln_1.bias": b["norm1"]["b"],
            pre + "ln_2.weight": b["norm2"]["w"], pre + "ln_2.bias": b["norm2"]["b"],
            pre + "attn.c_attn.weight": torch.cat([_flat_in(a["wq"]), _flat_in(a["wk"]), _flat_in(a["wv"])], 1),
            pre + "attn.c_attn.bias": torch.cat([a["bq"].reshape(-1), a["bk"].reshape(-1), a["bv"].reshape(-1)]),
            pre + "attn.c_proj.weight": a["wo"].reshape(-1, c.d_model), pre + "attn.c_proj.bias": a["bo"],
            pre + "mlp.c_fc.weight": m["w_in"], pre + "mlp.c_fc.bias": m["b_in"],
            pre + "mlp.c_proj.weight": m["w_out"], pre + "mlp.c_proj.bias": m["b_out"]})
    return _load(model, s)


def _llama(p: dict, c: GPTConfig, transformers: Any) -> Any:
    kv = c.n_kv_heads or c.n_heads
    cfg = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff,
                                   num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                                   num_key_value_heads=kv, head_dim=c.head_dim, rms_norm_eps=gpt.NORM_EPS,
                                   rope_theta=gpt.ROPE_THETA, max_position_embeddings=max(c.seq_len, 2048),
                                   tie_word_embeddings=c.tied_embeddings, attention_bias=False, mlp_bias=False)
    model = transformers.LlamaForCausalLM(cfg)
    s = {"model.embed_tokens.weight": p["emb"], "model.norm.weight": p["final_norm"]["w"]}
    if not c.tied_embeddings:
        s["lm_head.weight"] = p["head"].T
    for i, b in enumerate(p["blocks"]):
        a, m, pre = b["attn"], b["mlp"], f"model.layers.{i}."
        s.update({
            pre + "input_layernorm.weight": b["norm1"]["w"], pre + "post_attention_layernorm.weight": b["norm2"]["w"],
            pre + "self_attn.q_proj.weight": _flat_in(a["wq"]).T, pre + "self_attn.k_proj.weight": _flat_in(a["wk"]).T,
            pre + "self_attn.v_proj.weight": _flat_in(a["wv"]).T,
            pre + "self_attn.o_proj.weight": a["wo"].reshape(-1, c.d_model).T,
            pre + "mlp.gate_proj.weight": m["w_gate"].T, pre + "mlp.up_proj.weight": m["w_up"].T,
            pre + "mlp.down_proj.weight": m["w_down"].T})
    return _load(model, s)
