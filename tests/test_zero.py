"""ZeRO stages as placements: the spec rewrite, training equal to one device, and the
communication volume of each stage."""

from __future__ import annotations

import math

import optree
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
    """Bytes sent per rank per step (fp32, n=4), for the S elements of sharded leaves and
    the R elements of leaves too small to shard, following the ZeRO paper's accounting:
    stage 0: all-reduce 2(S+R)(n-1)/n; stage 1: all-reduce 2(S+R) + all-gather of the
    updated shards S, times (n-1)/n; stage 2: reduce-scatter S + all-gather S + all-reduce
    2R; stage 3: blocks are gathered in forward, gathered again in backward (all but the
    last block, whose backward follows its forward at once) and reduce-scattered
    (3 S_blocks - S_last), the rest 2 S_other, plus 2R. Scalars (loss, norm) aside."""
    res = Z.run_zero({"data": 4}, stage, steps=1)
    params = gpt.init(T.CONFIG, 0)
    pl = fs.parallel.zero(3, min_size=16)(P(), params).resolve(fs.Mesh({"data": 4}))
    paths, leaves, _ = fs.tree_flatten_with_paths(params)
    masters = fs.tree_flatten_with_paths(pl.master, is_leaf=lambda x: isinstance(x, fs.PartitionSpec))[1]
    S_blocks = sum(x.numel() for p, x, m in zip(paths, leaves, masters) if "data" in m.axes and p.startswith("blocks."))
    S_last = sum(x.numel() for p, x, m in zip(paths, leaves, masters)
                 if "data" in m.axes and p.startswith(f"blocks.{T.CONFIG.n_layers - 1}."))
    S = sum(x.numel() for x, m in zip(leaves, masters) if "data" in m.axes)
    R = sum(x.numel() for x in leaves) - S
    n, f4 = 4, 4
    total = sum(b for op, axis, shape, b in res["manifest"] if math.prod(shape) > 4)
    expect = {0: 2 * (S + R), 1: 2 * (S + R) + S, 2: 2 * S + 2 * R,
              3: 3 * S_blocks - S_last + 2 * (S - S_blocks) + 2 * R}[stage]
    assert total == expect * (n - 1) // n * f4
    assert S_blocks > 0 and S > S_blocks
    if stage == 3:  # the re-gather: one all-gather per block in backward, but the last
        assert res["phases"].count(("all_gather", "backward")) == T.CONFIG.n_layers - 1
        assert 0 < S_last < S_blocks
        # reshard_after_forward=False keeps the gathered blocks until backward: 2 S_blocks.
        keep = Z.run_zero({"data": 4}, 3, steps=1, reshard_after_forward=False)
        total = sum(b for op, axis, shape, b in keep["manifest"] if math.prod(shape) > 4)
        assert total == (2 * S + 2 * R) * (n - 1) // n * f4
        assert ("all_gather", "backward") not in keep["phases"]


def test_zero3_without_reshard_equals_one_device(one_device):
    res = Z.run_zero({"data": 2, "tensor": 2}, 3, reshard_after_forward=False)
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(one_device["losses"]), **TOL)
    for a, b in zip(T.flat(res["params"]), T.flat(one_device["params"])):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.multiprocess
def test_gloo_two_ranks_all_stages(one_device):
    from fsharded.testing import run_on_ranks

    per_rank = run_on_ranks(Z.gloo_zero, 2, 2)
    P_ = gpt.param_count(gpt.init(T.CONFIG, 0))
    for res in per_rank:
        msg = res["mismatch"]
        assert "laid out for another placement" in msg and "ZeRO stage 3" in msg and "Reshard it" in msg
        assert "params.blocks.0" in msg
        # Donated updates (in place): the peak of parameters + gradients + optimizer state
        # on each rank, fp32 AdamW, unreduced gradients counted as gradients. Stage 0: 16 P
        # (weights, full gradients, two moments). Stages 1-2: the state and the placed
        # gradient shard, (4 + 8 + 4) P / n, plus the gathered full weights (4 P) and one
        # bucket of full gradients while backward fills it (the default bucket holds the
        # whole model here: 4 P). Within 10% (the rest are step counters).
        d = res["donated"]
        assert 16 * P_ <= d[0]["model_states"] <= 1.1 * 16 * P_
        for stage in (1, 2):
            want = 16 * P_ / 2 + 4 * P_ + 4 * P_
            assert abs(d[stage]["model_states"] - want) <= 0.1 * want, (stage, d[stage]["model_states"] / P_)
        assert abs(d[0]["est_model_states"] - d[0]["model_states"]) <= 0.1 * d[0]["model_states"]
        # ZeRO-3 adds gathered weights on top: those outside the blocks for the whole step,
        # one or two blocks' worth inside them.
        block = sum(x.numel() for x in T.flat(gpt.init(T.CONFIG, 0)["blocks"][0])) * 4
        outside = 4 * P_ - block * T.CONFIG.n_layers
        assert 16 * P_ / 2 <= d[3]["model_states"] <= 1.1 * (16 * P_ / 2 + outside + 2 * block)
        assert d[3]["with_buffers"] <= 1.1 * (16 * P_ / 2 + outside + 2 * block)
        m0, m3 = res["memory"][0], res["memory"][3]
        for m in (m0, m3):  # the state each rank really holds is what the estimator says
            assert m["start"]["parameters"] == m["est_master"]
            assert m["start"]["optimizer state"] == m["est_optimizer"]
            # Activations (saved tensors, temporaries, activation gradients), estimated on a
            # meta run of one rank's forward + backward, within 10% of the measured peak;
            # the estimate's total (every category at its own peak) bounds the real peak.
            assert abs(m["est_activations"] - m["activations"]) <= 0.1 * m["activations"]
            assert m["total"] <= m["est_total"]
        assert m3["start"]["parameters"] < 0.6 * m0["start"]["parameters"]  # sharded over 2
        assert m3["peak"] < m0["peak"]
        assert m3["peak_by"]["gradients"] <= m0["peak_by"]["gradients"]
    for stage in (0, 1, 2, 3):
        virtual = Z.run_zero({"data": 2}, stage)
        for res in per_rank:
            r = res[stage]
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(one_device["losses"]), **TOL)
            if stage == 3:  # gathered once, kept until backward (no saved-tensor hooks)
                torch.testing.assert_close(torch.tensor(res["keep"]["losses"]),
                                           torch.tensor(one_device["losses"][:10]), **TOL)
                assert ("all_gather", "backward") not in res["keep"]["phases"]
            for a, b in zip(T.flat(r["params"]), T.flat(virtual["params"])):
                torch.testing.assert_close(a, b, **TOL)
            assert r["manifest"] == virtual["manifest"]
            if stage:  # each rank holds half of the sharded master weights
                assert r["local_master_numel"] < gpt.param_count(gpt.init(T.CONFIG, 0))


def test_zero3_full_weights_of_a_block_die_after_its_forward():
    """The re-gather: while block i+1 runs forward, no full (gathered) weight of block i
    is alive any more; each block's full weights exist only inside its own run (the last
    block's until its backward, which follows at once)."""
    import weakref

    config = T.CONFIG.replace(n_layers=3)
    alive_at_start, seen = [], []
    refs: list = []

    def spying_block(block, full, h, **kw):  # runs where the step's block hook calls it
        if len(seen) == config.n_layers:  # backward re-runs: not what we measure
            return block(full, h, **kw)
        alive_at_start.append(sum(r() is not None for r in refs))
        seen.append({tuple(t.shape) for t in T.flat(full)})
        refs.clear()
        refs.extend(weakref.ref(t) for t in T.flat(full))
        return block(full, h, **kw)

    def spy_loss(params, batch):
        return gpt.loss(params, batch, block_fn=spying_block)

    params = gpt.init(config, 0)
    plan = fs.parallel.zero(3, min_size=16)(P(), params)
    step = fs.train_step(spy_loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 2}), param_specs=plan,
                         blocks="blocks")
    state, _ = step(step.init(params), T.batches(1)[0])
    assert len(seen) == config.n_layers
    assert alive_at_start == [0] * config.n_layers
    assert all(r() is None for r in refs)  # and the last block's are gone after the step
    # the block ran on gathered (full) weights, not on its shards
    assert seen[0] == {tuple(x.shape) for x in T.flat(params["blocks"][0])}
    assert any("data" in s.axes for s in T.flat(plan.resolve(fs.Mesh({"data": 2})).master["blocks"][0],
                                                 ) if isinstance(s, fs.PartitionSpec))


def test_estimate_memory_follows_the_placement():
    """(2+2+K)P/n-style accounting: fp32 master 4 B, AdamW state 8 B per element, in the
    placement's shards; the optimizer's own state sizes are counted (meta init)."""
    params = gpt.init(T.CONFIG, 0)
    P_ = gpt.param_count(params)
    mesh = fs.Mesh({"data": 4})
    pl = fs.parallel.zero(3, min_size=16)(P(), params).resolve(mesh)
    masters = T.flat(pl.master)
    S = sum(x.numel() for x, m in zip(T.flat(params), masters) if "data" in m.axes)
    local = S // 4 + (P_ - S)
    opt = fs.optim.adamw(1e-3)
    e0 = fs.estimate_memory(params, P(), opt, mesh=mesh)
    assert e0.master == 4 * P_ and e0.grads == 4 * P_ and 8 * P_ <= e0.optimizer <= 8 * P_ + 64
    for stage in (1, 2, 3):
        e = fs.estimate_memory(params, fs.parallel.zero(stage, min_size=16)(P(), params), opt, mesh=mesh)
        assert e.master == 4 * local and 8 * local <= e.optimizer <= 8 * local + 64
    e3 = fs.estimate_memory(params, pl, opt, mesh=mesh, precision="bf16")
    assert e3.compute_params <= 2 * P_ and e3.grads < e0.grads and "at most 2 blocks" in str(e3)
    assert e3.total < e0.total


def test_estimate_memory_activations_match_a_measured_step():
    """On one device the meta-run activation estimate matches the live bytes a real
    train_step allocates besides parameters, gradients and optimizer state (within 10%);
    it follows the per-device batch, the remat of ZeRO-3 on the virtual mesh, bf16, and
    fails clearly on a loss it cannot run."""
    params = gpt.init(T.CONFIG, 0)
    b = T.batches(1)[0]
    opt = fs.optim.adamw(1e-3)
    one = fs.Mesh({"data": 1})
    step = fs.train_step(gpt.loss, opt, mesh=one)
    state = step.init(params)
    with fs.memory.track() as mem:
        mem.register(state.params, "parameters")
        mem.register(state.opt_state, "optimizer state")
        step(state, b)
    measured = mem.peak_of(("activations",))
    est = fs.estimate_memory(params, P(), opt, mesh=one, loss=gpt.loss, batch=b)
    assert abs(est.activations - measured) <= 0.1 * measured, (est.activations, measured)
    # Four devices: a quarter of the batch each.
    e4 = fs.estimate_memory(params, P(), opt, mesh=fs.Mesh({"data": 4}), loss=gpt.loss, batch=b)
    assert 0.2 * est.activations <= e4.activations <= 0.3 * est.activations
    # ZeRO-3 on the virtual mesh keeps only block inputs; bf16 halves most activations.
    mesh = fs.Mesh({"data": 2})
    e_0 = fs.estimate_memory(params, P(), opt, mesh=mesh, loss=gpt.loss, batch=b)
    e_3 = fs.estimate_memory(params, fs.parallel.zero(3, min_size=16)(P(), params), opt, mesh=mesh,
                             loss=gpt.loss, batch=b)
    e_bf = fs.estimate_memory(params, P(), opt, mesh=mesh, loss=gpt.loss, batch=b, precision="bf16")
    assert e_3.activations < 0.8 * e_0.activations and e_bf.activations < 0.8 * e_0.activations
    assert fs.estimate_memory(params, P(), opt, mesh=mesh, activation_bytes=123).activations == 123
    with pytest.raises(RuntimeError, match="activation_bytes="):
        fs.estimate_memory(params, P(), opt, mesh=mesh, loss=lambda p, b: p["nope"], batch=b)
    with pytest.raises(ValueError, match="batch="):
        fs.estimate_memory(params, P(), opt, mesh=mesh, loss=gpt.loss)


@pytest.mark.multiprocess
def test_gloo_four_ranks_stages_and_hybrid(one_device):
    from fsharded.testing import run_on_ranks

    per_rank = run_on_ranks(Z.gloo_zero4, 4, 4)
    ref = one_device["losses"][:10]
    for res in per_rank:
        for key in (0, 1, 2, 3, "hybrid"):
            torch.testing.assert_close(torch.tensor(res[key]["losses"]), torch.tensor(ref), **TOL, msg=str(key))
    virtual = Z.run_zero({"replica": 2, "shard": 2}, 3, axis="shard", batch_spec=P(("replica", "shard")), steps=10)
    for a, b in zip(T.flat(per_rank[0]["hybrid"]["params"]), T.flat(virtual["params"])):
        torch.testing.assert_close(a, b, **TOL)
    assert per_rank[0]["hybrid"]["manifest"] == virtual["manifest"]


@pytest.mark.multiprocess
def test_gloo_zero3_one_rank_and_without_shared_memory_equal_one_device(one_device, monkeypatch):
    """World size 1 (``torchrun --nproc-per-node 1``) and 2 ranks on gloo's own
    asynchronous collectives (the shared-memory transport off): the prefetched gathers
    must read sources that are still alive, so the losses equal one device's."""
    from fsharded.testing import run_on_ranks

    (lone,) = run_on_ranks(Z.zero3_losses, 1, 1)
    torch.testing.assert_close(torch.tensor(lone["losses"]), torch.tensor(one_device["losses"][:6]), **TOL)
    monkeypatch.setenv("FSHARDED_SHM", "0")
    for res in run_on_ranks(Z.zero3_losses, 2, 2):
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(one_device["losses"][:6]), **TOL)


def test_a_step_does_not_keep_the_parameters_it_was_built_from():
    # The plan keeps the leaves' shapes (meta stand-ins), not their values: a step holds its
    # plan for its life, and at ZeRO-3 the values would be a whole model per rank.
    import gc
    import weakref

    params = gpt.init(gpt.GPTConfig.tiny(), 0)
    plan = fs.parallel.zero(3)(fs.P(), params)
    assert {x.device.type for x in optree.tree_leaves(plan.params)} == {"meta"}
    step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 2}), param_specs=plan,
                         blocks="blocks")
    state = step.init(params)
    leaf = weakref.ref(optree.tree_leaves(params)[0])
    del params
    gc.collect()
    assert leaf() is None
    cfg = gpt.GPTConfig.tiny()
    state, _ = step(state, {"tokens": torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1))})
    assert int(state.step) == 1
