"""`fsharded bench gpu` stays runnable: its smoke mode runs every section on CPU under
Triton's interpreter (numbers meaningless there; the GPU run is the measurement)."""

from __future__ import annotations

import os

import pytest
import torch

from fsharded.bench import gpu


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
def test_gpu_bench_smoke_runs_every_section(capsys):
    assert gpu.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    for title in ("fused AdamW vs the memory-bandwidth limit", "causal flash attention",
                  "cross-entropy peak memory", "LayerNorm / RMSNorm", "int8 blockwise"):
        assert title in out
    assert "nan" not in out.split("copy bandwidth", 1)[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_gpu_bench_says_it_needs_a_gpu(capsys):
    assert gpu.main([]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err
