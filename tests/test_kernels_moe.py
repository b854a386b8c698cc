"""moe kernels: permute / unpermute / grouped_matmul — the references against plain Python
loops (forward, gradients, gradcheck in float64), the Triton kernels (interpreter on CPU,
tiny shapes) against the references, torch.func grad / vmap through both, the custom-op
rules, and bad-input errors.

Tolerances: float64 loops vs references — the same products summed in the same or a
different order, ~1e-15 relative: atol=rtol=1e-12. fp32 Triton vs reference — permute and
unpermute move rows and sum at most a few products per token in fp32 (the same order as
index_add), so a few ulps: atol=rtol=1e-5; grouped_matmul accumulates up to d_in=32 products
per output in tile order against torch's matmul order (exact fp32, precision "highest"), and
dw sums up to 24 rows: atol=rtol=1e-4.
"""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fsharded.kernels import moe
from fsharded.kernels._dispatch import triton_available
from fsharded.kernels.moe import (
    grouped_matmul,
    grouped_matmul_reference,
    permute,
    permute_reference,
    unpermute,
    unpermute_reference,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not triton_available(DEV), reason="Triton missing (or no GPU and TRITON_INTERPRET unset)"
)
F64 = dict(atol=1e-12, rtol=1e-12)
ROWS = dict(atol=1e-5, rtol=1e-5)
MM = dict(atol=1e-4, rtol=1e-4)

# Group sizes (sum 24): empty groups first / inside / last, a group smaller than the
# interpreter's 16-row tile, tiles straddling 2 and 3 groups.
OFFSETS = [[0, 0, 5, 19, 24], [0, 3, 3, 24, 24], [0, 24, 24, 24, 24], [0, 1, 2, 3, 24]]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _routing(T, k, seed=0, device="cpu"):
    """MoE-like indices: k choices per token, sorted by a random expert id (order % T)."""
    g = _gen(seed)
    experts = torch.randint(0, 4, (k * T,), generator=g)
    order = torch.argsort(experts, stable=True)
    return (order % T).to(device)


def _rand(*shape, seed=0, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64).to(device, dtype)


# ------------------------------------------------------------------------- plain loops


def _loop_permute(x, indices):
    return torch.stack([x[int(i)] for i in indices]) if len(indices) else x[:0]


def _loop_unpermute(y, indices, weights, T):
    rows = [torch.zeros_like(y[0]) for _ in range(T)]
    for n, t in enumerate(indices.tolist()):
        rows[t] = rows[t] + (y[n] if weights is None else weights[n] * y[n])
    return torch.stack(rows)


def _loop_gmm(x, w, offsets):
    b = offsets.tolist()
    out = []
    for n in range(x.shape[0]):
        e = max(i for i in range(w.shape[0]) if b[i] <= n < b[i + 1])
        out.append(x[n] @ w[e])
    return torch.stack(out)


def _grads(fn, inputs, cot):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, cot)]


# ------------------------------------------------------------------------- references


def test_references_match_loops_fp64(monkeypatch):
    T, d, k = 7, 5, 3
    idx = _routing(T, k)
    x = _rand(T, d, dtype=torch.float64)
    y = _rand(k * T, d, seed=1, dtype=torch.float64)
    w = _rand(k * T, seed=2, dtype=torch.float64)
    cot_p = _rand(k * T, d, seed=3, dtype=torch.float64)
    got = _grads(lambda x: permute_reference(x, idx), [x], cot_p)
    want = _grads(lambda x: _loop_permute(x, idx), [x], cot_p)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **F64)
    cot_u = _rand(T, d, seed=4, dtype=torch.float64)
    for weights in (w, None):
        ins = [y] if weights is None else [y, weights]

        def ref(y, *ws):
            return unpermute_reference(y, idx, ws[0] if ws else None, T)

        def loop(y, *ws):
            return _loop_unpermute(y, idx, ws[0] if ws else None, T)

        for a, b in zip(_grads(ref, ins, cot_u), _grads(loop, ins, cot_u)):
            torch.testing.assert_close(a, b, **F64)
    # a token no row maps to stays zero
    assert not unpermute_reference(y[:2], torch.tensor([0, 0]), None, 3)[1:].any()

    N, din, dout = 24, 6, 4
    xg = _rand(N, din, seed=5, dtype=torch.float64)
    wg = _rand(4, din, dout, seed=6, dtype=torch.float64)
    cot_g = _rand(N, dout, seed=7, dtype=torch.float64)
    results = []
    for offs in OFFSETS:
        o = torch.tensor(offs)
        got = _grads(lambda x, w, o=o: grouped_matmul_reference(x, w, o), [xg, wg], cot_g)
        want = _grads(lambda x, w, o=o: _loop_gmm(x, w, o), [xg, wg], cot_g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **F64)
        results.append(got)
    # The static-shape form (offsets without values: under vmap / tracing) agrees.
    monkeypatch.setattr(moe, "_concrete", lambda *t: False)
    for offs, want in zip(OFFSETS, results):
        o = torch.tensor(offs)
        got = _grads(lambda x, w, o=o: grouped_matmul_reference(x, w, o), [xg, wg], cot_g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **F64)


def test_gradcheck_references_fp64():
    T, d, k = 4, 3, 2
    idx = _routing(T, k)
    x = _rand(T, d, dtype=torch.float64).requires_grad_()
    y = _rand(k * T, d, seed=1, dtype=torch.float64).requires_grad_()
    w = _rand(k * T, seed=2, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: permute_reference(x, idx), (x,))
    assert torch.autograd.gradcheck(lambda y, w: unpermute_reference(y, idx, w, T), (y, w))
    xg = _rand(6, 3, seed=3, dtype=torch.float64).requires_grad_()
    wg = _rand(3, 3, 2, seed=4, dtype=torch.float64).requires_grad_()
    o = torch.tensor([0, 2, 2, 6])
    assert torch.autograd.gradcheck(lambda x, w: grouped_matmul_reference(x, w, o), (xg, wg))
    # second order through the references (torch ops all the way)
    assert torch.autograd.gradgradcheck(lambda x, w: grouped_matmul_reference(x, w, o), (xg, wg))


# ------------------------------------------------------------------------- Triton vs reference


@needs_triton
@pytest.mark.parametrize("T,d,k", [(8, 16, 2), (13, 32, 1), (24, 20, 3)])
def test_permute_unpermute_triton_matches_reference(T, d, k):
    idx = _routing(T, k, seed=T, device=DEV)
    x = _rand(T, d, device=DEV)
    y = _rand(k * T, d, seed=1, device=DEV)
    w = _rand(k * T, seed=2, device=DEV)
    cot_p, cot_u = _rand(k * T, d, seed=3, device=DEV), _rand(T, d, seed=4, device=DEV)
    for impl_fn, ins, cot in (
        (lambda impl: lambda x: permute(x, idx, impl=impl), [x], cot_p),
        (lambda impl: lambda y, w: unpermute(y, idx, w, T, impl=impl), [y, w], cot_u),
        (lambda impl: lambda y: unpermute(y, idx, None, T, impl=impl), [y], cot_u),
    ):
        got = _grads(impl_fn("triton"), ins, cot)
        want = _grads(impl_fn("reference"), ins, cot)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **ROWS)


@needs_triton
@pytest.mark.parametrize("offs", OFFSETS[:3])
def test_grouped_matmul_triton_matches_reference(offs):
    N, din, dout = 24, 32, 20  # d_out not a multiple of the 16-wide tile
    x, w = _rand(N, din, device=DEV), _rand(4, din, dout, seed=1, device=DEV)
    cot = _rand(N, dout, seed=2, device=DEV)
    o = torch.tensor(offs, device=DEV)
    got = _grads(lambda x, w: grouped_matmul(x, w, o, impl="triton"), [x, w], cot)
    want = _grads(lambda x, w: grouped_matmul(x, w, o, impl="reference"), [x, w], cot)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **MM)
    for e in range(4):  # an empty group's weight gets a zero grad
        assert got[2][e].any() == (offs[e + 1] > offs[e])


@needs_triton
def test_triton_bf16_and_3_experts():
    """bf16 rows and weights (the interpreter's bf16 dot goes through fp32 copies); both
    sides accumulate in fp32 and round once to bf16: one bf16 ulp."""
    N, din, dout = 16, 16, 16
    x = _rand(N, din, dtype=torch.bfloat16, device=DEV)
    w = _rand(3, din, dout, seed=1, dtype=torch.bfloat16, device=DEV)
    o = torch.tensor([0, 7, 7, 16], device=DEV)
    got = grouped_matmul(x, w, o, impl="triton")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(
        got, grouped_matmul(x, w, o, impl="reference"), atol=2e-2, rtol=1.6e-2
    )
    idx = _routing(8, 2, device=DEV)
    wt = _rand(16, seed=2, device=DEV)  # fp32 weights with bf16 rows
    got = unpermute(x, idx, wt, 8, impl="triton")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(
        got, unpermute(x, idx, wt, 8, impl="reference"), atol=2e-2, rtol=1.6e-2
    )


@needs_triton
def test_gradcheck_triton_permute_unpermute_fp64():
    T, d, k = 4, 3, 2
    idx = _routing(T, k, device=DEV)
    x = _rand(T, d, dtype=torch.float64, device=DEV).requires_grad_()
    y = _rand(k * T, d, seed=1, dtype=torch.float64, device=DEV).requires_grad_()
    w = _rand(k * T, seed=2, dtype=torch.float64, device=DEV).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: permute(x, idx, impl="triton"), (x,))
    assert torch.autograd.gradcheck(lambda y, w: unpermute(y, idx, w, T, impl="triton"), (y, w))


@needs_triton
def test_triton_double_backward():
    """permute and unweighted unpermute are each other's backward: any order works; the
    fused backward ops refuse a second derivative rather than return zeros."""
    T, d = 6, 16
    idx = _routing(T, 2, device=DEV)
    x = _rand(T, d, device=DEV)

    def second(impl):
        def f(x):
            return (permute(x, idx, impl=impl).sin()).sum()

        return torch.func.grad(lambda x: torch.func.grad(f)(x).square().sum())(x)

    torch.testing.assert_close(second("triton"), second("reference"), **ROWS)
    w = _rand(2 * T, device=DEV)
    y = _rand(2 * T, d, device=DEV)
    with pytest.raises(NotImplementedError, match="unpermute with weights.*impl='reference'"):
        torch.func.grad(
            lambda w: torch.func.grad(
                lambda w: unpermute(y, idx, w, T, impl="triton").square().sum()
            )(w).sum()
        )(w)
    xg, wg = _rand(16, 16, device=DEV), _rand(2, 16, 16, seed=1, device=DEV)
    o = torch.tensor([0, 9, 16], device=DEV)
    with pytest.raises(NotImplementedError, match="grouped_matmul"):
        torch.func.grad(
            lambda x: torch.func.grad(
                lambda x: grouped_matmul(x, wg, o, impl="triton").square().sum()
            )(x).sum()
        )(xg)


# ------------------------------------------------------------------------- grad / vmap


def _per_sample_routing(B, T, k):
    return torch.stack([_routing(T, k, seed=b) for b in range(B)])  # (B, k*T)


IMPLS = ["reference", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_grad_permute_unpermute(impl):
    """vmap over a leading batch dim with per-sample indices and weights (as the virtual mesh
    runs MoE), of forward and of grad, against a loop over the samples."""
    B, T, d, k = 3, 6, 16, 2
    xs = _rand(B, T, d, device=DEV)
    idx = _per_sample_routing(B, T, k).to(DEV)
    ws = _rand(B, k * T, seed=1, device=DEV)

    def layer(x, i, w):
        return unpermute(permute(x, i, impl=impl).tanh(), i, w, T, impl=impl)

    def loss(x, w, i):
        return layer(x, i, w).square().sum()

    got = torch.vmap(layer)(xs, idx, ws)
    gx, gw = torch.vmap(torch.func.grad(loss, argnums=(0, 1)))(xs, ws, idx)
    for b in range(B):

        def loop(x, w, i=idx[b]):
            return _loop_unpermute(_loop_permute(x, i).tanh(), i, w, T)

        xb, wb = xs[b].double(), ws[b].double()
        want = _grads(loop, [xb, wb], 2 * loop(xb, wb))
        torch.testing.assert_close(got[b], want[0].float(), **ROWS)
        torch.testing.assert_close(gx[b], want[1].float(), **ROWS)
        torch.testing.assert_close(gw[b], want[2].float(), **ROWS)
    # shared rows, per-sample indices (vmapped dim of x absent), vmapped dim not in front
    got = torch.vmap(lambda i: permute(xs[0], i, impl=impl))(idx)
    torch.testing.assert_close(got, xs[0][idx])
    got = torch.vmap(lambda x: permute(x, idx[0], impl=impl), in_dims=1)(xs.transpose(0, 1))
    torch.testing.assert_close(got, xs[:, idx[0]])


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_grad_grouped_matmul(impl):
    """Per-sample offsets with a shared w and with per-sample w; grad w.r.t. both; nested vmap."""
    N, din, dout = 24, 16, 16
    B = len(OFFSETS)
    xs = _rand(B, N, din, device=DEV)
    w = _rand(4, din, dout, seed=1, device=DEV)
    offs = torch.tensor(OFFSETS, device=DEV)

    def loss(x, w, o):
        return grouped_matmul(x, w, o, impl=impl).sin().sum()

    for w_dim, wv in ((None, w), (0, torch.stack([w * (b + 1) for b in range(B)]))):
        y = torch.vmap(lambda x, w, o: grouped_matmul(x, w, o, impl=impl), in_dims=(0, w_dim, 0))(
            xs, wv, offs
        )
        gx, gw = torch.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(0, w_dim, 0))(
            xs, wv, offs
        )
        assert gw.shape == (B, 4, din, dout)  # per-sample grads
        for b in range(B):
            wb = wv if w_dim is None else wv[b]
            ref = _grads(
                lambda x, w, o=offs[b]: grouped_matmul_reference(x, w, o).sin(),
                [xs[b], wb],
                torch.ones(N, dout, device=DEV),
            )
            torch.testing.assert_close(y[b], grouped_matmul_reference(xs[b], wb, offs[b]), **MM)
            torch.testing.assert_close(gx[b], ref[1], **MM)
            torch.testing.assert_close(gw[b], ref[2], **MM)
    # plain grad (offsets with values: the reference's slice loop)
    gx, gw = torch.func.grad(loss, argnums=(0, 1))(xs[0], w, offs[0])
    ref = _grads(
        lambda x, w: grouped_matmul_reference(x, w, offs[0]).sin(),
        [xs[0], w],
        torch.ones(N, dout, device=DEV),
    )
    torch.testing.assert_close(gx, ref[1], **MM)
    torch.testing.assert_close(gw, ref[2], **MM)
    # nested vmap: (2, 2) samples with their own offsets, w per outer sample
    o2, x2 = offs.view(2, 2, -1), xs.view(2, 2, N, din)
    w2 = torch.stack([w, -w])
    inner = torch.vmap(lambda x, w, o: grouped_matmul(x, w, o, impl=impl), in_dims=(0, None, 0))
    y2 = torch.vmap(inner)(x2, w2, o2)
    for a in range(2):
        for b in range(2):
            torch.testing.assert_close(
                y2[a, b], grouped_matmul_reference(x2[a, b], w2[a], o2[a, b]), **MM
            )


@needs_triton
def test_make_fx_and_opcheck():
    T, d = 8, 16
    idx = _routing(T, 2, device=DEV)
    x, w = _rand(T, d, device=DEV), _rand(2 * T, device=DEV)
    xg, wg = _rand(16, 16, device=DEV), _rand(3, 16, 16, seed=1, device=DEV)
    o = torch.tensor([0, 5, 5, 16], device=DEV)

    def f(x, w, xg, wg):
        def loss(x, w, xg, wg):
            h = unpermute(permute(x, idx, impl="triton"), idx, w, T, impl="triton")
            return h.sum() + grouped_matmul(xg, wg, o, impl="triton").square().sum()

        return torch.func.grad(loss, argnums=(0, 1, 2, 3))(x, w, xg, wg)

    gm = make_fx(f)(x, w, xg, wg)
    for op in (
        "moe_permute",
        "moe_unpermute",
        "moe_unpermute_backward",
        "grouped_matmul",
        "grouped_matmul_backward",
    ):
        assert f"fsharded.{op}." in gm.code, op
    for a, b in zip(gm(x, w, xg, wg), f(x, w, xg, wg)):
        torch.testing.assert_close(a, b)
    ops = torch.ops.fsharded
    rg = [t.clone().requires_grad_() for t in (x, w, xg, wg)]
    torch.library.opcheck(ops.moe_permute.default, (rg[0], idx))
    torch.library.opcheck(ops.moe_unpermute.default, (rg[0].repeat(2, 1), idx, rg[1], T))
    torch.library.opcheck(ops.moe_unpermute_backward.default, (x, x.repeat(2, 1), idx, w, True))
    torch.library.opcheck(ops.grouped_matmul.default, (rg[2], rg[3], o))
    torch.library.opcheck(ops.grouped_matmul_backward.default, (xg, xg, wg, o, True, True))


@pytest.mark.parametrize("impl", IMPLS)
def test_sorted_moe_layer_through_the_kernels(impl):
    """The dropless sorted MoE of fsharded.parallel.moe (route, sort_by_expert, expert MLP)
    as permute -> grouped_matmul -> gelu -> grouped_matmul -> unpermute: the same output
    and gradients as moe_layer(method="sorted"), also under vmap over shards."""
    from fsharded.parallel import moe as layer

    T, d, f, E, k = 10, 16, 16, 4, 2
    params = layer.init(d, f, E, seed=0, std=0.3)
    x = _rand(T, d)

    def kernels(params, x):
        logits = x @ params["router"]
        r = layer.route(logits, top_k=k, capacity_factor=None)
        order, counts, _ = layer.sort_by_expert(r)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        idx = order % T
        h = grouped_matmul(permute(x, idx, impl=impl), params["w1"], offsets, impl=impl)
        h = grouped_matmul(torch.nn.functional.gelu(h), params["w2"], offsets, impl=impl)
        return unpermute(h, idx, r.weights.t().reshape(-1)[order], T, impl=impl)

    def whole(params, x):
        return layer.moe_layer(
            params, x, top_k=k, capacity_factor=None, axis=None, method="sorted"
        )[0]

    cot = _rand(T, d, seed=1)
    keys = list(params)
    got = _grads(lambda x, *p: kernels(dict(zip(keys, p)), x), [x, *params.values()], cot)
    want = _grads(lambda x, *p: whole(dict(zip(keys, p)), x), [x, *params.values()], cot)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **MM)
    # The layer picks the same path itself when told the implementation (on CUDA: auto).
    wired = _grads(lambda x, *p: layer.moe_layer(dict(zip(keys, p)), x, top_k=k, capacity_factor=None, axis=None,
                                                  method="sorted", impl=impl)[0], [x, *params.values()], cot)
    for a, b in zip(wired, want):
        torch.testing.assert_close(a, b, **MM)
    xs = torch.stack([x, _rand(T, d, seed=2)])  # two virtual shards, each routed alone
    got = torch.vmap(kernels, in_dims=(None, 0))(params, xs)
    torch.testing.assert_close(got, torch.stack([whole(params, xs[i]) for i in range(2)]), **MM)


# ------------------------------------------------------------------------- dispatch, errors


def test_auto_on_cpu_runs_the_reference(monkeypatch):
    x, idx = torch.randn(4, 3), torch.tensor([1, 0])

    def boom(*a, **k):
        raise AssertionError("the Triton op ran")

    monkeypatch.setattr(moe._PermuteFn, "apply", boom)
    torch.testing.assert_close(permute(x, idx), x[idx])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="moe_permute: impl='triton' requested"):
        permute(x, idx, impl="triton")
    with pytest.raises(RuntimeError, match="grouped_matmul: impl='triton' requested"):
        grouped_matmul(x, torch.randn(1, 3, 2), torch.tensor([0, 4]), impl="triton")


@needs_triton
def test_fp64_grouped_matmul_falls_back_or_raises(monkeypatch):
    x, w, o = torch.randn(4, 3).double(), torch.randn(1, 3, 2).double(), torch.tensor([0, 4])
    with pytest.raises(ValueError, match="takes float16, bfloat16 or float32, got torch.float64"):
        grouped_matmul(x.to(DEV), w.to(DEV), o.to(DEV), impl="triton")
    monkeypatch.setattr(moe, "choose", lambda *a, **k: "triton")  # auto picking Triton
    torch.testing.assert_close(grouped_matmul(x, w, o), x @ w[0])


def test_bad_inputs():
    x, idx = torch.randn(4, 3), torch.tensor([1, 0, 3])
    with pytest.raises(
        ValueError,
        match=r"permute: indices must lie in \[0, 4\) \(the 4 rows "
        r"of x\), got indices\[1\]=4",
    ):
        permute(x, torch.tensor([0, 4, -1]))
    with pytest.raises(ValueError, match=r"indices has dtype torch.int32; pass int64 .*\.long\(\)"):
        permute(x, idx.int())
    with pytest.raises(
        ValueError,
        match=r"x must be 2-D \(tokens, features\), got shape \(4,\)"
        r".*indices must be 1-D",
    ):  # every problem at once
        permute(x[:, 0], idx[None])
    with pytest.raises(ValueError, match=r"x has dtype torch.int64; pass a float16"):
        permute(torch.ones(2, 2, dtype=torch.long), idx)
    y = torch.randn(3, 5)
    with pytest.raises(ValueError, match=r"indices has 2 entries but y \(3, 5\) has 3 rows"):
        unpermute(y, idx[:2], None, 4)
    with pytest.raises(ValueError, match=r"weights has shape \(2,\); .* shape \(3,\)"):
        unpermute(y, idx, torch.ones(2), 4)
    with pytest.raises(ValueError, match=r"num_tokens must be an int >= 0"):
        unpermute(y, idx, None, -1)
    with pytest.raises(
        ValueError, match=r"unpermute: indices must lie in \[0, 3\) \(num_tokens=3\)"
    ):
        unpermute(y, idx, None, 3)
    xg, wg = torch.randn(5, 3), torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"offsets\[2\]=2 < offsets\[1\]=4 in \[0, 4, 2, 5\]"):
        grouped_matmul(xg, torch.randn(3, 3, 4), torch.tensor([0, 4, 2, 5]))
    with pytest.raises(ValueError, match=r"offsets\[-1\]=4, expected N=5.*counts.cumsum"):
        grouped_matmul(xg, wg, torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match=r"offsets\[0\]=1, expected 0"):
        grouped_matmul(xg, wg, torch.tensor([1, 2, 5]))
    with pytest.raises(ValueError, match=r"offsets has 2 entries but w has 2 experts; pass the 3"):
        grouped_matmul(xg, wg, torch.tensor([0, 5]))
    with pytest.raises(
        ValueError, match=r"w \(2, 4, 4\) takes d_in=4 features but x \(5, 3\) has 3"
    ):
        grouped_matmul(xg, torch.randn(2, 4, 4), torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match=r"w has dtype torch.float64 but x torch.float32; cast"):
        grouped_matmul(xg, wg.double(), torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match=r"offsets has dtype torch.int32"):
        grouped_matmul(xg, wg, torch.tensor([0, 2, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"w must be a torch.Tensor, got list"):
        grouped_matmul(xg, [wg], torch.tensor([0, 2, 5]))


@needs_triton
def test_unchecked_out_of_range_is_dropped():
    """check=False: the kernels never touch memory out of bounds; bad rows read as zero /
    are dropped, here and per sample under vmap (the shift keeps them out of range)."""
    x = _rand(4, 16, device=DEV)
    bad = torch.tensor([1, 4, -1, 2], device=DEV)
    got = permute(x, bad, impl="triton", check=False)
    torch.testing.assert_close(got[[0, 3]], x[[1, 2]])
    assert not got[[1, 2]].any()
    out = unpermute(got, bad, None, 4, impl="triton", check=False)
    assert not out[[0, 3]].any() and torch.equal(out[1], x[1]) and torch.equal(out[2], x[2])
    xs = torch.stack([x, 2 * x])
    got = torch.vmap(lambda x: permute(x, bad, impl="triton", check=False))(xs)
    assert not got[0, 1].any() and torch.equal(got[1, 0], 2 * x[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_reference(dtype):
    T, k, d, E, f = 1000, 2, 512, 8, 384
    idx = _routing(T, k, device="cuda")
    x, w = _rand(T, d, dtype=dtype, device="cuda"), _rand(k * T, seed=1, device="cuda")
    counts = torch.bincount(torch.randint(0, E, (k * T,), generator=_gen(2)), minlength=E)
    counts[3] = 0  # an empty expert
    counts[0] += k * T - counts.sum()
    offs = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).cuda()
    we = _rand(E, d, f, seed=3, dtype=dtype, device="cuda") * d**-0.5

    def run(impl):
        def fn(x, w, we):
            h = grouped_matmul(permute(x, idx, impl=impl), we, offs, impl=impl)
            return unpermute(h, idx, w, T, impl=impl)

        return _grads(fn, [x, w, we], _rand(T, f, seed=4, dtype=dtype, device="cuda"))

    # bf16: both sides accumulate in fp32 and round once, one bf16 ulp plus dw's sums over
    # ~250 rows in another order; fp32: exact fp32 matmuls on both sides (precision
    # "highest"), sums in another order over d=512 and ~250 rows.
    tol = dict(atol=3e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-3, rtol=1e-3)
    for a, b in zip(run("triton"), run("reference")):
        torch.testing.assert_close(a.float(), b.float(), **tol)
