"""DeepSpeed ZeRO checkpoints read without DeepSpeed: the checkpoints under
tests/data/deepspeed were written by DeepSpeed 0.19.8 on 2 gloo ranks (make_fixture.py,
which also recorded DeepSpeed's own consolidation of the weights, the loss of its next step
and the weights after it). Imported here, they must give DeepSpeed's weights exactly and
continue its training: the next step's loss and weights as DeepSpeed computed them."""

from __future__ import annotations

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
