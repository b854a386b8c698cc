"""ZenFlow's overlapped update (``zero(..., offload_optimizer="cpu", zenflow=ZenFlow(...))``):
its own one-step-stale rule, the exact update where every row is hot, convergence against
the exact update, checkpoints, and refusals."""

from __future__ import annotations

import warnings

import optree
import pytest
import torch
import train_cases as T
import zenflow_cases as Z

import fsharded as fs
from fsharded import P
from fsharded.config import TrainConfig, from_deepspeed
from fsharded.models import gpt
from fsharded.parallel.offload import ZenFlow

ACROSS = dict(rtol=1e-5, atol=1e-6)  # gloo ranks against the virtual mesh (other reduction orders)

pytestmark = pytest.mark.filterwarnings("ignore:zero.*has no effect")


def _bitwise(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))


def _close(a: dict, b: dict, tol: dict) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), **tol)
    for x, y in zip(a["params"], b["params"], strict=True):
        torch.testing.assert_close(x, y, **tol)


@pytest.mark.parametrize("zf,clip", [(ZenFlow(0.25, select_interval=3), None),
                                     (ZenFlow(0.25, select_interval=3, update_interval=2), None),
                                     (ZenFlow(0.5, select_interval=2, warmup_steps=2, update_interval=3), None),
                                     (ZenFlow(0.25, select_interval=3, update_interval=3), 0.5)], ids=str)
def test_zenflow_follows_its_own_stale_reference(zf, clip):
    # The step (a thread on the host tier, hot rows on the device, a landing one step
    # later) against the rule written out in plain torch: the same within rounding (the
    # C++ kernel against torch's ops). With clipping, each step's cold gradients are summed
    # with that step's factor.
    got, ref = Z.run({"data": 1}, 1, zf, 8, clip=clip), Z.reference(zf, 8, clip=clip)
    _close(got, ref, dict(rtol=1e-5, atol=2e-6))
    # And the rule is not the exact update: the cold rows trained stale.
    exact = Z.run({"data": 1}, 1, None, 8, clip=clip)
    assert max((x - y).abs().max().item() for x, y in zip(got["params"], exact["params"])) > 1e-3


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_row_hot_or_warm_up_is_the_exact_update(stage):
    exact = Z.run({"data": 2}, stage, None, 5, clip=T.CLIP)
    assert _bitwise(Z.run({"data": 2}, stage, ZenFlow(1.0), 5, clip=T.CLIP), exact)
    assert _bitwise(Z.run({"data": 2}, stage, ZenFlow(1.0), 5, clip=T.CLIP, donate=False), exact)
    # Three exact warm-up steps: the first four losses are the exact run's, then it departs.
    warm = Z.run({"data": 2}, stage, ZenFlow(0.25, warmup_steps=3), 5, clip=T.CLIP)
    assert warm["losses"][:4] == exact["losses"][:4] and warm["losses"][4] != exact["losses"][4]


def test_zenflow_converges_within_two_percent_of_the_exact_update():
    # 200 steps of the bundled GPT on the stdlib text (the default job's data), ZeRO-2 over
    # two virtual devices: the mean loss of the last 20 steps against the exact update's.
    batches = T.batches(200)
    exact = Z.run({"data": 2}, 2, None, 200, batches=batches, clip=T.CLIP, lr=1e-3)
    stale = Z.run({"data": 2}, 2, ZenFlow(0.1, select_interval=20), 200, batches=batches, clip=T.CLIP, lr=1e-3)
    le, lz = (sum(r["losses"][-20:]) / 20 for r in (exact, stale))
    assert le < 0.8 * exact["losses"][0]  # it trained
    assert abs(lz - le) <= 0.02 * le, (lz, le)


def test_a_checkpoint_lands_the_update_and_a_resumed_run_continues_alike(tmp_path):
    # (The warm-up is counted by the state's own step count: a resumed job does not warm
    # up again.)
    zf = ZenFlow(0.25, select_interval=3, update_interval=2, warmup_steps=2)
    batches = T.batches(9)
    step, params = Z.make_step({"data": 2}, 2, zf)
    state = step.init(params)
    losses = []
    for i, b in enumerate(batches):
        if i == 5:  # mid-interval, an update in flight
            step.save(state, tmp_path / "ck")
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    step.settle(state)
    running = [x.clone() for x in optree.tree_leaves(step.params(state))]
    # A new job from the checkpoint: the same losses and parameters, bit for bit.
    step2, _ = Z.make_step({"data": 2}, 2, zf)
    state2 = step2.load(tmp_path / "ck")
    assert int(state2.step) == 5
    for b, want in zip(batches[5:], losses[5:], strict=True):
        state2, m = step2(state2, b)
        assert float(m["loss"]) == want
    step2.settle(state2)
    assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(step2.params(state2)), running, strict=True))
    # The same step loading it again settles what it held into its running state (which
    # stays usable), and the loaded state continues alike.
    state, _ = step(state, batches[0])  # an update in flight again
    state3 = step.load(tmp_path / "ck")
    for b in batches[5:]:
        state3, m = step(state3, b)
    assert float(m["loss"]) == losses[-1]
    step.settle(state3)
    step(state, batches[0])  # settled by the load: nothing held for it any more


def test_another_state_is_refused_while_the_update_is_in_flight():
    step, params = Z.make_step({"data": 2}, 2, ZenFlow(0.25))
    state = step.init(params)
    state, _ = step(state, T.batches(1)[0])
    other = step.init(params)
    with pytest.raises(RuntimeError, match="zenflow: the step holds the update in flight"):
        step(other, T.batches(1)[0])
    with pytest.raises(RuntimeError, match="another state"):
        step.settle(other)
    step.settle(state)  # landed: nothing held, any state may follow
    step(other, T.batches(1)[0])


@pytest.mark.parametrize("stage", [2, 3])
def test_zenflow_over_the_nvme_tier_gives_the_host_tiers_numbers(stage, tmp_path):
    # The cold rows' update streams the moments through the files; a selection reads the
    # hot rows' moments from them and writes them back through the tier's checksummed I/O
    # (a write through the memory map would be caught as a corrupted file at the next read).
    from fsharded.parallel import offload

    zf = ZenFlow(0.25, select_interval=2, update_interval=2)
    host = Z.run({"data": 2}, stage, zf, 7, clip=T.CLIP)
    step, params = Z.make_step({"data": 2}, stage, zf, clip=T.CLIP, offload="nvme", nvme_path=str(tmp_path))
    state = step.init(params)
    assert offload.nvme_files(state.opt_state)
    losses = []
    for b in T.batches(7):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    step.settle(state)
    offload.verify(state.opt_state)  # every file holds what the tier wrote
    got = {"losses": losses, "params": [x.clone() for x in optree.tree_leaves(step.params(state))]}
    assert _bitwise(got, host)


def test_zenflow_is_refused_where_it_does_not_apply(tmp_path):
    params = gpt.init(T.CONFIG, 0)
    with pytest.raises(ValueError, match="needs offload_optimizer='cpu' or 'nvme'"):
        fs.parallel.zero(2, zenflow=True)
    for tier in ("cpu", "nvme"):
        with pytest.raises(ValueError, match="zenflow needs .* the parameters in device memory"):
            fs.parallel.zero(3, offload_optimizer=tier, offload_params=tier, nvme_path=str(tmp_path), zenflow=True)
    for bad in (dict(topk_ratio=0), dict(topk_ratio=1.5), dict(select_interval=0), dict(update_interval=0),
                dict(warmup_steps=-1)):
        with pytest.raises(ValueError, match="zenflow: "):
            ZenFlow(**bad)
    assert fs.parallel.zero(2, offload_optimizer="cpu", zenflow=True)(P(), params).offload.zenflow == ZenFlow()
    with pytest.raises(ValueError, match="offload.zenflow: needs offload.optimizer cpu or nvme"):
        TrainConfig.from_dict({"zero_stage": 2, "offload": {"zenflow": True}})
    with pytest.raises(ValueError, match="zenflow_topk_ratio"):
        TrainConfig.from_dict({"zero_stage": 2, "offload": {"optimizer": "cpu", "zenflow": True,
                                                            "zenflow_topk_ratio": 2.0}})


def _ds(zenflow: dict | None, offload: dict | None = None) -> dict:
    z = {"stage": 2, "offload_optimizer": offload if offload is not None else {"device": "cpu"}}
    if zenflow is not None:
        z["zenflow"] = zenflow
    return {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": z}


def test_deepspeeds_zenflow_block_maps_onto_the_placement():
    # The block of DeepSpeed's ZenFlow tutorial, overlapped, selection by step.
    block = {"topk_ratio": 0.05, "select_strategy": "step", "select_interval": 8, "update_interval": 4,
             "full_warm_up_rounds": 2, "overlap_step": True, "offload": False, "pt_reserved_cores_perc": 0.5}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        off = from_deepspeed(_ds(block)).offload
    assert off.zero_kwargs()["zenflow"] == ZenFlow(0.05, select_interval=8, warmup_steps=2, update_interval=4)
    # "auto" selection (per epoch in DeepSpeed) and update interval: fsharded's, noted.
    with pytest.warns(UserWarning, match="reselects every 100 steps.*\n.*update_interval auto"):
        off = from_deepspeed(_ds({"topk_ratio": 0.1, "select_strategy": "auto", "select_interval": "auto",
                                  "update_interval": "auto", "overlap_step": True})).offload
    assert off.zero_kwargs()["zenflow"] == ZenFlow(0.1, select_interval=100)
    # Not overlapped, every step: the exact update, noted.
    with pytest.warns(UserWarning, match="is the exact update"):
        off = from_deepspeed(_ds({"overlap_step": False, "update_interval": 1})).offload
    assert off.optimizer == "cpu" and "zenflow" not in off.zero_kwargs()
    # Over the NVMe tier.
    off = from_deepspeed(_ds(block, offload={"device": "nvme", "nvme_path": "/tmp"})).offload
    assert off.optimizer == "nvme" and off.zero_kwargs()["zenflow"] == ZenFlow(0.05, 8, 2, 4)
    # Refused by name: no tier, offloaded parameters, in line every k steps.
    stage3 = _ds({"overlap_step": True})
    stage3["zero_optimization"].update(stage=3, offload_param={"device": "cpu"})
    for cfg, match in ((_ds({"overlap_step": True}, offload={"device": "none"}), "zenflow without offload_optimizer"),
                       (stage3, "zenflow with offload_optimizer.device = 'cpu' and offload_param.device = 'cpu'"),
                       (_ds({"overlap_step": False, "update_interval": 4}), "overlap_step = false with update")):
        with pytest.raises(ValueError, match=match):
            from_deepspeed(cfg)


def test_fsharded_train_runs_zenflow_from_a_deepspeed_config(tmp_path, capsys):
    import json

    from fsharded import train

    (tmp_path / "ds.json").write_text(json.dumps(_ds({"topk_ratio": 0.25, "select_strategy": "step",
                                                      "select_interval": 2, "update_interval": 1,
                                                      "overlap_step": True})))
    code = train.main(["--preset", "tiny", "--seq-len", "32", "--set", "data=stdlib:300000", "--steps", "3",
                       "--mesh", "data=2", "--deepspeed-config", str(tmp_path / "ds.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "zenflow" in out.splitlines()[0], out.splitlines()[0]


@pytest.mark.multiprocess
def test_zenflow_on_two_gloo_ranks_follows_the_virtual_mesh(tmp_path):
    from fsharded.testing import run_on_ranks

    zf = ZenFlow(0.25, select_interval=3, update_interval=2)
    for res in run_on_ranks(Z.gloo_zenflow, 2, 2, str(tmp_path)):
        assert _bitwise(res["all_hot"], res["exact"])
        for stage in (1, 2, 3):  # each rank selects its shard's rows, as each virtual device does
            _close(res["stale"][stage], Z.run({"data": 2}, stage, zf, 8, clip=T.CLIP), ACROSS)
        assert _bitwise(res["nvme"], res["stale"][2])  # the NVMe tier: the host tier's numbers


def test_estimate_memory_counts_zenflows_hot_moments_and_host_copies():
    params = gpt.init(T.CONFIG, 0)
    mesh, opt = fs.Mesh({"data": 2}), fs.optim.adamw(1e-3)
    est = {zf: fs.estimate_memory(params, fs.parallel.zero(2, min_size=16, offload_optimizer="cpu", zenflow=zf)(
        P(), params), opt, mesh=mesh) for zf in (None, ZenFlow(0.25), ZenFlow(1.0))}
    shards = []  # each device's shard of every leaf: sharded on dim 0 over data=2 where it is 16+ elements
    for x in optree.tree_leaves(params):
        shards.append(x.shape if x.numel() < 16 or x.shape[0] % 2 else (x.shape[0] // 2, *x.shape[1:]))
    total = sum(torch.Size(s).numel() for s in shards)
    hot = sum(ZenFlow(0.25).rows(s[0] if len(s) >= 2 else 1) * (torch.Size(s).numel() // (s[0] if len(s) >= 2 else 1))
              for s in shards)
    assert est[ZenFlow(0.25)].optimizer - est[None].optimizer == 2 * 4 * hot  # mu and nu of the hot rows, fp32
    assert est[ZenFlow(1.0)].optimizer - est[None].optimizer == 2 * 4 * total
    # The update's staging of parameters and gradients (one bucket: the whole model), and the
    # host copies of the update in flight, its gradients and the next interval's sums.
    assert est[ZenFlow(0.25)].staging == 2 * 4 * total + 3 * 4 * total
    # (The exact host tier's gradients go to the host in backward; ZenFlow's hot rows are
    # updated on the device, so its gradients stay there.)
    assert est[None].placed_grads == 0 and est[ZenFlow(0.25)].placed_grads > 0
    assert any("zenflow" in n for n in est[ZenFlow(0.25)].notes)
