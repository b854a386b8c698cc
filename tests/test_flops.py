"""FLOPs of the GPT step: the analytic count against torch's FlopCounterMode (within 1%),
for the architecture variants; MFU arithmetic."""

from __future__ import annotations

import math

import optree
import pytest
import torch

from fsharded import flops
from fsharded.models import gpt


@pytest.mark.parametrize("kw", [
    {},
    {"positions": "rotary", "n_kv_heads": 2},
    {"activation": "swiglu", "norm": "rmsnorm", "tied_embeddings": False},
], ids=str)
def test_gpt_count_matches_flop_counter_mode(kw):
    cfg = gpt.GPTConfig.tiny(**kw)
    params = optree.tree_map(lambda t: t.requires_grad_(), gpt.init(cfg, 0))
    B, T = 2, cfg.seq_len
    batch = {"tokens": torch.randint(0, cfg.vocab_size, (B, T + 1))}
    measured = flops.measure_flops(lambda: gpt.loss(params, batch, attention="einsum"))
    counted = flops.gpt_step_flops(params, batch=B, seq_len=T)
    assert abs(counted - measured) <= 0.01 * measured, (counted, measured)


@pytest.mark.parametrize("moe", [
    {"experts": 4, "top_k": 2, "capacity_factor": 1.25},
    {"experts": 4, "top_k": 1, "capacity_factor": None},  # dropless: the padded (E, T, d) buffer on CPU
], ids=["capacity", "dropless"])
def test_moe_count_matches_flop_counter_mode(moe):
    cfg = gpt.GPTConfig.tiny(moe=moe)
    params = optree.tree_map(lambda t: t.requires_grad_(), gpt.init(cfg, 0))
    B, T = 4, cfg.seq_len
    batch = {"tokens": torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))}
    measured = flops.measure_flops(lambda: gpt.loss(params, batch, moe=cfg.moe, attention="einsum"))
    counted = flops.gpt_step_flops(params, batch=B, seq_len=T, moe=cfg.moe, count="computed")
    assert abs(counted - measured) <= 0.01 * measured, (counted, measured)
    # Routed on 2 shards (data x expert): capacity per shard, each shard's half of the batch.
    half = {"tokens": batch["tokens"][: B // 2]}
    per_shard = flops.measure_flops(lambda: gpt.loss(params, half, moe=cfg.moe, attention="einsum"))
    two = flops.gpt_step_flops(params, batch=B, seq_len=T, moe=cfg.moe, routing_shards=2, count="computed")
    assert abs(two - 2 * per_shard) <= 0.01 * two, (two, per_shard)
    # Model FLOPs: k rows per token through the experts, fewer than the capacity buffer's.
    model = flops.gpt_step_flops(params, batch=B, seq_len=T, moe=cfg.moe)
    n_moe = sum(gpt._is_moe(b) for b in params["blocks"])
    d, E, f = cfg.d_model, moe["experts"], params["blocks"][1]["mlp"]["w1"].shape[-1]
    C = B * T if moe["capacity_factor"] is None else \
        math.ceil(moe["top_k"] * B * T * moe["capacity_factor"] / E)
    assert counted - model == n_moe * 3 * 2 * (E * C - moe["top_k"] * B * T) * 2 * d * f


def test_moe_needs_its_config_and_mfu():
    cfg = gpt.GPTConfig.tiny(moe={"experts": 4})
    with pytest.raises(ValueError, match="block 1 is a mixture of experts; pass its routing config"):
        flops.gpt_step_flops(gpt.init(cfg, 0), batch=2, seq_len=8)
    with pytest.raises(ValueError, match="do not split into 3 routing shards"):
        flops.gpt_step_flops(gpt.init(cfg, 0), batch=2, seq_len=8, moe=cfg.moe, routing_shards=3)
    assert flops.mfu(5e14, 1.0, 1000.0) == pytest.approx(0.5)
    assert flops.mfu(5e14, 1.0, None) is None


def test_train_reports_flops_and_mfu(capsys, tmp_path):
    import json

    from fsharded import train

    metrics = tmp_path / "m.jsonl"
    args = ["--preset", "tiny", "--seq-len", "32", "--batch", "4", "--steps", "3", "--set", "data=stdlib:200000",
            "--peak-tflops", "0.5", "--progress", "off", "--metrics", str(metrics)]
    assert train.main(args) == 0
    out = capsys.readouterr().out
    tcfg = train.make_config(train.build_parser().parse_args(args))
    mcfg = train.build_model_config(tcfg, 256)  # the byte-level stdlib text
    want = flops.gpt_step_flops(gpt.init(mcfg, 0), batch=8, seq_len=32)  # batch 4 on each of data=2
    assert f"{want / 1e9:,.2f} GFLOP per step" in out
    assert "TFLOP/s in this process, MFU " in out
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(recs) == 3
    for r in recs:  # every step's own rate and MFU
        assert r["tflops_per_s"] == pytest.approx(want / r["step_time_s"] / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops_per_s"] / 0.5)


def test_train_reports_moe_model_flops(capsys):
    from fsharded import train

    args = ["--preset", "tiny", "--seq-len", "16", "--batch", "2", "--steps", "2", "--set", "data=stdlib:200000",
            "--set", "model.moe.experts=4", "--mesh", "data=1,expert=2", "--progress", "off"]
    summary = train.run(train.make_config(train.build_parser().parse_args(args)), progress="off")
    mcfg = train.build_model_config(train.make_config(train.build_parser().parse_args(args)), 256)
    want = flops.gpt_step_flops(gpt.init(mcfg, 0), batch=4, seq_len=16, moe=mcfg.moe, routing_shards=2)
    assert summary["flops_per_step"] == want
    assert f"{want / 1e9:,.2f} GFLOP per step" in capsys.readouterr().out
