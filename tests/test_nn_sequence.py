"""fs.nn.sequence_parallel: Hugging Face decoders (Llama with rotary positions and GQA,
GPT-2 with learned positions) with the sequence sharded over a mesh axis by Ulysses, ring
attention (contiguous and zigzag) or both, through transformers' AttentionInterface:
forward, gradients and AdamW steps equal the stock model unsharded, on the virtual mesh
(with data and ZeRO) and on gloo ranks; the errors."""

from __future__ import annotations

import model_zoo as Z
import nn_seq_cases as C
import pytest
import seq_cases as S
import torch

import fsharded as fs
from fsharded import P

pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


_REF: dict = {}


def reference(kind: str) -> dict:
    if kind not in _REF:
        _REF[kind] = C.train(kind)
        # It trains: the comparison has teeth (a wrong gradient moves the loss by far more
        # than the tolerance within these steps).
        assert _REF[kind]["losses"][0] - _REF[kind]["losses"][-1] > 0.1
    return _REF[kind]


CASES = [  # model, mesh, strategy, layout, ZeRO stage
    ("llama", {"seq": 2}, "ulysses", "contiguous", 0),
    ("llama", {"seq": 4}, "ulysses", "contiguous", 0),  # 2 kv heads over 4 ranks: repeated
    ("llama", {"seq": 2}, "ring", "contiguous", 0),
    ("llama", {"seq": 4}, "ring", "zigzag", 0),
    ("llama", {"data": 2, "seq": 2}, "ulysses", "contiguous", 3),
    ("llama", {"data": 2, "seq": 2}, "ring", "zigzag", 2),
    ("llama", {"seq_ring": 2, "seq": 2}, "hybrid", "contiguous", 0),
    ("gpt2", {"seq": 2}, "ring", "zigzag", 0),
    ("gpt2", {"data": 2, "seq": 2}, "ulysses", "contiguous", 3),
]


@pytest.mark.parametrize("kind,mesh,strategy,layout,stage", CASES,
                         ids=lambda v: "-".join(f"{k}{n}" for k, n in v.items()) if isinstance(v, dict) else str(v))
def test_training_equals_the_unsharded_model(kind, mesh, strategy, layout, stage):
    # fp32; S.close: losses within 1e-5, weights within 2e-5 (Adam turns the reduction-order
    # rounding of near-zero gradients into visible steps, see seq_cases.close).
    S.close(C.train(kind, mesh, strategy, layout, zero_stage=stage), reference(kind))


@pytest.mark.parametrize("kind,mesh,strategy,layout", [
    ("llama", {"seq": 4}, "ulysses", "contiguous"),  # 29 -> 32: the last shard holds 5 real targets of 8
    ("gpt2", {"seq": 2}, "ring", "zigzag"),  # 29 -> 32: shard 0 (chunks 0 and 3) holds 13 real targets, shard 1 16
])
def test_a_length_that_does_not_divide_is_padded_and_masked(kind, mesh, strategy, layout):
    # Shards hold different numbers of real tokens: the loss divides by the global count, so
    # the step's mean over shards is the mean over real tokens (a per-shard mean is not).
    S.close(C.train(kind, mesh, strategy, layout, length=29), C.train(kind, length=29))


@pytest.mark.parametrize("kind,strategy,n,layout", [
    ("llama", "ulysses", 2, "contiguous"), ("llama", "ring", 4, "zigzag"),
    ("gpt2", "ulysses", 4, "contiguous"), ("gpt2", "ring", 2, "contiguous"),
    ("mistral", "ulysses", 2, "contiguous"),  # a sliding window (8) shorter than the sequence (32)
])
def test_logits_and_gradients_equal_the_stock_model(kind, strategy, n, layout):
    r = C.forward_and_grads(kind, strategy, n, layout)
    # fp32 attention in another summation order (blocks merged by log-sum-exp): ~1e-7.
    torch.testing.assert_close(r["logits"], r["ref_logits"], atol=1e-5, rtol=1e-5)
    assert len(r["grads"]) == len(r["ref_grads"])
    for a, b in zip(r["grads"], r["ref_grads"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_outside_shard_map_it_is_the_stock_model():
    # The switched model (and apply) compute what eager attention computed: plain causal
    # attention over the whole sequence, positions 0..T-1.
    x = C.shifted(C.batches(1)[0])["inputs"]
    want = C.build("llama")(input_ids=x).logits
    model = C.build("llama")
    sp = fs.nn.sequence_parallel(model, strategy="ring", layout="zigzag")
    assert model.config._attn_implementation == sp.attn_implementation == "fsharded_ring_zigzag_seq"
    torch.testing.assert_close(model(input_ids=x).logits, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sp.apply(sp.params, x).logits, want, atol=1e-6, rtol=1e-5)
    assert sp.batch_spec("data") == P("data", "seq") and sp.blocks == "model.layers"
    # prepare: shifted, padded to the degree (twice it for zigzag), zigzagged; restore inverts
    b = sp.prepare({"tokens": torch.arange(8).view(1, 8)}, fs.Mesh({"seq": 2}))
    assert b["inputs"].tolist() == [[0, 1, 6, 0, 2, 3, 4, 5]]  # chunks 0, 3 | 1, 2 of 4
    assert sp.restore(b["inputs"], 2).tolist() == [[0, 1, 2, 3, 4, 5, 6, 0]]
    assert sp.restore(b["targets"], 2).tolist() == [[1, 2, 3, 4, 5, 6, 7, fs.nn.IGNORE]]


@pytest.mark.multiprocess
def test_gloo_ranks_equal_the_unsharded_model():
    from fsharded.testing import run_on_ranks

    ref = reference("llama")
    for r in run_on_ranks(C.gloo_runs, 2):
        S.close(r["ring"], ref)
        S.close(r["ulysses_zero3"], ref)


def _sharded_forward(sp, n: int, x: torch.Tensor, **kw):
    return fs.shard_map(lambda p, x: sp.apply(p, x, **kw).logits, mesh=fs.Mesh({"seq": n}),
                        in_specs=(P(), P(None, "seq")), out_specs=P(None, "seq"))(sp.params, x)


def test_mistakes_are_named():
    x = C.shifted(C.batches(1)[0])["inputs"]  # (4, 32)
    # 4 query heads over a Ulysses degree of 8; ring has no head cap
    sp = fs.nn.sequence_parallel(C.build("llama"), strategy="ulysses")
    with pytest.raises(ValueError, match=r"LlamaAttention has 4 query heads, which do not divide by 8: .*ring"):
        _sharded_forward(sp, 8, x)
    # a padding mask: refused on the way in, by HF's mask step, and in the attention (4-d)
    ones = torch.ones_like(x)
    with pytest.raises(NotImplementedError, match="attention mask.*Pass no attention_mask"):
        sp.apply(sp.params, x, attention_mask=ones)
    with pytest.raises(NotImplementedError, match="2-d attention_mask"):
        sp.module(input_ids=x, attention_mask=ones)
    with pytest.raises(NotImplementedError, match=r"\(4, 1, 32, 32\) mask reached LlamaAttention"):
        sp.module(input_ids=x, attention_mask=torch.zeros(4, 1, 32, 32))
    with pytest.raises(ValueError, match="position_ids are computed"):
        sp.apply(sp.params, x, position_ids=torch.arange(32)[None])
    with pytest.raises(ValueError, match=r"use SequenceParallel.prepare"):
        sp.loss(sp.params, {"tokens": torch.zeros(4, 33, dtype=torch.int64)})
    # options
    with pytest.raises(ValueError, match="zigzag.*contiguous layout"):
        fs.nn.sequence_parallel(C.build("llama"), strategy="ulysses", layout="zigzag")
    with pytest.raises(ValueError, match="strategy must be one of"):
        fs.nn.sequence_parallel(C.build("llama"), strategy="rings")
    with pytest.raises(ValueError, match=r"axis=\(ring_axis, ulysses_axis\)"):
        fs.nn.sequence_parallel(C.build("llama"), strategy="hybrid", axis="seq")
    # not a transformers model (the HF-style module of model_zoo has no AttentionInterface)
    with pytest.raises(NotImplementedError, match="not a Hugging Face model"):
        fs.nn.sequence_parallel(Z.llama())
    # attention dropout in training mode
    drop = fs.nn.sequence_parallel(C.build("llama", attention_dropout=0.1).train())
    with pytest.raises(NotImplementedError, match=r"attention dropout \(p=0.1\)"):
        drop.apply(drop.params, x)
    # a sliding window shorter than the sequence: Ulysses only
    ring = fs.nn.sequence_parallel(C.build("mistral"), strategy="ring")
    with pytest.raises(NotImplementedError, match="sliding window of 8 tokens under ring attention"):
        _sharded_forward(ring, 2, x)
