"""The virtual mesh's donated update: the fused kernel on the tensors beneath the vmap
levels (``step._update.StackedFusedUpdate``) against the pure update, leaf layouts that
need its copies and alignments, and the state consumed in place as on real ranks."""

from __future__ import annotations

import optree
import pytest
import torch

import fsharded as fs
from fsharded import P
from fsharded.models import gpt
from fsharded.step._update import StackedFusedUpdate


def _batch(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, config.vocab_size, (4, 33), generator=g)}


def _run(donate: bool, stage: int, clip, opt, steps=4):
    config = gpt.GPTConfig.small(d_model=32, n_layers=2)
    params = gpt.init(config, 0)
    plan = fs.parallel.zero(stage, min_size=64)(P(), params)
    step = fs.train_step(gpt.loss, opt, mesh=fs.Mesh({"data": 2}), param_specs=plan, donate=donate,
                         clip=clip, blocks="blocks")
    state = step.init(params)
    losses = []
    for i in range(steps):
        state, m = step(state, _batch(config, i))
        losses.append(float(m["loss"]))
    return step, state, losses


@pytest.mark.parametrize("stage,clip,masked", [(s, c, False) for s in range(4) for c in (None, 0.5)]
                         + [(s, 0.5, True) for s in (0, 2, 3)])
def test_donated_virtual_update_equals_the_pure_one(stage, clip, masked):
    """``masked``: AdamW with ``decay_mask`` (no decay for biases and norms), whose fused
    form runs the decayed leaves and the others as two groups."""
    opt = fs.optim.adamw(3e-3, weight_decay=0.1, mask=fs.optim.decay_mask) if masked else fs.optim.adamw(3e-3)
    step, donated, l_d = _run(True, stage, clip, opt)
    assert any(isinstance(p.update, StackedFusedUpdate) for p in [step._plan(donated, False)])
    # The reference: the same optimizer without its fused form (optimizer.update per leaf)
    ref_step, pure, l_p = _run(False, stage, clip, fs.optim.Optimizer(opt.init, opt.update, opt.lr))
    assert type(ref_step._plan(pure, False).update).__name__ == "PureUpdate"
    # The kernel evaluates AdamW's formulas in another order: rounding apart, the same.
    # (The key bias has a zero gradient up to rounding, which Adam scales up to ~lr-sized
    # noise of either sign: it stays within atol, the other leaves agree to ~1e-7.)
    assert l_d == pytest.approx(l_p, rel=1e-5, abs=1e-6)
    for a, b in zip(optree.tree_leaves(donated), optree.tree_leaves(pure)):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b)  # step counters


def test_lion_and_a_leaf_sharded_on_its_inner_dim():
    """A weight sharded on dim 1 lies strided beneath the levels (copied and written back);
    a small replicated leaf has an invariant gradient (read once)."""
    params = {"w": torch.randn(6, 8), "b": torch.randn(3)}
    specs = {"w": P(None, "data"), "b": P()}

    def loss(p, batch):
        return ((batch @ p["w"]).tanh().sum(-1) + p["b"].sum()).pow(2).mean()

    x = torch.randn(8, 6)
    out = {}
    for donate in (True, False):
        step = fs.train_step(loss, fs.optim.lion(1e-2), mesh=fs.Mesh({"data": 2}), param_specs=specs,
                             donate=donate, batch_spec=P("data"))
        state = step.init({k: v.clone() for k, v in params.items()})
        for _ in range(3):
            state, _ = step(state, x)
        out[donate] = state
    torch.testing.assert_close(out[True].params["w"], out[False].params["w"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out[True].params["b"], out[False].params["b"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out[True].opt_state, out[False].opt_state, rtol=1e-6, atol=1e-7)


def test_the_donated_state_is_updated_in_place():
    """As on a real rank: the new state's tensors are the old ones' storage."""
    config = gpt.GPTConfig.small(d_model=32, n_layers=2)
    params = gpt.init(config, 0)
    plan = fs.parallel.zero(3, min_size=64)(P(), params)
    step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 2}), param_specs=plan,
                         donate=True, blocks="blocks")
    state = step.init(params)
    before = [t.untyped_storage().data_ptr() for t in optree.tree_leaves((state.params, state.opt_state))
              if isinstance(t, torch.Tensor) and t.dim() > 0]
    new, _ = step(state, _batch(config))
    after = [t.untyped_storage().data_ptr() for t in optree.tree_leaves((new.params, new.opt_state))
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    assert after == before
