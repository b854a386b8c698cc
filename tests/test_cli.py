"""The ``fsharded`` CLI: dispatch, the benchmark registry, and a smoke run of a benchmark.

    pytest tests/test_cli.py

No timing is asserted anywhere: benchmarks report numbers, tests only check they run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsharded.bench import BENCHMARKS, Report, Row, Section, get
from fsharded.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in BENCHMARKS:
        assert name in out


def test_bench_list_subprocess():
    r = subprocess.run(
        [sys.executable, "-m", "fsharded.cli", "bench", "--list"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "spmd" in r.stdout


def test_unknown_benchmark_names_the_known_ones(capsys):
    assert main(["bench", "no-such-bench"]) == 2
    err = capsys.readouterr().err
    assert "no-such-bench" in err and "spmd" in err
    with pytest.raises(KeyError, match="spmd"):
        get("no-such-bench")


def test_bench_without_name_is_a_usage_error(capsys):
    assert main(["bench"]) == 2
    assert "spmd" in capsys.readouterr().err


def test_train_options_reach_the_training_job(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--deepspeed-config" in out and "--mesh" in out
    # A bad flag value is the job's error (exit 2), not the top-level parser's.
    assert main(["train", "--mesh", "data"]) == 2
    assert "expected AXIS=SIZE" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "bench" in capsys.readouterr().err


def test_bench_options_reach_the_benchmark(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "spmd", "--help"])
    assert e.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_report_renders_markdown_and_text():
    rows = (Row("psum vs all_reduce", "4 KiB", 2e-5, 1e-5), Row("b", "1 MiB", 1e-3, 1e-3))
    report = Report("x", sections=[Section("t", "peer", rows, target=1.1)])
    report.finish()
    md = report.markdown()
    assert "| case | size | ours | peer | ours/peer |" in md
    assert "| psum vs all_reduce | 4 KiB | 20.0 us | 10.0 us | 2.00 |" in md
    assert "met by 1 of 2 rows" in md
    assert "load average" in md
    assert "psum vs all_reduce" in report.text()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_spmd_quick_runs():
    # Spawns 2 gloo ranks and a fake-group child; about 20 s on 2 busy cores. The timeout
    # only guards against a hang.
    r = subprocess.run(
        [sys.executable, "-m", "fsharded", "bench", "spmd", "--quick", "--markdown"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    out = r.stdout
    assert "| case | size | ours | peer | ours/peer |" in out
    for case in ("dp=2 fwd+bwd", "tp 2x2 Megatron", "psum vs all_reduce", "all_to_all vs"):
        assert case in out, out
    assert "fake process group" in out


@pytest.mark.multiprocess
def test_checkpoint_bench_quick_runs():
    """A smoke run (2 gloo ranks, a tiny model): the bench checks every load against the
    saved state itself and exits non-zero if one differs."""
    r = subprocess.run(
        [sys.executable, "-m", "fsharded", "bench", "checkpoint", "--quick", "--no-deepspeed",
         "--markdown"],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    for case in ("save (step.save vs dcp.save)", "load (step.load vs dcp.load)", "bytes on disk",
                 "2 ranks ZeRO-3 -> 1 process ZeRO-1", "while save_async writes vs without a save"):
        assert case in r.stdout, r.stdout
    assert "a save costs the loop" in r.stdout and "of one step" in r.stdout, r.stdout
