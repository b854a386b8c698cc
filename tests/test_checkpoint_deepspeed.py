"""DeepSpeed ZeRO checkpoints read without DeepSpeed: the checkpoints under
tests/data/deepspeed were written by DeepSpeed 0.19.8 on 2 gloo ranks (make_fixture.py,
which also recorded DeepSpeed's own consolidation of the weights, the loss of its next step
and the weights after it). Imported here, they must give DeepSpeed's weights exactly and
continue its training: the next step's loss and weights as DeepSpeed computed them.

bf16 checkpoints (``bf16_zero_pp_rank_*``): their fp32 masters and Adam moments must be
DeepSpeed's exactly, and a bf16 step continuing from them must give its next losses."""

from __future__ import annotations

import math
import os
import shutil

import deepspeed_cases as D
import pytest
import torch

import fsharded as fs
from fsharded import P
from fsharded.checkpoint import CheckpointError
from fsharded.models import gpt

DATA, FIXTURE, REF = D.DATA, D.FIXTURE, D.REF
ds_name, _step, _by_name = D.ds_name, D.step, D.by_name
REF_BF16 = D.REF_BF16
# The bf16 checkpoints kept: ZeRO-1 through DeepSpeed's ZeRO optimizer (its default: bf16
# gradients; 2 ranks) and through its BF16_Optimizer (fp32 gradient accumulation; 3 ranks,
# so that the last rank's partition is padded).
BF16_CASES = ["bf16_zero1", "bf16_zero1_fp32acc"]
# Continuing a bf16 checkpoint in bf16 (precision="bf16": fp32 masters, bf16 weights and
# compute, as DeepSpeed's bf16 runs). The first step's forward sees the same bf16 weights as
# DeepSpeed's (the loaded masters, rounded the same way): its loss agrees as the fp32 stages'
# do (measured: equal). Its gradients come out of bf16 backward passes that round unlike
# DeepSpeed's (one pass over all rows on one device, where DeepSpeed ran one per rank and
# reduced them in bf16), so the masters drift by ~lr x 2^-9 and a few weights round to the
# neighbouring bf16 value: the next losses differ by up to 1.5e-5 (relative; one device;
# 1.3e-6 to 4.5e-6 on virtual ranks as many as DeepSpeed's), while Adam restarted from fresh
# moments is off by 1.2e-4 to 3.4e-4. 5e-5 sits between, 3x from the first and 2x from the second.
BF16_FIRST = dict(rel=1e-6, abs=1e-6)
BF16_LOSS = dict(rel=5e-5)

@pytest.mark.parametrize("stage", [1, 2, 3])
def test_read_deepspeed_gives_its_own_consolidated_weights(stage):
    ck = fs.checkpoint.read_deepspeed(os.path.join(DATA, f"zero{stage}"))
    assert (ck.stage, ck.world, ck.step) == (stage, 2, 1)
    assert sorted(ck.names) == sorted(REF[stage]["fp32"])
    for name in ck.names:
        assert torch.equal(ck.tensor(name), REF[stage]["fp32"][name]), name
        assert ck.tensor(name, "exp_avg").shape == ck.shapes[name]
        assert bool((ck.tensor(name, "exp_avg_sq") >= 0).all())


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("target", [({"data": 2}, 3), ({"data": 2}, 1), ({"data": 1}, 0)],
                         ids=["virtual-zero3", "virtual-zero1", "one-device"])
def test_load_deepspeed_continues_its_training(stage, target):
    step, params = _step(*target)
    state = fs.checkpoint.load_deepspeed(os.path.join(DATA, f"zero{stage}"), step, params, names=ds_name)
    got = _by_name(step, state)
    for name, want in REF[stage]["fp32"].items():
        assert torch.equal(got[name], want), name
    assert int(state.step) == 1
    state, m = step(state, {"tokens": FIXTURE["batches"][1]})
    # DeepSpeed's next step (torch.optim.AdamW, its clipping) against ours from its moments.
    assert float(m["loss"]) == pytest.approx(REF[stage]["loss2"], rel=1e-6, abs=1e-6)
    after = _by_name(step, state)
    for name, want in REF[stage]["fp32_after"].items():
        torch.testing.assert_close(after[name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_names_as_a_dict():
    step, params = _step({"data": 1}, 0)
    paths = [p for p, _ in zip(*fs._tree.tree_flatten_with_paths(params)[:2])]
    state = fs.checkpoint.load_deepspeed(os.path.join(DATA, "zero2"), step, params,
                                         names={p: ds_name(p) for p in paths})
    assert all(torch.equal(_by_name(step, state)[n], w) for n, w in REF[2]["fp32"].items())


def test_fresh_moments_would_not_match():
    """The check above can fail: the same weights with Adam started afresh step elsewhere."""
    step, params = _step({"data": 2}, 1)
    loaded = fs.checkpoint.load_deepspeed(os.path.join(DATA, "zero1"), step, params, names=ds_name)
    fresh = step.init(step.params(loaded))
    fresh, _ = step(fresh, {"tokens": FIXTURE["batches"][1]})
    after = _by_name(step, fresh)
    assert any(not torch.allclose(after[n], w, rtol=1e-5, atol=1e-6) for n, w in REF[1]["fp32_after"].items())


def test_bad_input_is_named(tmp_path):
    step, params = _step({"data": 2}, 1)
    with pytest.raises(CheckpointError, match=r"blocks.0.attn.bk: no 'blocks.0.attn.bk' in the checkpoint[\s\S]*Pass names="):
        fs.checkpoint.load_deepspeed(os.path.join(DATA, "zero1"), step, params)  # names not mapped
    sgd = fs.train_step(gpt.loss, fs.optim.sgd(1e-2, momentum=0.9), mesh=fs.Mesh({"data": 2}), param_specs=P())
    with pytest.raises(NotImplementedError, match="adamw or adam"):
        fs.checkpoint.load_deepspeed(os.path.join(DATA, "zero1"), sgd, params, names=ds_name)
    other = fs.train_step(gpt.loss, fs.optim.adamw(1e-3, b2=0.95), mesh=fs.Mesh({"data": 2}), param_specs=P())
    with pytest.warns(UserWarning, match="b2: 0.95 here, 0.999 in the checkpoint"):
        fs.checkpoint.load_deepspeed(os.path.join(DATA, "zero1"), other, params, names=ds_name)
    broken = tmp_path / "ds"
    shutil.copytree(os.path.join(DATA, "zero2"), broken)
    os.remove(broken / "step1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match="saved by 2 ranks but holds the optimizer files of 1"):
        fs.checkpoint.read_deepspeed(broken)
    with open(broken / "step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", "r+b") as f:
        f.truncate(100)
    shutil.copy(broken / "step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                broken / "step1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match="cannot be read as a DeepSpeed checkpoint file"):
        fs.checkpoint.read_deepspeed(broken)
    with pytest.raises(CheckpointError, match="no tag 'nope'"):
        fs.checkpoint.read_deepspeed(os.path.join(DATA, "zero1"), tag="nope")


@pytest.mark.multiprocess
def test_load_deepspeed_on_gloo_ranks():
    from fsharded.testing import run_on_ranks

    for r in run_on_ranks(D.on_ranks, 2, 3):
        assert r["equal"]
        assert r["loss"] == pytest.approx(REF[3]["loss2"], rel=1e-6, abs=1e-6)
        for name, want in REF[3]["fp32_after"].items():
            torch.testing.assert_close(r["after"][name], want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_checkpoint_deepspeed_writes_now(tmp_path):
    """With DeepSpeed installed: checkpoints written now by make_fixture's worker (its
    version, whatever it is) import like the stored ones."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: the stored checkpoints are tested above")
    import importlib
    import sys

    from fsharded.testing import run_on_ranks

    if DATA not in sys.path:
        sys.path.insert(0, DATA)  # the spawned ranks import the worker from there too
    mod = importlib.import_module("make_fixture")
    ref = run_on_ranks(mod.worker, 2, str(tmp_path))[0]
    for stage in (1, 2, 3):
        step, params = _step({"data": 2}, stage)
        state = fs.checkpoint.load_deepspeed(tmp_path / f"zero{stage}", step, params, names=ds_name)
        got = _by_name(step, state)
        assert all(torch.equal(got[n], w) for n, w in ref[stage]["fp32"].items())
        state, m = step(state, {"tokens": FIXTURE["batches"][1]})
        assert float(m["loss"]) == pytest.approx(ref[stage]["loss2"], rel=1e-6, abs=1e-6)


# -- bf16 ------------------------------------------------------------------------------------


def _bf16_step(case: str, target: str, **kw):
    """A bf16 step on as many virtual ranks as DeepSpeed's (ZeRO-3 or -1) or on one device."""
    world = REF_BF16[case]["world"]
    mesh, stage = {"virtual-zero3": ({"data": world}, 3), "virtual-zero1": ({"data": world}, 1),
                   "one-device": ({"data": 1}, 0)}[target]
    return _step(mesh, stage, precision="bf16", **kw)


@pytest.mark.parametrize("case", BF16_CASES)
def test_read_deepspeed_bf16_gives_its_fp32_masters_and_moments(case):
    ref = REF_BF16[case]
    ck = fs.checkpoint.read_deepspeed(os.path.join(DATA, case))
    assert (ck.bf16, ck.stage, ck.world, ck.step, ck.adam_step) == (True, ref["stage"], ref["world"], 1, 1)
    assert sorted(os.listdir(os.path.join(DATA, case, "step1"))) == ref["files"]
    assert sorted(ck.names) == sorted(ref["fp32"])
    for name in ck.names:  # the fp32 masters, not the bf16 model weights: exactly DeepSpeed's
        for kind, key in (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            got = ck.tensor(name, kind)
            assert got.dtype == torch.float32 and torch.equal(got, ref[key][name]), (name, kind)
    assert any(not torch.equal(x, x.bfloat16().float()) for x in map(ck.tensor, ck.names))


def test_bf16_optimizer_padding_is_dropped():
    """BF16_Optimizer's 3 equal partitions of 4592 + 4 padding elements: the padding (the
    last rank's tail, in the masters and moments alike) belongs to no parameter."""
    ck = fs.checkpoint.read_deepspeed(os.path.join(DATA, "bf16_zero1_fp32acc"))
    assert [o["group_paddings"] for o in ck._optim] == [[0], [0], [4]]
    need = sum(math.prod(s) for s in ck.shapes.values())
    for kind in ck.KINDS:
        assert [p[0].numel() for p in ck._flat[kind]] == [(need + 4) // 3] * 3
    last = ck.names[-1]  # ends 4 elements before the partitions do
    assert torch.equal(ck.tensor(last).flatten(), ck._flat["param"][2][0][-4 - math.prod(ck.shapes[last]):-4])


@pytest.mark.parametrize("case", BF16_CASES)
@pytest.mark.parametrize("target", ["virtual-zero3", "virtual-zero1", "one-device"])
def test_load_deepspeed_bf16_continues_its_training(case, target):
    ref = REF_BF16[case]
    step, params = _bf16_step(case, target)
    state = fs.checkpoint.load_deepspeed(os.path.join(DATA, case), step, params, names=ds_name)
    got = _by_name(step, state)
    for name, want in ref["fp32"].items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want), name
    assert int(state.step) == 1
    _, losses = D.continue_training(step, state, ref["batches"][1:])
    assert losses[0] == pytest.approx(ref["losses"][0], **BF16_FIRST)
    assert losses == pytest.approx(ref["losses"], **BF16_LOSS)


@pytest.mark.parametrize("case", BF16_CASES)
def test_bf16_fresh_moments_would_not_match(case):
    """The check above can fail: the same masters with Adam started afresh train elsewhere."""
    step, params = _bf16_step(case, "virtual-zero1")
    loaded = fs.checkpoint.load_deepspeed(os.path.join(DATA, case), step, params, names=ds_name)
    _, losses = D.continue_training(step, step.init(step.params(loaded)), REF_BF16[case]["batches"][1:])
    assert losses != pytest.approx(REF_BF16[case]["losses"], **BF16_LOSS)


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_zero2_zero3_names(stage, tmp_path):
    """bf16 at ZeRO-2 and -3 writes the fp32 layouts under bf16_ optimizer-file names (the
    model states keep theirs): the fp32 fixtures so renamed read the same."""
    renamed = tmp_path / "ds"
    shutil.copytree(os.path.join(DATA, f"zero{stage}"), renamed)
    for f in os.listdir(renamed / "step1"):
        if f.endswith("_optim_states.pt"):
            os.rename(renamed / "step1" / f, renamed / "step1" / f"bf16_{f}")
    ck = fs.checkpoint.read_deepspeed(renamed)
    assert (ck.bf16, ck.stage, ck.world) == (True, stage, 2)
    assert all(torch.equal(ck.tensor(n), w) for n, w in REF[stage]["fp32"].items())
    step, params = _step({"data": 2}, stage)
    state = fs.checkpoint.load_deepspeed(renamed, step, params, names=ds_name)
    state, m = step(state, {"tokens": FIXTURE["batches"][1]})
    assert float(m["loss"]) == pytest.approx(REF[stage]["loss2"], rel=1e-6, abs=1e-6)


def test_bf16_bad_input_is_named(tmp_path):
    step, params = _bf16_step("bf16_zero1_fp32acc", "virtual-zero1")
    with pytest.raises(CheckpointError, match=r"blocks.0.attn.bk: no 'blocks.0.attn.bk' in the checkpoint[\s\S]*Pass names="):
        fs.checkpoint.load_deepspeed(os.path.join(DATA, "bf16_zero1_fp32acc"), step, params)
    wide = gpt.init(gpt.GPTConfig(**{**FIXTURE["config"], "d_model": 32}), 0)
    wider = fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 3}), param_specs=P(), precision="bf16")
    with pytest.raises(CheckpointError, match=r"emb: \(64, 32\) here, \(64, 16\) in the checkpoint"):
        fs.checkpoint.load_deepspeed(os.path.join(DATA, "bf16_zero1_fp32acc"), wider, wide, names=ds_name)
    for case in BF16_CASES:
        world = REF_BF16[case]["world"]
        name = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt".format
        broken = tmp_path / case
        shutil.copytree(os.path.join(DATA, case), broken)
        tag = broken / "step1"
        os.remove(tag / name(world - 1))
        with pytest.raises(CheckpointError, match=f"saved by {world} ranks but holds the optimizer files of "
                                                  f"{world - 1} .* missing: {name(world - 1)}"):
            fs.checkpoint.read_deepspeed(broken)
        os.rename(tag / name(0), tag / name(world - 1))
        with pytest.raises(CheckpointError, match=f"lacks some ranks' optimizer files: missing {name(0)}"):
            fs.checkpoint.read_deepspeed(broken)
        shutil.copy(tag / name(world - 1), tag / name(0))
        with open(tag / name(world - 1), "r+b") as f:
            f.truncate(100)
        with pytest.raises(CheckpointError, match=f"{name(world - 1)} cannot be read as a DeepSpeed checkpoint file"):
            fs.checkpoint.read_deepspeed(broken)
    # rank 0's file copied over the last rank's (3 ranks: the last one's holds the padding)
    shutil.copy(tmp_path / "bf16_zero1_fp32acc" / "step1" / name(0), tmp_path / "bf16_zero1_fp32acc" / "step1" / name(2))
    with pytest.raises(CheckpointError, match=r"do not fit its model states:\n  group 0 param: the ranks' partitions "
                                              r"hold 4596 elements, its 20 parameters \(param_shapes\) need 4592"):
        fs.checkpoint.read_deepspeed(tmp_path / "bf16_zero1_fp32acc")
    mixed = tmp_path / "mixed"
    shutil.copytree(os.path.join(DATA, "bf16_zero1"), mixed)
    shutil.copy(os.path.join(DATA, "zero1", "step1", "zero_pp_rank_0_mp_rank_00_optim_states.pt"), mixed / "step1")
    with pytest.raises(CheckpointError, match="both fp32 .* and bf16 .* optimizer files"):
        fs.checkpoint.read_deepspeed(mixed)
    # bf16 at stage 0: DeepSpeed writes only mp_rank_00_model_states.pt (its optimizer inside)
    stage0 = tmp_path / "stage0"
    os.makedirs(stage0 / "step1")
    (stage0 / "latest").write_text("step1")
    shutil.copy(os.path.join(DATA, "bf16_zero1", "step1", "mp_rank_00_model_states.pt"), stage0 / "step1")
    with pytest.raises(NotImplementedError, match=r"without ZeRO \(zero_optimization.stage 0"):
        fs.checkpoint.read_deepspeed(stage0)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_bf16_checkpoint_deepspeed_writes_now(tmp_path):
    """With DeepSpeed installed: bf16 checkpoints written now by make_fixture's worker_bf16
    (ZeRO-1 both ways, ZeRO-2, ZeRO-3) import like the stored ones."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: the stored checkpoints are tested above")
    import importlib
    import sys

    from fsharded.testing import run_on_ranks

    if DATA not in sys.path:
        sys.path.insert(0, DATA)
    mod = importlib.import_module("make_fixture")
    ref = {}
    for world in sorted({w for _, _, w in mod.BF16_CASES.values()}):
        ref.update(run_on_ranks(mod.worker_bf16, world, str(tmp_path), tuple(mod.BF16_CASES))[0])
    assert sorted(ref) == sorted(mod.BF16_CASES)
    for case, r in ref.items():
        ck = fs.checkpoint.read_deepspeed(tmp_path / case)
        assert (ck.bf16, ck.stage, ck.world) == (True, r["stage"], r["world"]), case
        assert all(torch.equal(ck.tensor(n, k), r[key][n]) for n in ck.names
                   for k, key in (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))), case
        step, params = _step({"data": r["world"]}, r["stage"], precision="bf16")
        state = fs.checkpoint.load_deepspeed(tmp_path / case, step, params, names=ds_name)
        _, losses = D.continue_training(step, state, r["batches"][1:])
        assert losses[0] == pytest.approx(r["losses"][0], **BF16_FIRST), case
        assert losses == pytest.approx(r["losses"], **BF16_LOSS), case
