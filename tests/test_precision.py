"""Mixed-precision policy and DeepSpeed's dynamic loss scaling as pure, vmap-safe state."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import fsharded as fs
from fsharded import P
from fsharded.precision import (
    DynamicLossScale,
    LossScaleState,
    Policy,
    StaticLossScale,
    all_finite,
    as_policy,
    cast_tree,
    check_loss_scale,
    loss_scale_init,
    scale_loss,
    tree_where,
    unscale,
)

OK, OVERFLOW = torch.tensor(True), torch.tensor(False)


# -- DeepSpeed's update rules, transcribed from deepspeed/runtime/fp16/ ---------------------


class DeepSpeedDynamicLossScaler:
    """``DynamicLossScaler.update_scale`` from ``loss_scaler.py`` (logging dropped).

    Used by DeepSpeed's ZeRO optimizers; raises when an overflow would shrink a scale
    already at the minimum.
    """

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis,
                 raise_error_at_min_scale=True):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if (self.cur_scale == self.min_scale) and self.raise_error_at_min_scale:
                    raise Exception("Current loss scale already at minimum")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class DeepSpeedFusedUpdate(DeepSpeedDynamicLossScaler):
    """``FP16_Optimizer._update_scale`` from ``fused_optimizer.py`` (the non-ZeRO path):
    the same state machine written differently, and it never raises."""

    def update_scale(self, overflow):
        if overflow:
            if self.cur_hysteresis > 1:
                self.cur_hysteresis -= 1
            else:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def _reference_args(ls: DynamicLossScale) -> dict:
    return dict(init_scale=2.0**ls.initial_scale_power, scale_window=ls.loss_scale_window,
                min_scale=ls.min_loss_scale, delayed_shift=ls.hysteresis,
                consecutive_hysteresis=ls.consecutive_hysteresis)


def _assert_matches(state: LossScaleState, ref, skipped: int) -> None:
    assert state.scale.item() == ref.cur_scale
    assert state.hysteresis.item() == ref.cur_hysteresis
    assert state.good_steps.item() == ref.cur_iter - ref.last_overflow_iter - 1
    assert state.skipped.item() == skipped


CONFIGS = [
    DynamicLossScale(initial_scale_power=4, loss_scale_window=3, hysteresis=2),
    DynamicLossScale(initial_scale_power=3, loss_scale_window=2, hysteresis=1),
    DynamicLossScale(initial_scale_power=5, loss_scale_window=4, hysteresis=3,
                     consecutive_hysteresis=True, min_loss_scale=2.0),
    DynamicLossScale(initial_scale_power=2, loss_scale_window=5, hysteresis=2,
                     consecutive_hysteresis=True, min_loss_scale=0.25),
]


@pytest.mark.parametrize("ls", CONFIGS, ids=lambda ls: f"w{ls.loss_scale_window}h{ls.hysteresis}"
                         f"{'c' if ls.consecutive_hysteresis else ''}")
@pytest.mark.parametrize("p_overflow", [0.1, 0.35, 0.7])
def test_matches_deepspeed_transcription_on_random_sequences(ls, p_overflow):
    """Every field after every update equals DeepSpeed's, for both of its code paths,
    and ``overflows_at_min`` counts exactly the updates where DeepSpeed would raise."""
    rng = random.Random(hash((ls.loss_scale_window, ls.hysteresis, p_overflow)) % 2**32)
    ref = DeepSpeedDynamicLossScaler(**_reference_args(ls), raise_error_at_min_scale=False)
    fused = DeepSpeedFusedUpdate(**_reference_args(ls))
    state, skipped, raises = ls.init(), 0, 0
    _assert_matches(state, ref, 0)
    for _ in range(300):  # growth is bounded by 300 / window doublings: fp32 holds the scale
        overflow = rng.random() < p_overflow
        strict = copy.deepcopy(ref)
        strict.raise_error_at_min_scale = True
        try:
            strict.update_scale(overflow)
        except Exception:
            raises += 1
        ref.update_scale(overflow)
        fused.update_scale(overflow)
        skipped += overflow
        state = ls.update(state, torch.tensor(not overflow))
        _assert_matches(state, ref, skipped)
        assert (fused.cur_scale, fused.cur_hysteresis) == (ref.cur_scale, ref.cur_hysteresis)
        assert state.overflows_at_min.item() == raises


@pytest.mark.parametrize("ls", CONFIGS, ids=lambda ls: f"w{ls.loss_scale_window}h{ls.hysteresis}")
def test_matches_deepspeed_class_when_installed(ls, monkeypatch):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    # update_scale logs through deepspeed.comm; no process group is needed for rank 0.
    monkeypatch.setattr(loss_scaler, "dist", type("Dist", (), {"get_rank": staticmethod(lambda: 0)}))
    ref = loss_scaler.DynamicLossScaler(**_reference_args(ls), raise_error_at_min_scale=False)
    rng, state, skipped, raises = random.Random(0), ls.init(), 0, 0
    for _ in range(200):
        overflow = rng.random() < 0.3
        strict = copy.deepcopy(ref)
        strict.raise_error_at_min_scale = True
        try:
            strict.update_scale(overflow)
        except Exception:
            raises += 1
        ref.update_scale(overflow)
        skipped += overflow
        state = ls.update(state, not overflow)
        _assert_matches(state, ref, skipped)
        assert state.overflows_at_min.item() == raises


# -- the behaviours one by one --------------------------------------------------------------


def test_overflow_skips_and_halves_only_after_hysteresis():
    ls = DynamicLossScale()  # DeepSpeed's defaults: 2**16, window 1000, hysteresis 2
    s = ls.init()
    assert (s.scale.item(), s.hysteresis.item()) == (2.0**16, 2)
    s = ls.update(s, OVERFLOW)  # first overflow spends hysteresis, keeps the scale
    assert (s.scale.item(), s.hysteresis.item(), s.skipped.item()) == (2.0**16, 1, 1)
    s = ls.update(s, OVERFLOW)  # hysteresis exhausted: halve
    assert (s.scale.item(), s.skipped.item()) == (2.0**15, 2)
    s = ls.update(s, OK)
    s = ls.update(s, OVERFLOW)  # not refilled by good steps short of a window: halve at once
    assert (s.scale.item(), s.hysteresis.item(), s.skipped.item()) == (2.0**14, 1, 3)


def test_consecutive_hysteresis_refills_on_every_good_step():
    ls = DynamicLossScale(consecutive_hysteresis=True)
    s = ls.init()
    for _ in range(5):  # alternating overflows never exhaust a refilled hysteresis
        s = ls.update(ls.update(s, OVERFLOW), OK)
    assert (s.scale.item(), s.hysteresis.item(), s.skipped.item()) == (2.0**16, 2, 5)
    s = ls.update(ls.update(s, OVERFLOW), OVERFLOW)
    assert s.scale.item() == 2.0**15


def test_scale_doubles_after_window_good_steps_and_refills_hysteresis():
    ls = DynamicLossScale(initial_scale_power=8, loss_scale_window=4)
    s = ls.update(ls.init(), OVERFLOW)
    assert s.hysteresis.item() == 1
    scales = []
    for _ in range(9):
        s = ls.update(s, OK)
        scales.append(s.scale.item())
    # DeepSpeed doubles on the update that follows `window` overflow-free ones (its
    # stable_interval counts updates before the current one), then every window after.
    assert scales == [256.0] * 4 + [512.0] * 4 + [1024.0]
    assert s.hysteresis.item() == 2


def test_min_scale_is_a_floor_and_overflows_there_are_counted():
    ls = DynamicLossScale(initial_scale_power=3, hysteresis=1, min_loss_scale=2.0)
    s = ls.init()
    for expected in (4.0, 2.0, 2.0, 2.0):
        s = ls.update(s, OVERFLOW)
        assert s.scale.item() == expected
    assert (s.skipped.item(), s.overflows_at_min.item()) == (4, 2)
    with pytest.raises(FloatingPointError, match="minimum"):
        check_loss_scale(s)
    check_loss_scale(ls.init())  # silent when healthy


def test_static_loss_scale_keeps_its_scale_and_counts_skips():
    ls = StaticLossScale(128.0)
    s = ls.init()
    for finite in (OK, OVERFLOW, OVERFLOW, OK):
        s = ls.update(s, finite)
    assert (s.scale.item(), s.skipped.item(), s.good_steps.item()) == (128.0, 2, 1)


def test_loss_scale_init_is_the_dynamic_init():
    s = loss_scale_init(initial_scale_power=10, hysteresis=3)
    assert (s.scale.item(), s.hysteresis.item(), s.skipped.item()) == (1024.0, 3, 0)
    assert s.scale.dtype == torch.float32 and s.skipped.dtype == torch.int64


@pytest.mark.parametrize("kw, field", [
    (dict(loss_scale_window=0), "loss_scale_window"), (dict(hysteresis=1.5), "hysteresis"),
    (dict(min_loss_scale=0.0), "min_loss_scale"), (dict(initial_scale_power=200), "initial_scale_power"),
    (dict(consecutive_hysteresis=1), "consecutive_hysteresis"),
])
def test_invalid_settings_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        DynamicLossScale(**kw)
    with pytest.raises(ValueError, match="scale"):
        StaticLossScale(float("inf"))


# -- helpers --------------------------------------------------------------------------------


def test_all_finite_and_tree_where_skip_a_step():
    params = {"w": torch.ones(3), "step": torch.tensor(4)}
    for bad in (float("inf"), float("-inf"), float("nan")):
        grads = {"w": torch.tensor([1.0, bad, 1.0]), "step": torch.tensor(0)}
        finite = all_finite(grads)
        assert finite.dtype == torch.bool and not finite
        new = {"w": params["w"] - 0.1 * grads["w"], "step": params["step"] + 1}
        out = tree_where(finite, new, params)
        assert torch.equal(out["w"], params["w"]) and out["step"].item() == 4
    assert all_finite({"w": torch.ones(2, dtype=torch.float16), "i": torch.tensor([7])})
    assert all_finite({})
    out = tree_where(True, {"w": torch.zeros(2, dtype=torch.bfloat16)}, {"w": torch.ones(2)})
    assert out["w"].dtype == torch.float32 and not out["w"].any()


def test_tree_where_errors():
    with pytest.raises(TypeError, match="leaf a differs"):
        tree_where(OK, {"a": 1}, {"a": 2})
    with pytest.raises(TypeError, match="tensor on one side"):
        tree_where(OK, {"a": torch.ones(1)}, {"a": 1.0})
    with pytest.raises(ValueError, match="different structures"):
        tree_where(OK, {"a": torch.ones(1)}, {"b": torch.ones(1)})


def test_scaling_rescues_fp16_gradients_that_underflow():
    """The reason loss scaling exists: a 1e-8 gradient is 0 in fp16 but survives scaling."""
    w = torch.ones(4, dtype=torch.float16)

    def loss_fn(w):
        return ((w * 1e-4) * 1e-4).sum()

    assert not torch.func.grad(loss_fn)(w).any()  # underflow: fp16's smallest is ~6e-8
    state = DynamicLossScale(initial_scale_power=14).init()
    grads = torch.func.grad(lambda w: scale_loss(loss_fn(w), state))(w)
    assert grads.dtype == torch.float16 and all_finite(grads)
    g = unscale(grads, state)
    assert g.dtype == torch.float32
    torch.testing.assert_close(g, torch.full((4,), 1e-8), rtol=2e-3, atol=0)  # fp16 rounding


def test_unscale_and_scale_loss_dtypes():
    state = StaticLossScale(4.0).init()
    assert scale_loss(torch.tensor(2.0, dtype=torch.bfloat16), state).dtype == torch.float32
    grads = {"a": torch.full((2,), 8.0, dtype=torch.float16), "n": torch.tensor([3]), "x": None}
    out = unscale(grads, state)
    assert out["a"].dtype == torch.float32 and out["a"].tolist() == [2.0, 2.0]
    assert out["n"].tolist() == [3] and out["x"] is None
    assert unscale(grads, state, dtype=None)["a"].dtype == torch.float16


# -- vmap and the virtual mesh --------------------------------------------------------------


def test_update_under_vmap_equals_per_sequence():
    ls = DynamicLossScale(initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    seqs = torch.rand(30, 3, generator=torch.Generator().manual_seed(0)) > 0.4  # (T, batch)
    batched = torch.func.vmap(lambda _: ls.init())(torch.arange(3))
    update = torch.func.vmap(ls.update)
    for t in range(seqs.shape[0]):
        batched = update(batched, seqs[t])
    for b in range(3):
        s = ls.init()
        for t in range(seqs.shape[0]):
            s = ls.update(s, seqs[t, b])
        for got, want in zip(batched, s):
            assert got[b].item() == want.item()


def test_one_shard_overflowing_skips_the_step_on_every_shard():
    """A data-parallel fp16-style step on the virtual mesh: an inf on one shard's batch
    makes every shard keep its parameters and halve the scale together."""
    mesh = fs.Mesh({"data": 2})
    ls = DynamicLossScale(initial_scale_power=8, hysteresis=1)
    policy = Policy.fp16(param_dtype=torch.float32, compute_dtype=torch.float32)

    def step(params, x, state):
        def loss(p):
            return (policy.cast_to_compute(p)["w"] * x).sum()

        # w is invariant over data, so its gradient comes back summed over the shards
        # (JAX's rule): an inf on one shard reaches every shard's gradient.
        grads = torch.func.grad(lambda p: scale_loss(loss(p), state))(params)
        grads = policy.cast_to_reduce(grads)
        finite = all_finite(grads, axis="data")
        grads = unscale(grads, state)
        new = {"w": params["w"] - 0.5 * grads["w"]}
        return tree_where(finite, new, params), ls.update(state, finite)

    sm = fs.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P()), out_specs=(P(), P()),
                      check_rep=True)
    params, state = {"w": torch.ones(2)}, ls.init()
    x = torch.ones(4, 2)
    params, state = sm(params, x, state)
    torch.testing.assert_close(params["w"], torch.full((2,), -1.0))  # 1 - 0.5 * (2 + 2)
    assert (state.scale.item(), state.skipped.item()) == (256.0, 0)
    x[3, 0] = float("inf")  # only shard 1 sees it
    new_params, state = sm(params, x, state)
    torch.testing.assert_close(new_params["w"], params["w"])
    assert (state.scale.item(), state.skipped.item()) == (128.0, 1)


# -- Policy ---------------------------------------------------------------------------------


def test_policy_constructors_and_names():
    assert Policy.fp32() == Policy() and not Policy.fp32().loss_scaling
    bf = Policy.bf16()
    assert (bf.param_dtype, bf.compute_dtype, bf.reduce_dtype, bf.master_dtype) == (
        torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)
    fp = Policy.fp16()
    assert fp.compute_dtype == torch.float16 and fp.master_dtype == torch.float32 and fp.loss_scaling
    assert Policy.from_name("BF16") == bf and Policy.from_name("half") == fp
    assert Policy.from_name("bf16", reduce_dtype=torch.bfloat16).reduce_dtype == torch.bfloat16
    assert as_policy(None) == Policy.fp32() and as_policy("fp16") == fp and as_policy(bf) is bf
    assert repr(bf) == "Policy(param=bf16, compute=bf16, reduce=fp32, master=fp32, loss_scaling=False)"
    with pytest.raises(ValueError, match="unknown precision 'fp8'.*'fp32', 'bf16', 'fp16'"):
        Policy.from_name("fp8")
    with pytest.raises(ValueError, match="compute_dtype: expected a floating torch.dtype"):
        Policy(compute_dtype=torch.int32)
    with pytest.raises(TypeError):
        as_policy(16)


def test_policy_carries_its_loss_scaler():
    assert Policy.bf16().loss_scaler() is None
    assert Policy.fp16().loss_scaler() == DynamicLossScale()
    static = Policy.fp16(loss_scale=StaticLossScale(64.0))
    assert static.loss_scaler() == StaticLossScale(64.0) and "StaticLossScale(scale=64.0)" in repr(static)
    with pytest.raises(ValueError, match="loss_scale: given, but loss_scaling is False"):
        Policy.bf16(loss_scale=DynamicLossScale())
    with pytest.raises(ValueError, match="loss_scale: expected a DynamicLossScale or StaticLossScale"):
        Policy.fp16(loss_scale=128.0)


def test_casts_touch_only_floating_leaves():
    tree = {"w": torch.ones(2), "ids": torch.arange(3), "mask": torch.ones(1, dtype=torch.bool),
            "lr": 0.1, "none": None}
    out = Policy.bf16().cast_to_compute(tree)
    assert out["w"].dtype == torch.bfloat16 and out["ids"].dtype == torch.int64
    assert out["mask"].dtype == torch.bool and out["lr"] == 0.1 and out["none"] is None
    assert Policy.bf16().cast_to_master(out)["w"].dtype == torch.float32
    assert Policy.fp16().cast_to_param(tree)["w"].dtype == torch.float16
    assert cast_tree(tree, None) is tree
    # the cast is differentiable: gradients come back in the master dtype
    g = torch.func.grad(lambda p: Policy.bf16().cast_to_compute(p)["w"].float().sum())(
        {"w": torch.ones(2)})
    assert g["w"].dtype == torch.float32 and g["w"].tolist() == [1.0, 1.0]
