"""The C++ CPU optimizer (fsharded.kernels.cpu_optim) against torch.optim and the references.

Tolerances: the C++ kernels evaluate torch.optim's formulas in fp32 but fuse some
multiply-adds (and multiply by 1/sqrt(bc2) where torch divides), so each step may round a
parameter 1 ulp differently; over a few steps that stays within a few ulp, i.e. well inside
rtol=1e-6 + atol=1e-6 for parameters of size ~1. Half copies are compared exactly with
``params.to(dtype)`` (both round to nearest even).
"""

import os
import shutil
import subprocess

import pytest
import torch

from fsharded.kernels import _dispatch
from fsharded.kernels import cpu_optim as co

TOL = {"rtol": 1e-6, "atol": 1e-6}
SIZES = (1, 7, 33, 1000, 4099)  # odd sizes: heads and tails around the vector width


@pytest.fixture(scope="module")
def mod():
    m = co.load()
    if m is None:
        pytest.skip(f"C++ CPU optimizer not buildable here: {co._build_cpu()[1]}")
    return m


@pytest.fixture(scope="module")
def isas(mod):
    return list(mod.supported_isas())


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request, mod, monkeypatch):
    if request.param not in mod.supported_isas():
        pytest.skip(f"this CPU has no {request.param}")
    monkeypatch.setenv(co.ISA_ENV, request.param)
    return request.param


def _make(sizes, seed=0, gdtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for n in sizes]
    grads = [[torch.randn(n, generator=g).to(gdtype) for n in sizes] for _ in range(4)]
    return params, grads


def _torch_run(opt_cls, params, grads, **kw):
    """Steps of torch.optim's single-tensor implementation; returns params and states."""
    ps = [p.clone().requires_grad_() for p in params]
    opt = opt_cls(ps, foreach=False, **kw)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.float()
        opt.step()
    return [p.detach() for p in ps], opt


# -- AdamW / Adam ---------------------------------------------------------------------------


@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_torch(isa, gdtype, wd):
    params, grads = _make(SIZES, gdtype=gdtype)
    ref, opt = _torch_run(
        torch.optim.AdamW, params, grads, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd
    )
    ps = [p.clone() for p in params]
    m, v = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    half = [torch.empty(p.shape, dtype=torch.bfloat16) for p in ps]
    for step, gs in enumerate(grads, 1):
        found = co.adamw_(
            ps,
            gs,
            m,
            v,
            lr=1e-2,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
            weight_decay=wd,
            step=step,
            half_params=half,
        )
        assert found.dtype == torch.bool and found.dim() == 0 and not found
    for i, p in enumerate(ps):
        torch.testing.assert_close(p, ref[i], **TOL)
        st = opt.state[opt.param_groups[0]["params"][i]]
        torch.testing.assert_close(m[i], st["exp_avg"], **TOL)
        torch.testing.assert_close(v[i], st["exp_avg_sq"], **TOL)
        assert torch.equal(half[i], p.to(torch.bfloat16))


def test_adam_l2_matches_torch(isa):
    params, grads = _make(SIZES, seed=1)
    ref, _ = _torch_run(torch.optim.Adam, params, grads, lr=1e-2, weight_decay=0.1)
    ps = [p.clone() for p in params]
    m, v = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    for step, gs in enumerate(grads, 1):
        co.adamw_(
            ps,
            gs,
            m,
            v,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.1,
            step=step,
            decoupled=False,
        )
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p, r, **TOL)


@pytest.mark.parametrize("hdtype", [torch.float16, torch.bfloat16])
def test_adamw_large_threads_and_half_copy(mod, isas, hdtype):
    """Multi-threaded (chunks cross tensor boundaries), streamed half copy (> 2^20
    elements): the same numbers whatever the thread count and with or without the
    non-finite check (which changes the order chunks are taken in), an exact half copy,
    every ISA."""
    sizes = (3, (1 << 20) + 5, 70001)
    params, grads = _make(sizes, seed=2)
    ref, _ = _torch_run(torch.optim.AdamW, params, grads[:2], lr=1e-3, weight_decay=0.01)
    for isa in isas:
        outs = []
        for threads, check in ((1, True), (3, True), (3, False)):
            ps = [p.clone() for p in params]
            m, v = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
            half = [torch.empty(p.shape, dtype=hdtype) for p in ps]
            for step, gs in enumerate(grads[:2], 1):
                args = (1e-3, 0.9, 0.999, 1e-8, 0.01, step, True, 1.0, check, threads, isa)
                assert not mod.adam(ps, gs, m, v, half, *args)
            outs.append((ps, m, v))
            for p, h in zip(ps, half):
                assert torch.equal(h, p.to(hdtype)), isa
        for other in outs[1:]:
            for a, b in zip(outs[0], other):
                for x, y in zip(a, b):
                    assert torch.equal(x, y), isa
        for p, r in zip(outs[0][0], ref):
            torch.testing.assert_close(p, r, **TOL)


def test_inv_scale_is_fused_unscaling(mod):
    params, grads = _make(SIZES, seed=3)
    scale = 1024.0  # a power of two: g * scale * (1 / scale) == g exactly
    runs = []
    for s in (1.0, scale):
        ps = [p.clone() for p in params]
        m, v = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        for step, gs in enumerate(grads, 1):
            co.adamw_(
                ps,
                [g * s for g in gs],
                m,
                v,
                lr=1e-2,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.1,
                step=step,
                inv_scale=1.0 / s,
            )
        runs.append(ps)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# -- Adagrad, Lion ----------------------------------------------------------------------------


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adagrad_matches_torch(isa, wd):
    params, grads = _make(SIZES, seed=4)
    ref, opt = _torch_run(
        torch.optim.Adagrad, params, grads, lr=0.1, lr_decay=0.01, weight_decay=wd, eps=1e-10
    )
    ps = [p.clone() for p in params]
    s = [torch.zeros_like(p) for p in ps]
    for step, gs in enumerate(grads, 1):
        assert not co.adagrad_(
            ps, gs, s, lr=0.1, eps=1e-10, weight_decay=wd, lr_decay=0.01, step=step
        )
    for i, p in enumerate(ps):
        torch.testing.assert_close(p, ref[i], **TOL)
        st = opt.state[opt.param_groups[0]["params"][i]]
        torch.testing.assert_close(s[i], st["sum"], **TOL)


def test_lion_matches_reference(isa):
    params, grads = _make(SIZES, seed=5, gdtype=torch.bfloat16)
    runs = []
    for fn in (co.lion_, co.lion_reference_):
        ps = [p.clone() for p in params]
        m = [torch.zeros_like(p) for p in ps]
        half = [torch.empty(p.shape, dtype=torch.float16) for p in ps]
        for gs in grads:
            assert not fn(
                ps, gs, m, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, half_params=half
            )
        runs.append((ps, m, half))
    for a, b in zip(*runs):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, **TOL)


# -- found_inf -------------------------------------------------------------------------------


def _steps():
    """(name, C++ fn, reference fn, number of fp32 states, kwargs) for each optimizer."""
    return [
        (
            "adamw",
            co.adamw_,
            co.adamw_reference_,
            2,
            dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3),
        ),
        (
            "lion",
            co.lion_,
            co.lion_reference_,
            1,
            dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1),
        ),
        (
            "adagrad",
            co.adagrad_,
            co.adagrad_reference_,
            1,
            dict(lr=0.1, eps=1e-10, weight_decay=0.1, step=2),
        ),
    ]


@pytest.mark.parametrize("case", ["inf", "nan", "overflow_after_unscale"])
@pytest.mark.parametrize("which", ["cpp", "reference"])
def test_nonfinite_grad_modifies_nothing(mod, which, case):
    for name, fn, ref_fn, nstates, kw in _steps():
        fn = fn if which == "cpp" else ref_fn
        params, grads = _make((5, 100_000, 17), seed=6, gdtype=torch.float16)
        gs = grads[0]
        inv_scale = 1.0
        if case == "overflow_after_unscale":  # finite fp16, beyond fp32 once times 2^113
            gs[1][77_777], inv_scale = 60000.0, float(2**113)
        else:
            gs[1][99_999] = float(case)
        states = [[torch.rand_like(p) for p in params] for _ in range(nstates)]
        half = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in params]
        before = [[t.clone() for t in ts] for ts in (params, *states, half)]
        found = fn(params, gs, *states, inv_scale=inv_scale, half_params=half, **kw)
        assert found.dim() == 0 and bool(found), name
        for old, new in zip(before, (params, *states, half)):
            for a, b in zip(old, new):
                assert torch.equal(a, b), f"{name} modified a tensor although found_inf"


@pytest.mark.parametrize("which", ["cpp", "reference"])
def test_check_finite_false_skips_the_check(mod, which):
    """check_finite=False: on finite gradients the very same numbers as with the check; a
    nan gradient is not detected (found_inf False) and reaches that tensor's parameters or
    state (so the check really did not run), while the other tensors step as usual."""
    for name, fn, ref_fn, nstates, kw in _steps():
        fn = fn if which == "cpp" else ref_fn
        # 100_000 elements: several chunks and both threads on the C++ side.
        params, grads = _make((5, 100_000, 17), seed=7, gdtype=torch.bfloat16)
        gs = grads[0]
        states = [[torch.rand_like(p) for p in params] for _ in range(nstates)]
        runs = {}
        for check in (True, False):
            ts = [[t.clone() for t in lst] for lst in (params, *states)]
            half = [torch.zeros(p.shape, dtype=torch.float16) for p in params]
            found = fn(ts[0], gs, *ts[1:], half_params=half, check_finite=check, **kw)
            assert found.dim() == 0 and not bool(found), name
            runs[check] = [*ts, half]
        for a, b in zip(runs[True], runs[False]):
            for x, y in zip(a, b):
                assert torch.equal(x, y), name
        bad = [g.clone() for g in gs]
        bad[1][4242] = float("nan")
        ts = [[t.clone() for t in lst] for lst in (params, *states)]
        half = [torch.zeros(p.shape, dtype=torch.float16) for p in params]
        found = fn(ts[0], bad, *ts[1:], half_params=half, check_finite=False, **kw)
        assert not bool(found), name
        # Lion's weights move by sign(.), which maps nan to 0: the nan lands in its momentum.
        hit = ts[1] if name == "lion" else ts[0]
        assert hit[1][4242].isnan() and hit[1].isnan().sum() == 1, name  # only that element
        if name != "lion":
            assert half[1][4242].isnan(), name
        for a, b in zip([*ts, half], runs[True]):
            assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]), name


def test_empty_lists_and_empty_tensors(mod):
    assert not co.adamw_(
        [], [], [], [], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1
    )
    p = [torch.zeros(0), torch.ones(3)]
    assert not co.lion_(
        p,
        [torch.zeros(0), torch.ones(3)],
        [torch.zeros(0), torch.zeros(3)],
        lr=0.5,
        beta1=0.9,
        beta2=0.99,
        weight_decay=0.0,
    )
    assert torch.equal(p[1], torch.full((3,), 0.5))


# -- bad input -----------------------------------------------------------------------------------


def _adam_args():
    p = [torch.zeros(4), torch.zeros(6)]
    return dict(
        params=p,
        grads=[torch.zeros(4), torch.zeros(6)],
        exp_avg=[torch.zeros(4), torch.zeros(6)],
        exp_avg_sq=[torch.zeros(4), torch.zeros(6)],
    )


HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)


@pytest.mark.parametrize("fn_name", ["adamw_", "adamw_reference_"])
@pytest.mark.parametrize(
    "change,exc,needle",
    [
        (lambda a: a["grads"].pop(), ValueError, "grads has 1 tensors but params has 2"),
        (lambda a: a["exp_avg_sq"].__setitem__(1, torch.zeros(5)), ValueError, "exp_avg_sq[1]"),
        (
            lambda a: a["params"].__setitem__(0, torch.zeros(4, dtype=torch.float64)),
            TypeError,
            "params[0]",
        ),
        (
            lambda a: a["grads"].__setitem__(1, torch.zeros(6, dtype=torch.int32)),
            TypeError,
            "grads[1]",
        ),
        (
            lambda a: a["exp_avg"].__setitem__(1, torch.zeros(6, dtype=torch.bfloat16)),
            TypeError,
            "exp_avg[1]",
        ),
        (
            lambda a: a.__setitem__("half_params", [torch.zeros(4), torch.zeros(6)]),
            TypeError,
            "half_params[0]",
        ),
        (lambda a: a.__setitem__("half_params", []), ValueError, "half_params has 0 tensors"),
        (lambda a: a.__setitem__("params", torch.zeros(4)), TypeError, "list of tensors"),
    ],
)
def test_bad_tensors_are_named(mod, fn_name, change, exc, needle):
    args = _adam_args()
    change(args)
    with pytest.raises(exc, match=needle.replace("[", r"\[").replace("]", r"\]")):
        getattr(co, fn_name)(**args, **HP)


def test_non_contiguous_rejected(mod):
    args = _adam_args()
    args["exp_avg"][0] = torch.zeros(8)[::2]
    with pytest.raises(ValueError, match=r"exp_avg\[0\].*contiguous"):
        co.adamw_(**args, **HP)


@pytest.mark.parametrize("fn", [co.adamw_, co.adamw_reference_])
@pytest.mark.parametrize(
    "bad,needle",
    [
        ({"step": 0}, "step=0"),
        ({"beta2": 1.0}, "beta2=1.0"),
        ({"lr": float("nan")}, "lr=nan"),
        ({"inv_scale": 0.0}, "inv_scale=0.0"),
    ],
)
def test_bad_scalars(mod, fn, bad, needle):
    with pytest.raises(ValueError, match=needle):
        fn(**_adam_args(), **{**HP, **bad})


def test_isa_override_and_unknown_isa(mod, monkeypatch):
    assert co.isa() in mod.supported_isas()
    monkeypatch.setenv(co.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="sse9"):
        co.adamw_(**_adam_args(), **HP)


# -- references vs torch ----------------------------------------------------------------------


def test_references_match_torch():
    params, grads = _make(SIZES, seed=7)
    for cls, fn, kw, torch_kw in [
        (
            torch.optim.AdamW,
            co.adamw_reference_,
            dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1),
            dict(lr=1e-2, weight_decay=0.1),
        ),
        (
            torch.optim.Adam,
            co.adamw_reference_,
            dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=False),
            dict(lr=1e-2, weight_decay=0.1),
        ),
        (
            torch.optim.Adagrad,
            co.adagrad_reference_,
            dict(lr=0.1, eps=1e-10, weight_decay=0.1, lr_decay=0.01),
            dict(lr=0.1, eps=1e-10, weight_decay=0.1, lr_decay=0.01),
        ),
    ]:
        ref, _ = _torch_run(cls, params, grads, **torch_kw)
        ps = [p.clone() for p in params]
        nstates = 1 if cls is torch.optim.Adagrad else 2
        states = [[torch.zeros_like(p) for p in ps] for _ in range(nstates)]
        for step, gs in enumerate(grads, 1):
            fn(ps, gs, *states, step=step, **kw)
        for p, r in zip(ps, ref):
            torch.testing.assert_close(p, r, **TOL)


# -- loading, dispatch --------------------------------------------------------------------------


def test_load_reports_missing_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    mod, why = co._compile("fsharded_never_built", co._SOURCES)
    assert mod is None and "no C++ compiler" in why and "/nonexistent/c++" in why


def test_load_required_raises_with_reason(monkeypatch):
    monkeypatch.setattr(co, "_build_cpu", lambda: (None, "the build broke: xyz"))
    assert co.load() is None
    with pytest.raises(RuntimeError, match="the build broke: xyz(.|\n)*reference"):
        co.load(required=True)


def test_dispatch_picks_cpp(mod, monkeypatch):
    monkeypatch.delenv(_dispatch.ENV, raising=False)
    assert _dispatch.choose("adamw", torch.zeros(3), cpp=True) == "cpp"
    assert _dispatch.choose("adamw", torch.zeros(3), impl="cpp", cpp=True) == "cpp"


# -- CUDA ------------------------------------------------------------------------------------------

NVCC = shutil.which("nvcc") or (
    "/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None
)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_cuda_sources_compile(tmp_path):
    src = co.CSRC / "cuda" / "multi_tensor_adam.cu"
    proc = subprocess.run(
        [NVCC, "-std=c++17", "-c", str(src), "-o", str(tmp_path / "a.o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "a.o").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_load_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA"):
        co.load_cuda()
    assert co.load_cuda(required=False) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
def test_cuda_adamw_matches_reference(gdtype):
    sizes = (1, 4099, 3 * 65536 + 7) + (33,) * 40  # > 36 tensors and chunk boundaries
    params, grads = _make(sizes, seed=8, gdtype=gdtype)
    outs = []
    for fn in (co.adamw_cuda_, co.adamw_reference_):
        ps = [p.cuda() for p in params]
        m, v = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        half = [torch.empty(p.shape, dtype=torch.bfloat16, device="cuda") for p in ps]
        for step, gs in enumerate(grads, 1):
            found = fn(
                ps,
                [g.cuda() for g in gs],
                m,
                v,
                lr=1e-2,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.1,
                step=step,
                half_params=half,
            )
            assert not bool(found)
        outs.append((ps, m, v))
        assert all(torch.equal(h, p.to(torch.bfloat16)) for h, p in zip(half, ps))
    for a, b in zip(*outs):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, **TOL)
    ps = [p.cuda() for p in params]
    before = [p.clone() for p in ps]
    gs = [g.cuda() for g in grads[0]]
    gs[-1][0] = float("inf")
    found = co.adamw_cuda_(
        ps,
        gs,
        [torch.zeros_like(p) for p in ps],
        [torch.zeros_like(p) for p in ps],
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.1,
        step=1,
    )
    assert bool(found) and all(torch.equal(a, b) for a, b in zip(before, ps))
    # check_finite=False: no check kernel, so the inf reaches that tensor's weights.
    found = co.adamw_cuda_(
        ps,
        gs,
        [torch.zeros_like(p) for p in ps],
        [torch.zeros_like(p) for p in ps],
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.1,
        step=1,
        check_finite=False,
    )
    assert not bool(found) and not torch.isfinite(ps[-1][0])
    assert all(torch.isfinite(p).all() for p in ps[:-1])


@pytest.mark.parametrize("hdtype", [torch.float16, torch.bfloat16])
def test_half_copy_rounds_like_torch(mod, isas, hdtype):
    """Special values through each ISA's bf16/fp16 conversion (vector body and scalar
    tail): ties, overflow to inf, fp16 subnormals and underflow, signed zero, inf, nan
    (bit-exact except nan payloads).
    Lion with lr=0 leaves the parameters as they are, so the copy is of these values."""
    f16 = torch.finfo(torch.float16)
    special = torch.tensor(
        [
            65504.0,
            65519.99,
            65520.0,
            1e5,
            -1e5,
            f16.tiny,
            f16.tiny / 3,
            2.0**-25,
            2.0**-24,
            3 * 2.0**-26,
            2.0**-26,
            1e-30,
            1e-45,
            -0.0,
            0.0,
            1.0 + 2.0**-11,
            1.0 + 3 * 2.0**-11,
            1.0 + 2.0**-8,
            1.0 + 3 * 2.0**-8,
            float("inf"),
            float("-inf"),
            float("nan"),
            3.14159,
        ]
    )
    p0 = torch.cat([special, torch.randn(64), special])  # in the vector body and the tail
    for isa in isas:
        p = [p0.clone()]
        half = [torch.empty(p0.shape, dtype=hdtype)]
        mod.lion(
            p,
            [torch.randn(p0.shape)],
            [torch.zeros(p0.shape)],
            half,
            0.0,
            0.9,
            0.99,
            0.0,
            1.0,
            True,
            1,
            isa,
        )
        torch.testing.assert_close(p[0], p0, rtol=0, atol=0, equal_nan=True)  # -0 may turn +0
        want = p[0].to(hdtype)
        nan = want.isnan()  # torch's own nan bits differ between its scalar and vector paths
        assert torch.equal(half[0].isnan(), nan), isa
        assert torch.equal(half[0][~nan].view(torch.int16), want[~nan].view(torch.int16)), isa
