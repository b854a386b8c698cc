"""train_step against a plain PyTorch loop, across layouts and backends, plus fp16 loss
scaling, accumulation and bad input."""

from __future__ import annotations

import math

import pytest
import test_gpt as TG
import torch
import train_cases as T

import fsharded as fs
from fsharded import P
from fsharded.models import gpt

# fp32 through 20 AdamW steps at lr 3e-3: the two programs sum in different orders, so
# results drift by a few ulps per step; 1e-5 is far below what a wrong reduction, a missing
# clip or a mis-sharded leaf produces (>1e-3 after one step).
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def plain():
    return T.run_plain_torch(TG.GPT)


@pytest.fixture(scope="module")
def one_device():
    return T.run_train_step({"data": 1})


def _module_params_equal(res, plain):
    params_by_name = dict(plain["model"].named_parameters())
    for mod_name, path in plain["names"].items():
        ours = TG._to_module_layout(path, TG._get(res["params"], path))
        torch.testing.assert_close(ours, params_by_name[mod_name].detach(), **TOL, msg=path)


def test_one_device_equals_plain_pytorch(one_device, plain):
    torch.testing.assert_close(torch.tensor(one_device["losses"]), torch.tensor(plain["losses"]), **TOL)
    _module_params_equal(one_device, plain)
    assert one_device["losses"][-1] < one_device["losses"][0] - 0.5  # it actually trains


@pytest.mark.parametrize("mesh_axes", [{"data": 4}, {"data": 2, "tensor": 2}], ids=str)
def test_virtual_layouts_equal_one_device(mesh_axes, one_device, plain):
    res = T.run_train_step(mesh_axes)
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(one_device["losses"]), **TOL)
    _module_params_equal(res, plain)


@pytest.mark.multiprocess
def test_gloo_two_ranks_equal_virtual(one_device):
    from fsharded.testing import run_on_ranks

    per_rank = run_on_ranks(T.gloo_train, 2, 2)
    virtual = T.run_train_step({"data": 2})
    for res in per_rank:
        torch.testing.assert_close(torch.tensor(res["dp"]["losses"]), torch.tensor(virtual["losses"]), **TOL)
        torch.testing.assert_close(torch.tensor(res["dp"]["losses"]), torch.tensor(one_device["losses"]), **TOL)
        for a, b in zip(T.flat(res["dp"]["params"]), T.flat(virtual["params"])):
            torch.testing.assert_close(a, b, **TOL)
        assert res["dp"]["manifest"] == virtual["manifest"]


def test_accumulation_equals_a_k_times_larger_batch():
    """k micro-batches per step, averaged, equal one step on the whole batch."""
    big = T.run_train_step({"data": 2}, accumulation=1, steps=5, batch=16)
    acc = T.run_train_step({"data": 2}, accumulation=4, steps=5, batch=16)
    torch.testing.assert_close(torch.tensor(acc["losses"]), torch.tensor(big["losses"]), rtol=1e-6, atol=1e-6)
    for a, b in zip(T.flat(acc["params"]), T.flat(big["params"])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_bf16_policy_trains_close_to_fp32(one_device):
    res = T.run_train_step({"data": 2}, precision="bf16")
    # bf16 compute keeps ~3 significant digits; the trajectories stay within a few percent.
    assert all(abs(a - b) < 0.05 * b for a, b in zip(res["losses"], one_device["losses"]))
    assert all(p.dtype == torch.float32 for p in T.flat(res["params"]))  # fp32 master weights


def _poisoned_loss(params, batch):
    return gpt.loss(params, batch) * batch["factor"].float().mean()


def test_fp16_loss_scaling_skips_overflow_and_follows_deepspeed_rules():
    """An injected inf skips the step (params unchanged), the scale halves only once the
    hysteresis (2) is used up, and grows x2 after a window of good steps."""
    policy = fs.precision.Policy.fp16(loss_scale=fs.precision.DynamicLossScale(
        initial_scale_power=8, loss_scale_window=3, hysteresis=2))
    params = gpt.init(T.CONFIG, 0)
    step = fs.train_step(_poisoned_loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 2}),
                         precision=policy)
    state = step.init(params)
    bs = T.batches(12)
    poison = {2, 3, 4}
    scales, skipped = [], []
    for i, b in enumerate(bs):
        b = {**b, "factor": torch.full((T.BATCH,), math.inf if i in poison else 1.0)}
        before = state
        state, m = step(state, b)
        scales.append(float(m["loss_scale"]))
        skipped.append(int(m["skipped"]))
        if i in poison:
            for x, y in zip(T.flat(before.params), T.flat(state.params)):
                assert torch.equal(x, y), "a skipped step must leave the parameters unchanged"
        else:
            assert not all(torch.equal(x, y) for x, y in zip(T.flat(before.params), T.flat(state.params)))
    # metrics report the scale the step ran with; skipped counts overflows so far.
    assert skipped == [0, 0, 1, 2, 3, 3, 3, 3, 3, 3, 3, 3]
    # The step at i=2 overflows: hysteresis 2 -> 1, no shrink. i=3 overflows at hysteresis 1:
    # halve (seen from i=4 on). i=4 overflows again: halve. Then DeepSpeed doubles after
    # the window (3) of good steps, on the 4th good update (i=8), seen from i=9.
    assert scales == [256.0] * 4 + [128.0] + [64.0] * 4 + [128.0] * 3


def test_nan_loss_in_fp32_stops_with_the_step_and_keeps_the_state():
    params = gpt.init(T.CONFIG, 0)
    step = fs.train_step(_poisoned_loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 2}))
    state = step.init(params)
    b = T.batches(2)
    state, _ = step(state, {**b[0], "factor": torch.ones(T.BATCH)})
    kept = [x.clone() for x in T.flat(state.params)]
    with pytest.raises(FloatingPointError, match=r"step 2 has loss nan.*after 1 step\) is unchanged"):
        step(state, {**b[1], "factor": torch.full((T.BATCH,), math.nan)})
    assert all(torch.equal(a, b) for a, b in zip(kept, T.flat(state.params)))
    assert int(state.step) == 1


def test_bad_input_errors():
    params = gpt.init(T.CONFIG, 0)
    mesh = fs.Mesh({"data": 2})
    b = T.batches(1)[0]
    step = fs.train_step(lambda p, b: gpt.apply(p, b["tokens"][:, :-1]), fs.optim.sgd(0.1), mesh=mesh)
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        step(step.init(params), b)
    step = fs.train_step(gpt.loss, fs.optim.sgd(0.1), mesh=mesh)
    with pytest.raises(ValueError, match=r"(?s)args\[1\].tokens.*not divisible by 2"):
        step(step.init(params), {"tokens": b["tokens"][:3]})
    with pytest.raises(ValueError, match="param_specs"):
        fs.train_step(gpt.loss, fs.optim.sgd(0.1), mesh=mesh, param_specs={"nope": P()}).init(params)
    with pytest.raises(ValueError, match="accumulation"):
        fs.train_step(gpt.loss, fs.optim.sgd(0.1), accumulation=0)
    with pytest.raises(ValueError, match="divisible into 3 micro-batches"):
        s = fs.train_step(gpt.loss, fs.optim.sgd(0.1), mesh=mesh, accumulation=3)
        s(s.init(params), b)


def test_manifest_of_a_data_parallel_step():
    """One bucketed all-reduce of every gradient plus the loss's, 2P(n-1)/n bytes in all."""
    params = gpt.init(T.CONFIG, 0)
    step = fs.train_step(gpt.loss, fs.optim.sgd(0.1), mesh=fs.Mesh({"data": 4}))
    state = step.init(params)
    m = step.collectives(state, T.batches(1)[0])
    P_ = gpt.param_count(params)
    assert [(e.op, e.axis, e.shape) for e in m] == [("psum", "data", (P_,)), ("psum", "data", ())]
    step.bucket_elems = P_ // 3  # smaller buckets: more calls, same bytes
    m3 = step.collectives(state, T.batches(1)[0])
    assert len(m3) in (4, 5) and m3.total_bytes() == m.total_bytes()
    # ring all-reduce sends 2(n-1)/n of the fp32 bytes: 2 * 3/4 * 4 B = 6 B per element
    assert m.total_bytes() == 6 * (P_ + 1)


def test_metrics_of_a_step():
    params = gpt.init(T.CONFIG, 0)
    opt = fs.optim.adamw(fs.optim.WarmupLR(warmup_max_lr=1e-3, warmup_num_steps=4, warmup_type="linear"))
    step = fs.train_step(gpt.loss, opt, mesh=fs.Mesh({"data": 2}), clip=0.5)
    state = step.init(params)
    lrs = []
    for b in T.batches(3):
        state, m = step(state, b)
        lrs.append(float(m["lr"]))
    assert set(m) == {"loss", "grad_norm", "lr", "loss_scale", "skipped", "tokens_per_s"}
    assert float(m["tokens_per_s"]) > 0 and int(m["skipped"]) == 0 and float(m["loss_scale"]) == 1.0
    assert lrs == [float(fs.optim.get_lr(opt, i)) for i in range(3)] and lrs[0] < lrs[2]
    assert int(state.step) == 3


def test_donated_updates_equal_functional_ones_and_consume_the_state(one_device):
    """donate=True updates parameters and moments in place (one device, real ranks);
    results are the same, and the state passed in is consumed."""
    params = gpt.init(T.CONFIG, 0)
    step = fs.train_step(gpt.loss, fs.optim.adamw(T.LR, weight_decay=T.WD), clip=T.CLIP, donate=True)
    state = step.init(params)
    losses = []
    for b in T.batches():
        before = state.params["emb"]
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        assert state.params["emb"] is before  # same buffer, updated in place
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_device["losses"]), **TOL)
    for a, b in zip(T.flat(step.params(state)), T.flat(one_device["params"])):
        torch.testing.assert_close(a, b, **TOL)
    with pytest.raises(ValueError, match="donate=True cannot be combined with fp16"):
        fs.train_step(gpt.loss, fs.optim.adamw(1e-3), precision="fp16", donate=True)
