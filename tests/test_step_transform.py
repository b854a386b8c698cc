"""The gradient transformation between a step's gradients and its update
(``step._transform``) on its own: unscale, the parameters' dtypes, the mesh-aware norm (one
reduction per set of axes), the clipping factor the update consumes (the fused kernels as
their ``inv_scale``), fp16's verdict; and the step's clipping against the optimizer chain's
``clip_by_global_norm``."""

from __future__ import annotations

import math

import optree
import pytest
import torch

import fsharded as fs
from fsharded import P
from fsharded.precision import DynamicLossScale
from fsharded.step._scaling import DynamicScaling, NoScaling
from fsharded.step._transform import ClipByGlobalNorm, GradientTransform, NoClip
from fsharded.step._update import CopiedFusedUpdate, FusedUpdate, PureUpdate


def _tree():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}


def test_clip_pieces():
    assert NoClip().factor(torch.tensor(3.0)) is None
    clip = ClipByGlobalNorm(1.0)
    assert float(clip.factor(torch.tensor(0.5))) == 1.0  # below the max: untouched
    assert float(clip.factor(torch.tensor(4.0))) == pytest.approx(1.0 / (4.0 + 1e-6), rel=1e-7)
    with pytest.raises(ValueError, match="clip must be a positive max norm or None, got 0"):
        ClipByGlobalNorm(0)
    with pytest.raises(ValueError, match="clip must be a positive max norm or None, got -1"):
        fs.train_step(lambda p, b: p["w"].sum(), fs.optim.sgd(0.1), clip=-1)


def test_transform_unscales_casts_and_measures():
    grads = {k: v.to(torch.bfloat16) for k, v in _tree().items()}
    params = optree.tree_map(lambda g: torch.zeros(g.shape), grads)  # fp32 masters
    t = GradientTransform(NoScaling(), ClipByGlobalNorm(0.5), [P(), P()], ())(grads, params, None)
    assert all(g.dtype == torch.float32 for g in t.grads.values())
    full = torch.cat([g.float().reshape(-1) for g in grads.values()]).norm()
    torch.testing.assert_close(t.norm, full)
    torch.testing.assert_close(t.factor, torch.clamp(0.5 / (full + 1e-6), max=1.0))
    assert t.finite is None
    # The transformation hands the factor on; it does not multiply the gradients itself.
    assert all(torch.equal(a, b.float()) for a, b in zip(t.grads.values(), grads.values()))


def test_fp16_transform_unscales_and_agrees_on_overflow():
    scaler = DynamicLossScale(initial_scale_power=4)
    state = scaler.init()
    grads = {k: (v * 16).half() for k, v in _tree().items()}
    params = optree.tree_map(lambda g: torch.zeros(g.shape), grads)
    tx = GradientTransform(DynamicScaling(scaler), NoClip(), [P(), P()], ())
    t = tx(grads, params, state)
    ref = _tree()
    for k in ref:  # exact: the scale is a power of two
        torch.testing.assert_close(t.grads[k], (ref[k] * 16).half().float() / 16, rtol=0, atol=0)
    assert bool(t.finite) and t.factor is None
    grads["b"][0] = math.inf
    assert not bool(tx(grads, params, state).finite)


def test_the_norm_is_mesh_aware_and_one_reduction():
    """Leaves sharded over data and replicated: every element counted once, one psum."""
    mesh = fs.Mesh({"data": 2, "tensor": 2})
    tree = {"a": torch.randn(4, 3), "b": torch.randn(6), "c": torch.randn(2)}
    specs = {"a": P("data"), "b": P("data"), "c": P()}
    flat = [specs[k] for k in sorted(tree)]
    tx = GradientTransform(NoScaling(), ClipByGlobalNorm(1.0), flat, mesh.axis_names)

    def body(g):
        t = tx(g, g, None)
        return t.norm, t.factor

    sm = fs.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(P(), P()))
    norm, factor = sm(tree)
    full = torch.cat([v.reshape(-1) for v in tree.values()]).norm()
    torch.testing.assert_close(norm, full)
    torch.testing.assert_close(factor, torch.clamp(1.0 / (full + 1e-6), max=1.0))
    assert [op for op, _ in sm.collectives(tree).ops()] == ["psum"]


def test_the_updates_consume_the_factor():
    """The functional form multiplies by it; the fused kernels take it as inv_scale, on the
    gradients as the transformation handed them (no pass of their own)."""
    opt = fs.optim.adamw(0.1)
    params, grads = _tree(), optree.tree_map(lambda x: 3 * x, _tree())
    t = GradientTransform(NoScaling(), ClipByGlobalNorm(1.0), [P(), P()], ())(grads, params, None)
    chain = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), opt)
    upd, _ = chain.update(grads, chain.init(params), params)
    want = fs.optim.apply_updates(params, upd)
    got, _ = PureUpdate(opt, eager=True)(t.grads, t.factor, opt.init(params), params)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
    seen = []
    real = fs.optim.fused_update_

    def spy(optimizer, g, state, p, *, inv_scale, check_finite):
        seen.append((inv_scale, [id(x) for x in optree.tree_leaves(g)]))
        return real(optimizer, g, state, p, inv_scale=inv_scale, check_finite=check_finite)

    for update in (CopiedFusedUpdate(opt, eager=True), FusedUpdate(opt, eager=True)):
        p = optree.tree_map(torch.clone, params)
        fs.optim.fused_update_ = spy
        try:
            got, _ = update(t.grads, t.factor, opt.init(p), p)
        finally:
            fs.optim.fused_update_ = real
        for k in want:  # the kernel's order of operations: rounding apart
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
        inv_scale, ids = seen.pop()
        assert inv_scale is t.factor and ids == [id(x) for x in optree.tree_leaves(t.grads)]


@pytest.mark.parametrize("mesh,donate", [({"data": 2}, False), ({"data": 2}, True), ({"data": 1}, True)])
def test_step_clipping_equals_clip_by_global_norm_in_the_chain(mesh, donate):
    """train_step(clip=c) against the optimizer chain's clip_by_global_norm(c): the same
    trajectory and the same metrics (the norm reported is the unclipped one either way)."""
    def loss(p, b):
        return ((b @ p["w"]).tanh().sum(-1) + p["b"].sum()).pow(2).mean()

    params = {"w": torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), "b": torch.ones(3)}
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    out = []
    for opt, clip in ((fs.optim.sgd(0.5), 0.1), (fs.optim.chain(fs.optim.clip_by_global_norm(0.1),
                                                                    fs.optim.sgd(0.5)), None)):
        step = fs.train_step(loss, opt, mesh=fs.Mesh(mesh), param_specs=P(), batch_spec=P("data"),
                             clip=clip, donate=donate)
        state = step.init({k: v.clone() for k, v in params.items()})
        norms = []
        for _ in range(3):
            state, m = step(state, x)
            norms.append(float(m["grad_norm"]))
        out.append((step.params(state), norms))
    (p1, n1), (p2, n2) = out
    assert n1 == pytest.approx(n2, rel=1e-6) and n1[0] > 0.1  # clipped: the norm is above the max
    for k in p1:
        torch.testing.assert_close(p1[k], p2[k], rtol=1e-6, atol=1e-7)
