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
@pytest.mark.parametrize("policy", ["blocks", "blocks:2", remat.Blocks(every=3)])
def test_a_policy_gives_the_numbers_of_keeping_every_activation(stage, policy):
    _same(R.run_gpt({"data": 2}, stage, policy), R.run_gpt({"data": 2}, stage, None))


def test_recomputed_blocks_draw_the_forwards_dropout_masks():
    # A Hugging Face GPT-2 with dropout through fs.nn.functional: the same masks in the
    # recomputation, else the gradients (and the losses after the first step) would differ.
    for stage in (0, 3):
        _same(R.run_hf_gpt2({"data": 2}, stage, "blocks"), R.run_hf_gpt2({"data": 2}, stage, None))


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


@pytest.mark.multiprocess
def test_policies_on_two_gloo_ranks_give_the_numbers_of_none():
    from fsharded.testing import run_on_ranks

    for res in run_on_ranks(R.gloo_remat, 2, 2):
        for stage in (0, 3):
            for policy in ("blocks", "blocks:2"):
                _same(res[(stage, policy)], res[(stage, None)])
    # And as the virtual mesh computes them.
    _same(res[(3, "blocks")], R.run_gpt({"data": 2}, 3, "blocks"), ACROSS)


def test_bad_policies_are_refused_by_name():
    params = gpt.init(R.CONFIG, 0)
    for bad in ("every", "blocks:0", "blocks:x", 3, remat):
        with pytest.raises(ValueError, match="remat"):
            fs.train_step(gpt.loss, fs.optim.adamw(1e-3), remat=bad)
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        remat.Blocks(every=0)
    # A pipelined loss runs its blocks through its stages: not composed with a policy yet.
    from fsharded.models import gpt_stages
    from fsharded.parallel import pipeline as pp

    piped = pp.pipelined(gpt_stages.pipeline_stages(params, 2), microbatches=2)
    step = fs.train_step(piped, fs.optim.adamw(1e-3), mesh=fs.Mesh({"pipe": 2}), remat="blocks")
    with pytest.raises(NotImplementedError, match="pipelined"):
        step(step.init(params), R.batches(1)[0])
    assert str(remat.policy("blocks:2")) == "blocks:2" and remat.policy("none") is None


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
