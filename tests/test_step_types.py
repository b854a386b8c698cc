"""train_step under the varying-axes typing: a model missing a collective is an error that
names the axis, never a different model; the GPT reduces exactly where its weights are
split, whatever the axis is called; both backends alike."""

from __future__ import annotations

import functools

import pytest
import torch
import train_cases as T

import fsharded as fs
from fsharded import P
from fsharded.models import gpt

# fp32 over a few steps of the same arithmetic in another order (sharded matmuls, sums
# over shards): ~1e-6 relative, as the other step tests.
TOL = dict(rtol=1e-5, atol=1e-5)


def _run(mesh_axes: dict, specs_fn, loss_fn, steps: int = 3) -> list[float]:
    mesh = fs.Mesh(mesh_axes)
    params = gpt.init(T.CONFIG, 0)
    step = fs.train_step(loss_fn, fs.optim.adamw(T.LR), mesh=mesh, param_specs=specs_fn(params),
                         batch_spec=P("data") if "data" in mesh_axes else P())
    state = step.init(params)
    losses = []
    for b in T.batches(steps):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return losses


def cases(reference: bool = True) -> dict:
    """Run here (virtual mesh) and on 2 gloo ranks (without the one-device reference)."""
    out = {}
    # The mesh axis is called "tp": the model told so trains the unsharded model...
    out["tp_named"] = _run({"tp": 2}, functools.partial(gpt.tensor_parallel_specs, axis="tp"),
                           functools.partial(gpt.loss, tensor_axis="tp"))
    # ...and one that is not (it reduces over "tensor", which this mesh lacks) is refused.
    try:
        _run({"tp": 2}, functools.partial(gpt.tensor_parallel_specs, axis="tp"), gpt.loss, steps=1)
        out["tp_unnamed"] = ""
    except ValueError as e:
        out["tp_unnamed"] = str(e)
    # Replicated weights on a mesh with a tensor axis: nothing to reduce, the same model.
    out["replicated_on_tensor_mesh"] = _run({"tensor": 2}, lambda p: P(), gpt.loss)
    if reference:
        out["one_device"] = _run({"data": 1}, lambda p: P(), gpt.loss)
    return out


def _check(res: dict) -> None:
    torch.testing.assert_close(torch.tensor(res["tp_named"]), torch.tensor(res["one_device"]), **TOL)
    torch.testing.assert_close(torch.tensor(res["replicated_on_tensor_mesh"]),
                               torch.tensor(res["one_device"]), **TOL)
    msg = res["tp_unnamed"]
    assert "the loss varies over mesh axis 'tp'" in msg and "tensor_axis='tp'" in msg


def test_virtual():
    _check(cases())


@pytest.mark.multiprocess
def test_gloo_two_ranks_equal_virtual():
    from fsharded.testing import run_on_ranks

    virtual = cases()
    for res in run_on_ranks(cases, 2, False):
        _check({**res, "one_device": virtual["one_device"]})
        for key in ("tp_named", "replicated_on_tensor_mesh"):
            torch.testing.assert_close(torch.tensor(res[key]), torch.tensor(virtual[key]), **TOL)


def test_a_model_without_its_psum_is_refused_by_name():
    """A hand-written tensor-parallel MLP that forgets the row-parallel psum."""
    mesh = fs.Mesh({"data": 2, "model": 2})
    params = {"w1": torch.randn(4, 8), "w2": torch.randn(8, 4)}
    specs = {"w1": P(None, "model"), "w2": P("model", None)}

    def loss(p, batch):
        return (torch.tanh(batch @ p["w1"]) @ p["w2"]).pow(2).mean()  # no psum over "model"

    step = fs.train_step(loss, fs.optim.sgd(0.1), mesh=mesh, param_specs=specs)
    with pytest.raises(ValueError, match="the loss varies over mesh axis 'model'"):
        step(step.init(params), torch.randn(8, 4))

    def fixed(p, batch):
        h = torch.tanh(fs.pvary(batch, "model") @ p["w1"])
        return fs.psum(h @ p["w2"], "model").pow(2).mean()

    step = fs.train_step(fixed, fs.optim.sgd(0.1), mesh=mesh, param_specs=specs)
    state, m = step(step.init(params), torch.randn(8, 4))
    assert torch.isfinite(m["loss"])


def schedule_case(bad: bool) -> str:
    """On each gloo rank: one step where, if ``bad``, rank 1 runs one collective more."""
    mesh = fs.Mesh({"data": 2})

    def loss(p, batch):
        value = gpt.loss(p, batch)
        if bad and fs.distributed.rank() == 1:
            value = value + fs.psum(value * 0, "data")  # a collective only rank 1 runs
        return value

    step = fs.train_step(loss, fs.optim.adamw(T.LR), mesh=mesh, param_specs=P())
    state = step.init(gpt.init(T.CONFIG, 0))
    try:
        step(state, T.batches(1)[0])
    except RuntimeError as e:
        return str(e)
    return ""


@pytest.mark.multiprocess
def test_ranks_running_different_collectives_fail_before_the_step():
    from fsharded.testing import run_on_ranks

    assert run_on_ranks(schedule_case, 2, False) == ["", ""]
    for msg in run_on_ranks(schedule_case, 2, True):  # an error on every rank, no hang
        assert "the ranks would run different collectives" in msg
        assert "collective #0: rank 0 runs ('reduce', 'psum', 'data', 'float32', (" in msg  # the gradients' psum
        assert "rank 1 runs ('forward', 'psum', 'data', 'float32', ())" in msg
