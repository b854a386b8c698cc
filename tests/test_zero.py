"""ZeRO stages as placements: the spec rewrite, training equal to one device, and the
communication volume of each stage."""

from __future__ import annotations

import math

import pytest
import torch
import train_cases as T
import zero_cases as Z

import fsharded as fs
from fsharded import P
from fsharded.models import gpt

# fp32, 20 AdamW steps: sharded and unsharded differ by summation order only (see
# test_train_step.py for why 1e-5 is far below what a wrong placement produces).
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def one_device():
    return Z.run_zero({"data": 1}, 0)


def test_zero_rewrites_specs():
    mesh = fs.Mesh({"data": 4, "tensor": 2})
    params = {"w": torch.zeros(6, 8), "tp": torch.zeros(16, 4), "small": torch.zeros(3), "odd": torch.zeros(5, 7)}
    specs = {"w": P(), "tp": P("tensor"), "small": P(), "odd": P()}
    pl = fs.parallel.zero(3, min_size=8)(specs, params).resolve(mesh)
    # w: dim 0 (6) is not divisible by 4, dim 1 (8) is; tp: data joins tensor as the minor
    # axis of dim 0 (16 / 2 / 4); small: under min_size; odd: no dim divides -> replicated.
    assert pl.master == {"w": P(None, "data"), "tp": P(("tensor", "data")), "small": P(), "odd": P()}
    assert pl.use == specs and pl.params == pl.master == pl.grads
    pl1 = fs.parallel.zero(1, min_size=8)(specs, params).resolve(mesh)
    assert pl1.params == specs and pl1.grads == specs and pl1.master == pl.master
    pl2 = fs.parallel.zero(2, min_size=8)(specs, params).resolve(mesh)
    assert pl2.params == specs and pl2.grads == pl.master


def test_zero_bad_input():
    params = {"w": torch.zeros(8, 8)}
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        fs.parallel.zero(4)
    with pytest.raises(ValueError, match="axis 'data' is not in Mesh"):
        fs.parallel.zero(2)(P(), params).resolve(fs.Mesh({"replica": 2}))
    with pytest.warns(UserWarning, match="size 1 .* no effect"):
        fs.parallel.zero(2)(P(), params).resolve(fs.Mesh({"data": 1}))
    with pytest.raises(ValueError, match="param_specs"):
        fs.parallel.zero(2)({"v": P()}, params)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("mesh_axes", [{"data": 4}, {"data": 2, "tensor": 2}], ids=str)
def test_stages_equal_one_device(stage, mesh_axes, one_device):
    res = Z.run_zero(mesh_axes, stage)
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(one_device["losses"]), **TOL)
    for a, b in zip(T.flat(res["params"]), T.flat(one_device["params"])):
        torch.testing.assert_close(a, b, **TOL)


def test_stage_with_bf16_and_accumulation(one_device):
    ref = Z.run_zero({"data": 2}, 0, precision="bf16", accumulation=2, steps=8)
    for stage in (1, 2, 3):
        res = Z.run_zero({"data": 2}, stage, precision="bf16", accumulation=2, steps=8)
        # Same bf16 arithmetic on the same shards: only the reduction layout differs.
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-4)


def test_hybrid_shard_within_replicate(one_device):
    """HSDP / ZeRO++ hpZ layout: shard over one axis, replicate over the other, the batch
    split over both."""
    res = Z.run_zero({"replica": 2, "shard": 2}, 3, axis="shard", batch_spec=P(("replica", "shard")))
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(one_device["losses"]), **TOL)
    ops = {(op, axis) for op, axis, *_ in res["manifest"]}
    assert ("all_gather", "shard") in ops and ("psum_scatter", "shard") in ops and ("psum", "replica") in ops


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_communication_volume_per_stage(stage):
    """Per rank per step, for P parameters (fp32, n=4 ranks): stages 0 and 2 move
    2P(n-1)/n elements, stage 1 (all-reduce, then all-gather the updated shards) 3P(n-1)/n,
    stage 3 here 2P(n-1)/n (all blocks are gathered once, not re-gathered in backward),
    plus a few scalars (the loss, the gradient norm)."""
    res = Z.run_zero({"data": 4}, stage, steps=1)
    params = gpt.init(T.CONFIG, 0)
    P_ = gpt.param_count(params)
    sharded = sum(x.numel() for x in T.flat(params) if x.numel() >= 16 and x.shape[0] % 4 == 0
                  or x.numel() >= 16 and x.dim() > 1 and x.shape[1] % 4 == 0)
    n, f4 = 4, 4
    big = [(op, b) for op, axis, shape, b in res["manifest"] if math.prod(shape) > 4]
    total = sum(b for _, b in big)
    if stage == 0:
        assert total == 2 * P_ * (n - 1) // n * f4
    elif stage == 1:
        assert total == 2 * P_ * (n - 1) // n * f4 + sharded * (n - 1) // n * f4
    else:  # reduce-scatter of the sharded leaves + all-reduce of the rest, + all-gather
        assert total == 2 * sharded * (n - 1) // n * f4 + 2 * (P_ - sharded) * (n - 1) // n * f4
    # the optimizer state and master weights are sharded from stage 1 on
    if stage:
        assert res["local_master_numel"] == P_  # virtual: global view of the sharded state


@pytest.mark.multiprocess
def test_gloo_two_ranks_all_stages(one_device):
    from fsharded.testing import run_on_ranks

    per_rank = run_on_ranks(Z.gloo_zero, 2, 2)
    for stage in (0, 1, 2, 3):
        virtual = Z.run_zero({"data": 2}, stage)
        for res in per_rank:
            r = res[stage]
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(one_device["losses"]), **TOL)
            for a, b in zip(T.flat(r["params"]), T.flat(virtual["params"])):
                torch.testing.assert_close(a, b, **TOL)
            assert r["manifest"] == virtual["manifest"]
            if stage:  # each rank holds half of the sharded master weights
                assert r["local_master_numel"] < gpt.param_count(gpt.init(T.CONFIG, 0))
