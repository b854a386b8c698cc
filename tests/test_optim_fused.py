"""fsharded.optim.fused_update_: the in-place kernel twin of adamw / adam / lion."""

from __future__ import annotations

import optree
import pytest
import torch
import train_cases as T

import fsharded as fs
from fsharded.kernels import cpu_optim
from fsharded.models import gpt

IMPLS = ["reference"] + (["cpp"] if cpu_optim.load(required=False) is not None else [])


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(5, 7, generator=g), "b": torch.randn(13, generator=g),
            "s": torch.randn((), generator=g)}


OPTIMIZERS = {
    "adamw": lambda: fs.optim.adamw(fs.optim.WarmupLR(warmup_max_lr=1e-2, warmup_num_steps=3),
                                    weight_decay=0.1),
    "adam": lambda: fs.optim.adam(1e-2, weight_decay=0.1),
    "lion": lambda: fs.optim.lion(1e-3, weight_decay=0.1),
    # decay_mask: "w" decayed, the bias and the scalar not (two groups of the kernel)
    "adamw-masked": lambda: fs.optim.adamw(fs.optim.WarmupLR(warmup_max_lr=1e-2, warmup_num_steps=3),
                                           weight_decay=0.1, mask=fs.optim.decay_mask),
    "lion-masked": lambda: fs.optim.lion(1e-3, weight_decay=0.1, mask=fs.optim.decay_mask),
    "adamw-bool-mask": lambda: fs.optim.adamw(1e-2, weight_decay=0.1, mask={"w": False, "b": True, "s": True}),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_equals_update_and_apply(name, impl):
    opt = OPTIMIZERS[name]()
    assert fs.optim.has_fused(opt)
    p1, p2 = _params(), _params()
    s1, s2 = opt.init(p1), opt.init(p2)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in p1.items()}
        u, s1 = opt.update(grads, s1, p1)
        p1 = fs.optim.apply_updates(p1, u)
        before = p2["w"]
        s2, found = fs.optim.fused_update_(opt, grads, s2, p2, impl=impl)
        assert p2["w"] is before and not bool(found)  # in place
    # Same formulas, other evaluation order: a few float32 ulps after 4 steps.
    for k in p1:
        torch.testing.assert_close(p2[k], p1[k], rtol=1e-6, atol=1e-6)
    for a, b in zip(fs.tree_flatten_with_paths(s2)[1], fs.tree_flatten_with_paths(s1)[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_skips_a_non_finite_step_and_unscales(impl):
    opt = fs.optim.adamw(1e-2)
    p, ref = _params(), _params()
    s, s_ref = opt.init(p), opt.init(ref)
    grads = {k: torch.ones_like(v) for k, v in p.items()}
    s, _ = fs.optim.fused_update_(opt, grads, s, p, impl=impl)
    snapshot = {k: v.clone() for k, v in p.items()}
    bad = {k: v.clone() for k, v in grads.items()}
    bad["b"][3] = float("nan")
    s_after, found = fs.optim.fused_update_(opt, bad, s, p, impl=impl)
    assert bool(found)
    for k in p:
        assert torch.equal(p[k], snapshot[k])
    assert int(s_after[0].count) == 1 and int(s_after[-1].count) == 1  # not advanced
    # inv_scale multiplies the gradients on load: grads x 4 with inv_scale 1/4 = grads.
    u, s_ref = opt.update(grads, s_ref, ref)
    ref = fs.optim.apply_updates(ref, u)
    u, s_ref = opt.update(grads, s_ref, ref)
    ref = fs.optim.apply_updates(ref, u)
    big = {k: 4 * v for k, v in grads.items()}
    fs.optim.fused_update_(opt, big, s_after, p, inv_scale=0.25, impl=impl)
    for k in p:
        torch.testing.assert_close(p[k], ref[k], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_fused_check_finite_false_is_passed_through(name, impl):
    """check_finite=False reaches the kernel: a nan gradient is not detected, lands in the
    step (adamw: the weights; lion: the momentum) and the counters advance."""
    opt = OPTIMIZERS[name]()
    p = _params()
    s = opt.init(p)
    grads = {k: torch.ones_like(v) for k, v in p.items()}
    grads["b"][3] = float("nan")
    s, found = fs.optim.fused_update_(opt, grads, s, p, check_finite=False, impl=impl)
    assert not bool(found)
    hit = s[0].mu["b"] if name == "lion" else p["b"]
    assert hit[3].isnan() and int(hit.isnan().sum()) == 1
    assert int(s[-1].count) == 1


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad_leaf", ["w", "b"])  # in the decayed group, in the other
def test_fused_masked_skips_a_non_finite_step_in_either_group(bad_leaf, impl):
    """With a decay mask the leaves run as two kernel groups: a nan in either leaves every
    leaf and counter untouched (the check runs over both groups before either updates)."""
    opt = OPTIMIZERS["adamw-masked"]()
    p = _params()
    s = opt.init(p)
    s, _ = fs.optim.fused_update_(opt, {k: torch.ones_like(v) for k, v in p.items()}, s, p, impl=impl)
    snap = {k: v.clone() for k, v in p.items()}
    moments = [x.clone() for x in optree.tree_leaves(s)]
    bad = {k: torch.ones_like(v) for k, v in p.items()}
    bad[bad_leaf].view(-1)[0] = float("nan")
    s2, found = fs.optim.fused_update_(opt, bad, s, p, impl=impl)
    assert bool(found)
    for k in p:
        assert torch.equal(p[k], snap[k]), k
    for a, b in zip(optree.tree_leaves(s2), moments):
        assert torch.equal(a, b)


def test_fused_decay_flags_are_read_as_the_mask_reads_them():
    """``decay_flags``: the mask on the parameters given (the virtual step passes those of
    the logical leaves, its kernel runs on the tensors beneath the vmap levels)."""
    p = _params()
    assert fs.optim.decay_flags(fs.optim.adamw(1e-3, mask=fs.optim.decay_mask), p) == [False, False, True]  # b, s, w
    assert fs.optim.decay_flags(fs.optim.adamw(1e-3), p) is None
    opt = fs.optim.adamw(1e-3, mask=fs.optim.decay_mask)
    with pytest.raises(ValueError, match="2 decay flags, params 3"):
        fs.optim.fused_update_(opt, p, opt.init(p), p, decay=[True, False])


def test_fused_refuses_what_it_cannot_run():
    assert not fs.optim.has_fused(fs.optim.sgd(0.1))
    p = _params()
    sgd = fs.optim.sgd(0.1)
    with pytest.raises(ValueError, match="no fused form"):
        fs.optim.fused_update_(sgd, p, sgd.init(p), p)
    opt = fs.optim.adamw(1e-3)
    with pytest.raises(ValueError, match="grads has 2 leaves"):
        fs.optim.fused_update_(opt, {"w": p["w"], "b": p["b"]}, opt.init(p), p)

    def under_vmap(x):
        q = {"w": x}
        return fs.optim.fused_update_(opt, q, opt.init(q), q)[1]

    with pytest.raises(RuntimeError, match="torch.func"):
        torch.func.vmap(under_vmap)(torch.ones(2, 3))


def test_donated_train_step_runs_the_fused_kernel(monkeypatch):
    """train_step(donate=True) takes the fused path (counted), with the same losses as
    the functional path; clipping is applied as the kernel's inv_scale."""
    from fsharded.kernels import fused_optim

    calls = []
    real = fused_optim.fused_adamw_
    monkeypatch.setattr(fused_optim, "fused_adamw_", lambda *a, **k: calls.append(k) or real(*a, **k))
    params = gpt.init(T.CONFIG, 0)
    runs = {}
    for donate in (False, True):
        step = fs.train_step(gpt.loss, fs.optim.adamw(T.LR, weight_decay=T.WD), clip=0.05,
                             donate=donate)
        state = step.init(params)
        runs[donate] = []
        for b in T.batches(3):
            old = [x.clone() for x in optree.tree_leaves(state)]
            new, m = step(state, b)
            if not donate:  # the pure step runs the kernel on copies: the old state is intact
                assert all(torch.equal(a, b) for a, b in zip(old, optree.tree_leaves(state)))
            state = new
            runs[donate].append(float(m["loss"]))
        if donate:  # three calls each
            assert len(calls) == 6
            calls = calls[3:]
    assert len(calls) == 3 and all(c["inv_scale"] < 1.0 for c in calls)  # clip 0.05 binds
    # No inf/nan check in the kernel: the functional path does not skip either.
    assert all(c["check_finite"] is False for c in calls)
    torch.testing.assert_close(torch.tensor(runs[True]), torch.tensor(runs[False]), rtol=1e-5, atol=1e-5)
