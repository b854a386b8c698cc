"""Smoke test of `fsharded bench pipeline` (ours and torch.distributed.pipelining on 2 gloo
ranks; no timing asserted): every framework trains the same cut GPT from the same weights,
so the first-step losses agree; the bubble, memory and bytes tables are made, and pipe x
ZeRO-3 runs on 4 ranks with ZeRO-0's losses."""

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
    # each framework's peak memory per rank, beside the same peers
    memory = out.split("### peak memory of the rank that needs most")[1].split("###")[0]
    assert "| ours 1f1b vs torch Schedule1F1B |" in memory
    # the bytes our transport sent: the table's sends of one micro-batch's activation each,
    # and a header of 88 bytes with the first of each kind
    sent = out.split("### our point-to-point bytes per step")[1].split("###")[0]
    for name in ("gpipe", "1f1b", "interleaved", "zb"):
        line = next(x for x in sent.splitlines() if x.startswith(f"| {name}: bytes sent"))
        ratio = float(line.rstrip(" |").rsplit("|", 1)[1])
        assert 1.0 <= ratio <= 1.01, line
    # pipe x ZeRO-3 runs, with the losses of ZeRO-0
    zero = out.split("### pipe x ZeRO-3")[1]
    assert "| step time, ZeRO-3 vs ZeRO-0 |" in zero
    z0, z3 = (float(x.split()[-1].rstrip(",")) for x in zero.split("first-step losses: ")[1].split("\n")[0].split(", "))
    assert abs(z0 - z3) < 1e-4, (z0, z3)
