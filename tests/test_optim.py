"""fsharded.optim: optimizers against torch.optim and written references, masks, schedules
(against formulas and DeepSpeed), mesh-aware clipping on the virtual mesh and on gloo,
gradient accumulation, and vmap-safety of every update."""

from __future__ import annotations

import math

import optree
import pytest
import torch

import fsharded as fs
from fsharded import P
from fsharded import optim as fo

DT = torch.float64
# float64 throughout: ours and torch.optim do the same arithmetic in a slightly different
# order, so 10 steps differ by a few ulps (~1e-15). 1e-10 is far above that and far below
# any semantic slip (a missing bias correction or decay term moves values by >1e-4).
TOL = dict(rtol=1e-10, atol=1e-10)


def make_params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=DT)  # noqa: E731
    return {
        "fc": {"w": r(4, 3), "b": r(3)},
        "ln_f": {"w": r(3), "b": r(3)},
        "emb": r(5, 3),
        "scale": r(()),
    }


def grad_seq(params: dict, steps: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [optree.tree_map(lambda p: torch.randn(p.shape, generator=g, dtype=DT), params)
            for _ in range(steps)]


def run_ours(opt, params, grads):
    state = opt.init(params)
    for g in grads:
        updates, state = opt.update(g, state, params)
        params = fo.apply_updates(params, updates)
    return params, state


def run_torch(make_opt, params, grads, lrs=None):
    leaves, treedef = optree.tree_flatten(params)
    ps = [p.clone().requires_grad_() for p in leaves]
    opt = make_opt(ps)
    for k, g in enumerate(grads):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[k]
        for p, gl in zip(ps, optree.tree_leaves(g)):
            p.grad = gl.clone()
        opt.step()
    return optree.tree_unflatten(treedef, [p.detach() for p in ps])


# -- against torch.optim -------------------------------------------------------------------

TORCH_CASES = {
    "adamw": (lambda: fo.adamw(1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "adamw_betas": (lambda: fo.adamw(3e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.0),
                    lambda ps: torch.optim.AdamW(ps, lr=3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)),
    "adam_l2": (lambda: fo.adam(1e-2, weight_decay=0.1),
                lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1)),
    "sgd": (lambda: fo.sgd(0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "sgd_momentum_dampening": (
        lambda: fo.sgd(0.1, momentum=0.9, dampening=0.3),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3)),
    "sgd_nesterov_wd": (
        lambda: fo.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.05),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05)),
    "adagrad": (
        lambda: fo.adagrad(0.1, lr_decay=0.05, weight_decay=0.05, initial_accumulator_value=0.1),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.05, weight_decay=0.05,
                                       initial_accumulator_value=0.1)),
}


@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_matches_torch_optim(name):
    ours, theirs = TORCH_CASES[name]
    params = make_params()
    grads = grad_seq(params, 10)
    got, _ = run_ours(ours(), params, grads)
    want = run_torch(theirs, params, grads)
    torch.testing.assert_close(got, want, **TOL)


def test_schedule_drives_the_step_count():
    """A scheduled adamw equals torch's AdamW with the group lr set to get_lr(opt, k)."""
    sched = fo.WarmupCosineLR(10, warmup_num_steps=3, warmup_type="linear", lr=0.05)
    opt = fo.adamw(sched, weight_decay=0.1)
    params = make_params()
    grads = grad_seq(params, 10)
    lrs = [float(fo.get_lr(opt, k)) for k in range(10)]
    assert lrs[0] == 0.0 and max(lrs) > 0.04
    got, state = run_ours(opt, params, grads)
    want = run_torch(lambda ps: torch.optim.AdamW(ps, lr=0.0, weight_decay=0.1), params, grads, lrs)
    torch.testing.assert_close(got, want, **TOL)
    assert int(state[-1].count) == 10


# -- lion and lamb against written references ----------------------------------------------


def lion_reference(params, grads, lr, b1, b2, wd, decay):
    """Chen et al. 2023, Alg. 2 (lucidrains/lion-pytorch): decay, signed step, momentum."""
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    for g in grads:
        for k in p:
            c = b1 * m[k] + (1 - b1) * g[k]
            if decay[k]:
                p[k] = p[k] * (1 - lr * wd)
            p[k] = p[k] - lr * torch.sign(c)
            m[k] = b2 * m[k] + (1 - b2) * g[k]
    return p


def lamb_reference(params, grads, lr, b1, b2, eps, wd):
    """You et al. 2019, Alg. 2 with bias correction, phi = identity, ratio 1 at zero norms."""
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    v = {k: torch.zeros_like(x) for k, x in params.items()}
    for t, g in enumerate(grads, start=1):
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            r = (m[k] / (1 - b1**t)) / ((v[k] / (1 - b2**t)).sqrt() + eps)
            u = r + wd * p[k]
            wn, un = p[k].norm(), u.norm()
            ratio = wn / un if (wn > 0 and un > 0) else 1.0
            p[k] = p[k] - lr * ratio * u
    return p


def flat_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    p = {"w": torch.randn(4, 3, generator=g, dtype=DT), "b": torch.randn(3, generator=g, dtype=DT),
         "z": torch.zeros(2, 2, dtype=DT)}  # a zero weight: LAMB's ratio falls back to 1
    return p


def test_lion_matches_reference():
    params = flat_params()
    grads = grad_seq(params, 10)
    opt = fo.lion(1e-2, b1=0.9, b2=0.99, weight_decay=0.5, mask=fo.decay_mask)
    got, _ = run_ours(opt, params, grads)
    want = lion_reference(params, grads, 1e-2, 0.9, 0.99, 0.5, decay={"w": True, "b": False, "z": True})
    torch.testing.assert_close(got, want, **TOL)


def test_lamb_matches_reference():
    params = flat_params()
    grads = grad_seq(params, 10)
    got, _ = run_ours(fo.lamb(1e-2, weight_decay=0.1), params, grads)
    want = lamb_reference(params, grads, 1e-2, 0.9, 0.999, 1e-6, 0.1)
    torch.testing.assert_close(got, want, **TOL)


# -- weight-decay masks ---------------------------------------------------------------------


def test_decay_mask_rule():
    params = {"blocks": [{"ln_1": {"w": torch.ones(3, 3)}, "attn": {"w": torch.ones(3, 3), "b": torch.ones(3)},
                          "post_ln": {"w": torch.ones(2, 2)}, "rmsnorm": {"g": torch.ones(2, 2)}}],
              "kiln": {"w": torch.ones(2, 2)}, "wte": torch.ones(5, 3), "scale": torch.ones(())}
    m = fo.decay_mask(params)
    assert m["blocks"][0] == {"ln_1": {"w": False}, "attn": {"w": True, "b": False},
                              "post_ln": {"w": False}, "rmsnorm": {"g": False}}
    assert m["kiln"]["w"] and m["wte"] and not m["scale"]
    assert not fo.decay_mask(params, no_decay=["wte"])["wte"]


@pytest.mark.parametrize("mask", ["rule", "tree", "prefix"])
def test_masked_leaves_are_not_decayed(mask):
    params = make_params()
    zero = [optree.tree_map(torch.zeros_like, params)] * 3  # adam's direction is 0: decay only
    lr, wd = 0.1, 0.5
    masks = {
        "rule": fo.decay_mask,
        "tree": {"fc": {"w": True, "b": False}, "ln_f": {"w": False, "b": False}, "emb": True, "scale": False},
        "prefix": {"fc": {"w": True, "b": False}, "ln_f": False, "emb": True, "scale": False},
    }
    got, _ = run_ours(fo.adamw(lr, weight_decay=wd, mask=masks[mask]), params, zero)
    f = (1 - lr * wd) ** 3
    torch.testing.assert_close(got["fc"]["w"], params["fc"]["w"] * f, **TOL)
    torch.testing.assert_close(got["emb"], params["emb"] * f, **TOL)
    torch.testing.assert_close(
        [got["fc"]["b"], got["ln_f"]["w"], got["ln_f"]["b"], got["scale"]],
        [params["fc"]["b"], params["ln_f"]["w"], params["ln_f"]["b"], params["scale"]], rtol=0, atol=0)


def test_bad_masks_are_errors():
    params = {"w": torch.ones(2, 2)}
    opt = fo.adamw(0.1, mask={"w": torch.tensor(True)})
    with pytest.raises(TypeError, match="Python bools"):
        opt.update(params, opt.init(params), params)
    opt = fo.adamw(0.1, mask={"v": True})
    with pytest.raises(ValueError, match="prefix"):
        opt.update(params, opt.init(params), params)
    with pytest.raises(ValueError, match="needs the parameters"):
        opt.update(params, opt.init(params))


# -- schedules ------------------------------------------------------------------------------


def test_schedule_values_follow_the_formulas():
    # step k runs at DeepSpeed's get_lr() for last_batch_iteration = k - 1.
    s = fo.WarmupLR(0.01, 0.1, 10, "log")
    assert float(s(0)) == 0.01 and float(s(1)) == 0.01  # constructor value, then log(1) = 0
    assert math.isclose(float(s(5)), 0.01 + 0.09 * math.log(5) / math.log(10), rel_tol=1e-14)
    assert float(s(10)) == pytest.approx(0.1, rel=1e-14) and float(s(500)) == 0.1
    s = fo.WarmupDecayLR(30, 0.0, 0.1, 10, "linear")
    assert math.isclose(float(s(4)), 0.1 * 3 / 10, rel_tol=1e-14)
    assert math.isclose(float(s(21)), 0.1 * (30 - 20) / 20, rel_tol=1e-14)
    assert float(s(31)) == 0.0 and float(s(1000)) == 0.0
    s = fo.WarmupCosineLR(110, warmup_min_ratio=0.1, warmup_num_steps=10, cos_min_ratio=0.01,
                          warmup_type="linear", lr=2.0)
    assert float(s(0)) == 0.0
    assert math.isclose(float(s(6)), 2.0 * (0.1 + 0.9 * 5 / 10), rel_tol=1e-14)
    assert math.isclose(float(s(60)), 2.0 * (0.01 + 0.99 * 0.5), rel_tol=1e-14)  # half-way
    assert math.isclose(float(s(500)), 2.0 * 0.01, rel_tol=1e-14)
    s = fo.OneCycle(0.1, 1.1, decay_lr_rate=0.5, cycle_first_step_size=10, cycle_second_step_size=5,
                    decay_step_size=2)
    assert math.isclose(float(s(5)), 0.6, rel_tol=1e-14)
    assert math.isclose(float(s(10)), 1.1, rel_tol=1e-14)
    assert math.isclose(float(s(13)), 0.5, rel_tol=1e-14)
    assert math.isclose(float(s(19)), 0.1 / (1 + 0.5 * 4 / 2), rel_tol=1e-14)
    stairs = fo.OneCycle(0.0, 1.0, cycle_first_step_size=4, cycle_first_stair_count=2)
    assert [float(stairs(k)) for k in range(9)] == [0.0, 0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0]
    assert float(fo.linear(1.0, 0.0, 4)(2)) == 0.5 and float(fo.linear(1.0, 0.0, 4)(9)) == 0.0
    assert float(fo.constant(0.3)(7)) == 0.3


ALL_SCHEDULES = [
    fo.constant(0.1), fo.linear(0.1, 0.0, 7),
    fo.WarmupLR(0.0, 0.1, 5), fo.WarmupDecayLR(20, 0.0, 0.1, 5, "linear"),
    fo.WarmupCosineLR(20, warmup_num_steps=5, lr=0.1),
    fo.OneCycle(0.01, 0.1, 0.2, 4, 6, 2, 1, 3),
]


@pytest.mark.parametrize("sched", ALL_SCHEDULES, ids=lambda s: type(s).__name__)
def test_schedules_are_tensor_functions(sched):
    """int and tensor steps agree; a vector of steps and vmap over steps give the same rates;
    the result is a 0-d float64 tensor."""
    steps = torch.arange(25)
    ints = torch.stack([sched(k) for k in range(25)])
    assert sched(3).shape == () and sched(3).dtype == DT
    torch.testing.assert_close(sched(steps), ints, rtol=0, atol=0)
    torch.testing.assert_close(torch.func.vmap(sched)(steps), ints, rtol=0, atol=0)


def test_schedule_arguments_are_validated():
    with pytest.raises(ValueError, match="lr="):
        fo.WarmupCosineLR(100)
    with pytest.raises(ValueError, match="warmup_type"):
        fo.WarmupLR(warmup_type="cos")
    with pytest.raises(ValueError, match="warmup_num_steps"):
        fo.WarmupDecayLR(100, warmup_num_steps=0)
    with pytest.raises(ValueError, match="cycle_first_step_size"):
        fo.OneCycle(0.1, 1.0, cycle_first_step_size=0)
    with pytest.raises(TypeError, match="integer"):
        fo.WarmupLR()(torch.tensor(1.5))


def test_schedules_match_deepspeed(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # no accelerator probing on import
    L = pytest.importorskip("deepspeed.runtime.lr_schedules")
    cases = [
        (lambda o: L.WarmupLR(o, 0.01, 0.5, 7, "log"), fo.WarmupLR(0.01, 0.5, 7, "log"), 1.0),
        (lambda o: L.WarmupLR(o, 0.01, 0.5, 1, "linear"), fo.WarmupLR(0.01, 0.5, 1, "linear"), 1.0),
        (lambda o: L.WarmupDecayLR(o, 20, 0.01, 0.5, 7, "log"), fo.WarmupDecayLR(20, 0.01, 0.5, 7, "log"), 1.0),
        (lambda o: L.WarmupDecayLR(o, 20, 0.0, 0.5, 7, "linear"),
         fo.WarmupDecayLR(20, 0.0, 0.5, 7, "linear"), 1.0),
        (lambda o: L.WarmupCosineLR(o, 20, 0.1, 5, 0.01, "linear"),
         fo.WarmupCosineLR(20, 0.1, 5, 0.01, "linear", lr=0.3), 0.3),
        (lambda o: L.WarmupCosineLR(o, 25, 0.0, 4, 0.001, "log"),
         fo.WarmupCosineLR(25, 0.0, 4, 0.001, "log", lr=0.3), 0.3),
        (lambda o: L.OneCycle(o, 0.01, 0.5, 0.3, 4, 6, 0, None, 3, cycle_momentum=False),
         fo.OneCycle(0.01, 0.5, 0.3, 4, 6, 0, None, 3), 1.0),
        (lambda o: L.OneCycle(o, 0.01, 0.5, 0.3, 5, 3, 2, 3, 2, cycle_momentum=False),
         fo.OneCycle(0.01, 0.5, 0.3, 5, 3, 2, 3, 2), 1.0),
    ]
    for make_ds, ours, base_lr in cases:
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=base_lr)
        ds = make_ds(opt)
        want = []
        for _ in range(30):  # as DeepSpeed's engine: optimizer.step() with the group lr, then
            want.append(opt.param_groups[0]["lr"])  # lr_scheduler.step()
            ds.step()
        got = ours(torch.arange(30))
        torch.testing.assert_close(got, torch.tensor(want, dtype=DT), rtol=1e-14, atol=1e-15,
                                   msg=lambda m, s=ours: f"{s}: {m}")


def test_get_lr():
    sched = fo.WarmupLR(0.0, 1.0, 4, "linear")
    assert float(fo.get_lr(fo.adamw(sched), 3)) == float(sched(3))
    assert float(fo.get_lr(fo.chain(fo.clip_by_global_norm(1.0), fo.lion(sched)), 3)) == float(sched(3))
    assert float(fo.get_lr(fo.MultiSteps(fo.sgd(0.5), 4), 10)) == 0.5
    assert math.isclose(float(fo.get_lr(fo.adagrad(0.1, lr_decay=0.5), 2)), 0.1 / 2)
    assert float(fo.get_lr(0.25, 9)) == 0.25
    with pytest.raises(ValueError, match="carries no learning rate"):
        fo.get_lr(fo.chain(fo.sgd(0.1), fo.sgd(0.2)), 0)
    init, update = fo.adamw(0.1)  # still the (init, update) pair
    assert isinstance(fo.adamw(0.1), fo.GradientTransformation)


# -- clipping and mesh-aware norms ------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_matches_torch(max_norm):
    grads = grad_seq(make_params(), 1)[0]
    tx = fo.clip_by_global_norm(max_norm)
    got, state = tx.update(grads, tx.init(None))
    ps = [torch.zeros_like(g, requires_grad=True) for g in optree.tree_leaves(grads)]
    for p, g in zip(ps, optree.tree_leaves(grads)):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(ps, max_norm)
    torch.testing.assert_close(optree.tree_leaves(got), [p.grad for p in ps], **TOL)
    torch.testing.assert_close(state.norm, norm.float())


SHARD_SPECS = {"a": P(None, "tensor"), "b": P(("data", "tensor")), "c": P()}


def shard_tree(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(4, 6, generator=g, dtype=DT), "b": torch.randn(8, generator=g, dtype=DT),
            "c": torch.randn(3, generator=g, dtype=DT)}


def clip_and_lamb_sharded(mesh, specs, params, grads):
    """Norm, clipped grads and two LAMB updates, computed on shards inside shard_map."""
    tx = fo.clip_by_global_norm(0.5, specs=specs)
    opt = fo.lamb(1e-2, weight_decay=0.1, specs=specs)

    def body(p, g):
        clipped, _ = tx.update(g, tx.init(p), p)
        state = opt.init(p)
        for _ in range(2):
            u, state = opt.update(g, state, p)
            p = fo.apply_updates(p, u)
        return fo.global_norm(g, specs), clipped, p

    sm = fs.shard_map(body, mesh=mesh, in_specs=(specs, specs), out_specs=(P(), specs, specs),
                      check_rep=True)
    return sm(params, grads)


def clip_and_lamb_unsharded(params, grads):
    tx, opt = fo.clip_by_global_norm(0.5), fo.lamb(1e-2, weight_decay=0.1)
    clipped, _ = tx.update(grads, tx.init(params))
    p, _ = run_ours(opt, params, [grads, grads])
    return fo.global_norm(grads), clipped, p


def test_norms_and_lamb_inside_shard_map_equal_unsharded():
    mesh = fs.Mesh({"data": 2, "tensor": 2})
    params, grads = shard_tree(0), shard_tree(1)
    got = clip_and_lamb_sharded(mesh, SHARD_SPECS, params, grads)
    want = clip_and_lamb_unsharded(params, grads)
    torch.testing.assert_close(got, want, **TOL)
    # Without specs each shard sees only its local norm: a value that varies over the
    # mesh, which out_specs=P() refuses; unchecked, it is a different number.
    with pytest.raises(ValueError, match=r"varies over \['data', 'tensor'\]"):
        fs.shard_map(lambda g: fo.global_norm(g), mesh=mesh, in_specs=(SHARD_SPECS,), out_specs=P())(grads)
    bad = fs.shard_map(lambda g: fo.global_norm(g), mesh=mesh, in_specs=(SHARD_SPECS,), out_specs=P(),
                       check_vma=False)
    assert not torch.allclose(bad(grads), want[0])


GLOO_SPECS = {"a": P(None, "data"), "b": P("data"), "c": P()}


def gloo_case():
    """Run on 2 gloo ranks by run_on_ranks: the same sharded computation, distributed."""
    return clip_and_lamb_sharded(fs.Mesh({"data": 2}), GLOO_SPECS, shard_tree(0), shard_tree(1))


@pytest.mark.multiprocess
def test_norms_and_lamb_on_gloo_ranks():
    from fsharded.testing import run_on_ranks

    want = clip_and_lamb_unsharded(shard_tree(0), shard_tree(1))
    for got in run_on_ranks(gloo_case, 2):
        torch.testing.assert_close(got, want, **TOL)


# -- accumulation ---------------------------------------------------------------------------


def test_multisteps_equals_one_step_on_the_mean():
    k = 3
    params = make_params()
    micro = grad_seq(params, 2 * k)
    inner = fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(fo.linear(0.1, 0.0, 10), weight_decay=0.1))
    opt = fo.MultiSteps(inner, every_k=k)
    p, state = params, opt.init(params)
    for i, g in enumerate(micro):
        u, state = opt.update(g, state, p)
        if (i + 1) % k:
            assert all(bool((x == 0).all()) for x in optree.tree_leaves(u))
        p = fo.apply_updates(p, u)
    means = [optree.tree_map(lambda *gs: sum(gs) / k, *micro[j:j + k]) for j in (0, k)]
    want, want_state = run_ours(inner, params, means)
    torch.testing.assert_close(p, want, **TOL)
    torch.testing.assert_close(state.inner_state, want_state, **TOL)
    assert int(state.gradient_step) == 2 and int(state.mini_step) == 0
    assert fo.get_lr(opt, 1) == fo.get_lr(inner, 1)


# -- vmap-safety and state specs -------------------------------------------------------------

VMAP_OPTS = {
    "adamw_sched": lambda: fo.adamw(fo.WarmupCosineLR(10, warmup_num_steps=2, lr=0.1), mask=fo.decay_mask),
    "sgd_nesterov": lambda: fo.sgd(fo.OneCycle(0.01, 0.1, cycle_first_step_size=2), momentum=0.9, nesterov=True),
    "lion": lambda: fo.lion(fo.WarmupDecayLR(10, 0.0, 0.1, 2), weight_decay=0.1),
    "adagrad": lambda: fo.adagrad(0.1, lr_decay=0.1),
    "lamb_clip": lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.lamb(fo.WarmupLR(0.0, 0.1, 3))),
    "multisteps": lambda: fo.MultiSteps(fo.adam(0.1, weight_decay=0.1), every_k=2),
}


@pytest.mark.parametrize("name", list(VMAP_OPTS))
def test_updates_run_under_vmap(name):
    """vmap over a stacked leading dim equals a loop over the slices (three steps)."""
    opt = VMAP_OPTS[name]()
    n = 3
    params = [flat_params(s) for s in range(n)]
    grads = [grad_seq(p, 3, seed=10 + i) for i, p in enumerate(params)]
    stack = lambda trees: optree.tree_map(lambda *xs: torch.stack(xs), *trees)  # noqa: E731

    def step(g, s, p):
        u, s = opt.update(g, s, p)
        return fo.apply_updates(p, u), s

    vp, vs = stack(params), torch.func.vmap(opt.init)(stack(params))
    for t in range(3):
        vp, vs = torch.func.vmap(step)(stack([g[t] for g in grads]), vs, vp)
    want = [run_ours(opt, params[i], grads[i])[0] for i in range(n)]
    torch.testing.assert_close(vp, stack(want), **TOL)


def test_state_specs():
    params = {"w": torch.zeros(4, 2), "b": torch.zeros(2)}
    specs = {"w": P("data", None), "b": P()}
    opt = fo.MultiSteps(fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(0.1)), 2)
    ss = fo.state_specs(opt.init(params), params, specs)
    assert ss.mini_step == P() and ss.acc_grads == specs
    clip_s, (adam_s, _, lr_s) = ss.inner_state
    assert clip_s.norm == P() and adam_s.mu == specs and adam_s.nu == specs
    assert adam_s.count == P() and lr_s.count == P()


def test_hyper_parameters_are_checked_at_construction():
    nan, inf = float("nan"), float("inf")
    cases = [
        (lambda: fs.optim.adamw(nan), r"lr must be a finite number >= 0, got nan"),
        (lambda: fs.optim.adamw(-1.0), r"lr must be a finite number >= 0, got -1\.0"),
        (lambda: fs.optim.adam(1e-3, b1=1.0), r"b1 must be a finite number in \[0, 1\), got 1\.0"),
        (lambda: fs.optim.adamw(1e-3, b2=nan), r"b2 must be a finite number in \[0, 1\)"),
        (lambda: fs.optim.adamw(1e-3, eps=-1e-8), r"eps must be a finite number >= 0"),
        (lambda: fs.optim.adamw(1e-3, weight_decay=inf), r"weight_decay must be a finite number >= 0, got inf"),
        (lambda: fs.optim.lion(1e-4, b1=-0.1), r"scale_by_lion: b1"),
        (lambda: fs.optim.sgd(0.1, momentum=nan), r"sgd: momentum must be a finite number >= 0"),
        (lambda: fs.optim.sgd(0.1, momentum=0.9, dampening=2.0), r"sgd: dampening must be a finite number in \[0, 1\]"),
        (lambda: fs.optim.lamb(1e-3, eps=nan), r"eps must be a finite number"),
    ]
    for make, match in cases:
        with pytest.raises(ValueError, match=match):
            make()
    with pytest.raises(TypeError, match="lr must be a float or a schedule"):
        fs.optim.adamw(True)
    fs.optim.adamw(0.0), fs.optim.sgd(1, momentum=0.9, dampening=1.0)  # edges that torch.optim takes too
