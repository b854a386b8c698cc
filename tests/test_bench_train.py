"""``fsharded bench train`` at tiny sizes: both sections run, and the job's row comes from
rounds that alternate the job and the eager loop (not one after the other)."""

from __future__ import annotations

import pytest

from fsharded import train
from fsharded.bench import train as bench_train


@pytest.mark.slow
def test_bench_train_quick_alternates_the_job_and_the_eager_loop(capsys, monkeypatch, tmp_path):
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
    saved = tmp_path / "train.json"
    assert bench_train.main(["--quick", "--markdown", "--rounds", "2", "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    # --save wrote the run as a result file that renders as the tables it printed
    from fsharded.bench import _results

    result = _results.load(saved)
    assert _results.render(result) in out and result["machine"]["cores"] > 0
    assert [len(s["rows"]) for s in result["sections"]] == [6, 1]
    assert "the default `fsharded train` job" in out and "3 alternating rounds" in out
    # Rounds of (job, eager), (eager, job), (job, eager): which goes first swaps each round.
    assert calls[calls.index("job"):] == ["job", "eager", "job", "job", "eager"], calls
