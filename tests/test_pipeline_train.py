"""train_step with a pipelined loss: the GPT cut into stages over the mesh's ``pipe`` axis
trains as the single-device GPT does (losses and parameters over 10 steps), for every
schedule, on the virtual mesh and on gloo ranks, alone and with data parallelism and
ZeRO-1/2 on the data axis."""

from __future__ import annotations

import optree
import pipeline_cases as C
import pytest
import torch

import fsharded as fs
from fsharded.models import gpt, gpt_stages
from fsharded.parallel import pipeline as pp
from fsharded.testing import run_on_ranks

STEPS = 10


@pytest.fixture(scope="module")
def reference():
    return C.train_reference(STEPS)


def assert_trains_like(out, ref):
    for a, b in zip(out["losses"], ref["losses"]):
        assert abs(a - b) < 1e-5, (out["losses"], ref["losses"])
    for path, a, b in zip(optree.tree_paths(out["params"]), optree.tree_leaves(out["params"]),
                          optree.tree_leaves(ref["params"])):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (path, float((a - b).abs().max()))


@pytest.mark.parametrize("mesh,name,v,zero", [
    ({"pipe": 2}, "gpipe", 1, 0), ({"pipe": 2}, "1f1b", 1, 0), ({"pipe": 2}, "interleaved", 2, 0),
    ({"pipe": 2}, "zb", 1, 0), ({"pipe": 4}, "1f1b", 1, 0), ({"pipe": 4}, "zb", 1, 0),
    ({"pipe": 2, "data": 2}, "1f1b", 1, 0), ({"data": 2, "pipe": 2}, "zb", 1, 1),
    ({"pipe": 2, "data": 2}, "interleaved", 2, 2)])
def test_on_the_virtual_mesh_it_trains_as_the_single_device_gpt(mesh, name, v, zero, reference):
    assert_trains_like(C.train(mesh, name, v, STEPS, zero=zero), reference)


@pytest.mark.parametrize("mesh,name,v,zero", [
    ({"pipe": 2}, "1f1b", 1, 0), ({"pipe": 2}, "zb", 1, 0), ({"pipe": 4}, "interleaved", 1, 0),
    ({"pipe": 2, "data": 2}, "zb", 1, 1), ({"data": 2, "pipe": 2}, "interleaved", 2, 2)])
def test_on_gloo_ranks_it_trains_as_the_single_device_gpt(mesh, name, v, zero, reference):
    if name == "interleaved" and v == 1:
        name = "gpipe"  # 4 stages on 4 ranks, one each
    world = 1
    for n in mesh.values():
        world *= n
    outs = run_on_ranks(C.train, world, mesh, name, v, STEPS, zero=zero)
    for out in outs:  # every rank has the same losses and, unsharded, the same parameters
        assert_trains_like(out, reference)


def test_a_pipelined_loss_called_as_a_function_is_the_models_loss():
    params, tokens = C.setup()
    loss = pp.pipelined(gpt_stages.pipeline_stages(params, 2, attention="einsum"), microbatches=4)
    ref = gpt.loss(params, {"tokens": tokens}, attention="einsum")
    assert abs(float(loss(params, {"tokens": tokens})) - float(ref)) < 1e-6


def _step(mesh, stages=2, **kw):
    params, tokens = C.setup()
    loss = pp.pipelined(gpt_stages.pipeline_stages(params, stages, attention="einsum"), microbatches=2)
    step = fs.train_step(loss, fs.optim.adamw(1e-3), mesh=fs.Mesh(mesh), **kw)
    return step, params, {"tokens": tokens}


def test_what_the_pipeline_cannot_run_is_refused_with_the_fix():
    step, params, batch = _step({"data": 2})
    with pytest.raises(ValueError, match="axis 'pipe', which Mesh\\(data=2\\) does not have"):
        step(step.init(params), batch)
    step, params, batch = _step({"pipe": 2}, stages=3)
    with pytest.raises(ValueError, match="2 ranks .* = 2 stages, but the model was cut into 3"):
        step(step.init(params), batch)
    step, params, batch = _step({"pipe": 2}, accumulation=2)
    with pytest.raises(ValueError, match="micro-batches are the accumulation"):
        step(step.init(params), batch)
    params, tokens = C.setup()
    step, params, batch = _step({"pipe": 2, "data": 2},
                                param_specs=fs.parallel.zero(3, min_size=8)(None, params))
    with pytest.raises(NotImplementedError, match="ZeRO-3"):
        step(step.init(params), batch)
    step, params, _ = _step({"pipe": 2})
    with pytest.raises(ValueError, match="batch of 3 does not divide into 2 micro-batches"):
        step(step.init(params), {"tokens": torch.zeros(3, 17, dtype=torch.long)})
