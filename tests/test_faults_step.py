"""A learning rate that is nan, inf or negative never reaches the parameters: schedules and
optimizers refuse one when they are made (and so does the DeepSpeed config reader); a
schedule given as a callable that returns one at step k is refused by the step before it
runs, the state passed in kept. fp16 refuses a step whose loss is nan and whose gradients
are finite, as fp32 and bf16 do. A refused step's message says when the state passed in
was already not finite."""

from __future__ import annotations

import math
import re

import nonfinite_cases as N
import pytest
import step_faults_cases as C
import torch

import fsharded as fs
from fsharded import P
from fsharded import optim as fo

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("make,match", [
    (lambda: fo.WarmupLR(warmup_max_lr=NAN), r"WarmupLR: warmup_max_lr must be a finite number >= 0 .*got nan"),
    (lambda: fo.WarmupLR(warmup_min_lr=-0.1), r"WarmupLR: warmup_min_lr .*got -0\.1: a negative rate"),
    (lambda: fo.WarmupDecayLR(100, warmup_max_lr=INF), r"WarmupDecayLR: warmup_max_lr .*got inf"),
    (lambda: fo.WarmupCosineLR(100, lr=NAN), r"WarmupCosineLR: lr must be a finite number >= 0 .*got nan"),
    (lambda: fo.WarmupCosineLR(100, warmup_min_ratio=NAN, lr=0.1), r"WarmupCosineLR: warmup_min_ratio .*got nan"),
    (lambda: fo.WarmupCosineLR(100, cos_min_ratio=-1.0, lr=0.1), r"WarmupCosineLR: cos_min_ratio .*got -1\.0"),
    (lambda: fo.OneCycle(NAN, 0.1), r"OneCycle: cycle_min_lr .*got nan"),
    (lambda: fo.OneCycle(0.0, INF), r"OneCycle: cycle_max_lr .*got inf"),
    (lambda: fo.OneCycle(0.0, 0.1, decay_lr_rate=-0.5, decay_step_size=2), r"OneCycle: decay_lr_rate .*got -0\.5"),
    (lambda: fo.OneCycle(0.0, 0.1, cycle_first_step_size=INF), r"OneCycle: cycle_first_step_size must be a positive int"),
    (lambda: fo.OneCycle(0.0, 0.1, decay_step_size=-1), r"OneCycle: decay_step_size must be an int >= 0"),
    (lambda: fo.constant(NAN), r"constant: lr must be a finite number >= 0 .*got nan"),
    (lambda: fo.linear(0.1, -0.01, 10), r"linear: end .*got -0\.01"),
    (lambda: fo.linear(INF, 0.0, 10), r"linear: init .*got inf"),
    (lambda: fo.adamw(NAN), r"adamw: lr must be a finite number >= 0, got nan"),
    (lambda: fo.sgd(-0.1), r"sgd: lr must be a finite number >= 0, got -0\.1"),
    (lambda: fo.lion(INF), r"lion: lr must be a finite number >= 0, got inf"),
    (lambda: fo.adagrad(0.1, lr_decay=-1.0), r"adagrad: lr_decay must be a finite number >= 0, got -1\.0"),
])
def test_rates_that_are_not_finite_or_negative_are_refused_when_made(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("config,match", [
    ('{"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": NaN}}}',
     r"scheduler\.params\.warmup_max_lr: expected a finite number >= 0, got nan"),
    ('{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, '
     '"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": -Infinity}}}',
     r"scheduler\.params\.cos_min_ratio: expected a finite number >= 0, got -inf"),
    ('{"train_batch_size": 8, "scheduler": {"type": "OneCycle", '
     '"params": {"cycle_min_lr": 0, "cycle_max_lr": 0.1, "cycle_first_step_size": 0}}}',
     r"scheduler\.params\.cycle_first_step_size: expected an int >= 1, got 0"),
])
def test_the_deepspeed_reader_refuses_schedule_rates_that_are_not_finite(config, match):
    from fsharded.config import TrainConfig, from_deepspeed

    with pytest.raises(ValueError, match=r"(?s)invalid DeepSpeed config:.*" + match):
        from_deepspeed(config)
    with pytest.raises(ValueError, match=r"scheduler\.params\.warmup_max_lr: expected a finite number >= 0"):
        TrainConfig(scheduler={"name": "WarmupLR", "params": {"warmup_max_lr": NAN}})


def test_the_rates_an_update_will_apply_are_read_from_the_state():
    opt = fo.chain(fo.clip_by_global_norm(1.0), fo.MultiSteps(fo.adamw(C.bad_at(2, NAN)), 2))
    state = opt.init({"w": torch.ones(2)})
    (count, lr), = fo.scheduled_lrs(opt, state)
    assert int(count) == 0 and float(lr) == pytest.approx(0.1)
    assert fo.scheduled_lrs(fo.clip_by_global_norm(1.0), ()) == []  # no rate in it


_CASES = [(False, 0, "adamw"), (True, 0, "adamw"), (True, 0, "sgd"), (False, 3, "adamw"), (True, 3, "adamw")]


@pytest.mark.parametrize("mesh", [{"data": 1}, {"data": 2}])
@pytest.mark.parametrize("donate,stage,optimizer", _CASES)
def test_a_callable_schedule_that_returns_nan_at_step_k_is_refused_before_the_step(mesh, donate, stage, optimizer):
    if stage and mesh["data"] == 1:
        pytest.skip("ZeRO-3 on one device is stage 0")
    out = C.run_bad_lr(mesh, donate, stage, optimizer)
    assert out["lrs"] == pytest.approx([0.1, 0.05])
    assert out["message"] is not None, "a step with a nan learning rate was applied silently"
    assert out["message"].startswith("train_step: step 3: the optimizer's learning rate is nan (its schedule's "
                                     "value at update 2, counted from 0). The step was not run: the state passed "
                                     "in (after 2 steps) is unchanged"), out["message"]
    assert out["unchanged"] and out["finite"], "the state passed in was changed by the refused step"
    assert out["step"] == 3 and out["lr_after"] == pytest.approx(0.1 / 3) and math.isfinite(out["loss_after"])


@pytest.mark.parametrize("value,shown", [(-0.5, "-0.5 (negative)"), (INF, "inf")])
def test_a_negative_or_infinite_rate_from_a_callable_is_refused_too(value, shown):
    out = C.run_bad_lr({"data": 2}, True, 0, "adamw", value=value)
    assert out["message"] is not None and f"learning rate is {shown} (its schedule's value at update 2" in out["message"]
    assert out["unchanged"] and out["finite"]


def test_on_nonfinite_skip_does_not_skip_a_nan_learning_rate():
    step = N.make_step({"data": 2}, donate=False, optimizer=fo.adamw(C.bad_at(0, NAN)), on_nonfinite="skip")
    good, _ = N.batches()
    state = step.init(N.params())
    with pytest.raises(FloatingPointError, match=r"step 1: the optimizer's learning rate is nan.*does not skip this"):
        step(state, good)
    assert all(bool(torch.isfinite(x).all()) for x in state.params.values())


@pytest.mark.parametrize("donate,stage", [(False, 0), (True, 0), (True, 3)])
def test_two_gloo_ranks_refuse_a_nan_learning_rate_together(donate, stage):
    from fsharded.testing import run_on_ranks

    virtual = C.run_bad_lr({"data": 2}, donate, stage)
    for out in run_on_ranks(C.gloo_bad_lr, 2, donate, stage):
        assert out["message"] is not None and "learning rate is nan" in out["message"] and \
            "(after 2 steps) is unchanged" in out["message"]
        assert out["unchanged"] and out["finite"] and out["step"] == 3
        assert out["loss_after"] == pytest.approx(virtual["loss_after"], rel=1e-6)


def test_the_lr_metric_is_the_rate_the_update_applied_after_a_skipped_step():
    step = N.make_step({"data": 2}, donate=False, optimizer=fo.sgd(fo.linear(0.4, 0.0, 4)), on_nonfinite="skip")
    good, bad = N.batches()
    state, m0 = step(step.init(N.params()), good)
    state, _ = step(state, bad)  # skipped: the optimizer's count stays at 1
    kept = [x.clone() for x in state.params.values()]
    state, m = step(state, good)
    assert float(m0["lr"]) == pytest.approx(0.4)
    # The update after the skip is the optimizer's second: linear(0.4, 0, 4) at 1 = 0.3.
    assert float(m["lr"]) == pytest.approx(0.3)
    g = {k: v for k, v in zip(state.params, kept)}
    assert not torch.equal(g["v"], state.params["v"])


@pytest.mark.parametrize("mesh", [{"data": 1}, {"data": 2}])
def test_fp16_refuses_a_nan_loss_with_finite_gradients_as_fp32_does(mesh):
    out = C.run_fp16_nan_loss(mesh, "raise")
    assert out["message"] is not None, "fp16 applied a step whose loss is nan"
    assert re.match(r"train_step: step 2 has loss nan and gradient norm 3\.59\d*\. It was not applied: "
                    r"the state passed in \(after 1 step\) is unchanged\. Lower", out["message"]), out["message"]
    assert out["unchanged"]
    for prec in ("fp32", "bf16"):  # the same refusal, the same words
        step = fs.train_step(C.nan_bias_loss, fo.adamw(0.1), mesh=fs.Mesh(mesh), param_specs=P(), batch_spec=P(),
                             precision=prec)
        with pytest.raises(FloatingPointError, match=r"step 1 has loss nan and gradient norm 4\.0\. It was not applied"):
            step(step.init({"w": torch.ones(4)}), {"bias": torch.tensor(NAN)})


def test_fp16_skips_a_nan_loss_with_finite_gradients_without_touching_the_loss_scale():
    out = C.run_fp16_nan_loss({"data": 2}, "skip")
    assert out["message"] is None and out["step"] == 2 and out["skipped"] == 1
    assert out["new_scale_same"], "a nan loss was counted as an overflow of the loss scale"
    assert all(torch.equal(a, b) for a, b in zip(out["new_params"], out["kept_params"]))


def test_two_gloo_ranks_refuse_an_fp16_nan_loss_together():
    from fsharded.testing import run_on_ranks

    for out in run_on_ranks(C.gloo_fp16_nan_loss, 2, "raise"):
        assert out["message"] is not None and "step 2 has loss nan" in out["message"] and out["unchanged"]


def test_a_refused_step_says_when_the_state_passed_in_was_already_not_finite():
    step = fs.train_step(C.nan_bias_loss, fo.adamw(0.1), mesh=fs.Mesh({"data": 2}), param_specs=P(), batch_spec=P())
    state = step.init({"w": torch.ones(4)})
    poisoned = state._replace(params={"w": torch.tensor([1.0, NAN, 1.0, 1.0])})  # e.g. loaded from a checkpoint
    with pytest.raises(FloatingPointError, match=r"is unchanged, but it already held non-finite values in "
                                                 r"params\.w, so it is no good state either"):
        step(poisoned, {"bias": torch.tensor(0.0)})
    with pytest.raises(FloatingPointError, match=r"is unchanged\. Lower the learning rate"):  # a good state: no such note
        step(state, {"bias": torch.tensor(NAN)})


def test_a_schedule_returning_python_floats_runs_and_its_nan_is_refused():
    # Before: any callable lr returning a Python float failed with AttributeError: 'float'
    # object has no attribute 'to', so its nan never reached the check.
    import fsharded as fs

    sched = lambda s: float("nan") if int(s) == 3 else 1e-2  # noqa: E731
    step = fs.train_step(lambda p, b: ((b @ p) ** 2).mean(), fs.optim.adamw(sched), mesh=fs.Mesh({"data": 2}))
    state = step.init(torch.ones(4, 2))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        state, m = step(state, torch.randn(8, 4, generator=g))
        assert m["lr"] == pytest.approx(1e-2)
    with pytest.raises(FloatingPointError, match="learning rate is nan"):
        step(state, torch.randn(8, 4, generator=g))
