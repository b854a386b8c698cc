"""The mixture-of-experts GPT (GPTConfig(moe=...)): expert parallelism over an 'expert'
axis, alone and with data, tensor, ZeRO 1-3 and remat, on the virtual mesh and on gloo
ranks, equal to one device on which each batch shard routes its own tokens (same
routing, same drops); the same collectives on every rank whatever the routing; the
all-to-all bytes per MoE layer; the errors."""

from __future__ import annotations

import math

import moe_cases as M
import pytest

import fsharded as fs
from fsharded import P
from fsharded.models import gpt
from fsharded.parallel import moe


@pytest.fixture(scope="module")
def reference() -> dict:
    return {n: M.train(None, shards=n) for n in (2, 4)}


@pytest.mark.parametrize("mesh,kw", [
    ({"expert": 2}, {}),
    ({"expert": 4}, {}),
    ({"data": 2}, {}),  # experts replicated: the same routing and drops as expert=2
    ({"data": 2, "expert": 2}, {"zero_stage": 1}),
    ({"data": 2, "expert": 2}, {"zero_stage": 3}),
    ({"data": 2, "expert": 2}, {"zero_stage": 2, "remat": True}),
    ({"tensor": 2, "expert": 2}, {"tensor": True}),
], ids=str)
def test_expert_parallel_training_equals_one_device(reference, mesh, kw):
    shards = mesh.get("data", 1) * mesh.get("expert", 1)
    got = M.train(mesh, **kw)
    M.close(got, reference[shards])
    assert 0 < max(got["drops"]) < 0.5  # capacity 1.0 drops some of the top-2 choices
    if kw.get("tensor"):  # expert tensor parallelism: each MoE layer psums its experts' outputs
        cfg = M.config()
        E, D = cfg.moe.experts, cfg.d_model
        layers = sum("router" in b["mlp"] for b in gpt.init(cfg, 0)["blocks"])
        tokens = 8 // shards * cfg.seq_len
        C = moe.capacity(tokens, E, top_k=cfg.moe.top_k, capacity_factor=cfg.moe.capacity_factor,
                         min_capacity=cfg.moe.min_capacity)
        # On CPU the experts' buffer stays shard-major after the all-to-all: (n * E/n, C, D)
        assert (E, C, D) != (8 // shards, cfg.seq_len, D)  # not the attention's psum shape
        bufs = [c for c in got["collectives"] if c[:4] == ("psum", "tensor", "forward", (E, C, D))]
        assert len(bufs) == layers, got["collectives"]


def test_dropless_and_top1():
    for moe_kw in ({"capacity_factor": None}, {"top_k": 1, "capacity_factor": 1.0}):
        want = M.train(None, shards=2, **moe_kw)
        got = M.train({"expert": 2}, **moe_kw)
        M.close(got, want)
        if moe_kw.get("capacity_factor", 1) is None:
            assert got["drops"] == [0.0] * M.STEPS


def test_all_to_all_bytes_per_moe_layer():
    # Per MoE layer and direction each shard sends (E_p - 1)/E_p of its (E, C, D) dispatch
    # buffer, C = capacity(tokens per shard, E, top_k, capacity factor); forward: dispatch
    # and combine, backward: their transposes.
    cfg = M.config()
    E, D, k = cfg.moe.experts, cfg.d_model, cfg.moe.top_k
    for n in (2, 4):
        got = M.train({"expert": n})
        a2a = [c for c in got["collectives"] if c[0] == "all_to_all"]
        tokens = 8 // n * cfg.seq_len  # rows per shard x sequence
        C = moe.capacity(tokens, E, top_k=k, capacity_factor=1.0, min_capacity=cfg.moe.min_capacity)
        assert C == math.ceil(k * tokens / E)
        per = E * C * D * 4 * (n - 1) // n
        assert len(a2a) == 4 * cfg.n_layers  # 2 forward + 2 backward per MoE layer
        assert all(c[4] == per for c in a2a)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,mesh,kw", [
    (2, {"expert": 2}, {}),
    (4, {"data": 2, "expert": 2}, {"zero_stage": 3}),
    (4, {"tensor": 2, "expert": 2}, {"tensor": True}),  # expert tensor parallelism
])
def test_gloo_ranks_equal_one_device_and_the_virtual_mesh(reference, world, mesh, kw):
    from fsharded.testing import run_on_ranks

    virtual = M.train(mesh, **kw)
    shards = mesh.get("data", 1) * mesh.get("expert", 1)  # batch shards, each routing its own tokens
    for r in run_on_ranks(M.train, world, mesh, **kw):
        M.close(r, reference[shards])
        M.close(r, virtual)


@pytest.mark.multiprocess
def test_every_rank_runs_the_same_collectives_under_skewed_routing():
    # Every token picks experts 0 and 1 (half the choices dropped, two experts idle on their
    # ranks): the shapes are static, so every rank runs the same all-to-alls, and the
    # step's own schedule check (which compares the ranks' lists before the first step)
    # passes; the lists equal the virtual mesh's.
    from fsharded.testing import run_on_ranks

    virtual = M.train({"expert": 4}, skew=True)
    assert virtual["drops"][0] == 0.5  # experts 0 and 1 take every choice, half fits
    ranks = run_on_ranks(M.train, 4, {"expert": 4}, skew=True)
    for r in ranks:
        assert r["collectives"] == ranks[0]["collectives"] == virtual["collectives"]
        assert r["drops"] == virtual["drops"]


def test_routing_bias_in_the_state_equals_one_device(reference):
    # Aux-loss-free balancing: the biases ride in TrainState.model_state and step by the
    # sign of the loads averaged over the batch shards, so every shard holds the same
    # biases, equal (not close) to the one-device run's; they change the routing.
    want = M.train(None, shards=4, bias_update_rate=0.01)
    got = M.train({"data": 2, "expert": 2}, zero_stage=3, bias_update_rate=0.01)
    M.close(got, want)
    assert any(x != 0 for b in got["bias"][0] for x in b)
    assert got["drops"] != reference[4]["drops"]


def test_routing_bias_balances_a_skewed_router():
    # A router leaning toward expert 0: without the bias one expert keeps twice the mean
    # load (and the drops); the bias steps the load toward uniform.
    plain = M.train(None, skew=0.05, steps=12)
    biased = M.train(None, skew=0.05, steps=12, bias_update_rate=0.01)
    assert min(plain["imbalance"]) == 2.0 and biased["imbalance"][0] == 2.0
    assert biased["imbalance"][-1] < 0.85 * plain["imbalance"][-1]
    assert sum(biased["drops"][-3:]) < 0.75 * sum(plain["drops"][-3:])
    first = biased["bias"][-1][0]
    assert first[0] == min(first) < 0  # the overloaded expert is pushed down


@pytest.mark.multiprocess
def test_routing_bias_on_gloo_ranks():
    from fsharded.testing import run_on_ranks

    want = M.train(None, shards=2, bias_update_rate=0.01)
    for r in run_on_ranks(M.train, 2, {"expert": 2}, bias_update_rate=0.01):
        M.close(r, want)


def test_mistakes_are_named():
    cfg = M.config()
    params = gpt.init(cfg, 0)
    batch = M.batches(cfg, 1)[0]
    with pytest.raises(ValueError, match=r"pass its routing config, gpt.loss\(params, batch, moe=config.moe\)"):
        gpt.loss(params, batch)
    with pytest.raises(ValueError, match="moe.experts is 8 but this block's router scores 4"):
        gpt.loss(params, batch, moe=gpt.MoEConfig(experts=8))
    with pytest.raises(ValueError, match="moe.top_k \\(5\\) exceeds moe.experts \\(4\\)"):
        M.config(top_k=5)
    with pytest.raises(NotImplementedError, match="GELU"):
        gpt.GPTConfig.tiny(activation="swiglu", moe={"experts": 4})
    with pytest.raises(ValueError, match=r"moe: unknown field\(s\) \['expert'\]"):
        gpt.GPTConfig.tiny(moe={"expert": 4})
    biased = M.config(bias_update_rate=1e-3)
    with pytest.raises(ValueError, match="bias_update_rate is set.*pass model_state="):
        gpt.loss(params, batch, moe=biased.moe)
    with pytest.raises(ValueError, match="no bias_update_rate"):
        gpt.loss(params, batch, gpt.init_model_state(params), moe=cfg.moe)
    with pytest.raises(ValueError, match="bias_update_rate must be a positive number"):
        M.config(bias_update_rate=-1.0)
    mesh = fs.Mesh({"expert": 8})  # 4 experts cannot be split over 8 shards
    with pytest.raises(ValueError, match="do not fit Mesh"):
        fs.shard_map(lambda p, b: gpt.loss(p, b, moe=cfg.moe), mesh=mesh,
                     in_specs=(gpt.expert_parallel_specs(params), P("expert")), out_specs=P())(params, batch)


def test_moe_config_from_deepspeeds_arguments():
    # DeepSpeed's MoE(hidden_size, expert, num_experts=..., k=..., ...) arguments
    c = gpt.MoEConfig.from_deepspeed(num_experts=8, k=2, capacity_factor=1.25, eval_capacity_factor=2.0,
                                     min_capacity=2, use_rts=False, top2_2nd_expert_sampling=False,
                                     ep_size=2, every=1)
    assert (c.experts, c.top_k, c.capacity_factor, c.eval_capacity_factor, c.min_capacity, c.every) == \
        (8, 2, 1.25, 2.0, 2, 1)
    dropless = gpt.MoEConfig.from_deepspeed(num_experts=4, drop_tokens=False, use_rts=False)
    assert dropless.capacity_factor is None and dropless.eval_capacity_factor is None and dropless.top_k == 1
    with pytest.raises(NotImplementedError, match=r"top2_2nd_expert_sampling=True") as e:
        gpt.MoEConfig.from_deepspeed(num_experts=8, k=2)  # DeepSpeed's defaults route at random
    assert "use_rts" not in str(e.value)  # only DeepSpeed's top-1 gate reads use_rts
    with pytest.raises(NotImplementedError, match=r"use_rts=True(.|\n)*noisy_gate_policy='RSample'"):
        gpt.MoEConfig.from_deepspeed(num_experts=8, noisy_gate_policy="RSample")
    # dropless top-1: nothing is dropped, so random token selection changes nothing
    assert gpt.MoEConfig.from_deepspeed(num_experts=4, drop_tokens=False).capacity_factor is None
    # DeepSpeed's positional arguments and its expert tensor parallelism (a tensor axis here)
    c = gpt.MoEConfig.from_deepspeed(hidden_size=16, expert=None, num_experts=8, k=2, use_rts=True,
                                     top2_2nd_expert_sampling=False, enable_expert_tensor_parallelism=True,
                                     ep_size=4)
    assert (c.experts, c.top_k) == (8, 2)
    with pytest.raises(ValueError, match="ep_size=3 does not divide num_experts=8"):
        gpt.MoEConfig.from_deepspeed(num_experts=8, use_rts=False, ep_size=3)
