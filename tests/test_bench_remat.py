"""Smoke test of `fsharded bench remat` (one process; no timing asserted): every policy
trains to the same first loss, keeps fewer activations than none, and the estimate agrees."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_remat_quick_runs():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "fsharded", "bench", "remat", "--quick", "--rounds", "1",
                           "--markdown"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert out.startswith("## fsharded bench remat")
    losses = re.search(r"first-step losses \(the same numbers under every policy\): (.*)", out).group(1)
    assert len({v.split()[-1] for v in losses.split("; ")}) == 1, losses
    memory = out.split("### peak activations")[1]
    for policy in ("blocks:4", "blocks:2", "blocks", "blocks,offload"):
        ratio = float(re.search(rf"\| {re.escape(policy)} \|[^\n]*\| ([0-9.]+) \|", memory).group(1))
        assert ratio < 1.0, (policy, ratio)
        est, tracked = re.search(rf"remat='{re.escape(policy)}'\)\.activations: ([0-9.]+) MB \(tracked ([0-9.]+) MB\)",
                                 memory).groups()
        assert abs(float(est) - float(tracked)) <= 0.02 * float(tracked)
