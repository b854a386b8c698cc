"""Smoke test of `fsharded bench seq` on 2 gloo ranks (no timing asserted)."""

import pytest


def test_rounds_grow_at_short_lengths():
    from fsharded.bench.seq import rounds_at

    assert [rounds_at(L, 5) for L in (256, 1024, 2048, 4096, 16384)] == [20, 20, 10, 5, 5]


@pytest.mark.multiprocess
def test_bench_seq_quick_runs_without_deepspeed(capsys):
    from fsharded.bench import seq

    assert seq.main(["--quick", "--no-deepspeed", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## fsharded bench seq")
    for title in ("### step time against no sequence parallelism",
                  "### peak bytes per rank against no sequence parallelism",
                  "### bytes sent per rank per layer (fwd)"):
        assert title in out, out
    for v in ("ulysses", "ring"):
        assert f"| {v} vs one rank, whole sequence | 256 tokens |" in out, out
    assert "DeepSpeed-Ulysses (4 all-to-alls)" in out and "| n/a |" in out  # the peer, not run


@pytest.mark.multiprocess
def test_bench_seq_gpt_quick_runs_and_its_losses_equal_the_whole_sequence(capsys):
    import re

    from fsharded.bench import seq

    assert seq.main(["--model", "gpt", "--quick", "--no-deepspeed", "--markdown"]) == 0
    out = capsys.readouterr().out
    for title in ("### GPT train step against no sequence parallelism",
                  "### bytes sent per rank per train step (forward, backward, gradient sync)",
                  "### peak activation and communication bytes of a GPT train step per rank"):
        assert title in out, out
    for v in ("ulysses", "ring"):
        assert f"| {v} vs one process, whole sequence | 256 tokens |" in out, out
    # The first step's loss of every variant against the whole sequence in one process.
    worst = float(re.search(r"first-step losses equal the whole sequence's to (\S+)", out).group(1))
    assert worst < 1e-5, out
