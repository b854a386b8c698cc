"""Smoke test of `fsharded bench pipeline` (ours and torch.distributed.pipelining on 2 gloo
ranks; no timing asserted): every framework trains the same cut GPT from the same weights,
so the first-step losses agree, and the bubble table is made."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_bench_pipeline_quick_runs():
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "fsharded", "bench", "pipeline", "--quick", "--no-deepspeed", "--ranks", "2",
         "--rounds", "1", "--markdown"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert out.startswith("## fsharded bench pipeline")
    for row in ("| ours 1f1b vs torch Schedule1F1B |", "| ours gpipe vs torch ScheduleGPipe |",
                "| ours interleaved vs torch ScheduleInterleaved1F1B |", "| ours ZB-H1 vs ours 1F1B |",
                "| 1f1b: measured idle fraction vs the table's bubble |"):
        assert row in out, out
    assert "DeepSpeed" not in out.split("###", 1)[1].split("first-step losses")[1].split("\n")[0]
    assert "first-step losses: fsharded gpipe 5." in out and "MISMATCH" not in out
