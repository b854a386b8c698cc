"""The step's guard against non-finite numbers (``step._guards``) on its own, and the steps it
skips counted in the state (``TrainState.skipped``): carried by the step, saved and loaded
(a checkpoint written before the count existed reads 0), the same whichever step object or
gloo rank runs it."""

from __future__ import annotations

import math
import warnings

import guards_cases as G
import nonfinite_cases as N
import pytest
import torch

import fsharded as fs
from fsharded.precision import DynamicLossScale
from fsharded.step._guards import Refuse, Skip, Unguarded, choose_guard, kept
from fsharded.step._transform import Transformed

# -- the guard alone ---------------------------------------------------------------------------


class _Step:
    """What a guard reads of its step."""

    def __init__(self, lr=0.1):
        self.optimizer, self.donate, self.distributed = fs.optim.sgd(lr), False, False


def _state(loss_scale=None, skipped=0):
    params = {"w": torch.ones(2)}
    return fs.TrainState(torch.tensor(3), params, fs.optim.sgd(0.1).init(params), loss_scale,
                         skipped=torch.tensor(skipped))


def _metrics(loss, norm):
    return {"loss": torch.tensor(loss), "grad_norm": torch.tensor(norm),
            "skipped": torch.zeros((), dtype=torch.int64)}


def test_choose_guard_once_from_the_settings():
    assert type(choose_guard(True, "raise")) is Refuse
    assert type(choose_guard(True, "skip")) is Skip
    assert type(choose_guard(False, "raise")) is Unguarded and type(choose_guard(False, "skip")) is Unguarded
    with pytest.raises(ValueError, match="on_nonfinite must be 'raise' or 'skip', got 'ignore'"):
        choose_guard(True, "ignore")


def test_verdicts():
    nan, one = torch.tensor(math.nan), torch.tensor(1.0)
    t = Transformed(None, one, None, None)
    assert Unguarded().verdict(nan, t) is None  # fp32 / bf16 unchecked: the update runs
    assert not bool(Refuse().verdict(nan, t)) and bool(Refuse().verdict(one, t))
    assert not bool(Refuse().verdict(one, t._replace(norm=torch.tensor(math.inf))))
    fp16 = t._replace(finite=torch.tensor(False))  # the loss scale's verdict decides
    assert Unguarded().verdict(one, fp16) is fp16.finite and Refuse().verdict(nan, fp16) is fp16.finite


def test_refuse_raises_with_the_state_kept_and_skip_counts():
    state, new = _state(), _state()._replace(step=torch.tensor(4))
    assert Refuse().after(_Step(), state, new, _metrics(1.0, 2.0), None)[0] is new
    with pytest.raises(FloatingPointError, match=r"step 4 has loss nan and gradient norm 2\.0\. It was not "
                                                 r"applied: the state passed in \(after 3 steps\) is unchanged"):
        Refuse().after(_Step(), state, new, _metrics(math.nan, 2.0), None)
    out, m = Skip().after(_Step(), state, new, _metrics(math.nan, 2.0), None)
    assert out.params is state.params and int(out.step) == 4 and int(out.skipped) == 1 and int(m["skipped"]) == 1
    out, m = Unguarded().after(_Step(), state, new, _metrics(math.nan, 2.0), None)
    assert out is new


def test_skip_reports_the_loss_scales_overflows_too():
    scale = DynamicLossScale().init()._replace(skipped=torch.tensor(5))
    state = _state(scale, skipped=2)
    out, m = Skip().after(_Step(), state, state, _metrics(math.nan, 1.0), None)  # applied by the loss scale
    assert int(out.skipped) == 3 and int(m["skipped"]) == 8 and out.loss_scale is scale


def test_a_zero_gradient_warns_once_per_guard():
    guard, state = Refuse(), _state()
    with pytest.warns(UserWarning, match="every gradient is exactly zero at step 4"):
        guard.after(_Step(), state, state, _metrics(1.0, 0.0), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.after(_Step(), state, state, _metrics(1.0, 0.0), None)


def test_before_refuses_a_bad_learning_rate_unless_unguarded():
    step = _Step(lr=lambda n: torch.tensor(math.nan, dtype=torch.float64))
    params = {"w": torch.ones(2)}
    state = fs.TrainState(torch.tensor(0), params, step.optimizer.init(params), None)
    with pytest.raises(FloatingPointError, match="learning rate is nan"):
        Skip().before(step, state)  # skipping would not help: every later step reads it too
    Unguarded().before(step, state)


def test_kept_says_when_the_state_was_already_bad():
    state = _state()
    assert kept(_Step(), state) == "the state passed in (after 3 steps) is unchanged"
    bad = state._replace(params={"w": torch.tensor([1.0, math.inf])})
    assert "already held non-finite values in params.w" in kept(_Step(), bad)


# -- the count in the state ------------------------------------------------------------------------


def test_a_skipped_step_advances_step_and_skipped(tmp_path):
    out = G.run_skips({"data": 2}, str(tmp_path / "ck"))
    assert out["steps"] == [1, 2, 3, 4] and out["skipped"] == [0, 1, 1, 2] and out["state_skipped"] == 2
    # Saved and loaded by a new step object: the count goes on from the checkpoint.
    assert out["loaded_skipped"] == 2 and out["after_load"] == (3, 3, 5)


def test_two_step_objects_on_one_state_agree():
    good, bad = N.batches()
    a = N.make_step({"data": 2}, donate=False, on_nonfinite="skip")
    b = N.make_step({"data": 2}, donate=False, on_nonfinite="skip")
    state, _ = a(a.init(N.params()), bad)
    for step in (a, b):  # the count is the state's, not the step object's
        new, m = step(state, bad)
        assert int(new.skipped) == 2 and int(m["skipped"]) == 2 and int(new.step) == 2
        new, m = step(new, good)
        assert int(new.skipped) == 2 and int(m["skipped"]) == 2 and int(new.step) == 3


def test_a_checkpoint_without_the_count_loads_as_zero(tmp_path):
    """A state saved before TrainState.skipped existed (no such entry) loads with 0; a state
    made without it (positionally, by older code) trains and starts counting."""
    step = N.make_step({"data": 2}, donate=False, on_nonfinite="skip")
    good, bad = N.batches()
    state, _ = step(step.init(N.params()), good)
    old = fs.TrainState(*state[:7])  # the seven fields a TrainState had before
    assert old.skipped is None
    step.save(old, str(tmp_path / "old"))
    saved = {e["path"] for e in fs.checkpoint.read_manifest(str(tmp_path / "old"))["leaves"]}
    assert "skipped" not in saved and "step" in saved
    for like in (None, N.params(), step.init(N.params())):
        loaded = step.load(str(tmp_path / "old"), like)
        assert int(loaded.skipped) == 0 and int(loaded.step) == 1
        assert torch.equal(loaded.params["w"], state.params["w"])
    new, m = step(old, bad)
    assert int(new.skipped) == 1 and int(m["skipped"]) == 1 and int(new.step) == 2
    new, _ = step(old, good)
    assert int(new.skipped) == 0
    assert step.state_specs(old).skipped is None and step.state_specs(new).skipped == fs.P()


@pytest.mark.multiprocess
def test_gloo_ranks_agree_on_the_count(tmp_path):
    from fsharded.testing import run_on_ranks

    virtual = G.run_skips({"data": 2})
    per_rank = run_on_ranks(G.gloo_skips, 2, str(tmp_path / "ck"))
    for out in per_rank:
        assert out["skipped"] == virtual["skipped"] == [0, 1, 1, 2] and out["steps"] == [1, 2, 3, 4]
        assert out["state_skipped"] == 2 and out["loaded_skipped"] == 2 and out["after_load"] == (3, 3, 5)
        torch.testing.assert_close(torch.tensor(out["w"]), virtual["w"], rtol=1e-6, atol=1e-7)
    # And the virtual mesh reads what the ranks saved.
    loaded = N.make_step({"data": 2}, donate=False, on_nonfinite="skip").load(str(tmp_path / "ck"))
    assert int(loaded.skipped) == 2 and int(loaded.step) == 4
