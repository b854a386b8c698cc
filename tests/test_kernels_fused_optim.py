"""fused_optim: the Triton multi-tensor kernels (interpreter on CPU) and the pure-torch
references against torch.optim and against each other.

Tolerances: the references replay torch.optim's ops one for one and are compared exactly.
The Triton kernel evaluates the same fp32 formulas in registers (different rounding of
intermediates, no ``lerp``/``addcmul`` special forms), so params differ from torch by a few
fp32 ulps of O(1) values after 3 steps: atol=rtol=1e-6.
"""

import math

import pytest
import torch

from fsharded.kernels import cpu_optim
from fsharded.kernels import fused_optim as fo

SIZES = (1, 7, 33, 130, 1025)  # odd sizes: partial chunks, several chunks for one tensor
TRITON_TOL = dict(atol=1e-6, rtol=1e-6)
ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


def _lists(seed=0, sizes=SIZES, n_states=2):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in sizes]
    states = [[torch.zeros(s) for s in sizes] for _ in range(n_states)]
    return params, states


def _grads(step, sizes=SIZES, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=gen) * scale).to(dtype) for s in sizes]


def _clone(lists):
    return [t.clone() for t in lists]


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_matches_torch_optim(impl, decoupled):
    params, (m, v) = _lists()
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(theirs, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, foreach=False)
    for step in (1, 2, 3):
        grads = _grads(step)
        for t, g in zip(theirs, grads):
            t.grad = g.clone()
        opt.step()
        found = fo.fused_adamw_(
            params, grads, m, v, **ADAM, step=step, decoupled=decoupled, impl=impl
        )
        assert found.shape == () and found.dtype == torch.bool and not found
    tol = TRITON_TOL if impl == "triton" else dict(atol=0, rtol=0)
    for p, t, mi, vi in zip(params, theirs, m, v):
        torch.testing.assert_close(p, t.detach(), **tol)
        torch.testing.assert_close(mi, opt.state[t]["exp_avg"], **tol)
        torch.testing.assert_close(vi, opt.state[t]["exp_avg_sq"], **tol)


def test_fused_adam_is_l2_adam():
    params, (m, v) = _lists()
    p2, m2, v2 = _clone(params), _clone(m), _clone(v)
    grads = _grads(1)
    fo.fused_adam_(params, grads, m, v, **ADAM, step=1, impl="reference")
    fo.fused_adamw_(p2, grads, m2, v2, **ADAM, step=1, decoupled=False, impl="reference")
    assert all(torch.equal(a, b) for a, b in zip(params, p2))


@pytest.mark.parametrize("half_dtype", [torch.bfloat16, torch.float16])
def test_adam_bf16_grads_inv_scale_half_params(half_dtype):
    """Scaled bf16 grads unscaled in the kernel; half params written in the same pass."""
    params, (m, v) = _lists(seed=1)
    ref_p, ref_m, ref_v = _clone(params), _clone(m), _clone(v)
    half = [torch.full_like(p, 7.0, dtype=half_dtype) for p in params]
    ref_half = _clone(half)
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for step in (1, 2, 3):
        grads = _grads(step, dtype=torch.bfloat16, scale=1024.0)
        kw = dict(**ADAM, step=step, inv_scale=1 / 1024, half_params=half)
        assert not fo.fused_adamw_(params, grads, m, v, **kw, impl="triton")
        kw["half_params"] = ref_half
        assert not fo.fused_adamw_(ref_p, grads, ref_m, ref_v, **kw, impl="reference")
        for t, g in zip(theirs, grads):  # 1/1024 is exact: torch sees the same fp32 grads
            t.grad = g.float() / 1024
        opt.step()
    for p, rp, t, h, rh in zip(params, ref_p, theirs, half, ref_half):
        torch.testing.assert_close(p, rp, **TRITON_TOL)
        torch.testing.assert_close(rp, t.detach(), atol=0, rtol=0)
        # The cast is fused: exactly the cast of the fp32 result (round to nearest even).
        assert torch.equal(h, p.to(half_dtype)) and torch.equal(rh, rp.to(half_dtype))


def test_mixed_grad_dtypes_one_call():
    """fp32 and fp16 grads in one list: one launch per dtype bucket, one shared found_inf."""
    params, (m, v) = _lists(seed=2)
    ref = [_clone(params), _clone(m), _clone(v)]
    grads = [g.to(torch.float16) if i % 2 else g for i, g in enumerate(_grads(1))]
    fo.fused_adamw_(params, grads, m, v, **ADAM, step=1, impl="triton")
    fo.fused_adamw_(ref[0], grads, ref[1], ref[2], **ADAM, step=1, impl="reference")
    for a, b in zip(params + m + v, ref[0] + ref[1] + ref[2]):
        torch.testing.assert_close(a, b, **TRITON_TOL)


def _run(kind, impl, params, grads, states, half, **kw):
    if kind == "adamw":
        return fo.fused_adamw_(
            params, grads, *states, **ADAM, step=3, half_params=half, impl=impl, **kw
        )
    if kind == "lion":
        return fo.fused_lion_(
            params,
            grads,
            states[0],
            lr=1e-3,
            beta1=0.9,
            beta2=0.99,
            weight_decay=0.1,
            half_params=half,
            impl=impl,
            **kw,
        )
    return fo.fused_adagrad_(
        params,
        grads,
        states[0],
        lr=0.1,
        eps=1e-10,
        weight_decay=0.1,
        half_params=half,
        impl=impl,
        **kw,
    )


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("kind", ["adamw", "lion", "adagrad"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_found_inf_leaves_everything_untouched(impl, kind, bad):
    params, states = _lists(seed=3)
    states = [[torch.randn_like(s) for s in lst] for lst in states[: 2 if kind == "adamw" else 1]]
    half = [p.bfloat16() for p in params]
    before = _clone(params) + [t.clone() for s in states for t in s] + _clone(half)
    grads = _grads(1, dtype=torch.bfloat16)
    grads[3][77] = bad  # one element, in the middle of a later tensor
    found = _run(kind, impl, params, grads, states, half, inv_scale=0.5)
    assert found.dtype == torch.bool and found.shape == () and bool(found)
    after = params + [t for s in states for t in s] + half
    assert all(torch.equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("impl", ["triton", "reference", "cpp"])
@pytest.mark.parametrize("kind", ["adamw", "lion", "adagrad"])
def test_check_finite_false_skips_the_check(impl, kind):
    """check_finite=False: the same numbers as with the check on finite grads; a nan grad
    goes undetected (found_inf False) into that tensor's params (Lion: its momentum, as
    sign(nan) moves no weight), the other tensors step as usual."""
    if impl == "cpp" and cpu_optim.load() is None:
        pytest.skip(f"C++ CPU optimizer not buildable here: {cpu_optim._build_cpu()[1]}")
    params, states = _lists(seed=5)
    # >= 0 like every second moment / Adagrad sum (no nan from sqrt of a negative state)
    states = [[torch.rand_like(s) for s in lst] for lst in states[: 2 if kind == "adamw" else 1]]
    grads = _grads(2, dtype=torch.bfloat16)
    runs = {}
    for check in (True, False):
        ps, st = _clone(params), [_clone(s) for s in states]
        half = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in params]
        found = _run(kind, impl, ps, grads, st, half, inv_scale=0.5, check_finite=check)
        assert found.dtype == torch.bool and found.shape == () and not bool(found)
        runs[check] = [ps, *st, half]
    for a, b in zip(runs[True], runs[False]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    grads[3][77] = math.nan
    ps, st = _clone(params), [_clone(s) for s in states]
    half = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in params]
    found = _run(kind, impl, ps, grads, st, half, inv_scale=0.5, check_finite=False)
    assert not bool(found)
    hit = st[0] if kind == "lion" else ps
    assert hit[3][77].isnan() and int(hit[3].isnan().sum()) == 1
    for i in (0, 1, 2, 4):
        assert all(torch.equal(a[i], b[i]) for a, b in zip([ps, *st, half], runs[True]))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_found_inf_after_unscaling(impl):
    """Finite grads that overflow fp32 once multiplied by inv_scale count as non-finite."""
    params, (m, v) = _lists(sizes=(5, 9))
    grads = [torch.full((5,), 1e38), torch.ones(9)]
    found = fo.fused_adamw_(params, grads, m, v, **ADAM, step=1, inv_scale=10.0, impl=impl)
    assert bool(found)
    assert not fo.fused_adamw_(params, grads, m, v, **ADAM, step=1, inv_scale=1.0, impl=impl)


def _lion_by_hand(p, g, m, lr, beta1, beta2, weight_decay):
    """Lion (Chen et al. 2023, Algorithm 2), written independently of the module."""
    update = torch.sign(beta1 * m + (1 - beta1) * g)
    p = p - lr * (update + weight_decay * p)
    m = beta2 * m + (1 - beta2) * g
    return p, m


def test_lion_triton_reference_paper():
    params, (m,) = _lists(seed=4, n_states=1)
    ref_p, ref_m = _clone(params), _clone(m)
    hand_p, hand_m = _clone(params), _clone(m)
    half = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1)
    for step in (1, 2, 3):
        grads = _grads(step, dtype=torch.bfloat16, scale=8.0)
        assert not fo.fused_lion_(
            params, grads, m, **kw, inv_scale=0.125, half_params=half, impl="triton"
        )
        assert not fo.fused_lion_(ref_p, grads, ref_m, **kw, inv_scale=0.125, impl="reference")
        for i, g in enumerate(grads):
            hand_p[i], hand_m[i] = _lion_by_hand(hand_p[i], g.float() / 8, hand_m[i], **kw)
    for a, b, c in zip(params + m, ref_p + ref_m, hand_p + hand_m):
        torch.testing.assert_close(a, b, **TRITON_TOL)
        torch.testing.assert_close(b, c, **TRITON_TOL)  # p*(1-lr*wd) vs p - lr*wd*p
    assert all(torch.equal(h, p.bfloat16()) for h, p in zip(half, params))


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_adagrad_matches_torch_optim(impl):
    params, (s,) = _lists(seed=5, n_states=1)
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.Adagrad(
        theirs, lr=0.1, lr_decay=0.01, weight_decay=0.1, eps=1e-10, foreach=False
    )
    for step in (1, 2, 3):
        grads = _grads(step)
        for t, g in zip(theirs, grads):
            t.grad = g.clone()
        opt.step()
        fo.fused_adagrad_(
            params,
            grads,
            s,
            lr=0.1,
            eps=1e-10,
            weight_decay=0.1,
            lr_decay=0.01,
            step=step,
            impl=impl,
        )
    tol = TRITON_TOL if impl == "triton" else dict(atol=0, rtol=0)
    for p, t, si in zip(params, theirs, s):
        torch.testing.assert_close(p, t.detach(), **tol)
        torch.testing.assert_close(si, opt.state[t]["sum"], **tol)


def test_one_table_per_bucket_and_cache():
    """The launch table: addresses, numels and one (tensor, offset) entry per chunk."""
    from fsharded.kernels import _triton_fused_optim as K

    chunk = 8
    addrs = tuple(range(100, 110))  # 5 rows (params, grads, 2 states, half) x 2 tensors
    table, n_chunks = K._table(torch.device("cpu"), addrs, (3, 17), chunk)
    assert n_chunks == 1 + 3
    head, blocks = table[: 6 * 2].tolist(), table[6 * 2 :].view(-1, 2).tolist()
    assert head == list(addrs) + [3, 17]
    assert blocks == [[0, 0], [1, 0], [1, 1], [1, 2]]  # (tensor, chunk within the tensor)
    again, _ = K._table(torch.device("cpu"), addrs, (3, 17), chunk)
    assert again is table  # repeated steps on the same buffers reuse it


@pytest.mark.parametrize("offset", [0, 1])
def test_views_of_flat_buffers(offset):
    """Params as views into flat buffers (ZeRO-style); offset 1 makes every address
    unaligned, which must take the kernel's unaligned variant."""
    sizes = (4, 300, 16)  # multiples of 4 fp32: 16-byte aligned views when offset == 0
    flats = [torch.zeros(offset + sum(sizes)) for _ in range(4)]
    gen = torch.Generator().manual_seed(7)
    for f in flats[:2]:
        f.copy_(torch.randn(f.shape, generator=gen))
    p, g, m, v = (t.narrow(0, offset, sum(sizes)).split(sizes) for t in flats)
    assert all(t.data_ptr() % 16 == 0 for t in p) == (offset == 0)
    ref = [[t.clone() for t in lst] for lst in (p, m, v)]
    assert not fo.fused_adamw_(list(p), list(g), list(m), list(v), **ADAM, step=1, impl="triton")
    fo.fused_adamw_(ref[0], list(g), ref[1], ref[2], **ADAM, step=1, impl="reference")
    for a, b in zip([*p, *m, *v], [t for lst in ref for t in lst]):
        torch.testing.assert_close(a, b, **TRITON_TOL)


def test_parameters_zero_numel_and_version_counter():
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.zeros(0))]
    m, v = [torch.zeros(5), torch.zeros(0)], [torch.zeros(5), torch.zeros(0)]
    version = params[0]._version
    before = params[0].detach().clone()
    assert not fo.fused_adamw_(
        params, [torch.ones(5), torch.ones(0)], m, v, **ADAM, step=1, impl="triton"
    )
    assert params[0]._version > version and not torch.equal(params[0].detach(), before)
    empty = fo.fused_lion_(
        [], [], [], lr=1.0, beta1=0.9, beta2=0.9, weight_decay=0.0, impl="triton"
    )
    assert empty.dtype == torch.bool and not empty


def test_bad_inputs():
    params, (m, v) = _lists(sizes=(4, 6))
    grads = _grads(1, sizes=(4, 6))
    call = fo.fused_adamw_
    with pytest.raises(TypeError, match=r"params must be a list of tensors.*\[buffer\]"):
        call(params[0], grads[0], m[0], v[0], **ADAM, step=1)
    with pytest.raises(ValueError, match="len\\(params\\)=2"):
        call(params, grads[:1], m, v, **ADAM, step=1)
    with pytest.raises(
        TypeError, match=r"params\[0\] has dtype torch.float16.*grads\[1\] has dtype torch.int64"
    ):
        call([params[0].half(), params[1]], [grads[0], grads[1].long()], m, v, **ADAM, step=1)
    with pytest.raises(
        ValueError, match=r"exp_avg\[1\] has shape \(5,\).*exp_avg_sq\[0\] is not contiguous"
    ):
        call(params, grads, [m[0], torch.zeros(5)], [torch.zeros(8)[::2], v[1]], **ADAM, step=1)
    with pytest.raises(TypeError, match=r"half_params\[0\] has dtype torch.float32"):
        call(params, grads, m, v, **ADAM, step=1, half_params=_clone(params))
    with pytest.raises(ValueError, match=r"beta2=1.0 \(must be in \[0, 1\)\).*step=0"):
        call(params, grads, m, v, **{**ADAM, "beta2": 1.0}, step=0)
    with pytest.raises(ValueError, match="lr=nan"):
        fo.fused_lion_(params, grads, m, lr=math.nan, beta1=0.9, beta2=0.99, weight_decay=0.0)
    with pytest.raises(ValueError, match="impl='fast'"):
        call(params, grads, m, v, **ADAM, step=1, impl="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_matches_reference_without_host_sync():
    sizes = (1, 4095, 4097, 1 << 20, 333)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).cuda() for s in sizes]
    grads = [torch.randn(s, generator=gen).cuda().bfloat16() for s in sizes]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    ref = [_clone(params), _clone(m), _clone(v)]
    half = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    kw = dict(**ADAM, step=1, inv_scale=0.5)
    fo.fused_adamw_(params, grads, m, v, **kw, half_params=half, impl="triton")  # warm-up
    fo.fused_adamw_(ref[0], grads, ref[1], ref[2], **kw, impl="reference")
    torch.cuda.set_sync_debug_mode("error")
    try:
        found = fo.fused_adamw_(
            params, grads, m, v, **{**kw, "step": 2}, half_params=half, impl="triton"
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    fo.fused_adamw_(ref[0], grads, ref[1], ref[2], **{**kw, "step": 2}, impl="reference")
    assert not found.item()
    for a, b in zip(params + m + v, ref[0] + ref[1] + ref[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # GPU sqrt/div approximations
    assert all(torch.equal(h, p.bfloat16()) for h, p in zip(half, params))
