"""Sequence parallelism in the bundled GPT (fsharded/parallel/{sequence,ulysses,ring}.py):
forward, gradients and 10 adamw steps against the unsharded model, on the virtual mesh
(with data, tensor and ZeRO) and on gloo ranks; GQA/MQA below the degree; the causal
balance of the zigzag layout; the bytes per layer each strategy moves; the errors."""

from __future__ import annotations

import optree
import pytest
import seq_cases as S
import torch

import fsharded as fs
from fsharded import P
from fsharded.models import gpt
from fsharded.parallel import ring, sequence, ulysses


@pytest.fixture(scope="module")
def reference() -> dict:
    return {(pos, kv): S.train({"data": 1}, positions=pos, kv=kv)
            for pos, kv in (("learned", None), ("rotary", None), ("rotary", 1), ("rotary", 2))}


CASES = [  # mesh, strategy, layout, ZeRO stage, positions, kv heads, tensor parallel
    ({"seq": 2}, "ulysses", "contiguous", 0, "learned", None, False),
    ({"seq": 4}, "ulysses", "contiguous", 0, "learned", None, False),
    ({"seq": 4}, "ulysses", "contiguous", 0, "rotary", 1, False),  # MQA: 1 kv head over 4 ranks
    ({"seq": 2}, "ring", "contiguous", 0, "learned", None, False),
    ({"seq": 4}, "ring", "zigzag", 0, "rotary", 2, False),
    ({"data": 2, "seq": 2}, "ulysses", "contiguous", 3, "learned", None, False),
    ({"data": 2, "seq": 2}, "ring", "zigzag", 1, "learned", None, False),
    ({"data": 2, "seq": 2}, "ring", "contiguous", 2, "rotary", 2, False),
    ({"tensor": 2, "seq": 2}, "ulysses", "contiguous", 0, "learned", None, True),
    ({"tensor": 2, "seq": 2}, "ring", "zigzag", 0, "rotary", 2, True),
    # A data axis of size 1 beside a sharded one (the loss stays typed invariant, the update
    # takes the per-leaf form for batched gradients).
    ({"data": 1, "seq": 2}, "ulysses", "contiguous", 0, "learned", None, False),
    ({"data": 1, "tensor": 2}, None, "contiguous", 0, "learned", None, True),
    # Hybrid: Ulysses over seq inside, ring over seq_ring across (with data and ZeRO-3)
    ({"seq_ring": 2, "seq": 2}, "hybrid", "contiguous", 0, "rotary", 2, False),
    ({"data": 2, "seq_ring": 2, "seq": 2}, "hybrid", "contiguous", 3, "learned", None, False),
    # Megatron-SP: the sequence over the tensor axis between the tensor-parallel layers
    ({"tensor": 2}, "megatron", "contiguous", 0, "learned", None, True),
    ({"tensor": 4}, "megatron", "contiguous", 0, "rotary", None, True),
    ({"data": 2, "tensor": 2}, "megatron", "contiguous", 3, "learned", None, True),
    ({"data": 2, "tensor": 2}, "megatron", "contiguous", 2, "rotary", None, True),
]


@pytest.mark.parametrize("mesh,strategy,layout,stage,positions,kv,tensor", CASES,
                                              ids=lambda v: "-".join(f"{k}{n}" for k, n in v.items()) if isinstance(v, dict) else str(v))
def test_training_equals_the_unsharded_model_on_the_virtual_mesh(reference, mesh, strategy, layout, stage,
                                                                 positions, kv, tensor):
    got = S.train(mesh, strategy, layout, zero_stage=stage, positions=positions, kv=kv, tensor=tensor)
    S.close(got, reference[(positions, kv)])


def _forward_and_grads(strategy: str, n: int, layout: str, positions: str, kv: int | None):
    cfg = S.config(positions, kv)
    params = gpt.init(cfg, 0)
    batch = S.batches(cfg, 1)[0]
    kw = {"attention": "einsum"}
    ref_out = gpt.apply(params, batch["inputs"], **kw)
    ref_g = torch.func.grad(lambda p: gpt.loss(p, batch, **kw))(params)
    mesh = fs.Mesh({"seq": n})
    kw.update(seq_axis="seq", seq_parallel=strategy, seq_layout=layout)
    b = {k: sequence.zigzag(v, n) if layout == "zigzag" else v for k, v in batch.items()}
    out = fs.shard_map(lambda p, x: gpt.apply(p, x, **kw), mesh=mesh, in_specs=(P(), P(None, "seq")),
                       out_specs=P(None, "seq"))(params, b["inputs"])
    if layout == "zigzag":
        out = sequence.unzigzag(out, n)
    loss = fs.shard_map(lambda p, b: fs.pmean(gpt.loss(p, b, **kw), "seq"), mesh=mesh,
                        in_specs=(P(), P(None, "seq")), out_specs=P())
    g = torch.func.grad(loss)(params, b)
    return out, ref_out, g, ref_g


@pytest.mark.parametrize("strategy,n,layout,positions,kv", [
    ("ulysses", 2, "contiguous", "learned", None), ("ulysses", 4, "contiguous", "rotary", 2),
    ("ring", 4, "contiguous", "learned", None), ("ring", 2, "zigzag", "rotary", 1),
])
def test_forward_and_gradients_inside_shard_map(strategy, n, layout, positions, kv):
    out, ref_out, g, ref_g = _forward_and_grads(strategy, n, layout, positions, kv)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    for a, b in zip(optree.tree_leaves(g), optree.tree_leaves(ref_g)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("strategy,mesh,layout,positions", [
    ("ulysses", {"seq": 4}, "contiguous", "learned"),  # 29 tokens padded to 32: fits the table
    ("ring", {"seq": 2}, "zigzag", "rotary"),  # 29 -> 32, the padding spread by the zigzag
    ("hybrid", {"seq_ring": 2, "seq": 2}, "contiguous", "rotary"),
    ("megatron", {"tensor": 2}, "contiguous", "rotary"),
])
def test_a_length_that_does_not_divide_is_padded_and_masked(strategy, mesh, layout, positions):
    want = S.train({"data": 1}, positions=positions, length=29)
    S.close(S.train(mesh, strategy, layout, positions=positions, length=29, tensor=strategy == "megatron"), want)
    b = gpt.shift({"tokens": torch.arange(8).view(1, 8)}, multiple=4)
    assert b["inputs"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 0]] and b["targets"].tolist() == [[1, 2, 3, 4, 5, 6, 7, -100]]


@pytest.mark.parametrize("strategy,layout,stage", [("ulysses", "contiguous", 1), ("ring", "zigzag", 3)])
def test_data_tensor_and_seq_with_zero_and_remat(reference, strategy, layout, stage):
    # 8 devices: data x tensor x seq, every block recomputed in backward
    got = S.train({"data": 2, "tensor": 2, "seq": 2}, strategy, layout, zero_stage=stage, tensor=True, remat=True)
    S.close(got, reference[("learned", None)])


def test_the_hybrid_passes_the_head_count():
    # 2 heads over a sequence degree of 8 (ring 4 x Ulysses 2); Ulysses alone stops at 2.
    want = S.train({"data": 1}, heads=2, positions="rotary", kv=1)
    S.close(S.train({"seq_ring": 4, "seq": 2}, "hybrid", heads=2, positions="rotary", kv=1), want)
    with pytest.raises(ValueError, match="2 query heads, which do not divide by 4"):
        S.train({"seq": 4}, "ulysses", heads=2)


def test_zigzag_balances_the_causal_work():
    # 4 shards of a 64-token sequence: the (query, key) pairs each shard's queries see.
    contiguous, zigzag = ring.causal_pairs(64, 4, "contiguous"), ring.causal_pairs(64, 4, "zigzag")
    assert contiguous == [136, 392, 648, 904]  # 16 queries at positions 16i..16i+15
    assert zigzag == [520, 520, 520, 520] and sum(zigzag) == sum(contiguous) == 64 * 65 // 2
    x = torch.arange(16).view(1, 16)
    assert sequence.zigzag(x, 2).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]]
    assert torch.equal(sequence.unzigzag(sequence.zigzag(x, 4), 4), x)


def test_kv_heads_are_repeated_only_as_far_as_the_degree_needs():
    assert ulysses.kv_heads_for(8, 8, 4) == 8
    assert ulysses.kv_heads_for(8, 2, 4) == 4  # each of 2 kv heads twice
    assert ulysses.kv_heads_for(8, 1, 4) == 4
    assert ulysses.kv_heads_for(12, 2, 3) == 6
    assert ulysses.kv_heads_for(8, 3, 8) == 8


def _manifest(strategy: str, n: int, kv: int | None) -> tuple:
    cfg = S.config("learned", kv)
    params = gpt.init(cfg, 0)
    x = S.batches(cfg, 1)[0]["inputs"]  # (4, 32)
    kw = dict(attention="einsum", seq_axis="seq", seq_parallel=strategy)
    sm = fs.shard_map(lambda p, x: gpt.apply(p, x, **kw), mesh=fs.Mesh({"seq": n}), in_specs=(P(), P(None, "seq")),
                      out_specs=P(None, "seq"))
    return cfg, x.shape, [e for e in sm.collectives(params, x) if e.axis == "seq"]


@pytest.mark.parametrize("n", [2, 4])
def test_bytes_per_layer_follow_the_formulas(n):
    # Ulysses: per attention, q, k, v and the output, each B x T/n x D per rank, go through
    # all-to-alls keeping 1/n: 4 B T D / n elements in and out, (n - 1)/n of them sent; q,
    # k and v packed into one all-to-all, the output in another.
    cfg, (B, T), entries = _manifest("ulysses", n, None)
    D, L = cfg.d_model, cfg.n_layers
    assert [e.op for e in entries] == ["all_to_all"] * 2 * L
    assert sum(e.bytes_sent for e in entries) == L * 4 * (B * T * D // n) * (n - 1) // n * 4
    # Ring: k and v, each B x T/n x KV x Dh, passed n - 1 times: (n - 1)/n of K and V per layer.
    cfg, (B, T), entries = _manifest("ring", n, 2)
    kv_elems = B * T * 2 * cfg.head_dim
    assert [e.op for e in entries] == ["ppermute"] * 2 * (n - 1) * L
    assert sum(e.bytes_sent for e in entries) == L * 2 * kv_elems * (n - 1) // n * 4


@pytest.mark.parametrize("n", [2, 4])
def test_megatron_sp_bytes_per_layer(n):
    # Megatron-SP: per block, the attention and the MLP each all-gather their input
    # (B x T/n x D per rank, (n - 1) of those sent) and reduce-scatter their output
    # (B x T x D, (n - 1)/n of it sent) in place of two all-reduces.
    cfg = S.config()
    params = gpt.init(cfg, 0)
    batch = S.batches(cfg, 1)[0]
    B, T = batch["inputs"].shape
    D, L = cfg.d_model, cfg.n_layers
    sm = fs.shard_map(lambda p, b: gpt.loss(p, b, attention="einsum", seq_parallel="megatron"),
                      mesh=fs.Mesh({"tensor": n}), in_specs=(gpt.tensor_parallel_specs(params), P()), out_specs=P())
    fwd = [e for e in sm.collectives(params, batch) if e.phase == "forward" and e.op != "psum"]
    assert [e.op for e in fwd] == ["all_gather", "psum_scatter"] * 2 * L
    assert all(e.bytes_sent == (n - 1) * B * T * D // n * 4 for e in fwd)
    with pytest.raises(ValueError, match="this block's weights are not split over it"):
        fs.shard_map(lambda p, b: gpt.loss(p, b, attention="einsum", seq_parallel="megatron"),
                     mesh=fs.Mesh({"tensor": n}), in_specs=(P(), P()), out_specs=P())(params, batch)


def test_mistakes_are_named():
    cfg = S.config()
    params = gpt.init(cfg, 0)
    batch = S.batches(cfg, 1)[0]
    mesh = fs.Mesh({"seq": 8})

    def run(**kw):
        return fs.shard_map(lambda p, x: gpt.apply(p, x, attention="einsum", seq_axis="seq", **kw), mesh=mesh,
                            in_specs=(P(), P(None, "seq")), out_specs=P(None, "seq"))(params, batch["inputs"])

    with pytest.raises(ValueError, match=r"4 query heads, which do not divide by 8: .*hybrid"):
        run(seq_parallel="ulysses")
    run(seq_parallel="ring")  # no head cap
    with pytest.raises(ValueError, match="zigzag.*contiguous layout"):
        run(seq_parallel="ulysses", seq_layout="zigzag")
    with pytest.raises(ValueError, match="seq_parallel must be one of"):
        run(seq_parallel="rings")
    tokens = {"tokens": torch.zeros(4, 33, dtype=torch.int64)}
    with pytest.raises(ValueError, match=r"batch\['tokens'\] \(B, T \+ 1\) cannot be split over the sequence"):
        fs.shard_map(lambda p, b: gpt.loss(p, b, seq_axis="seq"), mesh=fs.Mesh({"seq": 2}),
                     in_specs=(P(), P()), out_specs=P(), check_vma=False)(params, tokens)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,mesh,strategy,layout,stage", [
    (2, {"seq": 2}, "ulysses", "contiguous", 0),
    (2, {"seq": 2}, "ring", "zigzag", 3),
    (4, {"data": 2, "seq": 2}, "ulysses", "contiguous", 3),
    (4, {"seq_ring": 2, "seq": 2}, "hybrid", "contiguous", 0),
    (2, {"tensor": 2}, "megatron", "contiguous", 0),
])
def test_gloo_ranks_equal_the_unsharded_model_and_the_virtual_mesh(reference, world, mesh, strategy, layout, stage):
    from fsharded.testing import run_on_ranks

    tp = strategy == "megatron"
    virtual = S.train(mesh, strategy, layout, zero_stage=stage, tensor=tp)
    for r in run_on_ranks(S.train, world, mesh, strategy, layout, zero_stage=stage, tensor=tp):
        S.close(r, reference[("learned", None)])
        S.close(r, virtual)


def _ring_close(r: dict) -> None:
    torch.testing.assert_close(r["out"], r["ref"], atol=1e-6, rtol=1e-5)
    for a, b in zip(r["grads"], r["ref_grads"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_on_gloo_ranks_overlaps_and_computes_only_visible_blocks(layout):
    # On real ranks each block's exchange is posted before its attention and awaited after
    # (forward: n - 1 rounds of k and v; backward: k and v again and their gradients), and
    # blocks are cut to their visible part; the numbers are those of the virtual mesh,
    # where every block is computed whole under the mask, and of the whole sequence.
    from fsharded.testing import run_on_ranks

    n = 4
    virtual = S.ring_attention_case(n, layout)
    _ring_close(virtual)
    assert virtual["posted"] == 0
    kv_bytes = 2 * 8 * 2 * 8 * 4  # one shard's k (or v): B x T/n x KV x Dh float32
    forward = [("ppermute", "seq", "forward", kv_bytes)] * 2 * (n - 1)
    assert virtual["collectives"] == forward
    t = 8  # tokens per shard
    assert virtual["pairs"] == n * t * t  # every block whole (one vmap over the shards)
    for rank, r in enumerate(run_on_ranks(S.ring_attention_case, n, n, layout)):
        # contiguous: the blocks of earlier shards and the diagonal, later ones skipped;
        # zigzag: the diagonal whole, every other block half (the same on every rank)
        assert r["pairs"] == ((rank + 1) * t * t if layout == "contiguous" else t * t + (n - 1) * t * t // 2)
        _ring_close(r)
        torch.testing.assert_close(r["out"], virtual["out"], atol=1e-6, rtol=1e-5)
        # Forward: n - 1 hops of k and v. Backward (memory O(T/n): no block kept from the
        # forward): k and v go round again, n - 1 hops the other way, and their gradients
        # with them, n - 1 hops: 4 (n - 1) exchanges of one shard's k (or v) each.
        assert r["posted"] == 2 * (n - 1) + 4 * (n - 1)
        assert r["collectives"] == forward + [("ppermute", "seq", "backward", kv_bytes)] * 4 * (n - 1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh,strategy,layout,stage", [
    ({"seq": 2}, "ring", "zigzag", 0),
    ({"data": 2}, None, "contiguous", 2),
])
def test_listed_collectives_are_those_real_ranks_run(mesh, strategy, layout, stage):
    # step.collectives lists what one rank sends in a step: on real ranks the same entries
    # as a step records while it runs (the gradient buckets reduced during backward
    # included), and the same list on the virtual mesh, which describes the real ranks.
    import collections

    from fsharded.testing import run_on_ranks

    def unphased(rows):
        return collections.Counter((op, axis, shape, sent) for op, axis, _, shape, sent in rows)

    virtual = S.manifests(mesh, strategy, layout, zero_stage=stage)
    for r in run_on_ranks(S.manifests, 2, mesh, strategy, layout, zero_stage=stage):
        assert r["listed"] == virtual["listed"]
        assert unphased(r["ran"]) == unphased(r["listed"])
        # Only the gradient reduction moves into backward (its buckets go as they fill).
        moved = [row for row in r["ran"] if row not in r["listed"]]
        assert moved and all(op in ("psum", "psum_scatter") and phase == "backward"
                             for op, _, phase, _, _ in moved)
    ops = collections.Counter((op, phase) for op, _, phase, _, _ in virtual["listed"])
    if strategy == "ring":  # per layer: k, v forward; k, v and their gradients backward
        assert ops[("ppermute", "forward")] == 2 * 2 and ops[("ppermute", "backward")] == 4 * 2
    else:  # ZeRO-2: the gradients reduce-scattered after backward, the shards gathered for the loss
        assert ops[("psum_scatter", "reduce")] >= 1 and ops[("all_gather", "forward")] >= 1
