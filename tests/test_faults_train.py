"""Faults of `fsharded train` and `train_step` that used to pass quietly: a resumed run's
metrics, schedule and global batch; flags and configs that meant nothing; inputs the step
could not use. Each is now kept, or refused naming the flag or leaf and the fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import fsharded as fs
from fsharded import P, train

# The tiny GPT on 300 kB of text: a step takes milliseconds, a run of 20 steps a second.
BASE = ["--preset", "tiny", "--seq-len", "32", "--set", "data=stdlib:300000"]
TINY = [*BASE, "--batch", "4"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}


def _recs(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _main(args, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = train.main(args)
    except SystemExit as e:  # argparse's refusals
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# -- item: --resume with the same --metrics file --------------------------------------------------


def test_a_resumed_run_appends_to_its_metrics_file(tmp_path, capsys):
    """6 steps saving every 3, the step-6 checkpoint lost, a resume from step 3 with the
    same --metrics file: the file holds steps 1-6 once each, with the losses of a run that
    was never interrupted (exactly: the resume is bit for bit)."""
    straight, m, ck = tmp_path / "straight.jsonl", tmp_path / "m.jsonl", tmp_path / "ck"
    assert _main([*TINY, "--steps", "6", "--metrics", str(straight)], capsys)[0] == 0
    assert _main([*TINY, "--steps", "6", "--metrics", str(m), "--save-every", "3", "--save-dir", str(ck)],
                 capsys)[0] == 0
    shutil.rmtree(ck / "step-00000006")
    code, out, err = _main([*TINY, "--steps", "6", "--metrics", str(m), "--save-dir", str(ck),
                            "--resume", "latest"], capsys)
    assert code == 0, err[-2000:]
    assert "at step 3" in out
    recs = _recs(m)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]  # 1-3 kept, 4-6 trained again, once
    assert [r["loss"] for r in recs] == [r["loss"] for r in _recs(straight)]
    assert sorted(os.listdir(tmp_path)) == ["ck", "m.jsonl", "straight.jsonl"]  # no temporary left


def test_continuing_a_metrics_file_replaces_it_whole(tmp_path):
    """The records past the resumed step are dropped by a new file renamed over the old
    one (the old inode is never truncated); a record cut short by a kill is dropped; lines
    that are not records are kept."""
    from fsharded import _train_resume

    m = tmp_path / "m.jsonl"
    lines = [json.dumps({"step": n, "loss": 1.0 / n}) for n in range(1, 6)]
    m.write_text("\n".join([lines[0], "a note", *lines[1:]]) + '\n{"step": 6, "lo')
    inode = os.stat(m).st_ino
    with _train_resume.open_metrics(str(m), resumed_at=3) as f:
        f.write(json.dumps({"step": 4, "loss": 0.0}) + "\n")
    assert m.read_text().splitlines() == [lines[0], "a note", lines[1], lines[2], '{"step": 4, "loss": 0.0}']
    assert os.stat(m).st_ino != inode
    assert os.listdir(tmp_path) == ["m.jsonl"]
    with _train_resume.open_metrics(str(tmp_path / "new.jsonl"), resumed_at=0) as f:  # none yet
        f.write("{}\n")
    assert (tmp_path / "new.jsonl").read_text() == "{}\n"


# -- item: resuming changes the schedule or the global batch ------------------------------------


def test_a_run_resumed_to_a_later_step_keeps_its_schedule(tmp_path, capsys):
    """A 20-step run trained as 10 steps (--schedule-steps 20: the first half of a 20-step
    schedule), then resumed to 20, has the losses and learning rates of 20 steps straight,
    exactly: the state comes back bit for bit, the data position is the step count, and
    the same ops run in the same order in one process, so there is no rounding to allow."""
    straight, m, ck = tmp_path / "straight.jsonl", tmp_path / "m.jsonl", tmp_path / "ck"
    assert _main([*TINY, "--steps", "20", "--metrics", str(straight)], capsys)[0] == 0
    code, _, err = _main([*TINY, "--steps", "10", "--schedule-steps", "20", "--save-every", "10",
                          "--save-dir", str(ck), "--metrics", str(m)], capsys)
    assert code == 0, err[-2000:]
    code, _, err = _main([*TINY, "--steps", "20", "--resume", "latest", "--save-dir", str(ck),
                          "--metrics", str(m)], capsys)
    assert code == 0, err[-2000:]
    want, got = _recs(straight), _recs(m)
    assert [r["step"] for r in got] == list(range(1, 21))
    assert [(r["loss"], r["lr"]) for r in got] == [(r["loss"], r["lr"]) for r in want]
    job = json.loads((ck / "step-00000010" / "job.json").read_text())
    assert job["schedule"]["params"]["total_num_steps"] == 20 and job["global_batch"] == 8


def test_resuming_with_a_longer_steps_is_refused_naming_the_flags(tmp_path, capsys):
    """--steps 10, then --steps 20 --resume latest: --steps also sets the schedule's length,
    so the resume would restart the cosine (the lr of step 11: 3e-4 at the end of the
    10-step schedule, 1.88e-3 on a 20-step one). Refused, naming --schedule-steps 10 (keep
    it) and --resume-changes schedule (change it); each then runs as it says."""
    ck = tmp_path / "ck"
    assert _main([*TINY, "--steps", "10", "--save-every", "10", "--save-dir", str(ck)], capsys)[0] == 0
    resume = [*TINY, "--steps", "20", "--resume", "latest", "--save-dir", str(ck)]
    code, out, err = _main(resume, capsys)
    assert code == 1, (code, err[-2000:])
    assert "the learning-rate schedule changes (total_num_steps 10 -> 20, warmup_num_steps 1 -> 2" in err
    assert "the learning rate of step 11 would be 0.00188 instead of 0.0003" in err
    assert "pass --schedule-steps 10" in err and "--resume-changes schedule" in err
    assert "GPT" not in out  # refused before anything was built
    kept, changed = tmp_path / "kept.jsonl", tmp_path / "changed.jsonl"
    assert _main([*resume, "--schedule-steps", "10", "--metrics", str(kept)], capsys)[0] == 0
    assert {round(r["lr"], 12) for r in _recs(kept)} == {3e-4}  # the 10-step cosine's floor: 0.1 x 3e-3
    assert _main([*resume, "--resume-changes", "schedule", "--metrics", str(changed)], capsys)[0] == 0
    cosine20 = fs.optim.WarmupCosineLR(total_num_steps=20, warmup_num_steps=2, cos_min_ratio=0.1,
                                       warmup_type="linear", lr=3e-3)
    assert [r["lr"] for r in _recs(changed)] == [float(fs.optim.get_lr(cosine20, n)) for n in range(10, 20)]


def test_resuming_on_another_mesh_is_refused_unless_the_global_batch_is_kept(tmp_path, capsys):
    """Saved on data=2 with 4 rows a shard (8 a step); resumed on data=1: 4 rows a step
    would change the data order and the gradients' average. Refused naming --batch 8, which
    keeps it (then the losses are the data=2 run's, to fp32 summation order: a mean over 8
    rows vs the mean of two 4-row means), or --resume-changes batch."""
    ref, m, ck = tmp_path / "ref.jsonl", tmp_path / "m.jsonl", tmp_path / "ck"
    assert _main([*TINY, "--steps", "6", "--save-every", "3", "--save-dir", str(ck), "--metrics", str(ref)],
                 capsys)[0] == 0
    shutil.rmtree(ck / "step-00000006")
    code, out, err = _main([*TINY, "--steps", "6", "--mesh", "data=1", "--resume", "latest",
                            "--save-dir", str(ck)], capsys)
    assert code == 1, (code, err[-2000:])
    assert "the global batch changes from 8 rows (4 a batch shard x 1 accumulated x 2 shards" in err
    assert "pass --batch 8 (rows a batch shard on this mesh)" in err and "--resume-changes batch" in err
    code, _, err = _main([*BASE, "--batch", "8", "--steps", "6", "--mesh", "data=1", "--resume", "latest",
                          "--save-dir", str(ck), "--metrics", str(m)], capsys)
    assert code == 0, err[-2000:]
    for a, b in zip(_recs(m), _recs(ref)[3:], strict=True):  # a new file: steps 4-6
        assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5)
    assert _main([*TINY, "--steps", "6", "--mesh", "data=1", "--resume", "latest", "--save-dir", str(ck),
                  "--resume-changes", "batch"], capsys)[0] == 0


def test_a_checkpoint_without_its_record_is_checked_against_its_runs_earlier_one(tmp_path, capsys):
    """A save killed between the checkpoint and its job.json: the run's record of an earlier
    checkpoint stands for it; with no record at all (a checkpoint of step.save, or of an
    older fsharded) the resume is not checked, and says so."""
    ck = tmp_path / "ck"
    assert _main([*TINY, "--steps", "6", "--save-every", "3", "--save-dir", str(ck)], capsys)[0] == 0
    os.remove(ck / "step-00000006" / "job.json")
    resume = [*TINY, "--steps", "9", "--resume", "latest", "--save-dir", str(ck)]
    code, _, err = _main(resume, capsys)
    assert code == 1 and "total_num_steps 6 -> 9" in err and "pass --schedule-steps 6" in err, err[-2000:]
    assert "from step 7 on" in err
    os.remove(ck / "step-00000003" / "job.json")
    with pytest.warns(UserWarning, match="carries no record of its run's schedule and global batch"):
        code, out, err = _main(resume, capsys)
    assert code == 0 and "at step 6" in out, err[-2000:]


def _torchrun(args, timeout=300):
    from fsharded.testing import free_port

    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), "-m", "fsharded.train", *args],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.mark.multiprocess
def test_two_ranks_resume_with_their_metrics_schedule_and_batch(tmp_path):
    """On 2 gloo ranks: a resume with the same --metrics file keeps steps 1-3 and appends
    4-6 (the losses of the uninterrupted run, exactly, as the restart test holds them);
    a resume that would lengthen the schedule, or (in one process, data=1) halve the
    global batch, is refused naming the flag."""
    ref, m, ck = tmp_path / "ref.jsonl", tmp_path / "m.jsonl", tmp_path / "ck"
    r = _torchrun([*TINY, "--steps", "6", "--save-every", "3", "--save-dir", str(ck), "--metrics", str(ref)])
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.copy(ref, m)
    shutil.rmtree(ck / "step-00000006")
    r = _torchrun([*TINY, "--steps", "12", "--resume", "latest", "--save-dir", str(ck), "--metrics", str(m)])
    assert r.returncode != 0 and "pass --schedule-steps 6" in r.stderr, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "fsharded.train", *TINY, "--steps", "6", "--mesh", "data=1",
                        "--resume", "latest", "--save-dir", str(ck)], capture_output=True, text=True,
                       timeout=300, env=ENV)
    assert r.returncode == 1 and "pass --batch 8" in r.stderr, r.stderr[-3000:]
    r = _torchrun([*TINY, "--steps", "6", "--resume", "latest", "--save-dir", str(ck), "--metrics", str(m)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "at step 3" in r.stdout
    assert [(x["step"], x["loss"]) for x in _recs(m)] == [(x["step"], x["loss"]) for x in _recs(ref)]


# -- item: settings that meant nothing ----------------------------------------------------------


def test_save_every_zero_is_refused(tmp_path, capsys):
    code, out, err = _main([*TINY, "--steps", "2", "--save-every", "0", "--save-dir", str(tmp_path / "ck")], capsys)
    assert code == 2 and "--save-every: must be an int >= 1 (a checkpoint every N steps" in err, err
    cfg = train.make_config(train.build_parser().parse_args([*TINY, "--steps", "2"]))
    with pytest.raises(ValueError, match="--save-every: expected an int >= 1, got 0"):
        train.run(cfg, save_every=0, save_dir=str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()


def test_a_schedule_of_zero_steps_is_refused_by_the_config(tmp_path, capsys):
    from fsharded import config as C

    for sched, key in (({"name": "WarmupCosineLR", "params": {"total_num_steps": 0}}, "total_num_steps"),
                       ({"name": "WarmupDecayLR", "params": {"total_num_steps": 0}}, "total_num_steps"),
                       ({"name": "linear", "params": {"total_steps": 0}}, "total_steps"),
                       ({"name": "WarmupLR", "params": {"warmup_num_steps": -1}}, "warmup_num_steps")):
        with pytest.raises(ValueError, match=f"scheduler.params.{key}: expected an int >= "):
            C.TrainConfig(scheduler=sched)
    ds = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 0}}}
    with pytest.raises(ValueError, match="scheduler.params.total_num_steps: expected an int >= 1"):
        C.from_deepspeed(ds)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    code, out, err = _main([*TINY, "--steps", "2", "--deepspeed-config", str(path)], capsys)
    assert code == 2 and "scheduler.params.total_num_steps: expected an int >= 1" in err, err[-2000:]
    code, out, err = _main([*TINY, "--steps", "2", "--schedule-steps", "0"], capsys)
    assert code == 2 and "--schedule-steps: must be an int >= 1" in err, err[-2000:]


def _loss(p, b):
    return ((b["x"] @ p["w"]) ** 2).mean()


@pytest.mark.parametrize("mesh", [{"data": 1}, {"data": 2}], ids=["one-device", "data2"])
def test_a_complex_loss_is_refused_at_the_first_step(mesh):
    def complex_loss(p, b):
        return (b["x"].to(torch.complex64) @ p["w"].to(torch.complex64)).sum()

    step = fs.train_step(complex_loss, fs.optim.sgd(0.1), mesh=fs.Mesh(mesh))
    state = step.init({"w": torch.randn(3, 2)})
    with pytest.raises(TypeError, match="loss_fn returned a loss of dtype torch.complex64; it must be a real"):
        step(state, {"x": torch.randn(4, 3)})


# -- item: errors that need context -----------------------------------------------------------


@pytest.mark.parametrize("leaf,error,message", [
    (1.5, TypeError, "params.s: float 1.5"),
    (None, TypeError, "params.s: NoneType None"),
    (torch.empty(2, device="meta"), ValueError, "params.s: a meta tensor (2,) torch.float32"),
], ids=["float", "None", "meta"])
def test_parameter_leaves_without_values_are_named(leaf, error, message):
    step = fs.train_step(_loss, fs.optim.sgd(0.1), mesh=fs.Mesh({"data": 2}))
    with pytest.raises(error) as e:
        step.init({"w": torch.randn(3, 2), "s": leaf})
    assert message in str(e.value) and "params.w" not in str(e.value)


def test_a_meta_template_still_loads_a_checkpoint(tmp_path):
    step = fs.train_step(_loss, fs.optim.sgd(0.1), mesh=fs.Mesh({"data": 2}))
    state = step.init({"w": torch.randn(3, 2)})
    step.save(state, tmp_path / "ck")
    back = step.load(tmp_path / "ck", {"w": torch.empty(3, 2, device="meta")})
    assert torch.equal(back.params["w"], state.params["w"])


@pytest.mark.parametrize("opt", ["adam", torch.optim.SGD, None], ids=["str", "torch-class", "None"])
def test_a_non_optimizer_is_refused_when_the_step_is_built(opt):
    with pytest.raises(TypeError, match="train_step: optimizer must be a gradient transformation with "
                                        r"init\(params\) and update"):
        fs.train_step(_loss, opt, mesh=fs.Mesh({"data": 2}))


def test_a_torch_optimizer_instance_is_told_to_use_fsharded_optim():
    w = torch.nn.Parameter(torch.randn(3, 2))
    with pytest.raises(TypeError, match="torch.optim's optimizers keep their state inside themselves"):
        fs.train_step(_loss, torch.optim.AdamW([w]), mesh=fs.Mesh({"data": 2}))


def test_a_batch_with_no_rows_is_refused_naming_the_leaf():
    step = fs.train_step(_loss, fs.optim.sgd(0.1), mesh=fs.Mesh({"data": 2}), batch_spec=P("data"))
    state = step.init({"w": torch.randn(3, 2)})
    with pytest.raises(ValueError) as e:
        step(state, {"x": torch.randn(0, 3)})
    assert "batch.x: shape (0, 3)" in str(e.value) and "dim of size 0" in str(e.value)
    assert "learning rate" not in str(e.value)


def test_a_metrics_path_that_is_a_directory_is_named(tmp_path, capsys):
    code, out, err = _main([*TINY, "--steps", "1", "--metrics", str(tmp_path)], capsys)
    assert code == 1 and f"--metrics: '{tmp_path}' is a directory; give the path of a file" in err, err
    assert "GPT" not in out  # refused before anything was built


def test_an_edited_job_record_is_refused(tmp_path, capsys):
    """job.json carries its own checksum: an edited learning rate in it is refused instead of
    becoming what the resume is checked against."""
    ck = tmp_path / "ck"
    assert _main([*TINY, "--steps", "4", "--save-every", "4", "--save-dir", str(ck)], capsys)[0] == 0
    path = ck / "step-00000004" / "job.json"
    text = path.read_text()
    assert '"lr": 0.003' in text or '"lr": 0.0003' in text, text
    path.write_text(text.replace('"lr": 0.0003', '"lr": 0.0004').replace('"lr": 0.003', '"lr": 0.004'))
    code, _, err = _main([*TINY, "--steps", "6", "--schedule-steps", "4", "--resume", "latest",
                          "--save-dir", str(ck)], capsys)
    assert code == 1 and "job.json does not match its checksum" in err, err[-2000:]


def test_a_warmup_only_schedule_resumes_when_no_remaining_rate_changes(tmp_path, capsys):
    """WarmupLR's warmup follows --steps (a tenth): --steps 10, then --steps 20 --resume
    latest changes warmup_num_steps 1 -> 2, which no update after step 10 sees: accepted.
    With --schedule-steps 10 (the flag the refusals name) the schedule is the checkpoint's."""
    ck = tmp_path / "ck"
    run = [*TINY, "--schedule", "WarmupLR", "--save-dir", str(ck)]
    assert _main([*run, "--steps", "10", "--save-every", "10"], capsys)[0] == 0
    code, out, err = _main([*run, "--steps", "12", "--resume", "latest"], capsys)
    assert code == 0 and "resumed from" in out, err[-2000:]
    code, out, err = _main([*run, "--steps", "12", "--schedule-steps", "10", "--resume", "latest"], capsys)
    assert code == 0 and "resumed from" in out, err[-2000:]


def test_an_unknown_model_setting_is_named_with_the_near_one(tmp_path, capsys):
    # Before: TypeError: GPTConfig.__init__() got an unexpected keyword argument 'n_layer'.
    code, _, err = _main([*TINY, "--steps", "1", "--set", "model.n_layer=3"], capsys)
    assert code == 1 and "model.n_layer (did you mean model.n_layers?)" in err, err[-2000:]


def test_complex_parameters_are_refused_by_path():
    # Before: accepted with a torch warning, and the update dropped the imaginary part of
    # the gradient ((1+1j) became 0.9899+0.9999j after one adamw step).
    import torch

    import fsharded as fs

    step = fs.train_step(lambda p, b: (b.to(p["z"].dtype) @ p["z"]).abs().mean(), fs.optim.adamw(1e-2),
                         mesh=fs.Mesh({"data": 2}))
    with pytest.raises(ValueError, match=r"(?s)real floating-point.*z: torch.complex64.*view_as_real"):
        step.init({"z": torch.ones(4, 2, dtype=torch.complex64)})


def test_a_torch_optimizer_is_refused_in_one_readable_line():
    import torch

    import fsharded as fs

    opt = torch.optim.AdamW([torch.zeros(2, requires_grad=True)])
    with pytest.raises(TypeError) as e:
        fs.train_step(lambda p, b: p.sum(), opt, mesh=fs.Mesh({"data": 1}))
    assert "got a torch.optim.adamw.AdamW instance" in str(e.value) and "\n" not in str(e.value)
