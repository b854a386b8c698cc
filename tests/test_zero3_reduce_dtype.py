"""ZeRO-3 under mixed precision reduces its block gradients in the policy's reduce dtype:
the blocks' weights travel in the compute dtype (bf16) and their gradients are
reduce-scattered in fp32 (``Policy.bf16``'s default), as ZeRO 1-2 reduce theirs, so ZeRO-3
gives ZeRO-2's numbers; with ``reduce_dtype=bf16`` both reduce in bf16."""

from __future__ import annotations

import collections

import optree
import pytest
import torch
import train_cases as T

import fsharded as fs
from fsharded import P
from fsharded.models import gpt
from fsharded.precision import Policy


def _run(mesh: dict, stage: int, policy: Policy, steps: int = 4) -> dict:
    params = gpt.init(T.CONFIG, 0)
    step = fs.train_step(gpt.loss, fs.optim.adamw(1e-2), mesh=fs.Mesh(mesh), precision=policy, blocks="blocks",
                         param_specs=fs.parallel.zero(stage, min_size=16)(P(), params))
    state = step.init(params)
    dtypes = collections.Counter((e.op, e.phase, e.dtype) for e in step.collectives(state, T.batches(1)[0]))
    losses = []
    for b in T.batches(steps):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return {"losses": losses, "params": [x.clone() for x in optree.tree_leaves(step.params(state))], "ops": dtypes}


def _bitwise(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


def _checked(res: dict) -> None:
    for name, policy in (("fp32 reduce", Policy.bf16()), ("bf16 reduce", Policy.bf16(reduce_dtype=torch.bfloat16))):
        z2, z3 = res[name]
        assert _bitwise(z3, z2), name
        ops, red = z3["ops"], policy.reduce_dtype
        # The blocks' weights travel in bf16, forward and again in backward; their gradients
        # are reduce-scattered in the reduce dtype (the leaves gathered for the whole step,
        # in the master dtype, in fp32: never in less than the reduce dtype).
        assert ops[("all_gather", "forward", torch.bfloat16)] > 0 and ops[("all_gather", "backward", torch.bfloat16)] > 0
        assert ops[("psum_scatter", "backward", red)] >= T.CONFIG.n_layers, ops
        assert {d for (op, _, d) in ops if op == "psum_scatter"} <= {red, torch.float32}, ops


def gloo_cases(world: int) -> dict:
    return {name: (_run({"data": world}, 2, policy), _run({"data": world}, 3, policy))
            for name, policy in (("fp32 reduce", Policy.bf16()),
                                 ("bf16 reduce", Policy.bf16(reduce_dtype=torch.bfloat16)))}


def test_zero3_reduces_in_the_policys_dtype_and_gives_zero2s_numbers():
    _checked(gloo_cases(2))  # (the virtual mesh: data=2 in this process)


@pytest.mark.multiprocess
def test_on_two_gloo_ranks_too():
    from fsharded.testing import run_on_ranks

    virtual = gloo_cases(2)
    for res in run_on_ranks(gloo_cases, 2, 2):
        _checked(res)
        for name in res:  # and the ranks agree with the virtual mesh
            torch.testing.assert_close(torch.tensor(res[name][1]["losses"]), torch.tensor(virtual[name][1]["losses"]),
                                       rtol=1e-5, atol=1e-5)


def test_fp16_with_loss_scaling_too():
    # Scaled gradients reduce-scattered in fp32 (or fp16, asked for), unscaled after.
    for policy in (Policy.fp16(), Policy.fp16(reduce_dtype=torch.float16)):
        z2, z3 = _run({"data": 2}, 2, policy), _run({"data": 2}, 3, policy)
        assert _bitwise(z3, z2), policy
        assert z3["ops"][("psum_scatter", "backward", policy.reduce_dtype)] >= T.CONFIG.n_layers


def test_with_tensor_parallel_blocks_too():
    # The blocks' shards sharded over tensor and data: gathered over data in bf16, typed as
    # the gather types them (replicated over what they are replicated over).
    import functools

    params = gpt.init(T.CONFIG, 0)
    out = {}
    for stage in (2, 3):
        plan = fs.parallel.zero(stage, min_size=16)(gpt.tensor_parallel_specs(params), params)
        step = fs.train_step(functools.partial(gpt.loss, tensor_axis="tensor"), fs.optim.adamw(1e-2),
                             mesh=fs.Mesh({"data": 2, "tensor": 2}), param_specs=plan, precision="bf16",
                             blocks="blocks")
        state = step.init(params)
        losses = []
        for b in T.batches(3):
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        out[stage] = {"losses": losses, "params": [x.clone() for x in optree.tree_leaves(step.params(state))]}
    assert _bitwise(out[3], out[2])


def test_a_pipeline_gathering_its_blocks_per_micro_batch_reduces_in_fp32_too():
    # ZeRO-3 under a pipeline with reshard_after_forward=True gathers each block per
    # micro-batch in bf16 and reduce-scatters in fp32: the numbers of gathering each
    # stage whole (in the master dtype) at its table's GATHER.
    import pipeline_cases as C

    per_block = C.train_mixed({"data": 2, "pipe": 2}, "1f1b", 3, "bf16", zero=3, reshard=True)
    per_stage = C.train_mixed({"data": 2, "pipe": 2}, "1f1b", 3, "bf16", zero=3)
    assert per_block["losses"] == per_stage["losses"]
    for a, b in zip(optree.tree_leaves(per_block["params"]), optree.tree_leaves(per_stage["params"])):
        assert torch.equal(a, b)
