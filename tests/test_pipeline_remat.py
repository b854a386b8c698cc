"""``train_step(remat=...)`` with a pipelined loss: each stage's blocks recomputed in
backward per micro-batch, with the numbers of keeping every activation."""

from __future__ import annotations

import pipeline_cases as C
import pytest
import torch

TOL = dict(rtol=1e-6, atol=1e-7)


def _same(a: dict, b: dict, tol: dict = TOL) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), **tol)
    torch.testing.assert_close(a["params"], b["params"], **tol)


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2), ("gpipe", 1)])
@pytest.mark.parametrize("policy", ["blocks", "blocks:2,offload", "blocks,dots"])
def test_pipelined_blocks_recomputed_give_the_numbers_of_none(name, v, policy):
    _same(C.train({"pipe": 2}, name, v, 3, remat=policy), C.train({"pipe": 2}, name, v, 3))


def test_with_zero3_gathering_per_block_and_tensor_parallel():
    # ZeRO-3 regathering each block per micro-batch (its own recomputation under
    # torch.func: the policy adds none of its own), and tensor parallelism beside it.
    mesh = {"data": 2, "pipe": 2}
    _same(C.train(mesh, "1f1b", 1, 3, zero=3, reshard=True, remat="blocks"),
          C.train(mesh, "1f1b", 1, 3, zero=3, reshard=True))
    mesh = {"pipe": 2, "tensor": 2}
    _same(C.train(mesh, "1f1b", 1, 3, tensor=True, remat="blocks,partition"),
          C.train(mesh, "1f1b", 1, 3, tensor=True))


def test_a_hugging_face_model_cut_into_stages_with_dropout():
    # fs.nn.pipeline_stages runs the stage's blocks through its own cut, which hands them
    # to the policy: the recomputed blocks draw the forward's dropout masks.
    _same(C.hf_train("gpt2", {"pipe": 2}, "1f1b", 3, dropout=0.1, remat="blocks"),
          C.hf_train("gpt2", {"pipe": 2}, "1f1b", 3, dropout=0.1))


def test_the_recomputed_stages_keep_fewer_activations(monkeypatch):
    import fsharded as fs
    from fsharded.models import gpt
    from fsharded.parallel import remat

    calls = []
    orig = remat._Remat.apply
    monkeypatch.setattr(remat._Remat, "apply", lambda *a: calls.append(1) or orig(*a))
    out = {}
    for policy in (None, "blocks"):
        params, tokens = C.setup(layers=4, batch=8, **C.TRAIN_CFG)
        stages = C.gpt_stages.pipeline_stages(params, 2, attention="einsum")
        loss = C.pp.pipelined(stages, schedule="gpipe", microbatches=2)
        step = fs.train_step(loss, fs.optim.adamw(1e-2), mesh=fs.Mesh({"pipe": 2}), remat=policy)
        state, _ = step(step.init(params), {"tokens": tokens})
        with fs.memory.track() as mem:
            mem.register(state.params, "parameters")
            mem.register(state.opt_state, "optimizer state")
            step(state, {"tokens": tokens})
        out[policy] = mem.peak_of(("activations",))
    assert out["blocks"] < out[None], out
    assert calls  # the stages' blocks went through the remat
    del gpt


def test_selective_remat_replays_every_product_in_the_stages(monkeypatch):
    from fsharded.parallel import remat

    made = []
    kept_init = remat._Kept.__init__
    monkeypatch.setattr(remat._Kept, "__init__", lambda self, ops: made.append(self) or kept_init(self, ops))
    C.train({"pipe": 2}, "1f1b", 1, 1, remat="blocks,dots")
    assert made and sum(k.misses for k in made) == 0
    assert sum(k.hits for k in made) == sum(k.recorded for k in made) > 0


@pytest.mark.multiprocess
def test_on_two_gloo_pipe_ranks():
    from fsharded.testing import run_on_ranks

    for res in run_on_ranks(C.gloo_remat, 2, 2):
        for policy in ("blocks", "blocks:2,offload"):
            _same(res[("pipe", policy)], res[("pipe", None)])


def test_estimate_memory_measures_a_pipelined_loss_under_a_policy():
    import fsharded as fs

    params, tokens = C.setup(layers=8, batch=8, **C.TRAIN_CFG)  # 4 blocks per stage
    stages = C.gpt_stages.pipeline_stages(params, 2, attention="einsum")
    loss = C.pp.pipelined(stages, schedule="gpipe", microbatches=2)
    mesh = fs.Mesh({"pipe": 2})
    est = {p: fs.estimate_memory(params, None, fs.optim.adamw(1e-2), mesh=mesh, loss=loss,
                                 batch={"tokens": tokens}, remat=p) for p in (None, "blocks:2", "blocks")}
    a = {p: e.activations for p, e in est.items()}
    assert a["blocks"] < a["blocks:2"] < a[None], a


def test_a_remat_budget_with_a_pipeline_picks_the_least_recomputation_that_fits():
    # The policies count each stage's blocks (2 here); the peak is the pipe rank's that
    # needs most: its stages' state and the schedule's micro-batches in flight.
    import fsharded as fs
    from fsharded.parallel import remat

    params, tokens = C.setup(layers=4, batch=8, **C.TRAIN_CFG)
    loss = C.pp.pipelined(C.gpt_stages.pipeline_stages(params, 2, attention="einsum"), schedule="1f1b",
                          microbatches=4)
    mesh, opt, batch = fs.Mesh({"pipe": 2}), fs.optim.adamw(1e-2), {"tokens": tokens}
    cands = remat.Budget(1).candidates(2)
    assert [str(c) for c in cands] == ["None", "blocks,dots", "blocks:2", "blocks", "blocks,offload"]
    peaks = [fs.estimate_memory(params, fs.P(), opt, mesh=mesh, loss=loss, batch=batch, remat=c).peak for c in cands]
    # Recomputing more blocks leaves less waiting in each micro-batch in flight.
    assert peaks[0] > peaks[2] > peaks[3] > peaks[4], peaks

    def run(policy):
        step = fs.train_step(loss, opt, mesh=mesh, remat=policy)
        state = step.init(params)
        losses = []
        for _ in range(2):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        return step.remat, losses

    _, ref = run(None)
    for i in range(len(cands)):  # a budget just above a candidate's peak: the first that fits
        got, losses = run(f"budget:{peaks[i] + 1}")
        assert got == cands[next(j for j, p in enumerate(peaks) if p <= peaks[i] + 1)], (i, got, peaks)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), **TOL)
    with pytest.raises(ValueError, match=r"no policy fits .* MiB per device; estimated peaks: none .*; blocks,offload"):
        run(f"budget:{min(peaks) - 1}")
