"""Fused cross-entropy: the Triton kernels (interpreted on CPU) and the reference against
torch's cross_entropy, vocabulary-parallel on the virtual mesh against the unsharded loss,
and the custom ops under opcheck / vmap / grad / make_fx.

Tolerances. fp32: ours sums exp over the row in chunks, torch in one pass, both in fp32,
so losses and gradients agree to a few fp32 ulps of the row's logsumexp (rtol 1e-5,
atol 1e-6 covers V <= 100). bf16 logits: both upcast the same bf16 values, so the loss
keeps the fp32 tolerance; the gradient is rounded to bf16 once on each side from fp32
values that agree to ~1e-6, and the interpreter's fp32 -> bf16 cast truncates where torch
rounds, so they may differ by one bf16 ulp (2**-7 relative): rtol 1e-2.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fsharded as fs
from fsharded import P
from fsharded.kernels import _dispatch
from fsharded.kernels.losses import cross_entropy, cross_entropy_reference

# Triton runs on the GPU when there is one, else interpreted on CPU (tests/conftest.py).
DEV = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = [
    "reference",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not _dispatch.triton_available(DEV), reason="needs Triton (CUDA, or TRITON_INTERPRET=1)"
        ),
    ),
]
FP32 = dict(rtol=1e-5, atol=1e-6)
BF16_GRAD = dict(rtol=1e-2, atol=1e-5)


def _torch_ce(logits, targets, reduction="mean", ignore_index=-100):
    """torch's loss on the fp32 logits, rows flattened, reshaped back for "none"."""
    V = logits.shape[-1]
    out = F.cross_entropy(
        logits.float().reshape(-1, V),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
    )
    return out.reshape(targets.shape) if reduction == "none" else out


def _data(shape, V, dtype=torch.float32, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, V, generator=g)).to(DEV, dtype)
    targets = torch.randint(0, V, shape, generator=g).to(DEV)
    if ignore and targets.numel() > 2:
        targets.view(-1)[1] = -100
    return logits, targets


def _value_and_grad(fn, logits, targets, reduction, **kw):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, targets, reduction=reduction, **kw)
    cot = (
        torch.linspace(0.5, 1.5, loss.numel(), device=DEV).reshape(loss.shape)
        if loss.dim()
        else None
    )
    loss.backward(cot)
    return loss.detach(), x.grad


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch(impl, dtype, reduction):
    logits, targets = _data((2, 5), 37, dtype)  # 37: two chunks, the last one partial
    got, g = _value_and_grad(
        lambda x, t, **kw: cross_entropy(x, t, impl=impl, **kw), logits, targets, reduction
    )
    want, gw = _value_and_grad(_torch_ce, logits, targets, reduction)
    assert got.dtype == torch.float32 and g.dtype == dtype
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(g, gw, **(FP32 if dtype == torch.float32 else BF16_GRAD))
    assert (g[0, 1] == 0).all()  # the ignored row has no gradient


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("V", [1, 32, 64, 100])
def test_vocab_sizes_and_chunking(impl, V):
    logits, targets = _data((3,), V, seed=V, ignore=False)
    got, g = _value_and_grad(
        lambda x, t, **kw: cross_entropy(x, t, impl=impl, **kw), logits, targets, "sum"
    )
    want, gw = _value_and_grad(_torch_ce, logits, targets, "sum")
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(g, gw, **FP32)


@pytest.mark.parametrize("impl", IMPLS)
def test_extreme_logits(impl):
    """Large magnitudes (the online max keeps exp in range) and -inf entries, including a
    whole first chunk of -inf (the running max is -inf there)."""
    logits, targets = _data((4,), 70, seed=3, ignore=False)
    logits[0] *= 1e4
    logits[1, :40] = float("-inf")
    logits[2, ::3] = float("-inf")
    targets[1], targets[2] = 50, 1
    got, g = _value_and_grad(
        lambda x, t, **kw: cross_entropy(x, t, impl=impl, **kw), logits, targets, "none"
    )
    want, gw = _value_and_grad(_torch_ce, logits, targets, "none")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)  # row 0 has |lse| ~ 1e4
    torch.testing.assert_close(g, gw, **FP32)


@pytest.mark.parametrize("impl", IMPLS)
def test_ignore_index(impl):
    logits, targets = _data((6,), 20, seed=1, ignore=False)
    targets[:3] = 0
    for ii in (0, 7):
        got, g = _value_and_grad(
            lambda x, t, **kw: cross_entropy(x, t, impl=impl, **kw),
            logits,
            targets,
            "mean",
            ignore_index=ii,
        )
        want, gw = _value_and_grad(_torch_ce, logits, targets, "mean", ignore_index=ii)
        torch.testing.assert_close(got, want, **FP32)
        torch.testing.assert_close(g, gw, **FP32)
    all_ignored = torch.full((6,), -100, device=DEV)
    assert cross_entropy(logits, all_ignored, impl=impl).isnan()  # 0 / 0, as torch
    assert _torch_ce(logits, all_ignored).isnan()
    assert cross_entropy(logits, all_ignored, reduction="sum", impl=impl) == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_shapes_and_strides(impl):
    x1, t1 = _data((), 13, seed=2)  # (V,) logits, a 0-d target
    torch.testing.assert_close(cross_entropy(x1, t1, impl=impl), _torch_ce(x1, t1), **FP32)
    x3, t3 = _data((2, 3, 2), 11, seed=4)
    torch.testing.assert_close(
        cross_entropy(x3, t3, reduction="none", impl=impl), _torch_ce(x3, t3, "none"), **FP32
    )
    base, t = _data((4,), 50, seed=5, ignore=False)
    t = t % 37
    for x in (base[:, 5:42], base.t().contiguous().t()[:, :37], base.t()[:37].t()):
        # row-strided, column-major (stride 1 along rows), and a transposed slice
        torch.testing.assert_close(cross_entropy(x, t, impl=impl), _torch_ce(x, t), **FP32)
    empty = torch.empty(0, 9, device=DEV)
    no_t = torch.empty(0, dtype=torch.long, device=DEV)
    assert cross_entropy(empty, no_t, reduction="sum", impl=impl) == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_targets_give_nan_rows(impl):
    logits, targets = _data((4,), 10, seed=6, ignore=False)
    targets[1], targets[2] = 10, -3
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, targets, reduction="none", impl=impl)
    assert loss[1].isnan() and loss[2].isnan() and loss[[0, 3]].isfinite().all()
    loss[[0, 3]].sum().backward()
    assert (x.grad[[1, 2]] == 0).all()
    assert cross_entropy(logits, targets, impl=impl).isnan()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [2, 4])
def test_vocab_parallel_matches_unsharded(impl, n):
    """Value and gradient of the vocab-sharded loss equal the loss on the full logits,
    with .backward() through shard_map and with torch.func.grad inside it."""
    mesh = fs.Mesh({"tensor": n})
    logits, targets = _data((6,), 48, seed=n)  # 48 / n columns per shard
    targets[2] = 47  # owned by the last shard
    for reduction in ("mean", "none"):
        f = fs.shard_map(
            lambda x, t, r=reduction: cross_entropy(x, t, axis="tensor", reduction=r, impl=impl),
            mesh=mesh,
            in_specs=(P(None, "tensor"), P()),
            out_specs=P(),
        )
        got, g = _value_and_grad(lambda x, t, reduction, f=f: f(x, t), logits, targets, reduction)
        want, gw = _value_and_grad(_torch_ce, logits, targets, reduction)
        torch.testing.assert_close(got, want, **FP32)
        torch.testing.assert_close(g, gw, **FP32)

    def step(x, t):
        return torch.func.grad(lambda x: cross_entropy(x, t, axis="tensor", impl=impl))(x)

    g_in = fs.shard_map(
        step, mesh=mesh, in_specs=(P(None, "tensor"), P()), out_specs=P(None, "tensor")
    )(logits, targets)
    torch.testing.assert_close(g_in, gw_mean(logits, targets), **FP32)

    ref = fs.shard_map(
        lambda x, t: cross_entropy_reference(x, t, axis="tensor"),
        mesh=mesh,
        in_specs=(P(None, "tensor"), P()),
        out_specs=P(),
    )(logits, targets)
    torch.testing.assert_close(ref, _torch_ce(logits, targets), **FP32)


def gw_mean(logits, targets):
    return _value_and_grad(_torch_ce, logits, targets, "mean")[1]


@pytest.mark.parametrize("impl", IMPLS)
def test_vocab_parallel_bf16_and_out_of_range(impl):
    mesh = fs.Mesh({"tensor": 2})
    logits, targets = _data((2, 3), 20, torch.bfloat16, seed=9)
    f = fs.shard_map(
        lambda x, t: cross_entropy(x, t, axis="tensor", impl=impl),
        mesh=mesh,
        in_specs=(P(None, None, "tensor"), P()),
        out_specs=P(),
    )
    got, g = _value_and_grad(lambda x, t, reduction: f(x, t), logits, targets, "mean")
    want, gw = _value_and_grad(_torch_ce, logits, targets, "mean")
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(g, gw, **BF16_GRAD)
    bad = targets.clone()
    bad[0, 0] = 20  # past the global vocabulary: no shard owns it
    assert f(logits, bad).isnan()


@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck(impl):
    logits, targets = _data((3,), 37, seed=7)
    logits.requires_grad_()
    torch.library.opcheck(torch.ops.fsharded.cross_entropy_fwd, (logits, targets, impl))
    lse, _ = torch.ops.fsharded.cross_entropy_fwd(logits.detach(), targets, impl)
    d = torch.randn(3, device=DEV)
    torch.library.opcheck(
        torch.ops.fsharded.cross_entropy_bwd, (logits.detach(), targets, lse, d, -d, impl)
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_grad_and_gradcheck(impl):
    logits, targets = _data((3, 4), 19, seed=8)  # vmapped over the first dim
    loss = lambda x, t: cross_entropy(x, t, impl=impl)  # noqa: E731
    got = torch.func.vmap(loss)(logits, targets)
    torch.testing.assert_close(
        got, torch.stack([_torch_ce(x, t) for x, t in zip(logits, targets)]), **FP32
    )
    # targets not batched (in_dims None), and vmap of grad
    g = torch.func.vmap(torch.func.grad(loss), in_dims=(0, None))(logits, targets[0])
    gw = torch.stack([gw_mean(x, targets[0]) for x in logits])
    torch.testing.assert_close(g, gw, **FP32)
    # the backward formula, in float64 (reference path; Triton takes no fp64)
    x64 = logits[0].double().requires_grad_()
    torch.autograd.gradcheck(lambda x: cross_entropy(x, targets[0], impl="reference"), (x64,))


@pytest.mark.parametrize("impl", IMPLS)
def test_make_fx(impl):
    logits, targets = _data((4,), 21, seed=10)

    def step(x, t):
        return torch.func.grad_and_value(lambda x: cross_entropy(x, t, impl=impl))(x)

    gm = make_fx(step, tracing_mode="fake")(logits, targets)
    code = gm.code
    assert "fsharded.cross_entropy_fwd" in code and "fsharded.cross_entropy_bwd" in code
    g, loss = gm(logits, targets)
    torch.testing.assert_close(loss, _torch_ce(logits, targets), **FP32)
    torch.testing.assert_close(g, gw_mean(logits, targets), **FP32)


def test_errors():
    x, t = _data((3,), 5)
    with pytest.raises(TypeError, match="logits must be float"):
        cross_entropy(x.int(), t)
    with pytest.raises(TypeError, match="targets must be int64"):
        cross_entropy(x, t.float())
    with pytest.raises(ValueError, match=r"targets of shape \(4,\)"):
        cross_entropy(x, torch.zeros(4, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="non-empty last"):
        cross_entropy(torch.empty(3, 0, device=DEV), t)
    with pytest.raises(ValueError, match="reduction='avg'"):
        cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="bound by an enclosing shard_map"):
        cross_entropy(x, t, axis="tensor")
    mesh = fs.Mesh({"data": 2})
    with pytest.raises(ValueError, match="bound by an enclosing shard_map"):
        fs.shard_map(
            lambda x, t: cross_entropy(x, t, axis="tensor"),
            mesh=mesh,
            in_specs=(P(), P()),
            out_specs=P(),
        )(x, t)
    if _dispatch.triton_available(DEV):
        with pytest.raises(TypeError, match="Triton kernel takes"):
            cross_entropy(x.double(), t, impl="triton")
    # float64 runs the reference under auto
    torch.testing.assert_close(cross_entropy(x.double(), t), _torch_ce(x.double(), t).double())


def test_import_does_not_import_triton():
    code = (
        "import sys, fsharded.kernels.losses, fsharded.kernels.quant; "
        "assert 'triton' not in sys.modules, 'triton imported'"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_large_vocab_bf16():
    """Real sizes on the GPU: autotuned kernels, bf16 logits, V not a multiple of a chunk."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 50257, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 50257, (512,), device="cuda", generator=g)
    loss = cross_entropy(x, t, impl="triton")
    loss.backward()
    xr = x.detach().clone().requires_grad_()
    want = F.cross_entropy(xr.float(), t)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, xr.grad, **BF16_GRAD)


def _gloo_one(impl: str) -> tuple:
    logits, targets = _data((6,), 20, seed=11)
    logits, targets = logits.cpu(), targets.cpu()
    specs = dict(mesh=fs.Mesh({"tensor": 2}), in_specs=(P(None, "tensor"), P()))

    def loss(x, t):
        return cross_entropy(x, t, axis="tensor", impl=impl)

    x = logits.clone().requires_grad_()
    value = fs.shard_map(loss, out_specs=P(), **specs)(x, targets)
    value.backward()
    step = fs.shard_map(
        lambda x, t: torch.func.grad(loss)(x, t), out_specs=P(None, "tensor"), **specs
    )
    return value.detach(), x.grad, step(logits, targets)


def _gloo_case() -> dict:
    """On each gloo rank: the vocab-parallel loss and its gradient (backward through
    shard_map, and torch.func.grad inside it) for every implementation that runs on CPU."""
    # The ranks run the reference kernels: Triton's interpreter inside spawned gloo ranks
    # aborted at teardown about once in 50 runs on a loaded 2-core machine; the Triton
    # kernels are checked against the reference in-process (and on GPUs by -m gpu).
    impls = ["reference"]
    return {impl: _gloo_one(impl) for impl in impls}


@pytest.mark.multiprocess
def test_vocab_parallel_on_gloo_ranks():
    from fsharded.testing import run_on_ranks

    logits, targets = _data((6,), 20, seed=11)
    want, gw = _value_and_grad(_torch_ce, logits.cpu(), targets.cpu(), "mean")
    for rank in run_on_ranks(_gloo_case, 2):
        assert rank.keys() >= {"reference"}
        for loss, g_backward, g_inside in rank.values():
            torch.testing.assert_close(loss, want, **FP32)
            torch.testing.assert_close(g_backward, gw, **FP32)
            torch.testing.assert_close(g_inside, gw, **FP32)
