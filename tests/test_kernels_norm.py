"""norm: Triton LayerNorm / RMSNorm (interpreter on CPU) against the pure-torch references,
forward and backward, under grad / vmap / make_fx, and as custom ops (opcheck).

Tolerances: fp32 — both sides compute fp32 statistics over 33 columns in different orders
and dx subtracts row means, so results agree to a few fp32 ulps: atol=rtol=1e-5. bf16 — the
math is fp32 on both sides and only the final cast to bf16 differs (the reference rounds to
nearest; the interpreter truncates), i.e. at most one bf16 ulp, 2**-7 relative at the top of a
binade: rtol=1.6e-2 (torch's bf16 default) with atol=1e-2 for values near zero.
"""

import functools

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fsharded.kernels import norm
from fsharded.kernels.norm import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float64: dict(atol=1e-12, rtol=1e-12),
}
SHAPE = (2, 16, 33)  # 32 rows; N=33 is not a power of two (masked columns)


def _inputs(dtype=torch.float32, wdtype=torch.float32, shape=SHAPE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = (torch.randn(shape, generator=gen) * 3 + 1).to(dtype)
    w = (1 + 0.5 * torch.randn(n, generator=gen)).to(wdtype)
    b = torch.randn(n, generator=gen).to(wdtype)
    dy = torch.randn(shape, generator=gen).to(dtype)
    return x, w, b, dy


def _fwd_bwd(fn, x, params, dy, **kw):
    leaves = [t.detach().requires_grad_() for t in (x, *params) if t is not None]
    it = iter(leaves)
    args = [next(it) if t is not None else None for t in (x, *params)]
    y = fn(*args, **kw)
    grads = torch.autograd.grad(y, leaves, dy)
    return [y, *grads]


CASES = [
    ("layer", (True, True)),
    ("layer", (True, False)),
    ("layer", (False, False)),
    ("rms", (True,)),
    ("rms", (False,)),
]


@pytest.mark.parametrize("kind,affine", CASES)
@pytest.mark.parametrize(
    "dtype,wdtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_forward_backward_match_reference(kind, affine, dtype, wdtype):
    x, w, b, dy = _inputs(dtype, wdtype)
    params = [t if on else None for t, on in zip((w, b), affine)]
    fn = layer_norm if kind == "layer" else rms_norm
    got = _fwd_bwd(fn, x, params, dy, impl="triton")
    want = _fwd_bwd(fn, x, params, dy, impl="reference")
    assert got[0].dtype == dtype  # output in x's dtype; grads in their leaf's dtype
    assert [g.dtype for g in got] == [g.dtype for g in want]
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, **TOL[dtype])


def test_references_match_torch_modules():
    x, w, b, _ = _inputs()
    ln = torch.nn.LayerNorm(33, eps=1e-5)
    rms = torch.nn.RMSNorm(33, eps=1e-6)
    with torch.no_grad():
        ln.weight.copy_(w), ln.bias.copy_(b), rms.weight.copy_(w)
    torch.testing.assert_close(layer_norm_reference(x, w, b), ln(x))
    torch.testing.assert_close(rms_norm_reference(x, w), rms(x))


def test_gradcheck_fp64():
    x, w, b, _ = _inputs(torch.float64, torch.float64, shape=(2, 3, 5))
    args = [t.requires_grad_() for t in (x, w, b)]
    assert torch.autograd.gradcheck(lambda *a: layer_norm(*a, impl="triton"), args)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, impl="triton"), args[:2])


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_vmap(kind):
    fn, ref = (
        (layer_norm, layer_norm_reference) if kind == "layer" else (rms_norm, rms_norm_reference)
    )
    x, w, b, _ = _inputs()
    params = (w, b) if kind == "layer" else (w,)
    tri = functools.partial(fn, impl="triton")
    # vmapped dim not in front, shared parameters: folded into the kernel's rows
    got = torch.vmap(tri, in_dims=(1,) + (None,) * len(params))(x, *params)
    torch.testing.assert_close(got, ref(x.movedim(1, 0), *params), **TOL[torch.float32])
    # per-sample parameters: the documented reference fallback, same numbers
    ws = torch.stack([w, 2 * w])
    batched = (ws, torch.stack([b, -b])) if kind == "layer" else (ws,)
    got = torch.vmap(tri)(x, *batched)
    want = torch.stack([ref(x[i], *(p[i] for p in batched)) for i in range(2)])
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_per_sample_grads_vmap_of_grad(kind):
    """vmap(grad): the backward op's vmap rule gives one dweight per sample (row groups),
    also nested (vmap of vmap multiplies the groups)."""
    fn, ref = (
        (layer_norm, layer_norm_reference) if kind == "layer" else (rms_norm, rms_norm_reference)
    )
    x, w, b, dy = _inputs(shape=(2, 3, 4, 9))
    params = (w, b) if kind == "layer" else (w,)
    argnums = tuple(range(1 + len(params)))

    def loss(f):
        return lambda x, *rest: (f(x, *rest[:-1]) * rest[-1]).sum()  # rest = (*params, dy)

    tri = loss(functools.partial(fn, impl="triton"))
    nones = (None,) * len(params)
    got = torch.vmap(
        torch.vmap(torch.func.grad(tri, argnums), in_dims=(0, *nones, 0)), in_dims=(0, *nones, 0)
    )(x, *params, dy)
    want = torch.vmap(
        torch.vmap(torch.func.grad(loss(ref), argnums), in_dims=(0, *nones, 0)),
        in_dims=(0, *nones, 0),
    )(x, *params, dy)
    assert got[1].shape == (2, 3, 9)
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, **TOL[torch.float32])
    # per-sample weights with vmap(grad): backward falls back to the reference, same numbers
    ws = torch.stack([w, 2 * w])
    g1 = torch.vmap(torch.func.grad(tri, argnums=1), in_dims=(0, 0, *nones[1:], 0))(
        x, ws, *params[1:], dy
    )
    g2 = torch.vmap(torch.func.grad(loss(ref), argnums=1), in_dims=(0, 0, *nones[1:], 0))(
        x, ws, *params[1:], dy
    )
    torch.testing.assert_close(g1, g2, **TOL[torch.float32])


def test_make_fx_traces_the_ops():
    x, w, b, dy = _inputs(shape=(4, 8))

    def f(x, w, b):
        return torch.func.grad(
            lambda x, w, b: (layer_norm(x, w, b, impl="triton") * dy).sum(), (0, 1, 2)
        )(x, w, b)

    gm = make_fx(f)(x, w, b)
    code = gm.code
    assert "fsharded.layer_norm.default" in code and "fsharded.layer_norm_backward" in code
    for a, r in zip(gm(x, w, b), f(x, w, b)):
        torch.testing.assert_close(a, r)
    gm = make_fx(lambda x, w: rms_norm(x, w, impl="triton"))(x, w)
    assert "fsharded.rms_norm.default" in gm.code
    torch.testing.assert_close(gm(x, w), rms_norm_reference(x, w), **TOL[torch.float32])


def test_opcheck():
    x, w, b, dy = _inputs(shape=(2, 3, 10))
    rg = [t.clone().requires_grad_() for t in (x, w, b)]
    ops = torch.ops.fsharded
    torch.library.opcheck(ops.layer_norm.default, (*rg, 1e-5))
    torch.library.opcheck(ops.layer_norm.default, (x, None, None, 1e-5))
    torch.library.opcheck(ops.rms_norm.default, (rg[0], rg[1], 1e-6))
    torch.library.opcheck(ops.layer_norm_backward.default, (dy, x, w, 1e-5, True, 2))
    torch.library.opcheck(ops.layer_norm_backward.default, (dy, x, None, 1e-5, False, 1))
    torch.library.opcheck(ops.rms_norm_backward.default, (dy, x, w, 1e-6, 3))


def test_backward_op_groups_sum_per_group():
    x, w, b, dy = _inputs(shape=(6, 7))
    dx, dw, db = torch.ops.fsharded.layer_norm_backward(dy, x, w, 1e-5, True, 3)
    ref = norm._backward_reference(dy, x, w, eps=1e-5, rms=False, need_db=True, groups=3)
    assert dw.shape == db.shape == (3, 7)
    for a, r in zip((dx, dw, db), ref):
        torch.testing.assert_close(a, r, **TOL[torch.float32])
    torch.testing.assert_close(db, dy.view(3, 2, 7).sum(1))


def test_no_rows_and_double_backward_error():
    x, w, b, _ = _inputs(shape=(0, 5))
    y, gx, gw, gb = _fwd_bwd(layer_norm, x, (w, b), torch.zeros(0, 5), impl="triton")
    assert y.shape == gx.shape == (0, 5) and not gw.any() and not gb.any()
    # Higher-order derivatives through the Triton path fail loudly (never silent zeros).
    x, w, _, _ = _inputs(shape=(3, 5))

    def f(x):
        return rms_norm(x, w, impl="triton").pow(2).sum()

    with pytest.raises(NotImplementedError, match="double backward.*impl='reference'"):
        torch.func.grad(lambda x: torch.func.grad(f)(x).sum())(x)


def test_bad_inputs(monkeypatch):
    x, w, b, _ = _inputs(shape=(2, 8))
    with pytest.raises(ValueError, match=r"weight has shape \(7,\) but x \(2, 8\) has last dim 8"):
        layer_norm(x, w[:7], impl="triton")
    with pytest.raises(ValueError, match=r"bias has shape \(9,\)"):
        layer_norm(x, w, torch.zeros(9))
    with pytest.raises(TypeError, match="x has dtype torch.int64.*float\\(\\)"):
        rms_norm(torch.ones(2, 8, dtype=torch.long), impl="triton")
    with pytest.raises(TypeError, match="weight must be a floating tensor"):
        rms_norm(x, torch.ones(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="last dim >= 1"):
        layer_norm(torch.ones(3, 0))
    wide = torch.randn(1, norm.MAX_HIDDEN + 1)
    with pytest.raises(ValueError, match="exceeds the Triton kernel's maximum MAX_HIDDEN=16384"):
        layer_norm(wide, impl="triton")
    with pytest.raises(ValueError, match="MAX_HIDDEN"):
        torch.ops.fsharded.rms_norm(wide, None, 1e-6)
    # auto choice on a device where Triton would run: falls back to the reference
    monkeypatch.setattr(norm, "choose", lambda *a, **k: "triton")
    torch.testing.assert_close(rms_norm(wide), rms_norm_reference(wide))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("n", [128, 4096, 5120, 16384])
def test_cuda_matches_reference(n):
    x, w, b, dy = (t.cuda() for t in _inputs(torch.bfloat16, torch.float32, shape=(3, 700, n)))
    for fn, params in ((layer_norm, (w, b)), (rms_norm, (w,))):
        got = _fwd_bwd(fn, x, params, dy, impl="triton")
        want = _fwd_bwd(fn, x, params, dy, impl="reference")
        for a, r in zip(got, want):
            # dweight sums 2100 rows: fp32 partial sums in a different order
            torch.testing.assert_close(a, r, atol=2e-2, rtol=1.6e-2)
