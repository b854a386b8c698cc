"""``train_step(remat=...)``: blocks recomputed in backward, with the numbers of keeping
every activation and the memory the policy says."""

from __future__ import annotations

import pytest
import remat_cases as R
import torch

import fsharded as fs
from fsharded.models import gpt
from fsharded.parallel import remat

TOL = dict(rtol=1e-6, atol=1e-7)  # the same backend: the same numbers but for float rounding
ACROSS = dict(rtol=1e-5, atol=1e-6)  # gloo ranks against the virtual mesh (other reduction orders)


def _same(a: dict, b: dict, tol: dict = TOL) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), **tol)
    for x, y in zip(a["params"], b["params"], strict=True):
        torch.testing.assert_close(x, y, **tol)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("policy", ["blocks", "blocks:2", remat.Blocks(every=3), "blocks,offload", "blocks,dots",
                                    "blocks:2,dots,offload"])
def test_a_policy_gives_the_numbers_of_keeping_every_activation(stage, policy):
    _same(R.run_gpt({"data": 2}, stage, policy), R.run_gpt({"data": 2}, stage, None))


def test_recomputed_blocks_draw_the_forwards_dropout_masks():
    # A Hugging Face GPT-2 with dropout through fs.nn.functional: the same masks in the
    # recomputation, else the gradients (and the losses after the first step) would differ.
    for stage in (0, 3):
        _same(R.run_hf_gpt2({"data": 2}, stage, "blocks"), R.run_hf_gpt2({"data": 2}, stage, None))
    # Its blocks' inputs (hidden states and a float mask) kept in host memory: the same.
    _same(R.run_hf_gpt2({"data": 2}, 0, "blocks,offload"), R.run_hf_gpt2({"data": 2}, 0, None))


def test_the_memory_tracker_sees_what_each_policy_keeps():
    one = {p: R.activations({"data": 1}, 0, p) for p in (None, "blocks:2", "blocks")}
    # Every block recomputed keeps less than every other one, which keeps less than none.
    assert one["blocks"] < one["blocks:2"] < one[None]
    # Four blocks: every other one recomputed saves about half of what all four save.
    saved_all, saved_half = one[None] - one["blocks"], one[None] - one["blocks:2"]
    assert 0.4 * saved_all < saved_half < 0.6 * saved_all
    # ZeRO-3 on the virtual mesh recomputes its blocks already (re-gathering their weights),
    # but for the last: "blocks" recomputes that one too, "blocks:2" nothing more.
    z3 = {p: R.activations({"data": 2}, 3, p) for p in (None, "blocks:2", "blocks")}
    assert z3["blocks"] < z3[None] and z3["blocks:2"] == z3[None]


def test_selective_remat_keeps_the_products_and_recomputes_the_rest():
    act = {p: R.activations({"data": 1}, 0, p) for p in (None, "blocks,dots", "blocks")}
    # It keeps the matrix products' outputs: less than every activation, more than inputs.
    assert act["blocks"] < act["blocks,dots"] < act[None], act
    # The recomputation takes every product it kept (none recomputed, none run twice),
    # through the torch.func transforms and the virtual mesh's vmap.
    count = R.replays({"data": 2}, 0, "blocks,dots")
    assert count["misses"] == 0 and count["hits"] == count["recorded"] > 0, count
    # ZeRO-3 on the virtual mesh recomputes its blocks to gather their weights again: with
    # the policy it keeps their products too (more memory than its full recomputation).
    z3 = R.replays({"data": 2}, 3, "blocks,dots")
    assert z3["misses"] == 0 and z3["hits"] == z3["recorded"] == count["recorded"], (z3, count)
    assert R.activations({"data": 2}, 3, "blocks,dots") > R.activations({"data": 2}, 3, None)
    # An HF GPT-2 with dropout: the same numbers as none.
    _same(R.run_hf_gpt2({"data": 2}, 0, "selective"), R.run_hf_gpt2({"data": 2}, 0, None))


def test_checkpoint_replays_the_products_it_kept():
    w = [torch.randn(32, 32, requires_grad=True) for _ in range(3)]
    x0 = torch.randn(4, 8, 32, requires_grad=True)

    def run(save):
        x = x0
        for wi in w:
            x = remat.checkpoint(lambda a, b: torch.nn.functional.gelu(torch.tanh(a @ b) @ b.T), save=save)(x, wi)
        return torch.autograd.grad(x.square().sum(), [x0, *w])

    for a, b in zip(run("dots"), run(None), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    def live(save):
        with fs.memory.track() as mem:
            x = x0
            for wi in w:
                x = remat.checkpoint(lambda a, b: torch.tanh(a @ b) @ b.T, save=save)(x, wi)
            return mem.live_bytes()["activations"]

    one = 4 * 8 * 32 * 4
    # Kept: each block's two products (the second is its output); the tanh between is not.
    assert live("dots") == 6 * one and live(None) == 3 * one
    with pytest.raises(ValueError, match="save must be"):
        remat.checkpoint(lambda a: a, save="matmuls")


def test_a_product_changed_in_place_is_not_replayed(monkeypatch):
    # An in-place op on a product in the forward (an in-place activation) changes what was
    # kept: the recomputation must multiply again, not take the changed value.
    made = []
    kept_init = remat._Kept.__init__
    monkeypatch.setattr(remat._Kept, "__init__", lambda self, ops: made.append(self) or kept_init(self, ops))
    w = torch.randn(16, 16, requires_grad=True)
    x0 = torch.randn(4, 16, requires_grad=True)

    def block(a, b):
        y = a @ b
        y.mul_(0.5)  # in place, on the kept product
        return torch.nn.functional.relu(y, inplace=True) @ b.T

    def grads(save):
        return torch.autograd.grad(remat.checkpoint(block, save=save)(x0, w).square().sum(), [x0, w])

    for a, b in zip(grads("dots"), grads(None), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert made[0].misses >= 1 and made[0].recorded == 2


@pytest.mark.parametrize("policy", ["blocks,partition", "blocks:2,partition,offload", "blocks,dots,partition"])
def test_partitioned_inputs_give_the_numbers_of_none(policy):
    # Tensor parallel over two virtual devices (and ZeRO-2 over data beside it): each
    # recomputed block keeps half of its input, gathered whole again in backward.
    _same(R.run_gpt({"data": 1, "tensor": 2}, 0, policy), R.run_gpt({"data": 1, "tensor": 2}, 0, None))
    _same(R.run_gpt({"data": 2, "tensor": 2}, 2, policy), R.run_gpt({"data": 2, "tensor": 2}, 2, None))


def test_partitioned_block_inputs_keep_one_part_per_device():
    # The tiny GPT's block input is 16 x 16 x 16 fp32 (16 kB), four blocks, the same on
    # both tensor shards: each device keeps half of each (the virtual mesh holds both
    # devices' halves, as much as one whole input: counted per device).
    block_input = 16 * 16 * 16 * 4
    mesh = {"data": 1, "tensor": 2}
    whole = R.activations(mesh, 0, "blocks", per_device=True)
    parted = R.activations(mesh, 0, "blocks,partition", per_device=True)
    assert whole - parted >= 3 * block_input // 2, (whole, parted)
    # With offload the parts go to host memory: half of each input per device.
    assert R.activations(mesh, 0, "blocks,partition,offload", categories=("offloaded activations",),
                         per_device=True) == 4 * block_input // 2
    assert R.activations(mesh, 0, "blocks,offload", categories=("offloaded activations",),
                         per_device=True) == 4 * block_input
    # A tensor axis of size 1: nothing to split, the memory of "blocks"; no such axis: an error.
    assert R.activations({"data": 1, "tensor": 1}, 0, "blocks,partition") == \
        R.activations({"data": 1, "tensor": 1}, 0, "blocks")
    with pytest.raises(ValueError, match="partition axis 'model' is not an axis"):
        R.run_gpt({"data": 1}, 0, "blocks,partition:model", steps=1)


def test_offloaded_block_inputs_leave_the_device_activations():
    # The tiny GPT's block input is 16 rows x 16 positions x 16 features in fp32: 16 kB,
    # four blocks. With offload every one of them is a host copy between forward and
    # backward, and the device keeps none of them.
    block_input = 16 * 16 * 16 * 4
    kept = R.activations({"data": 1}, 0, "blocks")
    moved = R.activations({"data": 1}, 0, "blocks,offload")
    host = R.activations({"data": 1}, 0, "blocks,offload", categories=("offloaded activations",))
    assert host == 4 * block_input
    # Of the four, the last block's input is alive at the peak (where backward starts) on
    # the device all the same: the head's input is its output, not its input.
    assert kept - moved >= 3 * block_input, (kept, moved)
    # Every other block: two of the four moved.
    assert R.activations({"data": 1}, 0, "blocks:2,offload", categories=("offloaded activations",)) == \
        2 * block_input
    # The copy back in backward is a new tensor: nothing is read from a freed buffer (the
    # numbers of none, on one device too).
    _same(R.run_gpt({"data": 1}, 0, "blocks,offload"), R.run_gpt({"data": 1}, 0, None))


def test_estimate_memory_counts_the_activations_a_policy_keeps():
    params = gpt.init(R.CONFIG, 0)
    batch = R.batches(1, rows=16)[0]
    specs = fs.parallel.zero(0, min_size=16)(fs.P(), params)
    for policy in (None, "blocks:2", "blocks", "blocks,offload", "blocks,dots"):
        est = fs.estimate_memory(params, specs, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 1}), loss=gpt.loss,
                                 batch=batch, remat=policy)
        measured = R.activations({"data": 1}, 0, policy)  # in the step, by the memory tracker
        assert abs(est.activations - measured) <= 0.01 * measured, (policy, est.activations, measured)
        assert (policy is None) == (not any("remat" in n for n in est.notes))
    with pytest.raises(ValueError, match="remat"):
        fs.estimate_memory(params, specs, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 1}), remat="all")


def test_checkpoint_offloads_the_arguments_it_names():
    w = [torch.randn(32, 32, requires_grad=True) for _ in range(3)]
    x0 = torch.randn(8, 32, requires_grad=True)

    def run(offload):
        x = x0
        for wi in w:
            x = remat.checkpoint(lambda a, b: torch.tanh(a @ b), offload=offload)(x, wi)
        return torch.autograd.grad(x.square().sum(), [x0, *w])

    ref = run(False)
    for offload in (True, lambda i, a: i == 0):
        for a, b in zip(run(offload), ref, strict=True):
            assert torch.equal(a, b)
    with fs.memory.track() as mem:
        x = x0
        for wi in w:  # only the activations (argument 0) moved
            x = remat.checkpoint(lambda a, b: torch.tanh(a @ b), offload=lambda i, a: i == 0)(x, wi)
        live = mem.live_bytes()
    assert live["offloaded activations"] == 3 * 8 * 32 * 4
    assert live["activations"] == 8 * 32 * 4  # the output alone: the inputs are host copies now


@pytest.mark.multiprocess
def test_policies_on_two_gloo_ranks_give_the_numbers_of_none():
    from fsharded.testing import run_on_ranks

    for res in run_on_ranks(R.gloo_remat, 2, 2):
        for stage in (0, 3):
            for policy in ("blocks", "blocks:2", "blocks:2,offload", "blocks,dots"):
                _same(res[(stage, policy)], res[(stage, None)])
        for policy in ("blocks,partition", "blocks,partition,offload"):
            _same(res[("tensor", policy)], res[("tensor", None)])
    # And as the virtual mesh computes them.
    _same(res[(3, "blocks")], R.run_gpt({"data": 2}, 3, "blocks"), ACROSS)


def test_bad_policies_are_refused_by_name():
    for bad in ("every", "blocks:0", "blocks:x", 3, remat, "blocks,cpu", "blocks,offload,offload", "none,offload",
                "blocks,dots,dots", "selective:2", "blocks,partition,partition"):
        with pytest.raises(ValueError, match="remat"):
            fs.train_step(gpt.loss, fs.optim.adamw(1e-3), remat=bad)
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        remat.Blocks(every=0)
    assert str(remat.policy("blocks:2")) == "blocks:2" and remat.policy("none") is None
    assert remat.policy(" Blocks:2, offload") == remat.Blocks(2, offload=True)
    assert remat.policy("blocks:2,offload,dots") == remat.Blocks(2, offload=True, save="dots")
    assert remat.policy("selective") == remat.Blocks(save="dots") and str(remat.Blocks(save="dots")) == "blocks,dots"
    assert remat.policy("blocks,partition,offload") == remat.Blocks(offload=True, partition="tensor")
    assert str(remat.policy("blocks:2,partition:model")) == "blocks:2,partition:model"
    assert str(remat.Blocks(2, offload=True)) == "blocks:2,offload"
    with pytest.raises(ValueError, match="offload must be a bool"):
        remat.Blocks(offload="cpu")


def test_fsharded_train_takes_remat_policy(capsys):
    from fsharded.tools import train

    outs = []
    for policy in ("none", "blocks"):
        capsys.readouterr()
        code = train.main(["--preset", "tiny", "--seq-len", "32", "--set", "data=stdlib:300000", "--steps", "3",
                           "--mesh", "data=2", "--set", f"remat.policy={policy}"])
        out, err = capsys.readouterr()
        assert code == 0, err
        outs.append(out)
    assert "remat blocks" in outs[1].splitlines()[0]
    done = [next(line for line in o.splitlines() if line.startswith("done: loss")) for o in outs]
    assert done[0] == done[1]
    code = train.main(["--preset", "tiny", "--steps", "1", "--set", "remat.policy=every"])
    assert code != 0 and "remat.policy" in capsys.readouterr().err


def test_deepspeeds_activation_checkpointing_block_is_a_remat_policy():
    from fsharded.config import from_deepspeed

    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert from_deepspeed(ds, data_parallel_size=2).remat.policy == "none"
    at_defaults = {"activation_checkpointing": {"partition_activations": False, "contiguous_memory_optimization": False,
                                                "number_checkpoints": None, "profile": False}}
    assert from_deepspeed({**ds, **at_defaults}, data_parallel_size=2).remat.policy == "blocks"
    cpu = {"activation_checkpointing": {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": True}}
    assert from_deepspeed({**ds, **cpu}, data_parallel_size=2).remat.policy == "blocks,offload"
    # Splitting the kept inputs over tensor ranks (a no-op without a tensor axis), with and
    # without the parts in host memory.
    part = {"activation_checkpointing": {"partition_activations": True}}
    assert from_deepspeed({**ds, **part}, data_parallel_size=2).remat.policy == "blocks"
    both = {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}
    assert from_deepspeed({**ds, **both}, data_parallel_size=2,
                          mesh={"data": 2, "tensor": 2}).remat.policy == "blocks,partition,offload"
    with pytest.raises(ValueError, match=r"activation_checkpointing\.cpu_checkpointing: expected bool"):
        from_deepspeed({**ds, "activation_checkpointing": {"cpu_checkpointing": "yes"}}, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"activation_checkpointing\.cpu_chekpointing: not a key"):
        from_deepspeed({**ds, "activation_checkpointing": {"cpu_chekpointing": True}}, data_parallel_size=2)


def test_fsharded_train_runs_a_deepspeed_activation_checkpointing_config(tmp_path, capsys):
    import json

    from fsharded.tools import train

    base = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    lines = []
    for extra in ({}, {"activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 2}}):
        path = tmp_path / f"ds{len(lines)}.json"
        path.write_text(json.dumps({**base, **extra}))
        capsys.readouterr()
        code = train.main(["--preset", "tiny", "--seq-len", "32", "--set", "data=stdlib:300000", "--steps", "3",
                           "--mesh", "data=2", "--deepspeed-config", str(path)])
        out, err = capsys.readouterr()
        assert code == 0, err
        lines.append(out.splitlines())
    assert "remat" not in lines[0][0] and "remat blocks,offload" in lines[1][0], lines[1][0]
    done = [next(x for x in o if x.startswith("done: loss")) for o in lines]
    assert done[0] == done[1]  # the same numbers
    # A config without the block leaves the job's own policy (here from --set) alone.
    capsys.readouterr()
    code = train.main(["--preset", "tiny", "--seq-len", "32", "--set", "data=stdlib:300000", "--steps", "1",
                       "--mesh", "data=2", "--deepspeed-config", str(tmp_path / "ds0.json"),
                       "--set", "remat.policy=blocks:2"])
    out, err = capsys.readouterr()
    assert code == 0 and "remat blocks:2" in out.splitlines()[0], err


def test_a_remat_budget_picks_the_least_recomputation_that_fits():
    params = gpt.init(R.CONFIG, 0)
    batch = R.batches(1, rows=16)[0]
    mesh, opt = fs.Mesh({"data": 1}), fs.optim.adamw(1e-3)
    specs = fs.parallel.zero(0, min_size=16)(fs.P(), params)
    # none, all 4 selectively, 1 block, 2 blocks, all 4, all 4 with their inputs moved
    cands = remat.Budget(1).candidates(4)
    assert [str(c) for c in cands] == ["None", "blocks,dots", "blocks:4", "blocks:3", "blocks", "blocks,offload"]
    peaks = [fs.estimate_memory(params, specs, opt, mesh=mesh, loss=gpt.loss, batch=batch, remat=c).peak
             for c in cands]
    # Each whole-block count keeps less than the one before; selective keeps less than none.
    assert peaks[2:] == sorted(peaks[2:], reverse=True) and len(set(peaks[2:])) == 4 and peaks[1] < peaks[0], peaks

    def chosen(budget):
        step = fs.train_step(gpt.loss, opt, mesh=mesh, blocks="blocks", param_specs=specs, remat=f"budget:{budget}")
        state, m = step(step.init(params), batch)
        return step.remat, float(m["loss"])

    for i in range(len(cands)):  # a budget just above a candidate's peak: the first that fits
        got, loss = chosen(peaks[i] + 1)
        assert got == cands[next(j for j, p in enumerate(peaks) if p <= peaks[i] + 1)], (i, got)
    assert loss == chosen(peaks[0])[1]  # the same numbers whatever it picked
    with pytest.raises(ValueError, match=r"no policy fits .* MiB per device; estimated peaks: none .*; blocks,offload"):
        chosen(peaks[-1] - 1)
    assert remat.policy("budget:2GiB") == remat.Budget(2 * 2**30) and remat.policy("budget:1.5 MB").bytes == 1_500_000
    for bad in ("budget:", "budget:-1GB", "budget:lots", "budget:1GB,offload"):
        with pytest.raises(ValueError, match="budget:SIZE"):
            remat.policy(bad)
