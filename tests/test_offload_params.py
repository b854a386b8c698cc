"""ZeRO-3 parameter offload (``zero(3, offload_params="cpu" | "nvme")``, ZeRO-Infinity):
the parameter shards in host memory or NVMe files, read back per block, updated in their
tier; the numbers of device memory, bit for bit."""

from __future__ import annotations

import json

import offload_cases as O
import optree
import pytest
import torch
import train_cases as T

import fsharded as fs
from fsharded import P
from fsharded.models import gpt
from fsharded.parallel import offload


@pytest.fixture(scope="module")
def in_memory() -> dict:
    return O.run({"data": 2}, 3, None)


@pytest.mark.parametrize("tiers", [("cpu", "cpu"), ("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "cpu")])
def test_parameter_offload_equals_device_memory_bit_for_bit_on_the_virtual_mesh(in_memory, tiers):
    opt_tier, param_tier = tiers
    got = O.run({"data": 2}, 3, opt_tier, params_tier=param_tier)
    assert O.same(got, in_memory)
    # Every fp32 leaf of the model is a file in the NVMe tier.
    n = len(optree.tree_leaves(gpt.init(T.CONFIG, 0)))
    assert got["param_files"] == (n if param_tier == "nvme" else 0)


@pytest.mark.multiprocess
def test_parameter_offload_on_two_gloo_ranks_reads_each_blocks_shards_from_the_tier(in_memory):
    from fsharded.testing import run_on_ranks

    for res in run_on_ranks(O.gloo_param_offload, 2, 2):
        for tier, r in res.items():
            assert r["same"], tier
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(in_memory["losses"]),
                                       rtol=1e-5, atol=1e-5)
            for a, b in zip(optree.tree_leaves(r["params"]), optree.tree_leaves(in_memory["params"])):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        nvme = res["nvme"]
        assert nvme["block_files"] == nvme["block_leaves"] > 0 and nvme["files"] > nvme["block_files"]
        # The blocks' shards came in through aio, not through the files' memory maps.
        assert nvme["block_rss"] == 0, nvme["block_rss"]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("tiers", [("cpu", "cpu"), ("nvme", "nvme")])
def test_master_shards_in_a_tier_at_zero_1_and_2_equal_device_memory(stage, tiers):
    # The master weights' shards in host memory or files; the step gathers the parameters
    # it computes with from them at its start, and the update streams them.
    got = O.run({"data": 2}, stage, tiers[0], params_tier=tiers[1])
    assert O.same(got, O.run({"data": 2}, stage, None))
    assert got["param_files"] == (len(optree.tree_leaves(gpt.init(T.CONFIG, 0))) if tiers[1] == "nvme" else 0)


@pytest.mark.parametrize("stage", [1, 2])
def test_master_shards_in_a_tier_in_bf16_at_zero_1_and_2(stage, tmp_path):
    # The fp32 shards read at the step's start and cast to bf16 before the gather.
    params = gpt.init(T.CONFIG, 0)

    def run(**kw) -> tuple:
        step = fs.train_step(gpt.loss, fs.optim.adamw(T.LR, weight_decay=T.WD), mesh=fs.Mesh({"data": 2}),
                             param_specs=fs.parallel.zero(stage, min_size=16, **kw)(P(), params), clip=T.CLIP,
                             precision="bf16", blocks="blocks")
        state = step.init(params)
        losses = []
        for b in T.batches(4):
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        return losses, optree.tree_leaves(step.params(state))

    ref = run()
    for tier in ("cpu", "nvme"):
        got = run(offload_optimizer=tier, offload_params=tier, nvme_path=str(tmp_path), bucket_elems=2048)
        assert got[0] == ref[0] and all(torch.equal(a, b) for a, b in zip(got[1], ref[1])), tier


@pytest.mark.multiprocess
def test_master_shards_in_a_tier_at_zero_1_and_2_on_two_gloo_ranks(tmp_path):
    from fsharded.testing import run_on_ranks

    for res in run_on_ranks(O.gloo_param_offload_stages, 2, 2, str(tmp_path)):
        for stage in (1, 2):
            for tier in ("cpu", "nvme"):
                r = res[(stage, tier)]
                assert r["same"], (stage, tier)
                assert r["files"] == (len(optree.tree_leaves(gpt.init(T.CONFIG, 0))) if tier == "nvme" else 0)
                # Read through aio before the gather, not through the files' memory maps.
                assert r["mapped"] == 0, (stage, tier, r["mapped"])
        # A corrupted file of a leaf outside the blocks, at ZeRO-2 (the step's gather) and
        # ZeRO-3 (the loss's): an error naming it, on the rank that reads it.
        for stage in (2, 3):
            victim, msg = res["errors"][stage]
            assert "does not hold what the step wrote" in msg and victim in msg, (stage, msg)


@pytest.mark.multiprocess
def test_parameter_offload_in_bf16_on_two_gloo_ranks(tmp_path):
    # Under mixed precision each block's fp32 shards are read from their files through aio
    # and cast to bf16 as they travel (not cast whole, through their maps, at the start).
    from fsharded.testing import run_on_ranks

    for r in run_on_ranks(O.gloo_param_offload_bf16, 2, 2, str(tmp_path)):
        assert r["same"] and r["files"] == len(optree.tree_leaves(gpt.init(T.CONFIG, 0))), r
        assert r["mapped"] == 0, r


def test_fetch_reads_a_tier_tensor_and_checks_it(tmp_path):
    off = offload.Offload("nvme", "nvme", nvme_path=str(tmp_path), bucket_elems=2048)
    x = torch.randn(5000)
    (t,) = offload.place_params([x], off)
    assert offload.nvme_files([t]) and torch.equal(offload.fetch(t), x)
    plain = torch.randn(3)
    assert offload.fetch(plain) is plain
    with open(offload.nvme_files([t])[0], "r+b") as raw:  # a byte of the second piece
        raw.seek(4 * 2048 + 5)
        raw.write(b"\x01")
    with pytest.raises(RuntimeError, match=r"\(piece 1\) does not hold what the step wrote"):
        offload.fetch(t)
    # A 16-bit leaf (kept frozen in its own dtype) stays where it is.
    (h,) = offload.place_params([torch.ones(4096, dtype=torch.bfloat16)], off)
    assert not offload.nvme_files([h])


def test_a_corrupted_parameter_file_is_an_error_naming_it(tmp_path):
    step, params = O.make_step({"data": 2}, 3, "nvme", nvme_path=str(tmp_path), params_tier="nvme")
    b = T.batches(1)[0]
    state, _ = step(step.init(params), b)
    victim = sorted(offload.nvme_files(state.params["blocks"]))[0]
    with open(victim, "r+b") as raw:
        raw.seek(16)
        raw.write(b"\x7f\x7f\x7f\x7f")
    with pytest.raises(RuntimeError, match="does not hold what the step wrote") as e:
        step(state, b)
    assert victim in str(e.value)


def test_offloaded_parameters_checkpoint_and_resume_into_any_tier(tmp_path):
    b = T.batches(6)
    ref_step, params = O.make_step({"data": 2}, 3, None)
    ref = ref_step.init(params)
    for x in b:
        ref, _ = ref_step(ref, x)
    step, _ = O.make_step({"data": 2}, 3, "nvme", nvme_path=str(tmp_path), params_tier="nvme")
    state = step.init(params)
    for x in b[:3]:
        state, _ = step(state, x)
    step.save(state, tmp_path / "ckpt")
    for tiers in (("nvme", "nvme"), ("cpu", "cpu"), (None, None)):
        s2, _ = O.make_step({"data": 2}, 3, tiers[0], nvme_path=str(tmp_path), params_tier=tiers[1])
        got = s2.load(tmp_path / "ckpt")
        assert bool(offload.nvme_files(got.params)) == (tiers[1] == "nvme")
        for x in b[3:]:
            got, _ = s2(got, x)
        for u, v in zip(optree.tree_leaves(s2.params(got)), optree.tree_leaves(ref_step.params(ref))):
            assert torch.equal(u, v), tiers


def test_the_memory_estimate_counts_offloaded_parameters(tmp_path):
    params = gpt.init(T.CONFIG, 0)
    mesh = fs.Mesh({"data": 2})
    kw = dict(offload_optimizer="nvme", nvme_path=str(tmp_path), bucket_elems=2048)
    est = {pt: fs.estimate_memory(params, fs.parallel.zero(3, offload_params=pt, **kw)(P(), params),
                                  fs.optim.adamw(1e-3), mesh=mesh) for pt in (None, "cpu", "nvme")}
    base = est[None]
    for pt in ("cpu", "nvme"):
        e = est[pt]
        assert e.offloaded_params == base.master > 0 and e.master == 0
        assert e.peak == base.peak - base.master
        assert e.host == base.host + (base.master if pt == "cpu" else 2 * 2048 * 4 * 0) + \
            (2 * 2048 * 4 if pt == "nvme" else 0)
        assert any("master parameters offloaded" in n for n in e.notes)
    # ZeRO 1 and 2: the master shards off the device likewise.
    for stage in (1, 2):
        on, off = (fs.estimate_memory(params, fs.parallel.zero(stage, offload_params=pt, **kw)(P(), params),
                                      fs.optim.adamw(1e-3), mesh=mesh) for pt in (None, "cpu"))
        assert off.offloaded_params == on.master > 0 and off.master == 0 and off.peak == on.peak - on.master
        assert any("read back at the step's start" in n for n in off.notes)


def test_parameter_offload_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ValueError, match="needs offload_optimizer= as well"):
        fs.parallel.zero(3, offload_params="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="stage 0 does not shard them"):
        fs.parallel.zero(0, offload_optimizer="cpu", offload_params="cpu")
    with pytest.raises(ValueError, match="offload_params must be None, 'cpu' or 'nvme'"):
        fs.parallel.zero(3, offload_optimizer="cpu", offload_params="disk")
    with pytest.raises(ValueError, match="needs nvme_path"):
        fs.parallel.zero(3, offload_optimizer="cpu", offload_params="nvme")
    # A state whose parameters are in memory, given to a step that keeps them on NVMe.
    plain, params = O.make_step({"data": 2}, 3, "nvme", nvme_path=str(tmp_path))
    tiered, _ = O.make_step({"data": 2}, 3, "nvme", nvme_path=str(tmp_path), params_tier="nvme")
    with pytest.raises(RuntimeError, match="parameters are not in their tier"):
        tiered(plain.init(params), T.batches(1)[0])


def test_a_deepspeed_offload_param_config_trains_with_the_numbers_of_one_without(tmp_path, capsys):
    from fsharded.config import TrainConfig, from_deepspeed
    from fsharded.tools import train

    nvme = tmp_path / "nvme"
    nvme.mkdir()

    def run(zero):
        ds = tmp_path / f"ds-{len(zero)}.json"
        ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, **zero},
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
        metrics = tmp_path / f"m-{len(zero)}.jsonl"
        capsys.readouterr()
        code = train.main(["--preset", "tiny", "--seq-len", "32", "--set", "data=stdlib:300000", "--steps", "3",
                           "--mesh", "data=2", "--deepspeed-config", str(ds), "--set", f"metrics_file={metrics}"])
        out, err = capsys.readouterr()
        assert code == 0, err
        return out, [json.loads(line)["loss"] for line in metrics.read_text().splitlines() if '"loss"' in line]

    _, plain = run({})
    out, got = run({"offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)},
                    "offload_param": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 5,
                                      "buffer_size": 1e8, "max_in_cpu": 1e9, "pin_memory": True}})
    assert "parameters offloaded to nvme" in out and len(plain) == 3 and got == plain
    # Parameters without the optimizer state, or on another disk: refused by name.
    base = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ValueError, match="offload_param.device = 'cpu' without offload_optimizer"):
        from_deepspeed({**base, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
                       data_parallel_size=2)
    with pytest.raises(ValueError, match="cpu_offload_params = True without offload_optimizer"):
        from_deepspeed({**base, "zero_optimization": {"stage": 3, "cpu_offload_params": True}}, data_parallel_size=2)
    other = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)},
             "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    with pytest.raises(ValueError, match="parameters on another disk"):
        from_deepspeed({**base, "zero_optimization": other}, data_parallel_size=2)
    cfg = from_deepspeed({**base, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                        "cpu_offload_params": True}}, data_parallel_size=2)
    assert (cfg.offload.optimizer, cfg.offload.params) == ("cpu", "cpu")
    # DeepSpeed reads offload_param at ZeRO-3 only: at stage 2 it is not applied (noted).
    with pytest.warns(UserWarning, match="at stage 3 only, so at stage 2 it is not applied"):
        cfg = from_deepspeed({**base, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                                            "offload_param": {"device": "cpu"}}}, data_parallel_size=2)
    assert (cfg.offload.optimizer, cfg.offload.params) == ("cpu", "none")
    # fsharded's own config keeps the master shards in the tier at stages 1-2 as well; stage 0 is refused.
    assert TrainConfig.from_dict({"zero_stage": 2, "offload": {"optimizer": "cpu", "params": "cpu"}}).offload.params \
        == "cpu"
    with pytest.raises(ValueError, match="offload.params=cpu: needs zero_stage 1, 2 or 3"):
        TrainConfig.from_dict({"zero_stage": 0, "offload": {"optimizer": "cpu", "params": "cpu"}})
