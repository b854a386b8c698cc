"""Frozen parameters where a state moves between steps: the reshard recipe
(``step.init(old.params(state))``), a step whose ``trainable=`` differs from the state it
is given, a DeepSpeed checkpoint loaded into a step with frozen leaves, and the rule
tables' forms."""

from __future__ import annotations

import os

import frozen_cases as C
import optree
import pytest
import torch

import fsharded as fs

pytestmark = pytest.mark.usefixtures("one_thread")


def _loss(fm):
    return lambda p, b: fm.apply(p, b["idx"], b["y"])


def _check_reshard(r: dict) -> None:
    m = C.model()
    assert r["second"] is not None and torch.equal(r["second"], r["first"])
    for k, p in m.named_parameters():
        if p.requires_grad:
            assert not torch.equal(r["params"][k], p.detach()), k
        else:  # still frozen after the reshard: bit for bit what it was
            assert torch.equal(r["params"][k], p.detach()), k


def test_init_of_a_steps_params_trains_the_same_leaves():
    # step.params(state) are plain tensors: without a mark, a step taking the leaves'
    # flags (trainable=None) would train the frozen backbone after a reshard.
    _check_reshard(C.reshard(2))


@pytest.mark.multiprocess
def test_init_of_a_steps_params_trains_the_same_leaves_on_gloo_ranks():
    from fsharded.testing import run_on_ranks

    for r in run_on_ranks(C.reshard, 2, 2):
        _check_reshard(r)


def test_a_step_refuses_a_state_that_trains_other_leaves():
    m = C.model()
    fm = fs.nn.functional(m)
    mesh = fs.Mesh({"data": 2})
    first = fs.train_step(_loss(fm), fs.optim.adamw(C.LR), mesh=mesh)
    state = first.init(fm.params)
    b = C.batches(1)[0]
    state, _ = first(state, b)
    # Unfreezing for a second phase: the state has no optimizer state for the frozen
    # leaves, so it cannot quietly go on training only what it trained.
    every = fs.train_step(_loss(fm), fs.optim.adamw(C.LR), mesh=mesh, trainable=True)
    with pytest.raises(ValueError, match=r"(?s)other parameters.*params\.embed\.weight: frozen in the state, "
                                         r"trained here.*step\.init\(old_step\.params\(state\)\)"):
        every(state, b)
    fresh = every.init(first.params(state))  # the recipe: an explicit trainable= decides
    assert fresh.trainable is None
    after, _ = every(fresh, b)
    assert not torch.equal(after.params["embed"]["weight"], m.embed.weight)
    # The same choice given explicitly is no disagreement.
    same = fs.train_step(_loss(fm), fs.optim.adamw(C.LR), mesh=mesh, trainable=fm.trainable)
    same(state, b)


def test_load_deepspeed_into_a_step_with_frozen_leaves():
    import deepspeed_cases as D

    step, params = D.step({"data": 2}, 3, trainable=[("blocks.0.*", False), ("*", True)])
    state = fs.checkpoint.load_deepspeed(os.path.join(D.DATA, "zero2"), step, params, names=D.ds_name)
    got = D.by_name(step, state)
    for name, want in D.REF[2]["fp32"].items():  # frozen leaves too: DeepSpeed trained them all
        assert torch.equal(got[name], want), name
    paths = fs.tree_flatten_with_paths(params)[0]
    assert state.trainable.tolist() == [not p.startswith("blocks.0.") for p in paths]
    after, _ = step(state, {"tokens": D.FIXTURE["batches"][1]})
    new = D.by_name(step, after)
    for p in paths:
        n = D.ds_name(p)
        assert torch.equal(new[n], got[n]) == p.startswith("blocks.0."), p


def test_rule_tables_as_tuples_and_for_list_params_and_the_prefix_error():
    params = {"a": {"w": torch.randn(3, 3), "b": torch.randn(3)}, "c": torch.randn(3)}

    def loss(p, b):
        return (b @ p["a"]["w"] + p["a"]["b"] + p["c"]).square().sum()

    state = fs.train_step(loss, fs.optim.sgd(0.1), trainable=(("a.*", False), ("*", True))).init(params)
    assert state.trainable.tolist() == [False, False, True]
    listed = [torch.randn(3), torch.randn(3)]
    step = fs.train_step(lambda p, b: (p[0] * p[1] * b).sum(), fs.optim.sgd(0.1),
                         trainable=[("0", False), ("*", True)])
    assert step.init(listed).trainable.tolist() == [False, True]
    with pytest.raises(ValueError, match=r"(?s)tree of bools is not a prefix of the parameter tree.*"
                                         r"a: trainable has dict with keys \['w'\]"):
        fs.train_step(loss, fs.optim.sgd(0.1), trainable={"a": {"w": False}, "c": True}).init(params)


def test_frozen_leaves_through_a_tensor_parallel_plan_train_as_pytorch():
    # Frozen leaves sharded over the tensor axis (a colwise fc1, a rowwise fc2 weight)
    # beside trained ones, at ZeRO-3 over data: the trained leaves as torch.optim.AdamW
    # trains them. fp32 Adam at lr 0.1: the tensor-parallel matmuls sum in another order
    # (measured 4e-5 at most, the same with no leaf frozen), hence 1e-4.
    def model():
        m = C.model()
        m.blocks[1].fc1.requires_grad_(False)
        m.blocks[2].fc2.weight.requires_grad_(False)
        return m

    ref = model()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=C.LR)
    for b in C.batches():
        opt.zero_grad()
        ref(b["idx"], b["y"]).backward()
        opt.step()
    m = model()
    fm = fs.nn.functional(m)
    tp = fs.parallel.tensor.plan(fm, {"blocks.*.fc1.*": "colwise", "blocks.*.fc2.weight": "rowwise"}, axis="tensor")
    step = fs.train_step(_loss(fm), fs.optim.adamw(C.LR), mesh=fs.Mesh({"data": 2, "tensor": 2}),
                         param_specs=fs.parallel.zero(3, min_size=1)(tp.specs, fm.params), blocks=fm.blocks)
    state = step.init(fm.params)
    with tp.applied():
        for b in C.batches():
            state, _ = step(state, b)
    got = dict(zip(fs.tree_flatten_with_paths(state.params)[0], optree.tree_leaves(step.params(state))))
    for k, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(got[k], p.detach(), rtol=1e-4, atol=1e-4, msg=k)
        else:
            assert torch.equal(got[k], dict(m.named_parameters())[k]), k


@pytest.mark.multiprocess
def test_a_trainable_function_of_the_leaves_is_decided_once_on_gloo_ranks():
    # At ZeRO-3 a rank holds half of each leaf: the function must not be asked again of
    # the shards (1,024-element weights would become 512 and read as another choice).
    from fsharded.testing import run_on_ranks

    want = [x.numel() > 600 for x in optree.tree_leaves(fs.nn.functional(C.model()).params)]
    assert any(want) and not all(want)
    for got in run_on_ranks(C.by_size, 2, 2):
        assert got == want
