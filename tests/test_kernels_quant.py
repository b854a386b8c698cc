"""Blockwise int8 quantisation: Triton (interpreted on CPU) bit-exact against the
reference, the stated error bound, the custom ops under opcheck / vmap / make_fx, and the
quantized collectives against the exact ones on the virtual mesh.

Exactness: q and the scales use the same fp32 operations in the same order on both sides
(correctly rounded division, round half to even), so they are compared bit for bit, and
so is the dequantized output (one fp32 product, one rounding to the output dtype).
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fsharded as fs
from fsharded import P
from fsharded.kernels import _dispatch
from fsharded.kernels.quant import (
    dequantize_int8,
    dequantize_int8_reference,
    quantize_int8,
    quantize_int8_reference,
    quantized_all_gather,
    quantized_psum_scatter,
)

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
FP32_SLACK = 1 + 2.0**-14  # the fp32 roundings in the bound (module docstring)
ULP_HALF = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _data(*shape, dtype=torch.float32, seed=0):
    """Values over six decades, so blocks have very different scales; one zero block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 10 ** torch.empty(shape).uniform_(-3, 3, generator=g)
    x.view(-1)[:16] = 0
    return x.to(DEV, dtype)


def _bound(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Elementwise ``scale / 2`` of each element's block, shaped like ``x``."""
    _, s = quantize_int8_reference(x, block_size)
    return (s / 2).repeat_interleave(block_size)[: x.numel()].view(x.shape)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
def test_bit_exact_and_error_bound(impl, dtype, block_size):
    x = _data(3, 100, dtype=dtype, seed=block_size)  # 300 elements: a padded last block
    q, s = quantize_int8(x, block_size, impl=impl)
    qr, sr = quantize_int8_reference(x, block_size)
    nb = -(-300 // block_size)
    assert q.shape == (nb * block_size,) and q.dtype == torch.int8
    assert s.shape == (nb,) and s.dtype == torch.float32
    assert torch.equal(q, qr) and torch.equal(s, sr)
    assert (q[300:] == 0).all() and q.abs().max() <= 127
    for out in (torch.float32, dtype):
        y = dequantize_int8(q, s, x.shape, out, block_size, impl=impl)
        assert y.shape == x.shape and y.dtype == out
        assert torch.equal(y, dequantize_int8_reference(qr, sr, x.shape, out, block_size))
        err = (x.float() - y.float()).abs()
        assert (err <= _bound(x, block_size) * FP32_SLACK + y.float().abs() * ULP_HALF[out]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_rounding_zero_and_nonfinite_blocks(impl):
    x = torch.tensor(
        [127.0, 2.5, 3.5, -2.5, 0.5, -127.0, 1.49, 126.5]  # scale 1: ties go to even
        + [0.0] * 8  # a zero block: scale 0, q 0, exact
        + [1.0, float("nan"), 2.0, 3.0, float("inf"), 1.0, 0.0, -1.0],  # non-finite blocks
        device=DEV,
    )
    q, s = quantize_int8(x, 8, impl=impl)
    assert q[:8].tolist() == [127, 2, 4, -2, 0, -127, 1, 126]
    assert s[0] == 1 and s[1] == 0 and not s[2].isfinite()
    y = dequantize_int8(q, s, x.shape, block_size=8, impl=impl)
    assert torch.equal(
        y[:16],
        torch.tensor([127, 2, 4, -2, 0, -127, 1, 126] + [0] * 8, dtype=torch.float32, device=DEV),
    )
    assert y[16:].isnan().all()  # a block holding nan/inf dequantizes to nan
    qr, sr = quantize_int8_reference(x, 8)
    assert torch.equal(q, qr)
    torch.testing.assert_close(s, sr, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap(impl):
    x = _data(4, 3, 50, seed=1)
    q, s = torch.func.vmap(lambda v: quantize_int8(v, 32, impl=impl))(x)
    for i in range(4):
        qi, si = quantize_int8_reference(x[i], 32)
        assert torch.equal(q[i], qi) and torch.equal(s[i], si)
    y = torch.func.vmap(lambda a, b: dequantize_int8(a, b, (3, 50), torch.bfloat16, 32, impl=impl))(
        q, s
    )
    for i in range(4):
        assert torch.equal(y[i], dequantize_int8_reference(q[i], s[i], (3, 50), torch.bfloat16, 32))
    # q batched with shared (unbatched) scales
    y0 = torch.func.vmap(lambda a: dequantize_int8(a, s[0], (3, 50), block_size=32, impl=impl))(q)
    assert torch.equal(y0[2], dequantize_int8_reference(q[2], s[0], (3, 50), block_size=32))


@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck_and_make_fx(impl):
    x = _data(2, 40, seed=2)
    torch.library.opcheck(torch.ops.fsharded.quantize_int8, (x, 16, impl))
    q, s = torch.ops.fsharded.quantize_int8(x, 16, impl)
    torch.library.opcheck(torch.ops.fsharded.dequantize_int8, (q, s, 40, 16, torch.bfloat16, impl))

    def roundtrip(x):
        q, s = quantize_int8(x, 16, impl=impl)
        return dequantize_int8(q, s, x.shape, block_size=16, impl=impl)

    gm = make_fx(roundtrip, tracing_mode="fake")(x)
    assert "fsharded.quantize_int8" in gm.code and "fsharded.dequantize_int8" in gm.code
    assert torch.equal(gm(x), roundtrip(x))


def test_errors():
    x = _data(64)
    for bad in (0, -4, 3, 100, 2**15, 2.0):
        with pytest.raises(ValueError, match="power of two"):
            quantize_int8(x, bad)
    with pytest.raises(TypeError, match="must be float32, bfloat16 or float16"):
        quantize_int8(torch.arange(8, device=DEV))
    with pytest.raises(TypeError, match="cast float64"):
        quantize_int8(x.double())
    q, s = quantize_int8(x, 16)
    with pytest.raises(ValueError, match="needs 4 scales"):
        dequantize_int8(q, s[:3], (64,), block_size=16)
    with pytest.raises(ValueError, match="needs 5 scales"):
        dequantize_int8(q, s, (65,), block_size=16)
    with pytest.raises(TypeError, match="q must be an int8"):
        dequantize_int8(q.int(), s, (64,), block_size=16)
    with pytest.raises(TypeError, match="scales must be a float32"):
        dequantize_int8(q, s.half(), (64,), block_size=16)
    with pytest.raises(TypeError, match="dtype must be"):
        dequantize_int8(q, s, (64,), torch.int32, block_size=16)


def _gather_bound(shards, dim, block_size):
    return torch.cat([_bound(xs, block_size) for xs in shards], dim)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [2, 4])
def test_quantized_all_gather(impl, n):
    mesh = fs.Mesh({"d": n})
    x = _data(8, 24, seed=n)
    for dim, spec in ((0, P("d")), (1, P(None, "d"))):
        f = fs.shard_map(
            lambda v, dim=dim: quantized_all_gather(v, "d", invariant=True, block_size=16, dim=dim, impl=impl),
            mesh=mesh,
            in_specs=(spec,),
            out_specs=P(),
        )
        got = f(x)
        exact = fs.shard_map(
            lambda v, dim=dim: fs.all_gather_invariant(v, "d", dim=dim),
            mesh=mesh,
            in_specs=(spec,),
            out_specs=P(),
        )(x)
        assert torch.equal(exact, x) and got.dtype == x.dtype
        bound = _gather_bound(x.chunk(n, dim), dim, 16)
        assert ((got - exact).abs() <= bound * FP32_SLACK).all()
        assert not torch.equal(got, exact)  # it did quantize
    xb = x.to(torch.bfloat16)
    got = fs.shard_map(
        lambda v: quantized_all_gather(v, "d", invariant=True, impl=impl),
        mesh=mesh,
        in_specs=(P("d"),),
        out_specs=P(),
    )(xb)
    err = (got.float() - xb.float()).abs()
    assert got.dtype == torch.bfloat16
    assert (
        err <= _gather_bound(xb.chunk(n), 0, 256) * FP32_SLACK + got.float().abs() * 2**-8
    ).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [2, 4])
def test_quantized_psum_scatter(impl, n):
    mesh = fs.Mesh({"d": n})
    x = _data(n * 4, 8 * n, seed=10 + n)  # shard j holds rows [4j, 4j + 4)
    for dim in (0, 1):
        f = fs.shard_map(
            lambda v, dim=dim: quantized_psum_scatter(v, "d", block_size=8, dim=dim, impl=impl),
            mesh=mesh,
            in_specs=(P("d"),),
            out_specs=P("d") if dim == 0 else P(None, "d"),
        )
        exact = fs.shard_map(
            lambda v, dim=dim: fs.psum_scatter(v, "d", dim=dim),
            mesh=mesh,
            in_specs=(P("d"),),
            out_specs=P("d") if dim == 0 else P(None, "d"),
        )(x)
        got = f(x)
        # Shard i's output sums chunk i of every shard j, each quantized on its own.
        shards = x.chunk(n, 0)
        bound = torch.cat(
            [sum(_bound(xj.chunk(n, dim)[i].contiguous(), 8) for xj in shards) for i in range(n)],
            dim,
        )
        abs_sum = torch.cat(
            [sum(xj.chunk(n, dim)[i].abs() for xj in shards) for i in range(n)], dim
        )
        err = (got - exact).abs()
        assert (err <= bound * FP32_SLACK + abs_sum * 2.0**-21).all()  # + fp32 sum roundings
        assert not torch.equal(got, exact)


def test_quantized_collectives_bytes_grad_and_errors():
    mesh = fs.Mesh({"d": 4})
    x = torch.randn(4 * 256, device=DEV)
    m = fs.shard_map(
        lambda v: quantized_all_gather(v, "d", invariant=True), mesh=mesh, in_specs=(P("d"),), out_specs=P()
    ).collectives(x)
    exact = fs.shard_map(
        lambda v: fs.all_gather_invariant(v, "d"), mesh=mesh, in_specs=(P("d"),), out_specs=P()
    ).collectives(x)
    assert [e.dtype for e in m] == [torch.int8, torch.float32]
    assert m.total_bytes() * 3.9 < exact.total_bytes()  # 256 int8 + one fp32 vs 256 fp32
    with pytest.raises(ValueError, match="requires grad"):
        fs.shard_map(
            lambda v: quantized_all_gather(v, "d", invariant=True), mesh=mesh, in_specs=(P("d"),), out_specs=P()
        )(x.clone().requires_grad_())
    with pytest.raises(ValueError, match="requires grad"):
        fs.shard_map(
            torch.func.grad(lambda v: quantized_psum_scatter(v, "d").sum()),
            mesh=mesh,
            in_specs=(P(),),
            out_specs=P(),
        )(x)
    with pytest.raises(ValueError, match="not divisible by the size 4"):
        fs.shard_map(
            lambda v: quantized_psum_scatter(v, "d"), mesh=mesh, in_specs=(P(),), out_specs=P()
        )(torch.randn(6, device=DEV))
    with pytest.raises(ValueError, match="outside shard_map"):
        quantized_all_gather(x, "d")
    one = fs.Mesh({"d": 1, "e": 2})  # a size-1 axis sends nothing, so nothing is quantized
    out = fs.shard_map(
        lambda v: quantized_psum_scatter(quantized_all_gather(v, "d", invariant=True), "d"),
        mesh=one,
        in_specs=(P("e"),),
        out_specs=P("e"),
    )(x)
    assert torch.equal(out, x)


def _collectives(impl: str):
    mesh = fs.Mesh({"d": 2})
    gather = fs.shard_map(
        lambda v: quantized_all_gather(v, "d", invariant=True, block_size=16, impl=impl),
        mesh=mesh,
        in_specs=(P("d"),),
        out_specs=P(),
    )
    scatter = fs.shard_map(
        lambda v: quantized_psum_scatter(v, "d", block_size=16, dim=1, impl=impl),
        mesh=mesh,
        in_specs=(P(),),
        out_specs=P(None, "d"),
    )
    return gather, scatter


def _gloo_case() -> dict:
    """On each gloo rank: both quantized collectives (int8 and fp32 payloads through gloo)."""
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(0))
    # The ranks run the reference kernels: Triton's interpreter inside spawned gloo ranks
    # aborted at teardown about once in 50 runs on a loaded 2-core machine; the Triton
    # kernels are checked against the reference in-process (and on GPUs by -m gpu).
    impls = ["reference"]
    out = {}
    for impl in impls:
        gather, scatter = _collectives(impl)
        out[impl] = (gather(x), scatter(x))
    return out


@pytest.mark.multiprocess
def test_quantized_collectives_on_gloo_ranks():
    from fsharded.testing import run_on_ranks

    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(0))
    # The same inputs on the virtual mesh: the results must agree bit for bit.
    gather, scatter = _collectives("reference")
    want_gather, want_scatter = gather(x), scatter(x)
    assert ((want_gather - x).abs() <= _gather_bound(x.chunk(2), 0, 16) * FP32_SLACK).all()
    for rank in run_on_ranks(_gloo_case, 2):
        assert rank.keys() >= {"reference"}
        for gathered, scattered in rank.values():
            assert torch.equal(gathered, want_gather) and torch.equal(scattered, want_scatter)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bit_exact_large():
    """Compiled kernels (correctly rounded division on the GPU) against the reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(3_000_001, device="cuda", generator=g) * 100).to(dtype)
        for block_size in (64, 256, 4096):
            q, s = quantize_int8(x, block_size, impl="triton")
            qr, sr = quantize_int8_reference(x, block_size)
            assert torch.equal(q, qr) and torch.equal(s, sr)
            y = dequantize_int8(q, s, x.shape, dtype, block_size, impl="triton")
            assert torch.equal(y, dequantize_int8_reference(qr, sr, x.shape, dtype, block_size))
