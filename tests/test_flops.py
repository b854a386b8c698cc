"""FLOPs of the GPT step: the analytic count against torch's FlopCounterMode (within 1%),
for the architecture variants; MFU arithmetic."""

from __future__ import annotations

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


def test_moe_blocks_are_refused_and_mfu():
    cfg = gpt.GPTConfig.tiny(moe={"experts": 4})
    with pytest.raises(NotImplementedError, match="block 1 is a mixture of experts"):
        flops.gpt_step_flops(gpt.init(cfg, 0), batch=2, seq_len=8)
    assert flops.mfu(5e14, 1.0, 1000.0) == pytest.approx(0.5)
    assert flops.mfu(5e14, 1.0, None) is None


def test_train_reports_flops_and_mfu(capsys):
    from fsharded import train

    args = ["--preset", "tiny", "--seq-len", "32", "--batch", "4", "--steps", "3", "--set", "data=stdlib:200000",
            "--peak-tflops", "0.5", "--progress", "off"]
    assert train.main(args) == 0
    out = capsys.readouterr().out
    tcfg = train.make_config(train.build_parser().parse_args(args))
    mcfg = train.build_model_config(tcfg, 256)  # the byte-level stdlib text
    want = flops.gpt_step_flops(gpt.init(mcfg, 0), batch=8, seq_len=32)  # batch 4 on each of data=2
    assert f"{want / 1e9:,.2f} GFLOP per step" in out
    assert "TFLOP/s in this process, MFU " in out
