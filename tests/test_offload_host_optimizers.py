"""Optimizers without a fused form (SGD, Lamb, Adagrad, a chain of transformations) with
their state in the host tier (``zero(k, offload_optimizer="cpu")``): updated on host copies,
with the numbers of device memory."""

from __future__ import annotations

import optree
import pytest
import torch
import train_cases as T

import fsharded as fs
from fsharded import P
from fsharded.models import gpt

OPTIMIZERS = {
    "sgd": lambda: fs.optim.sgd(1e-2, momentum=0.9),
    "lamb": lambda: fs.optim.lamb(1e-3),
    "adagrad": lambda: fs.optim.adagrad(1e-2),
    "chain": lambda: fs.optim.chain(fs.optim.scale_by_adam(), fs.optim.scale_by_learning_rate(1e-3)),
}


def run(mesh: dict, stage: int, name: str, tier: str | None, *, steps: int = 4, donate: bool = False) -> dict:
    params = gpt.init(T.CONFIG, 0)
    kw = {"offload_optimizer": tier} if tier else {}
    step = fs.train_step(gpt.loss, OPTIMIZERS[name](), mesh=fs.Mesh(mesh), clip=T.CLIP, donate=donate,
                         param_specs=fs.parallel.zero(stage, min_size=16, **kw)(P(), params), blocks="blocks")
    state = step.init(params)
    losses = []
    for b in T.batches(steps):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return {"losses": losses, "params": [x.clone() for x in optree.tree_leaves(step.params(state))]}


def same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))


def gloo_host(world: int) -> dict:
    return {(stage, name, tier, donate): run({"data": world}, stage, name, tier, donate=donate)
            for stage in (1, 3) for name in ("sgd", "lamb") for tier in (None, "cpu") for donate in (False, True)}


@pytest.mark.parametrize("stage,name", [(2, n) for n in OPTIMIZERS] + [(s, n) for s in (1, 3) for n in ("sgd", "chain")])
def test_an_optimizer_without_a_fused_form_runs_in_the_host_tier_with_the_same_numbers(stage, name):
    ref = run({"data": 2}, stage, name, None)
    assert same(run({"data": 2}, stage, name, "cpu"), ref)
    assert same(run({"data": 2}, stage, name, "cpu", donate=True), ref)


def test_its_state_lives_in_host_memory_and_the_tier_is_checked(monkeypatch):
    from fsharded.step import _update

    calls = []
    host_call = _update.HostUpdate.__call__
    monkeypatch.setattr(_update.HostUpdate, "__call__", lambda self, *a, **k: calls.append(1) or host_call(self, *a, **k))
    params = gpt.init(T.CONFIG, 0)
    step = fs.train_step(gpt.loss, fs.optim.sgd(1e-2, momentum=0.9), mesh=fs.Mesh({"data": 2}),
                         param_specs=fs.parallel.zero(2, min_size=16, offload_optimizer="cpu")(P(), params))
    state = step.init(params)
    traces = [x for x in optree.tree_leaves(state.opt_state) if isinstance(x, torch.Tensor) and x.dim() > 0]
    assert traces and all(x.device.type == "cpu" for x in traces)
    step(state, T.batches(1)[0])
    assert calls  # the update ran on host copies
    # Refused by name where the state is streamed through the fused kernel.
    for kw in (dict(offload_optimizer="nvme", nvme_path="/tmp"), dict(offload_optimizer="cpu", zenflow=True)):
        step = fs.train_step(gpt.loss, fs.optim.sgd(1e-2), mesh=fs.Mesh({"data": 2}),
                             param_specs=fs.parallel.zero(2, min_size=16, **kw)(P(), params))
        with pytest.raises(NotImplementedError, match="without a fused form .* host copies"):
            step.init(params)


@pytest.mark.multiprocess
def test_on_two_gloo_ranks_too():
    from fsharded.testing import run_on_ranks

    for res in run_on_ranks(gloo_host, 2, 2):
        for stage in (1, 3):
            for name in ("sgd", "lamb"):
                for donate in (False, True):
                    assert same(res[(stage, name, "cpu", donate)], res[(stage, name, None, donate)]), (stage, name)
