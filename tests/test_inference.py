"""Generation with the key/value cache (``fs.inference``) against full recomputation."""

from __future__ import annotations

import pytest
import torch

import fsharded as fs
from fsharded.models import gpt
from fsharded.models._gpt_config import MoEConfig

PROMPTS = [[5, 9, 2, 7, 1], [3], [8, 8, 4]]


def recompute(params, prompt, n, moe=None):
    """Greedy decoding by running the whole sequence again for each new token, and each
    step's last logits."""
    seq, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            last = gpt.apply(params, torch.tensor([seq]), attention="einsum", moe=moe, train=False)[0, -1]
            logits.append(last)
            seq.append(int(last.argmax()))
    return seq[len(prompt):], torch.stack(logits)


CONFIGS = {
    "learned": dict(),
    "rotary, grouped-query": dict(positions="rotary", n_kv_heads=2, tied_embeddings=False),
    "llama-style (RMSNorm, SwiGLU, no biases)": dict(positions="rotary", norm="rmsnorm", activation="swiglu", bias=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_with_the_cache_equals_full_recomputation_for_each_prompt_of_a_batch(name):
    cfg = gpt.GPTConfig.tiny(**CONFIGS[name])
    params = gpt.init(cfg, 0)
    out = fs.inference.generate(params, PROMPTS, max_new_tokens=8)
    for prompt, got in zip(PROMPTS, out.tokens):
        want, _ = recompute(params, prompt, 8)
        assert got == want, (name, prompt, got, want)
    assert out.stopped == [False] * 3 and out.decode_tokens == 7 * 3 and out.prefill_tokens == 9


def test_the_cached_logits_are_the_full_forwards():
    params = gpt.init(gpt.GPTConfig.tiny(positions="rotary"), 1)
    prompt = [4, 1, 7]
    cache = fs.inference.KVCache.empty(params, 2, 10, start=torch.tensor([2, 0]))
    # Row 0: the prompt after two padding slots; row 1: other tokens filling every slot.
    rows = torch.tensor([[0, 0, *prompt], [9, 3, 2, 6, 5]])
    first = fs.inference.extend(params, rows, cache)
    nxt = torch.tensor([[11], [12]])
    second = fs.inference.extend(params, nxt, cache)
    with torch.no_grad():
        full0 = gpt.apply(params, torch.tensor([[*prompt, 11]]), attention="einsum")[0]
        full1 = gpt.apply(params, torch.tensor([[9, 3, 2, 6, 5, 12]]), attention="einsum")[0]
    torch.testing.assert_close(first[0, 2:], full0[:3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[0, 0], full0[3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first[1], full1[:5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[1, 0], full1[5], rtol=1e-5, atol=1e-5)
    assert cache.length == 6


def test_a_mixture_of_experts_generates_as_its_dropless_recomputation():
    moe = MoEConfig(experts=4, top_k=2, every=1)
    params = gpt.init(gpt.GPTConfig.tiny(moe=moe), 0)
    out = fs.inference.generate(params, PROMPTS, max_new_tokens=6, moe=moe)
    dropless = MoEConfig(experts=4, top_k=2, every=1, eval_capacity_factor=None)
    for prompt, got in zip(PROMPTS, out.tokens):
        assert got == recompute(params, prompt, 6, moe=dropless)[0]


def test_sampling_with_a_key_is_reproducible_and_filters_as_asked():
    params = gpt.init(gpt.GPTConfig.tiny(), 0)
    key = fs.random.key(7)
    a = fs.inference.generate(params, PROMPTS, max_new_tokens=6, key=key, temperature=1.5)
    b = fs.inference.generate(params, PROMPTS, max_new_tokens=6, key=key, temperature=1.5)
    c = fs.inference.generate(params, PROMPTS, max_new_tokens=6, key=fs.random.key(8), temperature=1.5)
    greedy = fs.inference.generate(params, PROMPTS, max_new_tokens=6)
    assert a.tokens == b.tokens and a.tokens != c.tokens and a.tokens != greedy.tokens
    # top-k 1, a tiny top-p, and temperature 0 leave only the most likely token
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(temperature=0.0)):
        assert fs.inference.generate(params, PROMPTS, max_new_tokens=6, key=key, **kw).tokens == greedy.tokens, kw


def test_sample_draws_each_token_as_often_as_its_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    got = fs.inference.sample(logits, fs.random.key(0))
    freq = torch.bincount(got, minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)
    # top-k 2 renormalises the two most likely; top-p 0.8 keeps the tokens reaching it (0.5 + 0.3)
    for kw in (dict(top_k=2), dict(top_p=0.8)):
        freq = torch.bincount(fs.inference.sample(logits, fs.random.key(1), **kw), minlength=4).float() / 4000
        torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.03, rtol=0)


def test_a_row_stops_at_its_stop_token_and_the_others_go_on():
    params = gpt.init(gpt.GPTConfig.tiny(), 0)
    greedy = fs.inference.generate(params, PROMPTS, max_new_tokens=8)
    stop = greedy.tokens[0][2]
    out = fs.inference.generate(params, PROMPTS, max_new_tokens=8, stop_tokens=[stop])
    for full, got, stopped in zip(greedy.tokens, out.tokens, out.stopped):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert got == full[:cut] and stopped == (stop in full)


def test_bad_input_is_a_clear_error():
    params = gpt.init(gpt.GPTConfig.tiny(), 0)  # 16 learned positions
    with pytest.raises(ValueError, match="exceeds the model's context of 16 learned positions"):
        fs.inference.generate(params, [list(range(10))], max_new_tokens=8)  # (its 17th token read at 16)
    with pytest.raises(ValueError, match="outside the vocabulary of 64"):
        fs.inference.generate(params, [[1, 64]], max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one token"):
        fs.inference.generate(params, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        fs.inference.generate(params, [[1]], max_new_tokens=2, key=fs.random.key(0), top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        fs.inference.generate(params, [[1]], max_new_tokens=2, key=fs.random.key(0), temperature=float("nan"))
    with pytest.raises(ValueError, match="must be integer"):
        fs.inference.generate(params, torch.zeros(2, 0, dtype=torch.int64), max_new_tokens=2)
    # (the last new token is produced, never read: 10 + 7 tokens need 16 positions)
    assert len(fs.inference.generate(params, [list(range(10))], max_new_tokens=7).tokens[0]) == 7


def test_the_module_docstring_example_runs():
    import doctest

    assert doctest.testmod(fs.inference, raise_on_error=False).failed == 0


# -- int8 weight-only ---------------------------------------------------------------------------

INT8_PROMPTS = [list(b"def main("), list(b"import o"), list(b"    return ")]
INT8_LOGIT_TOL = 0.02  # max |logit error| as a fraction of the fp32 logits' standard deviation


@pytest.fixture(scope="module")
def trained_models():
    """Tiny GPTs trained 80 steps on the stdlib corpus (peaked next-token distributions, as a
    real model's are; a random model's near-ties would make any rounding flip a token)."""
    out = {}
    for name, kw in (("learned, tied", {}),
                     ("llama-style, untied", dict(positions="rotary", norm="rmsnorm", activation="swiglu",
                                                  bias=False, n_kv_heads=2, tied_embeddings=False))):
        cfg = gpt.GPTConfig.tiny(vocab_size=256, seq_len=32, **kw)
        step = fs.train_step(gpt.loss, fs.optim.adamw(1e-2))
        state = step.init(gpt.init(cfg, 0))
        data = fs.data.Batches(fs.data.load_tokens("stdlib:200000"), 8, cfg.seq_len, seed=0)
        for i in range(80):
            state, _ = step(state, data.batch_at(i))
        out[name] = step.params(state)
    return out


@pytest.mark.parametrize("group_size", [None, 8])
@pytest.mark.parametrize("name", ["learned, tied", "llama-style, untied"])
def test_int8_weights_stay_within_the_stated_logit_tolerance_and_greedy_matches(trained_models, name, group_size):
    params = trained_models[name]
    q = fs.inference.quantize(params, group_size)
    blk = q["blocks"][0]
    assert all(isinstance(blk["attn"][k], fs.inference.Int8Weight) for k in ("wq", "wk", "wv", "wo"))
    assert isinstance(q["head"], fs.inference.Int8Weight) and q["head"].shape == (16, 256)
    assert "head" not in params or params["head"].shape == (16, 256)
    assert q["emb"] is params["emb"] or torch.equal(q["emb"], params["emb"])  # the lookup stays float
    tokens = torch.tensor([list(b"def main(x):\n    ")] * 2)
    want = fs.inference.extend(params, tokens, fs.inference.KVCache.empty(params, 2, 20))
    got = fs.inference.extend(q, tokens, fs.inference.KVCache.empty(q, 2, 20))
    err = float((got - want).abs().max()) / float(want.std())
    assert 0 < err <= INT8_LOGIT_TOL, err
    assert fs.inference.generate(q, INT8_PROMPTS, 12).tokens == fs.inference.generate(params, INT8_PROMPTS, 12).tokens


def test_int8_with_bf16_activations_and_a_mixture_of_experts(trained_models):
    params = trained_models["learned, tied"]
    q16 = fs.inference.quantize(params, dtype=torch.bfloat16)
    assert q16["emb"].dtype == torch.bfloat16 and q16["head"].scales.dtype == torch.float32
    tokens = torch.tensor([list(b"import os\n")])
    want = fs.inference.extend(params, tokens, fs.inference.KVCache.empty(params, 1, 12))
    got = fs.inference.extend(q16, tokens, fs.inference.KVCache.empty(q16, 1, 12))
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().max()) / float(want.std()) <= 0.1  # int8 and bf16 roundings
    # A mixture of experts: the dense blocks' projections are int8, the experts stay floating.
    moe = MoEConfig(experts=4, top_k=2, every=2)
    mp = gpt.init(gpt.GPTConfig.tiny(moe=moe, init_std=0.2), 0)
    mq = fs.inference.quantize(mp)
    assert isinstance(mq["blocks"][0]["mlp"]["w_in"], fs.inference.Int8Weight)
    assert not any(isinstance(v, fs.inference.Int8Weight) for v in mq["blocks"][1]["mlp"].values())
    a = fs.inference.extend(mp, torch.tensor([[1, 2, 3, 4]]), fs.inference.KVCache.empty(mp, 1, 4), moe=moe)
    b = fs.inference.extend(mq, torch.tensor([[1, 2, 3, 4]]), fs.inference.KVCache.empty(mq, 1, 4), moe=moe)
    assert float((a - b).abs().max()) / float(a.std()) <= 0.1


# -- a compiled decode step ----------------------------------------------------------------------


def test_a_compiled_decode_step_gives_the_eager_tokens_and_is_reused():
    import torch._dynamo

    cfg = gpt.GPTConfig.tiny(positions="rotary", norm="rmsnorm", activation="swiglu", bias=False, n_kv_heads=2,
                             tied_embeddings=False, init_std=0.2)
    params = gpt.init(cfg, 0)
    eager = fs.inference.generate(params, PROMPTS, 8)
    torch._dynamo.utils.counters.clear()
    first = fs.inference.generate(params, PROMPTS, 8, compile=True)
    assert first.tokens == eager.tokens and first.compile_s > 0
    assert first.cache.slots == 64  # 5 + 8 slots, rounded up to 64: one compiled step for many lengths
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    again = fs.inference.generate(params, [[7, 7], [1, 2, 3], [9]], 20, compile=True, key=fs.random.key(4),
                                  temperature=0.7)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompile
    assert again.tokens == fs.inference.generate(params, [[7, 7], [1, 2, 3], [9]], 20, key=fs.random.key(4),
                                                 temperature=0.7).tokens
    q = fs.inference.quantize(gpt.init(gpt.GPTConfig.tiny(init_std=0.2), 0))  # int8, learned positions
    assert fs.inference.generate(q, PROMPTS, 6, compile=True).tokens == fs.inference.generate(q, PROMPTS, 6).tokens
    with pytest.raises(NotImplementedError, match="compile=True decodes the bundled GPT .dense or a mixture of experts. on one device"):
        fs.inference.generate(params, PROMPTS, 2, compile=True, mesh=fs.Mesh({"tensor": 2}))


@pytest.mark.parametrize("biased", [False, True])
def test_a_compiled_decode_step_routes_a_mixture_of_experts_as_eagerly(biased):
    # Dropless routing in static shapes (every expert's buffer as long as the batch), the
    # experts' products row by row: the eager tokens, greedy and drawn, with routing biases
    # (aux-loss-free balancing) from model_state too.
    moe = MoEConfig(experts=4, top_k=2, every=2, bias_update_rate=1e-2 if biased else None)
    params = gpt.init(gpt.GPTConfig.tiny(n_layers=4, moe=moe, init_std=1.0), 0)
    kw = dict(moe=moe)
    if biased:
        ms = gpt.init_model_state(params)
        ms = {"moe_bias": [torch.randn(b.shape, generator=torch.Generator().manual_seed(i)) for i, b in
                           enumerate(ms["moe_bias"])]}
        kw["model_state"] = ms
    eager = fs.inference.generate(params, PROMPTS, 8, **kw)
    got = fs.inference.generate(params, PROMPTS, 8, compile=True, **kw)
    assert got.tokens == eager.tokens and got.compile_s > 0
    assert len({t for row in eager.tokens for t in row}) > 3  # (not one token over and over)
    drawn = dict(key=fs.random.key(2), temperature=0.8)
    assert (fs.inference.generate(params, PROMPTS, 8, compile=True, **drawn, **kw).tokens
            == fs.inference.generate(params, PROMPTS, 8, **drawn, **kw).tokens)
