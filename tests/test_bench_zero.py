"""Smoke test of `fsharded bench zero` (ours and FSDP2 on 2 gloo ranks; no timing asserted)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_bench_zero_quick_runs():
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "fsharded", "bench", "zero", "--quick", "--no-deepspeed",
         "--rounds", "1", "--iters", "1", "--markdown"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert out.startswith("## fsharded bench zero")
    for title in ("### step time", "### bytes sent per rank per step", "### peak RSS per rank",
                  "### step time of our stages against each other"):
        assert title in out, out
    assert "| ZeRO-3 vs FSDP2 fully_shard |" in out
    assert "| ZeRO-2 vs FSDP2 fully_shard(reshard_after_forward=False) |" in out
    assert "DeepSpeed ZeRO" not in out  # skipped
    # the bound of a data-parallel step, the same arithmetic: the same losses bit for bit
    assert "| ZeRO-0 vs the floor |" in out
    assert "the floor 5." in out and "(|diff| step 1 0.0e+00, max 0.0e+00)" in out
    # ... and of a ZeRO-1/2 step: reduce-scattered, each rank updating its shard
    assert "| ZeRO-1 vs the floor |" in out and "| ZeRO-2 vs the floor |" in out
    # same init and data: every framework's losses match ours; every stage's losses printed
    assert "MISMATCH" not in out
    for stage in range(4):
        assert f"ZeRO-{stage} losses over" in out
    # our manifest agrees with the bytes counted at torch.distributed
    assert "our collective manifests match the torch.distributed count at every stage" in out
    # ... here over the same-host shared-memory transport (counted by its observer)
    assert "same-host shared memory" in out
