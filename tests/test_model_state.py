"""train_step(update_model_state=...): state the model reads but does not differentiate,
carried in TrainState.model_state and updated once per step from the loss's stats
averaged over micro-batches and batch shards — equal to a plain loop on one device on
the virtual mesh and on gloo ranks, kept on skipped steps, saved and loaded with the
state, and refused by name where it would differ between shards or change shape."""

from __future__ import annotations

import math

import model_state_cases as C
import pytest
import torch

import fsharded as fs
from fsharded import P

pytestmark = pytest.mark.filterwarnings("ignore:train_step. ZeRO stage 3 without blocks")


@pytest.mark.parametrize("mesh,kw,shards", [
    ({"data": 1}, {}, 1),
    ({"data": 2}, {}, 2),
    ({"data": 4}, {"accumulation": 2}, 4),  # the stats are averaged over micro-batches too
    ({"data": 2}, {"zero_stage": 3}, 2),
], ids=str)
def test_equals_the_plain_loop(mesh, kw, shards):
    C.close(C.train(mesh, **kw), C.reference(shards, kw.get("accumulation", 1)))


@pytest.mark.multiprocess
def test_gloo_ranks_equal_the_plain_loop_and_the_virtual_mesh():
    from fsharded.testing import run_on_ranks

    virtual = C.train({"data": 2}, zero_stage=3)
    for r in run_on_ranks(C.train, 2, {"data": 2}, zero_stage=3):
        C.close(r, C.reference(2))
        C.close(r, virtual, tol=1e-7)


def test_a_skipped_step_keeps_the_old_model_state():
    step = fs.train_step(C.loss_fn, fs.optim.adamw(1e-2), mesh=fs.Mesh({"data": 2}),
                         update_model_state=C.update, on_nonfinite="skip")
    state = step.init(C.params(), C.init_state())
    b = C.batches(1)[0]
    state, _ = step(state, b)
    bad = {**b, "y": b["y"].clone()}
    bad["y"][0, 0] = math.nan
    after, m = step(state, bad)
    assert int(m["skipped"]) == 1 and int(after.step) == 2
    torch.testing.assert_close(after.model_state["mean"], state.model_state["mean"], rtol=0, atol=0)
    assert int(after.model_state["seen"]) == 1


def test_fp16_overflow_keeps_the_old_model_state():
    # The loss (~28) times the first loss scales overflows fp16: those steps are skipped
    # (parameters and model state kept) until the scale has come down.
    step = fs.train_step(C.loss_fn, fs.optim.sgd(1e-3), update_model_state=C.update, precision="fp16")
    state = step.init(C.params(), C.init_state())
    b = C.batches(1)[0]
    applied, skipped = 0, 0
    for _ in range(24):
        before = state.model_state["mean"].clone()
        state, m = step(state, b)
        now_skipped = int(m["skipped"]) - skipped
        skipped += now_skipped
        applied += 1 - now_skipped
        assert int(state.model_state["seen"]) == applied
        if now_skipped:
            assert torch.equal(state.model_state["mean"], before)
    assert skipped > 0 and applied > 0


def test_saved_and_loaded_into_another_mesh(tmp_path):
    a = fs.train_step(C.loss_fn, fs.optim.adamw(1e-2), mesh=fs.Mesh({"data": 2}), update_model_state=C.update,
                      param_specs=fs.parallel.zero(3, axis="data", min_size=1)(P(), C.params()))
    state = a.init(C.params(), C.init_state())
    for b in C.batches(2):
        state, _ = a(state, b)
    a.save(state, tmp_path / "ck")
    b = fs.train_step(C.loss_fn, fs.optim.adamw(1e-2), mesh=fs.Mesh({"data": 4}), update_model_state=C.update)
    loaded = b.load(tmp_path / "ck")  # the model state's tree from the manifest
    assert int(loaded.model_state["seen"]) == 2
    torch.testing.assert_close(loaded.model_state["mean"], state.model_state["mean"], rtol=0, atol=0)
    # and the run goes on as the unsplit one does
    nxt = C.batches(3)[2]
    s1, m1 = a(state, nxt)
    s2, m2 = b(loaded, nxt)
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-6)  # data=4 sums in another order
    torch.testing.assert_close(s1.model_state["mean"], s2.model_state["mean"])


def test_mistakes_are_named():
    mesh = fs.Mesh({"data": 2})
    opt = fs.optim.sgd(0.1)
    with pytest.raises(ValueError, match=r"init\(params, model_state=tree\)"):
        fs.train_step(C.loss_fn, opt, mesh=mesh, update_model_state=C.update).init(C.params())
    with pytest.raises(ValueError, match="has no update_model_state"):
        fs.train_step(lambda p, b: C.loss_fn(p, b, C.init_state())[0], opt, mesh=mesh).init(
            C.params(), C.init_state())
    with pytest.raises(ValueError, match="model_state_specs without update_model_state"):
        fs.train_step(C.loss_fn, opt, model_state_specs=P())
    b = C.batches(1)[0]

    def run(loss_fn, update, ms=None):
        step = fs.train_step(loss_fn, opt, mesh=mesh, update_model_state=update)
        return step(step.init(C.params(), ms or C.init_state()), b)

    with pytest.raises(ValueError, match=r"must return \(loss, metrics, stats\)"):
        run(lambda p, batch, ms: C.loss_fn(p, batch, ms)[:2], C.update)
    with pytest.raises(ValueError, match=r"model_state.mean: torch.float32 \(6,\) became torch.float32 \(1, 6\)"):
        run(C.loss_fn, lambda ms, st: {**C.update(ms, st), "mean": ms["mean"][None]})
    with pytest.raises(ValueError, match="changed the model state's structure"):
        run(C.loss_fn, lambda ms, st: {"mean": ms["mean"]})
    # An update from this shard's own numbers would give each data shard another state.
    with pytest.raises(ValueError, match=r"model_state.mean: varies over \['data'\]"):
        run(C.loss_fn, lambda ms, st: {**C.update(ms, st), "mean": ms["mean"] + fs.axis_index("data")})
