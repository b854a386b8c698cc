"""The step's key scope (``step/_keys.py``): a loss that draws nothing runs without the
scope's mode after its first step; one that starts drawing later gets the numbers of an
always-scoped step, and torch's global generator is left as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fsharded as fs
from fsharded import random as R
from fsharded.step import _keys


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w1": torch.randn(6, 16, generator=g) * 0.3, "w2": torch.randn(16, 3, generator=g) * 0.3}


def _batches(n=5):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(8, 6, generator=g), "y": torch.randn(8, 3, generator=g)} for _ in range(n)]


def _loss(seen: list, draw_from: int | None = None, op=None):
    """An MLP's loss; ``seen`` gets, per call, whether a key scope was entered. From call
    ``draw_from`` on (counting from 1) it applies dropout (or ``op``) to the hidden layer."""

    def loss(p, b):
        seen.append(R.innermost() is not None)
        h = torch.tanh(b["x"] @ p["w1"])
        if draw_from is not None and len(seen) >= draw_from:
            h = op(h) if op is not None else F.dropout(h, 0.5, training=True)
        return F.mse_loss(h @ p["w2"], b["y"])

    return loss


def _train(loss, n=5, mesh=None):
    step = fs.train_step(loss, fs.optim.adamw(1e-2), mesh=fs.Mesh(mesh or {}))
    state = step.init(_params())
    losses = []
    for b in _batches(n):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return losses, step.params(state)


def test_a_loss_that_draws_nothing_runs_unscoped_after_its_first_step():
    seen: list = []
    losses, params = _train(_loss(seen))
    assert seen == [True, False, False, False, False]
    ref_seen: list = []
    with pytest.MonkeyPatch.context() as mp:  # the reference: scoped at every step
        mp.setattr(_keys.Keys, "__init__", lambda self, watch: setattr(self, "draws", True))
        ref_losses, ref_params = _train(_loss(ref_seen))
    assert ref_seen == [True] * 5
    assert losses == ref_losses
    assert all(torch.equal(params[k], ref_params[k]) for k in params)


@pytest.mark.parametrize("mesh", [{}, {"data": 2}])
def test_a_loss_that_starts_drawing_later_gets_the_keyed_masks(mesh):
    # Steps 1-2 draw nothing (unscoped from step 2); step 3's dropout first runs unscoped,
    # is noticed on torch's generator, undone and redone under the step's key: the same
    # numbers as a step scoped throughout, and the global generator untouched.
    seen: list = []
    torch.manual_seed(123)
    before = torch.get_rng_state()
    losses, params = _train(_loss(seen, draw_from=3), mesh=mesh)
    assert torch.equal(torch.get_rng_state(), before)
    # calls: step 1 scoped, step 2 unscoped, step 3 unscoped (drew; on the virtual mesh
    # vmap refused it) then scoped, steps 4-5 scoped
    assert seen == [True, False, False, True, True, True]
    ref_seen: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_keys.Keys, "__init__", lambda self, watch: setattr(self, "draws", True))
        ref_losses, ref_params = _train(_loss(ref_seen, draw_from=3), mesh=mesh)
    assert losses == ref_losses
    assert all(torch.equal(params[k], ref_params[k]) for k in params)
    # and the masks are the step's: another seed's step differs
    step = fs.train_step(_loss([], draw_from=1), fs.optim.adamw(1e-2), mesh=fs.Mesh(mesh), seed=1)
    state = step.init(_params())
    other = []
    for b in _batches():
        state, m = step(state, b)
        other.append(float(m["loss"]))
    assert other[2:] != losses[2:]


def test_a_later_op_the_scope_refuses_is_refused_not_drawn_unkeyed():
    # randperm draws from the global generator; under the scope it is refused. Unscoped
    # it would draw unkeyed numbers: the run is redone scoped, and so refused.
    seen: list = []
    loss = _loss(seen, draw_from=3, op=lambda h: h[:, torch.randperm(h.shape[1])])
    with pytest.raises(NotImplementedError, match="randperm"):
        _train(loss)
    assert seen == [True, False, False, True]


def _ranked(draw_from: int, only: int | None, scoped: bool) -> tuple:
    """On a gloo rank of data=2: ``_train`` of a loss that draws from call ``draw_from``
    (on rank ``only`` alone, where given); ``scoped``: the reference, scoped at every step."""
    import torch.distributed as dist
    seen: list = []
    draws = draw_from if only is None or only == dist.get_rank() else None
    with pytest.MonkeyPatch.context() as mp:  # (the ranks' processes are reused: undone after)
        if scoped:
            mp.setattr(_keys.Keys, "__init__", lambda self, watch, ranks=None: self.__dict__.update(
                watch=watch, ranks=ranks, draws=True))
        losses, params = _train(_loss(seen, draw_from=draws), mesh={"data": 2})
    return seen, losses, params


@pytest.mark.multiprocess
@pytest.mark.parametrize("only", [None, 1])
def test_on_real_ranks_every_rank_redoes_a_run_any_of_them_drew_unscoped(only):
    # Calls: the schedule check's dry run (scoped), step 1 (scoped: nothing drew on any
    # rank), step 2 (unscoped), step 3 (unscoped; a rank drew: every rank redoes it
    # scoped, also one that drew nothing), steps 4-5 scoped. The numbers of a step scoped
    # throughout, on every rank.
    from fsharded.testing import run_on_ranks
    got = run_on_ranks(_ranked, 2, 4, only, False)
    ref = run_on_ranks(_ranked, 2, 4, only, True)
    for (seen, losses, params), (ref_seen, ref_losses, ref_params) in zip(got, ref):
        assert seen == [True, True, False, False, True, True, True]
        assert ref_seen == [True] * 6
        assert losses == ref_losses
        assert all(torch.equal(params[k], ref_params[k]) for k in params)
    # a loss that never draws runs unscoped on every rank after its first step
    for seen, _, _ in run_on_ranks(_ranked, 2, None, None, False):
        assert seen == [True, True, False, False, False, False]


def test_keys_alone():
    calls = []

    def key():
        calls.append(1)
        return R.key(0)

    keys = _keys.Keys(watch=True)
    assert keys.run(key, lambda: torch.ones(2)).sum() == 2
    assert keys.draws is False and calls == []  # nothing drew: the key was never derived
    a = keys.run(key, lambda: torch.rand(3))  # drew from the global generator: redone keyed
    assert keys.draws is True and calls == [1]
    with R.scope(R.key(0)):
        assert torch.equal(a, torch.rand(3))
    never = _keys.Keys(watch=False)  # scoped every time
    never.run(key, lambda: None)
    assert never.draws is True
