"""`fsharded train` end to end, in subprocesses: virtual mesh, torchrun with 2 ranks,
config files, DeepSpeed configs and bad flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import commands
import pytest

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch", "4",
        "--steps", "6", "--set", "data=stdlib:300000"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}


def _run(args, timeout=240):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=ENV)


def _losses(path):
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


def test_train_virtual_mesh(tmp_path):
    m = tmp_path / "m.jsonl"
    r = _run([sys.executable, "-m", "fsharded", "train", *TINY, "--metrics", str(m)])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "Mesh(data=2) on the virtual backend" in out and "done: loss" in out
    assert "collectives per step" in out and "tokens/s" in out
    assert "step     1" in out  # no TTY: plain log lines, no progress bar
    recs = [json.loads(line) for line in m.read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 7))
    assert {"loss", "grad_norm", "lr", "loss_scale", "skipped", "tokens_per_s"} <= recs[0].keys()


@pytest.mark.multiprocess
def test_train_torchrun_two_ranks_matches_virtual(tmp_path):
    mv, md = tmp_path / "v.jsonl", tmp_path / "d.jsonl"
    rv = _run([sys.executable, "-m", "fsharded.train", *TINY, "--metrics", str(mv)])
    assert rv.returncode == 0, rv.stderr
    rd = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(_port()), "-m", "fsharded.train", *TINY, "--metrics", str(md)])
    assert rd.returncode == 0, rd.stderr[-3000:]
    assert "on the distributed backend" in rd.stdout
    # Same mesh (data=2), same data, same numbers: fp32 summation order differs slightly.
    for a, b in zip(_losses(mv), _losses(md), strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


def _port():
    from fsharded.testing import free_port

    return free_port()


def test_train_from_config_files(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('precision = "bf16"\ngrad_accum_steps = 2\n[optimizer]\nname = "lion"\nlr = 1e-4\n'
                    '[scheduler]\nname = "WarmupLR"\nparams = { warmup_num_steps = 2 }\n')
    r = _run([sys.executable, "-m", "fsharded", "train", *TINY, "--config", str(toml)])
    assert r.returncode == 0, r.stderr
    assert "batch 16x32" in r.stdout and "bf16" in r.stdout  # 4 x accum 2 x data 2
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "train_batch_size": 24, "gradient_accumulation_steps": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}},
        "fp16": {"enabled": True, "initial_scale_power": 8}, "gradient_clipping": 1.0,
        "some_unknown_key": 1}))
    r = _run([sys.executable, "-m", "fsharded", "train", *TINY, "--deepspeed-config", str(ds)])
    assert r.returncode == 0, r.stderr
    assert "batch 24x32" in r.stdout and "fp16" in r.stdout
    assert "some_unknown_key" in r.stderr  # warned by name


def test_train_bad_flags():
    r = _run([sys.executable, "-m", "fsharded", "train", "--mesh", "data:2"])
    assert r.returncode == 2 and "expected AXIS=SIZE" in r.stderr
    r = _run([sys.executable, "-m", "fsharded", "train", *TINY, "--set", "optimizer.nope=1"])
    assert r.returncode == 2 and "optimizer.nope" in r.stderr
    # A vocabulary set smaller than the data's is refused, naming the setting to change.
    r = _run([sys.executable, "-m", "fsharded", "train", "--preset", "tiny", "--set", "model.vocab_size=64",
              "--steps", "1"])
    assert r.returncode != 0 and "model.vocab_size=256" in r.stderr


def test_a_preset_runs_as_given_on_the_default_data():
    r = _run([sys.executable, "-m", "fsharded", "train", "--preset", "tiny", "--steps", "2"])
    assert r.returncode == 0, r.stderr
    assert "done: loss" in r.stdout


def test_train_with_zero_stage_matches_stage_0(tmp_path):
    m0, m3 = tmp_path / "z0.jsonl", tmp_path / "z3.jsonl"
    r0 = _run([sys.executable, "-m", "fsharded", "train", *TINY, "--metrics", str(m0)])
    r3 = _run([sys.executable, "-m", "fsharded", "train", *TINY, "--set", "zero_stage=3", "--metrics", str(m3)])
    assert r0.returncode == 0 and r3.returncode == 0, r3.stderr
    assert "ZeRO-3" in r3.stdout
    for a, b in zip(_losses(m0), _losses(m3), strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


def test_save_every_and_resume_latest_continue_exactly(tmp_path):
    """6 steps straight vs 6 steps saving every 3 (blocking, and in the background), then
    (the step-6 checkpoint removed) a new process resuming from the latest (step 3): steps
    4-6 bit for bit, the data picked up where the run stopped. Independent runs go two at a
    time."""
    import shutil

    py = [sys.executable, "-m", "fsharded", "train", *TINY]
    straight = tmp_path / "a.jsonl"
    modes = {"blocking": [], "async": ["--async-save"]}
    ck = {m: tmp_path / f"ck-{m}" for m in modes}
    saved = {m: tmp_path / f"b-{m}.jsonl" for m in modes}
    resumed = {m: tmp_path / f"c-{m}.jsonl" for m in modes}
    runs = commands.run_all([py + ["--metrics", str(straight)],
                             *(py + ["--metrics", str(saved[m]), "--save-every", "3", "--save-dir", str(ck[m]), *flag]
                               for m, flag in modes.items())], timeout=240, env=ENV)
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    for m in modes:
        assert sorted(os.listdir(ck[m])) == ["step-00000003", "step-00000006"], m
        assert _losses(saved[m]) == _losses(straight), m  # saving changes nothing
    # resumed at its last step (a restart after the end): says so, prints no nan loss
    at_end, first = commands.run_all([
        py + ["--resume", "latest", "--save-dir", str(ck["blocking"]), "--save-every", "3"],
        py + ["--resume", "latest", "--save-dir", str(tmp_path / "none")]], timeout=240, env=ENV)
    assert at_end.returncode == 0, at_end.stderr
    assert "done: nothing to train, the state is at step 6 of 6" in at_end.stdout and "nan" not in at_end.stdout
    assert first.returncode == 0 and "no checkpoint in" in first.stdout  # a job's first start: from step 0
    assert "starting at step 0" in first.stdout
    for m in modes:
        shutil.rmtree(ck[m] / "step-00000006")
    runs = commands.run_all([py + ["--metrics", str(resumed[m]), "--resume", "latest", "--save-dir", str(ck[m])]
                             for m in modes], timeout=240, env=ENV)
    for m, r in zip(modes, runs):
        assert r.returncode == 0, r.stderr
        assert "resumed from" in r.stdout and "at step 3" in r.stdout
        assert [json.loads(x)["step"] for x in resumed[m].read_text().splitlines()] == [4, 5, 6], m
        assert _losses(resumed[m]) == _losses(straight)[3:], m
    r = _run(py + ["--resume", str(tmp_path / "none" / "step-9")])
    assert r.returncode == 1 and "no checkpoint at" in r.stderr


def test_a_diverged_fp16_run_exits_non_zero():
    r = _run([sys.executable, "-m", "fsharded", "train", "--preset", "tiny", "--precision", "fp16",
              "--lr", "1e30", "--steps", "60"])
    assert r.returncode == 1, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "loss scale at its minimum" in r.stderr and "diverged" in r.stderr


def test_a_declared_axis_replicates(capsys):
    from fsharded import train

    assert train.main(["--preset", "tiny", "--steps", "2", "--mesh", "data=2,replica=2",
                       "--replicate-over", "replica"]) == 0
    out = capsys.readouterr().out
    assert "Mesh(data=2, replica=2)" in out
    assert train.main(["--preset", "tiny", "--steps", "2", "--mesh", "data=2"]) == 0
    plain = capsys.readouterr().out
    done = [next(line for line in o.splitlines() if line.startswith("done: loss")) for o in (out, plain)]
    assert done[0] == done[1]  # replicated over the extra axis: the same training


def _done(capsys) -> str:
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("done: loss"))


def test_sequence_parallel_runs_train_as_the_unsharded_job(capsys, tmp_path):
    from fsharded import train

    base = ["--preset", "tiny", "--steps", "3"]
    assert train.main([*base, "--mesh", "data=1"]) == 0
    want = _done(capsys)
    for extra in (["--mesh", "seq=2"], ["--mesh", "seq=2", "--set", "model.seq_parallel=ring"],
                  ["--mesh", "data=1,seq=2,tensor=2", "--set", "model.seq_parallel=ring",
                   "--set", "model.seq_layout=contiguous"],
                  ["--mesh", "seq=2,seq_ring=2", "--set", "model.seq_parallel=hybrid"],
                  ["--mesh", "data=1,tensor=2", "--set", "model.seq_parallel=megatron"]):
        assert train.main([*base, *extra]) == 0, extra
        assert _done(capsys) == want, extra
    rotary = [*base, "--seq-len", "36", "--set", "model.positions=rotary"]  # 36 tokens over 8 chunks: padded
    assert train.main([*rotary, "--mesh", "data=1"]) == 0
    want = _done(capsys)
    assert train.main([*rotary, "--mesh", "seq=4", "--set", "model.seq_parallel=ring"]) == 0
    assert _done(capsys) == want
    rotary[rotary.index("36")] = "37"  # 37 over tensor=2: padded
    assert train.main([*rotary, "--mesh", "data=1"]) == 0
    want = _done(capsys)
    assert train.main([*rotary, "--mesh", "data=1,tensor=2", "--set", "model.seq_parallel=megatron"]) == 0
    assert _done(capsys) == want
    ds = tmp_path / "ds.json"  # DeepSpeed's key: Ulysses over seq, data = ranks / 2
    ds.write_text('{"train_micro_batch_size_per_gpu": 8, "sequence_parallel_size": 2}')
    assert train.main([*base, "--deepspeed-config", str(ds)]) == 0
    out = capsys.readouterr().out
    assert "Mesh(data=1, seq=2)" in out and "(ulysses, contiguous)" in out
    for extra, message in ((["--set", "model.seq_parallel=ring"], "shards the sequence over the mesh axis 'seq'"),
                           (["--mesh", "seq=2", "--set", "model.seq_parallel=megatron"],
                            "shards the sequence over the 'tensor' axis"),
                           (["--mesh", "seq=2", "--set", "model.seq_parallel=hybrid"], "give both"),
                           (["--mesh", "seq=4", "--seq-len", "36", "--set", "model.seq_parallel=ring"],
                            "--seq-len 36 does not divide into 8 sequence chunks (seq=4, zigzag layout), and "
                            "padding it to 40 would run past the 36 learned positions"),
                           (["--mesh", "seq=8"], "splits the 4 attention heads")):
        assert train.main([*base, *extra]) == 1, extra
        assert message in capsys.readouterr().err, extra


def test_experts_over_an_expert_axis_train_as_over_a_data_axis(capsys, tmp_path):
    # --batch is per data x expert shard and each shard routes its own rows: expert=2 (the
    # experts split) and data=2 (the experts replicated) see the same routing, drops and
    # losses; with ZeRO-3 over data beside the expert axis too.
    from fsharded import train

    moe = ["--preset", "tiny", "--steps", "3", "--set", "model.moe.experts=4", "--set", "model.moe.top_k=2",
           "--set", "model.moe.capacity_factor=1.0", "--set", "model.moe.every=1"]
    runs = {}
    for mesh in ("data=2", "expert=2", "data=2,expert=2", "data=4"):
        extra = ["--set", "zero_stage=3"] if mesh == "data=2,expert=2" else []
        m = tmp_path / f"{mesh}.jsonl"
        assert train.main([*moe, "--mesh", mesh, *extra, "--metrics", str(m)]) == 0, mesh
        runs[mesh] = [json.loads(line) for line in m.read_text().splitlines()]
    assert "4 experts top-2 every 1 blocks over expert=2" in capsys.readouterr().out
    for a, b in (("data=2", "expert=2"), ("data=4", "data=2,expert=2")):
        for ra, rb in zip(runs[a], runs[b], strict=True):
            assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5, abs=1e-5), (a, b)
            assert ra["moe_drop_fraction"] == rb["moe_drop_fraction"], (a, b)
    assert 0 < runs["data=2"][0]["moe_drop_fraction"] < 0.5
    for extra, message in ((["--mesh", "expert=3"], "model.moe.experts=4 does not divide over expert=3"),
                           (["--mesh", "expert=2", "--set", "model.moe.experts=0"], "moe.experts must be a positive int")):
        assert train.main([*moe, *extra]) in (1, 2), extra
        assert message in capsys.readouterr().err, extra
    assert train.main(["--preset", "tiny", "--steps", "1", "--mesh", "expert=2"]) == 1
    assert "has an 'expert' axis but the model has no experts" in capsys.readouterr().err


def test_activations_that_cannot_fit_are_refused_before_the_model_is_built(capsys, monkeypatch):
    from fsharded import train
    from fsharded.step import _estimate as _memory

    # 64 MiB: the tiny model's state (~0.2 MB) and a step on 2 rows fit; 512 rows a data
    # shard (1024 rows on the virtual mesh's 2 devices, in this process) do not.
    monkeypatch.setattr(_memory, "available_memory", lambda device="cpu": (64 * 2**20, "a test limit"))
    assert train.main(["--preset", "tiny", "--steps", "1", "--batch", "512"]) == 1
    out, err = capsys.readouterr()
    assert "memory check: the training state and one micro-batch's activations (the virtual mesh holds all " \
           "of it in this process) needs about 1.1" in err, err[-1500:]
    assert "To need less: a smaller --batch (now 512 a data shard, 1.1" in err and "GPT" not in out
    assert "ZeRO-3" not in err  # the state is not what does not fit
    assert train.main(["--preset", "tiny", "--steps", "1", "--batch", "2"]) == 0


def test_mesh_and_path_mistakes_are_named_before_anything_is_built(tmp_path, capsys):
    cases = [
        (["--mesh", "data=2,tensr=2"], 1, "mesh axis 'tensr' is not one fsharded train shards over (data, tensor, seq, seq_ring, expert, pipe); "
                                          "did you mean 'tensor'? (an axis that should only replicate: "
                                          "--replicate-over tensr)"),
        (["--mesh", "data=2", "--replicate-over", "replica"], 1, "axis 'replica' is not in the mesh"),
        (["--mesh", "data=2", "--replicate-over", "data"], 1, "'data' is an axis fsharded train shards over"),
        (["--mesh", "data=2,data=1"], 2, "axis 'data' given twice"),
        (["--mesh", ""], 2, "expected AXIS=SIZE"),
        (["--mesh", "data=0"], 2, "sizes are >= 1"),
        (["--data", str(tmp_path / "nonexistent.txt")], 1, "nonexistent.txt' is not a file"),
        (["--metrics", str(tmp_path / "no" / "dir" / "m.jsonl")], 1, "does not exist"),
    ]
    from fsharded import train

    for extra, rc, message in cases:  # in this process: main() returns the exit status
        capsys.readouterr()
        try:
            code = train.main(["--preset", "tiny", "--steps", "1", *extra])
        except SystemExit as e:  # argparse-level refusals
            code = e.code
        out, err = capsys.readouterr()
        assert code == rc and message in err, (extra, code, err[-1500:])
        assert "GPT" not in out  # refused before the model is built


def test_metrics_reach_the_disk_line_by_line(tmp_path):
    import signal

    m = tmp_path / "m.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "fsharded", "train", "--preset", "tiny", "--steps", "100000", "--no-compile",
                          "--set", "log_every=1", "--metrics", str(m)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=ENV)
    try:
        for line in p.stdout:  # the progress line of step 6 is printed after step 5's record
            if line.startswith("step     6"):
                break
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
    recs = [json.loads(x) for x in m.read_text().splitlines()[:5]]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]  # a block-buffered file would be empty


def test_a_model_that_cannot_fit_is_refused_before_it_is_built():
    # ~12.9 B parameters: hundreds of GiB of fp32 state; refused from meta tensors in seconds.
    r = _run([sys.executable, "-m", "fsharded", "train", "--preset", "tiny", "--steps", "1",
              "--set", "model.d_model=4096", "--set", "model.n_layers=64"])
    assert r.returncode == 1, r.stderr[-2000:]
    assert "memory check: the training state" in r.stderr and "GiB is available" in r.stderr
    assert "ZeRO-3 on more ranks" in r.stderr and "--force" in r.stderr and "GPT" not in r.stdout
    r = _run([sys.executable, "-m", "fsharded", "train", "--preset", "tiny", "--steps", "1", "--force"])
    assert r.returncode == 0 and "done: loss" in r.stdout, r.stderr[-2000:]



def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(name))
    return sorted(out)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers through /proc")
def test_torchrun_restarts_a_killed_rank_from_the_last_checkpoint(tmp_path):
    """torchrun --max-restarts=1 ... --save-every 5 --resume latest: a worker SIGKILLed mid-run,
    torchrun restarts both, and the job resumes from the last checkpoint and ends with the
    losses of a run that was not interrupted, bit for bit (the same ranks, data position,
    keys and schedule). The restarted ranks meet under their own prefix of the agent's
    store (fs.distributed.initialize), which still holds the dead attempt's addresses."""
    import signal
    import time

    args = ["--preset", "tiny", "--steps", "40", "--set", "log_every=1"]
    ref, got, ck = tmp_path / "ref.jsonl", tmp_path / "got.jsonl", tmp_path / "ck"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    r = _run([*torchrun, "--master_port", str(_port()), "-m", "fsharded.train", *args, "--metrics", str(ref)],
             timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    p = subprocess.Popen([*torchrun, "--max-restarts", "1", "--master_port", str(_port()), "-m", "fsharded.train",
                          *args, "--metrics", str(got), "--save-every", "5", "--save-dir", str(ck),
                          "--resume", "latest"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 300
        while not (ck / "step-00000010").is_dir() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.02)
        workers = _children(p.pid)
        assert len(workers) == 2 and p.poll() is None, "the run ended before a worker could be killed"
        os.kill(workers[1], signal.SIGKILL)
        out, err = p.communicate(timeout=600)
    finally:
        p.kill()
    assert p.returncode == 0, err[-3000:]
    assert "resumed from" in out, out[-2000:]
    resumed_at = int(out.split("resumed from")[1].split("at step")[1].split()[0])
    assert 10 <= resumed_at < 40
    recs = [json.loads(x) for x in got.read_text().splitlines()]
    # The first attempt's records up to the checkpoint kept, the rest trained again, once.
    assert [r["step"] for r in recs] == list(range(1, 41))
    assert [r["loss"] for r in recs] == _losses(ref)


def test_timeout_flag_sets_how_long_a_rank_waits(tmp_path):
    """--timeout reaches initialize() under torchrun's environment (one rank here)."""
    from fsharded.testing import free_port

    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        "from fsharded import comm\n"
        "from fsharded.tools import train\n"
        f"rc = train.main([*{TINY!r}, '--mesh', 'data=1', '--timeout', '7'])\n"
        "print('timeout', comm.timeout_s(), rc)\n")
    env = {**ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "timeout 7.0 0" in r.stdout, r.stdout[-2000:]
