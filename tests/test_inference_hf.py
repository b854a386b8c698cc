"""Hugging Face causal LMs built from a config (GPT-2, Llama with grouped-query attention)
generating with fsharded's cache: the same greedy tokens as transformers' own ``generate``
and as full recomputation, for each prompt of a left-padded batch; and the bundled GPT's
weights exported to the matching transformers model generate what ``fs.inference`` does."""

from __future__ import annotations

import inference_cases as C
import pytest
import torch

import fsharded as fs
from fsharded.models import gpt

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 2, 7, 1], [3], [8, 8, 4, 200, 17, 3, 90]]


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    return C.hf_model(kind, seed, positions=32)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_with_our_cache_equals_transformers_generate(kind):
    model = build(kind)
    out = fs.inference.generate(model, PROMPTS, max_new_tokens=10)
    for prompt, got in zip(PROMPTS, out.tokens):
        assert got == hf_greedy(model, prompt, 10), (kind, prompt)
    assert out.cache.k[0].shape == ((3, 17, 2, 8) if kind == "llama" else (3, 17, 2, 16))  # (B, slots, KV, Dh)
    # fs.nn.functional of it, with other weights: the cache runs through apply(params)
    fm = fs.nn.functional(model)
    other = build(kind, seed=1)
    fm.params = fs.nn.functional(other).params
    assert fs.inference.generate(fm, PROMPTS, max_new_tokens=6).tokens == \
        fs.inference.generate(other, PROMPTS, max_new_tokens=6).tokens
    assert model.config._attn_implementation == "sdpa"  # switched only while it runs


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_cached_logits_equal_the_models_own_forward(kind):
    model = build(kind)
    out = fs.inference.generate(model, PROMPTS, max_new_tokens=3)
    for prompt, new in zip(PROMPTS, out.tokens):
        with torch.no_grad():
            full = model(torch.tensor([prompt + new])).logits[0]
        assert [int(t) for t in full[len(prompt) - 1:-1].argmax(-1)] == new
    # a padded row's prefill logits, against its own forward
    from fsharded.inference._hf import HFDecoder

    dec = HFDecoder(model)
    cache = dec.empty_cache(2, 9, torch.tensor([4, 0]), None)
    with torch.no_grad():
        got = dec.forward(torch.tensor([[0, 0, 0, 0, 5, 9, 2], [1, 2, 3, 4, 5, 6, 7]]), cache)
        for row, toks in ((0, [5, 9, 2]), (1, [1, 2, 3, 4, 5, 6, 7])):
            want = model(torch.tensor([toks])).logits[0]
            torch.testing.assert_close(got[row, 7 - len(toks):], want, rtol=1e-5, atol=1e-5)


def test_sampling_a_hugging_face_model_is_reproducible_and_errors_are_named():
    model = build("llama")
    a = fs.inference.generate(model, PROMPTS, 8, key=fs.random.key(2), temperature=0.9, top_p=0.95)
    b = fs.inference.generate(model, PROMPTS, 8, key=fs.random.key(2), temperature=0.9, top_p=0.95)
    assert a.tokens == b.tokens != fs.inference.generate(model, PROMPTS, 8).tokens
    with pytest.raises(ValueError, match="outside the vocabulary of 256"):
        fs.inference.generate(model, [[1, 256]], 2)
    with pytest.raises(ValueError, match="exceeds the model's context of 32 learned positions"):
        fs.inference.generate(build("gpt2"), [list(range(30))], 8)
    with pytest.raises(NotImplementedError, match="takes no moe="):
        fs.inference.generate(model, [[1]], 2, moe=gpt.MoEConfig(experts=2))
    with pytest.raises(NotImplementedError, match="splits the heads over a 'tensor' axis only"):
        fs.inference.generate(model, [[1], [2]], 2, mesh=fs.Mesh({"data": 2}))
    with pytest.raises(NotImplementedError, match="is not a Hugging Face model"):
        fs.inference.generate(torch.nn.Linear(2, 2), [[1]], 2)


EXPORTS = {
    "GPT2LMHeadModel": gpt.GPTConfig.tiny(vocab_size=256, seq_len=32, init_std=0.2),
    "LlamaForCausalLM, grouped-query, untied": gpt.GPTConfig.llama_style(d_model=32, n_layers=2, n_heads=4,
                                                                       vocab_size=256, seq_len=32, init_std=0.2),
    "LlamaForCausalLM, tied": gpt.GPTConfig.llama_style(d_model=32, n_layers=2, n_heads=4, n_kv_heads=None,
                                                      tied_embeddings=True, vocab_size=256, seq_len=32, init_std=0.2),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_the_gpt_exported_to_transformers_generates_our_tokens(name):
    cfg = EXPORTS[name]
    params = gpt.init(cfg, 0)
    model = fs.inference.to_transformers(params, cfg)
    assert type(model).__name__ == name.split(",")[0]
    x = torch.tensor([[5, 9, 2, 7, 1, 33]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, gpt.apply(params, x, attention="einsum", train=False),
                                   rtol=1e-5, atol=1e-5)
    ours = fs.inference.generate(params, PROMPTS, max_new_tokens=10)
    for prompt, got in zip(PROMPTS, ours.tokens):
        assert got == hf_greedy(model, prompt, 10), (name, prompt)
    assert fs.inference.generate(model, PROMPTS, max_new_tokens=10).tokens == ours.tokens  # our cache in theirs


def test_a_gpt_without_a_stock_transformers_model_is_refused():
    for cfg in (gpt.GPTConfig.tiny(positions="rotary"), gpt.GPTConfig.tiny(moe={"experts": 4})):
        with pytest.raises(ValueError, match="to_transformers"):
            fs.inference.to_transformers(gpt.init(cfg, 0), cfg)


def test_attention_options_the_cache_does_not_apply_are_refused():
    # (sliding windows, soft-capping, GPT-2's own scalings: generating would give other logits)
    torch.manual_seed(0)
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8)).eval()
    with pytest.raises(NotImplementedError, match="sliding_window=8"):
        fs.inference.generate(mistral, [[1, 2, 3]], 2)
    for flag in (dict(scale_attn_by_inverse_layer_idx=True), dict(scale_attn_weights=False)):
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32,
                                                                    n_layer=2, n_head=2, **flag)).eval()
        with pytest.raises(NotImplementedError, match="scales its attention its own way"):
            fs.inference.generate(gpt2, [[1, 2, 3]], 2)
