"""``fsharded bench train`` at tiny sizes: both sections run, and the job's row comes from
rounds that alternate the job and the eager loop (not one after the other)."""

from __future__ import annotations

import pytest

from fsharded import train
from fsharded.bench import train as bench_train


@pytest.mark.slow
def test_bench_train_quick_alternates_the_job_and_the_eager_loop(capsys, monkeypatch):
    calls: list[str] = []  # "job" per fsharded train run, "eager" per run of eager steps
    eager_step, real_run = bench_train._Eager.__call__, train.run

    def eager(self, batch):
        if not calls or calls[-1] != "eager":
            calls.append("eager")
        return eager_step(self, batch)

    def job(cfg, **kw):
        calls.append("job")
        return real_run(cfg, **kw)

    monkeypatch.setattr(bench_train._Eager, "__call__", eager)
    monkeypatch.setattr(train, "run", job)
    assert bench_train.main(["--quick", "--markdown", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "the default `fsharded train` job" in out and "3 alternating rounds" in out
    # Rounds of (job, eager), (eager, job), (job, eager): which goes first swaps each round.
    assert calls[calls.index("job"):] == ["job", "eager", "job", "job", "eager"], calls
