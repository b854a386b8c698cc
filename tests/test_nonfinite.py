"""Non-finite numbers never reach the state: a step with inf/nan gradients (and a finite
loss) or a nan loss stops with the true last state — donated, fused and sharded states
included — naming the gradient leaves; on_nonfinite="skip" skips it; a diverged fp16 run
stops once its loss scale is at the minimum."""

from __future__ import annotations

import math

import nonfinite_cases as N
import pytest
import torch

import fsharded as fs
from fsharded import P


@pytest.mark.parametrize("mesh", [{"data": 1}, {"data": 2}])
@pytest.mark.parametrize("donate,stage,optimizer", [
    (False, 0, "adamw"), (True, 0, "adamw"), (True, 3, "adamw"), (True, 0, "sgd"), (False, 3, "sgd")])
def test_inf_gradients_with_a_finite_loss_stop_with_the_last_good_state(mesh, donate, stage, optimizer):
    if stage and mesh["data"] == 1:
        pytest.skip("ZeRO-3 on one device is stage 0")
    out = N.run_stop(mesh, donate, stage, optimizer)
    assert out["message"] is not None, "the non-finite step was applied silently"
    assert "step 2 has loss" in out["message"] and "gradient norm nan" in out["message"]  # 0/0
    assert "non-finite gradients in params.w." in out["message"]  # only w: v and u are finite
    assert "(after 1 step) is unchanged" in out["message"]
    assert out["unchanged"], "the state passed in was changed by a step that raised"
    assert out["finite_after"] and out["step"] == 2 and math.isfinite(out["loss"])


@pytest.mark.parametrize("donate,stage", [(False, 0), (True, 0), (True, 3)])
def test_two_gloo_ranks_stop_together_when_one_shard_is_not_finite(donate, stage):
    from fsharded.testing import run_on_ranks

    virtual = N.run_stop({"data": 2}, donate, stage)
    per_rank = run_on_ranks(N.gloo_stop, 2, donate, stage)
    for out in per_rank:  # the bad row is in rank 1's half only: both ranks stop, both name w
        assert out["message"] is not None and "non-finite gradients in params.w." in out["message"]
        assert out["unchanged"] and out["finite_after"] and out["step"] == 2
        assert out["loss"] == pytest.approx(virtual["loss"], rel=1e-6)


def test_a_nan_loss_with_finite_gradients_is_not_applied_in_place():
    def loss(p, b):  # the nan does not reach the gradients
        return (p["w"] ** 2).sum() + b["bias"]

    params = {"w": torch.ones(4)}
    for mesh in ({"data": 1}, {"data": 2}):
        step = fs.train_step(loss, fs.optim.adamw(0.1), mesh=fs.Mesh(mesh), param_specs=P(),
                             batch_spec=P(), donate=True)
        state = step.init(params)
        with pytest.raises(FloatingPointError, match=r"step 1 has loss nan and gradient norm 4\.0.*unchanged"):
            step(state, {"bias": torch.tensor(math.nan)})
        assert torch.equal(state.params["w"], torch.ones(4))
        assert torch.equal(state.opt_state[0].mu["w"], torch.zeros(4))


def test_bf16_compute_stops_too():
    step = N.make_step({"data": 2}, donate=True, precision="bf16")
    good, bad = N.batches()
    state, _ = step(step.init(N.params()), good)
    kept = [x.clone() for x in state.params.values()]
    with pytest.raises(FloatingPointError, match=r"non-finite gradients in params\.w\."):
        step(state, bad)
    assert all(torch.equal(a, b) for a, b in zip(kept, state.params.values()))


def test_on_nonfinite_skip_skips_and_counts():
    for donate in (False, True):
        step = N.make_step({"data": 2}, donate=donate, on_nonfinite="skip")
        good, bad = N.batches()
        state, _ = step(step.init(N.params()), good)
        kept = [x.clone() for x in state.params.values()]
        state, m = step(state, bad)
        assert int(m["skipped"]) == 1 and int(state.step) == 2
        assert all(torch.equal(a, b) for a, b in zip(kept, state.params.values()))
        state, m = step(state, good)
        assert int(state.step) == 3 and all(bool(torch.isfinite(x).all()) for x in state.params.values())
        assert not all(torch.equal(a, b) for a, b in zip(kept, state.params.values()))
    with pytest.raises(ValueError, match="on_nonfinite must be 'raise' or 'skip'"):
        N.make_step({"data": 1}, donate=False, on_nonfinite="ignore")


def test_a_diverged_fp16_run_stops_at_the_minimum_scale():
    def loss(p, b):  # gradients of 2e10 * w overflow fp16 whatever the scale
        return ((p["w"] * 1e5) ** 2).sum() * b["x"].mean()

    step = fs.train_step(loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 2}), param_specs=P(),
                         precision="fp16")
    state = step.init({"w": torch.ones(4)})
    batch = {"x": torch.ones(4, 2)}
    skipped = []
    with pytest.raises(FloatingPointError, match=r"loss scale at its minimum \(1\.0\).*diverged"):
        for _ in range(60):
            new, m = step(state, batch)
            skipped.append(int(m["skipped"]))
            state = new
    # Every step skipped on the way down from 2**16 (hysteresis 2), the parameters intact.
    assert skipped == list(range(1, len(skipped) + 1)) and 15 <= len(skipped) < 60
    assert torch.equal(state.params["w"], torch.ones(4))


def test_a_loss_that_does_not_depend_on_the_parameters_warns_once():
    def detached(p, b):
        return (p["w"].detach() * b["x"]).sum()

    step = fs.train_step(detached, fs.optim.sgd(0.1), mesh=fs.Mesh({"data": 2}), param_specs=P())
    state = step.init({"w": torch.ones(3)})
    batch = {"x": torch.ones(4, 3)}
    with pytest.warns(UserWarning, match=r"every gradient is exactly zero at step 1: the loss probably does not"):
        state, m = step(state, batch)
    assert float(m["grad_norm"]) == 0.0
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        step(state, batch)


def test_integer_parameters_are_refused_with_their_paths():
    step = fs.train_step(lambda p, b: p["w"].sum(), fs.optim.sgd(0.1), mesh=fs.Mesh({"data": 1}))
    with pytest.raises(ValueError, match=r"(?s)must be real floating-point tensors.*  ids: torch.int64.*in the batch"):
        step.init({"w": torch.ones(2), "ids": torch.arange(3)})


def _gloo_memory_check() -> str:
    import os

    from fsharded.models import gpt
    from fsharded.step import _estimate as _memory

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    config = gpt.GPTConfig.small(d_model=64, n_layers=2)
    params = gpt.init(config, 0)
    real = _memory.available_memory
    limit = gpt.param_count(params) * 4 * 3 // 2  # ZeRO-0's replicated state cannot fit, ZeRO-3's can
    _memory.available_memory = lambda device="cpu": (limit, "a test limit")
    try:
        step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 2}))
        step.init(params)
        return "no error"
    except fs.InsufficientMemoryError as e:
        return str(e)
    finally:
        _memory.available_memory = real


def test_a_state_that_cannot_fit_is_refused_before_it_is_allocated(monkeypatch):
    from fsharded.models import gpt
    from fsharded.step import _estimate as _memory
    from fsharded.testing import run_on_ranks

    config = gpt.GPTConfig.small(d_model=64, n_layers=2)
    params = gpt.init(config, 0)
    n = gpt.param_count(params)
    limit = n * 4  # less than the fp32 weights alone
    monkeypatch.setattr(_memory, "available_memory", lambda device="cpu": (limit, "a test limit"))
    step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 2}))
    with pytest.raises(fs.InsufficientMemoryError, match=r"(?s)train_step.init: the training state .*needs "
                                                         r"about .* GiB, but 0\.00 GiB is available \(a test limit\)"
                                                         r".*check_memory=False"):
        step.init(params)
    fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 2}), check_memory=False).init(params)
    monkeypatch.undo()
    step.init(params)  # this machine has the room
    msg = run_on_ranks(_gloo_memory_check, 2)[0]
    assert "per rank" in msg and "2 processes of" in msg and "Would fit: ZeRO-3 over data" in msg, msg


def _gloo_step_memory_check() -> list:
    import os

    from fsharded.models import gpt
    from fsharded.step import _estimate as _memory

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    config = gpt.GPTConfig.small(d_model=64, n_layers=2)
    params = gpt.init(config, 0)
    real = _memory.available_memory
    # 20 MB for 2 ranks: the state (~1.5 MB a rank) and a step on 4 rows a rank (~5 MB)
    # fit; a step on 32 rows a rank (~30 MB of activations) does not.
    _memory.available_memory = lambda device="cpu": (20 * 2**20, "a test limit")
    out = []
    try:
        step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 2}))
        state = step.init(params)
        g = torch.Generator().manual_seed(0)
        small = {"tokens": torch.randint(0, config.vocab_size, (8, 65), generator=g)}
        big = {"tokens": torch.randint(0, config.vocab_size, (64, 65), generator=g)}
        state, _ = step(state, small)
        out.append(int(state.step))
        try:
            step(state, big)
            out.append("no error")
        except fs.InsufficientMemoryError as e:
            out.append(str(e))
        out.append(int(state.step))
    finally:
        _memory.available_memory = real
    return out


def test_a_step_whose_activations_cannot_fit_is_refused_before_it_runs():
    from fsharded.testing import run_on_ranks

    for r, (done, msg, after) in enumerate(run_on_ranks(_gloo_step_memory_check, 2)):
        assert done == 1 and after == 1
        assert msg.startswith(f"train_step: step 2: its forward, backward and update on rank {r} (measured on a "
                              "dry run, beyond the state already allocated) needs about 0.06 GiB (2 processes of "
                              "0.03 GiB on this host), but 0.02 GiB is available (a test limit). To need less: "
                              "a smaller batch (this rank's share is 32 rows); recomputing the model's blocks in backward "
                              "(train_step(remat=\"blocks\")"), msg
        assert "more data ranks (now 2)" in msg and "check_memory=False" in msg, msg
