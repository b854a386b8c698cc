"""Memory as the ZeRO paper promises it: the estimator's model states against the paper's
table, and its per-device peak against the tracker's on real ranks."""

from __future__ import annotations

import memory_cases as M
import pytest
import torch

import fsharded as fs
from fsharded import P

GB = 1e9  # the paper's unit (120 GB = 16 B x 7.5e9)


def test_model_states_reproduce_the_zero_paper_table():
    """Figure 1 of the ZeRO paper: 7.5B parameters, N=64, fp16 parameters and gradients,
    Adam with fp32 master (K=12): (2+2+K)P, 2P+2P+KP/N, 2P+(2+K)P/N, (2+2+K)P/N = 120 /
    31.4 / 16.6 / 1.9 GB. Within 5%, the issue's tolerance: the paper rounds to 0.1 GB, and
    step counters aside nothing else is counted. Shapes only (meta tensors). At stage 3 no
    fp16 copy of the shards is kept (each block's are cast as its gather sends them), so
    the model states are (2+K)P/N = 1.64 GB, 2P/N below the paper's."""
    leaf = (15625, 16000)  # 250M elements; dim 1 divides by 64
    params = {"blocks": [{"w": torch.empty(leaf, device="meta")} for _ in range(30)]}
    assert sum(b["w"].numel() for b in params["blocks"]) == 7.5e9
    policy = fs.precision.Policy.fp16(reduce_dtype=torch.float16)
    mesh = fs.Mesh({"data": 64})
    paper = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9 - 2 * 7.5e9 / 64 / GB}
    got = {}
    for stage in range(4):
        e = fs.estimate_memory(params, fs.parallel.zero(stage)(P(), params), fs.optim.adamw(1e-3),
                               precision=policy, mesh=mesh, blocks="blocks")
        got[stage] = e.model_states / GB
    for stage, want in paper.items():
        assert abs(got[stage] - want) <= 0.05 * want, (stage, got[stage], want)
    # A wrong accounting (full gradients at stage 2, full parameters at stage 3) is far off.
    assert got[2] < 0.6 * got[1] and got[3] < 0.15 * got[2]


def test_estimate_memory_blocks_argument():
    params = {"layers": [{"w": torch.empty(64, 64)} for _ in range(4)], "emb": torch.empty(64, 64)}
    plan = fs.parallel.zero(3, min_size=16)(P(), params)
    mesh = fs.Mesh({"data": 2})
    opt = fs.optim.adamw(1e-3)
    per_block = fs.estimate_memory(params, plan, opt, mesh=mesh, blocks="layers")
    up_front = fs.estimate_memory(params, plan, opt, mesh=mesh, blocks=None)
    assert "at most 2 blocks" in str(per_block) and "at most 2 blocks" not in str(up_front)
    assert per_block.peak < up_front.peak
    with pytest.raises(ValueError, match="blocks='nope'"):
        fs.estimate_memory(params, plan, opt, mesh=mesh, blocks="nope")


def _check(per_stage: dict, what: str) -> None:
    for stage, r in per_stage.items():
        # 10%: the tolerance. The estimate models the peak as state + gathered
        # weights + the larger of (activations + the gradients reduced beside them) and
        # (all gradients reduced); what it leaves out (small temporaries of the update,
        # per-op transients) is a few percent here.
        assert abs(r["est_peak"] - r["peak"]) <= 0.1 * r["peak"], (what, stage, r["est_peak"], r["peak"])
        # The gradients are counted as gradients, not as activations: at least the reduced
        # ones in their placement (more while unreduced).
        assert r["grads_peak"] >= r["est_placed_grads"] > 0, (what, stage, r["grads_peak"])
    # ZeRO-3 with blocks holds less than stage 2, which holds no more than stage 1.
    assert per_stage[3]["peak"] < per_stage[2]["peak"] <= per_stage[1]["peak"]
    # ZeRO-3's gathered block weights count as parameters (beyond this rank's fp32 shards)
    # while they are alive (on ranks that is at the peak, on the virtual mesh the update is).
    shards = per_stage[3]["params"] * 4 / 2
    assert per_stage[3]["params_peak"] > 1.2 * shards, (what, per_stage[3]["params_peak"], shards)


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", ["1M", "6M"])
def test_measured_peaks_match_the_estimate_on_two_ranks(size):
    from fsharded.testing import run_on_ranks

    for r in run_on_ranks(M.measure, 2, {"data": 2}, size):
        _check(r, size)


@pytest.mark.parametrize("size", ["1M", "6M"])
def test_measured_peaks_match_the_estimate_on_the_virtual_mesh(size):
    """The same, per device on the virtual mesh (one process holds both devices; the
    tracker divides each storage by the copies it holds). The virtual step reduces after
    backward and updates in place beneath the vmap levels; the estimate models that."""
    _check(M.measure({"data": 2}, size), f"virtual {size}")


def _check_moe(r: dict, what: str, over: float, activations: bool = True) -> None:
    # The activations are measured on one device's forward + backward with the mesh's
    # axes bound as device 0 binds them (its all-to-alls answering locally): an
    # expert-parallel layer runs as on a rank, on its share of the experts.
    if activations:
        assert abs(r["est_activations"] - r["activations"]) <= 0.1 * r["activations"], (what, r)
    assert r["peak"] * (1 - 0.1) <= r["est_peak"] <= r["peak"] * (1 + over), (what, r)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_moe_expert_parallel_estimate_on_the_virtual_mesh(stage):
    """A GPT with experts split over ``expert`` and ZeRO over ``data``: the estimator runs
    its loss (it refused before: the layer held half the experts with no expert axis
    bound) and lands within 10% of the tracked peak."""
    # At ZeRO-3 the virtual mesh re-gathers through a remat of each block, and its
    # activations peak is the estimator's peak rule's business (checked), not one number.
    _check_moe(M.measure_moe({"data": 2, "expert": 2}, stage), f"virtual, stage {stage}", 0.1, stage < 3)


@pytest.mark.multiprocess
def test_moe_expert_parallel_estimate_on_real_ranks():
    """The same on gloo ranks, where the estimate is conservative: the activations within
    10%, the peak above the tracked one by at most 20% (11-14% seen: its gradient buckets
    are modelled as a dense model's)."""
    from fsharded.testing import run_on_ranks

    for r in run_on_ranks(M.measure_moe, 2, {"expert": 2}, 0):
        _check_moe(r, "2 ranks, expert=2", 0.2)
    for r in run_on_ranks(M.measure_moe, 4, {"data": 2, "expert": 2}, 3):
        _check_moe(r, "4 ranks, data=2 x expert=2, ZeRO-3", 0.2)


def test_estimate_memory_takes_a_loss_that_returns_metrics():
    # train_step takes (loss, metrics) from a loss (fsharded train's MoE GPT reports its
    # routing so); the estimator measures the same program.
    params = {"w": torch.randn(64, 64)}

    def loss(p, b):
        out = (b @ p["w"]).square().mean()
        return out, {"loss": out.detach()}

    kw = dict(mesh=fs.Mesh({"data": 2}), batch=torch.randn(16, 64))
    with_metrics = fs.estimate_memory(params, P(), fs.optim.adamw(1e-3), loss=loss, **kw)
    plain = fs.estimate_memory(params, P(), fs.optim.adamw(1e-3), loss=lambda p, b: loss(p, b)[0], **kw)
    assert with_metrics.activations == plain.activations > 0
