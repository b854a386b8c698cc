"""Smoke test of `fsharded bench offload` (ours only, on 2 gloo ranks; no timing asserted):
the six tiers train the same GPT with the same first-step loss, and every table is made."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_bench_offload_quick_runs(tmp_path):
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "fsharded", "bench", "offload", "--quick", "--no-deepspeed", "--steps", "1",
         "--nvme-path", str(tmp_path), "--markdown"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert out.startswith("## fsharded bench offload")
    for row in ("| fsharded, optimizer state on NVMe vs in memory |",
                "| fsharded, optimizer state in host memory vs in memory |",
                "| fsharded, parameters and optimizer state on NVMe vs in memory |",
                "| fsharded, ZenFlow over the host tier vs the exact host tier |",
                "| fsharded, ZenFlow over the NVMe tier vs the exact NVMe tier |",
                "| our NVMe update's time per step (moments read, updated, written) |"):
        assert row in out, out
    assert "first-step losses: fsharded, optimizer state in memory" in out and "MISMATCH" not in out
    held = out.split("### RSS between steps")[1].split("###")[0]
    assert "| fsharded, parameters and optimizer state on NVMe vs in memory |" in held
    assert "DeepSpeed, optimizer state" not in out
    assert os.listdir(tmp_path) == []  # the tier's files and the disk test's are gone
