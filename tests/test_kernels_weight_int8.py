"""Int8 weight-only products (``kernels.weight_int8``): the quantisation's error bound and
layout, Triton (interpreted on CPU) and ATen's packed CPU product against the fp32
reference, the custom op under ``make_fx``, and bad input named; the C++ row product of
float weights (``rows_matmul``) against the exact product."""

from __future__ import annotations

import os

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fsharded.kernels import _dispatch
from fsharded.kernels.weight_int8 import (
    dequantize_weight,
    int8_matmul,
    int8_matmul_reference,
    quantize_weight,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not _dispatch.triton_available(DEV), reason="needs Triton (CUDA, or TRITON_INTERPRET=1)")
# One rounding of the fp32 result to the output dtype (the interpreter's bf16 cast truncates:
# a full ulp), on top of the fp32 accumulation's order (relative to the row's magnitude).
ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.mark.parametrize("group_size", [None, 32, 8])
def test_quantize_weight_layout_and_error_bound(group_size):
    torch.manual_seed(0)
    w = torch.randn(64, 24) * torch.logspace(-2, 1, 24)  # channels of very different scales
    w[:8, 3] = 0.0  # a group of zeros
    q, s = quantize_weight(w, group_size)
    G = 64 if group_size is None else group_size
    assert q.shape == (24, 64) and q.dtype == torch.int8 and s.shape == (24, 64 // G) and s.dtype == torch.float32
    assert int(q.abs().max()) <= 127
    want = w.T.reshape(24, 64 // G, G).abs().amax(-1) / 127
    assert torch.equal(s, want)  # absmax / 127 per output channel and group
    err = (dequantize_weight(q, s) - w).abs()
    bound = s.repeat_interleave(G, dim=1).T / 2 * (1 + 2.0**-14)
    assert bool((err <= bound).all())
    if group_size == 8:
        assert float(s[3, 0]) == 0.0 and not q[3, :8].any()  # zeros stay exact


def _cases():
    torch.manual_seed(1)
    yield from [(1, 64, 40, None), (5, 96, 72, 32), (17, 128, 130, 16), (64, 80, 33, None), (3, 48, 130, None),
                (2, 37, 9, None), (4, 100, 42, 20)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", [pytest.param("triton", marks=needs_triton), "cpu", "cpp"])
def test_int8_matmul_equals_the_fp32_reference(impl, dtype):
    for M, K, N, G in _cases():
        if impl == "cpu" and (G is not None or K % 16):
            continue  # the packed product: one scale per output channel, K a multiple of 16
        w = torch.randn(K, N)
        q, s = quantize_weight(w, G)
        x = torch.randn(M, K).to(dtype)
        ref = int8_matmul_reference(x, q, s).float()
        exact = x.float() @ dequantize_weight(q, s)
        assert torch.allclose(ref, exact.to(dtype).float(), rtol=0, atol=0)
        got = int8_matmul(x.to(DEV) if impl == "triton" else x, q.to(DEV) if impl == "triton" else q,
                          s.to(DEV) if impl == "triton" else s, impl=impl).float().cpu()
        assert got.dtype == torch.float32 and got.shape == (M, N)
        # fp32 accumulation in another order, one rounding to dtype, and (the packed CPU
        # product) the scales rounded to dtype: bounded by the row's magnitude.
        scale_err = 0.0 if impl in ("triton", "cpp") or dtype == torch.float32 else {torch.bfloat16: 2.0**-8,
                                                                              torch.float16: 2.0**-11}[dtype]
        mag = x.float().abs() @ dequantize_weight(q, s).abs()
        tol = mag * (1e-5 + scale_err) + exact.abs() * ULP[dtype] * 2 + 1e-6
        assert bool(((got - exact).abs() <= tol).all()), (M, K, N, G, dtype, float((got - exact).abs().max()))


def test_auto_picks_the_cpu_products_and_leading_dims_pass_through(monkeypatch):
    from fsharded.kernels import weight_int8

    w = torch.randn(32, 12)
    q, s = quantize_weight(w)
    x = torch.randn(2, 3, 32)
    y = int8_matmul(x, q, s)
    assert y.shape == (2, 3, 12)
    torch.testing.assert_close(y, x @ dequantize_weight(q, s), rtol=1e-5, atol=1e-5)
    chosen = []
    real, real_cpp = weight_int8._op, weight_int8._cpp

    def spy(x, q, s, impl):
        chosen.append(impl)
        return real(x, q, s, impl)

    def spy_cpp(x, q, s):
        chosen.append("cpp")
        return real_cpp(x, q, s)

    monkeypatch.setattr(weight_int8, "_op", spy)
    monkeypatch.setattr(weight_int8, "_cpp", spy_cpp)
    int8_matmul(torch.randn(16, 32), q, s)  # decoding rows: the C++ product
    int8_matmul(torch.randn(17, 32), q, s)  # more rows (a prefill): ATen's packed product
    int8_matmul(torch.randn(17, 32), *quantize_weight(w, 8))  # groups, many rows: the reference
    assert chosen == ["cpp", "cpu", "reference"]
    monkeypatch.setattr(weight_int8, "_op", real)
    monkeypatch.setattr(weight_int8, "_cpp", real_cpp)
    # Traced: the C++ product is a dispatcher op of its own (fsharded_cpu), the others the
    # Python custom op.
    for rows, op in ((x, "fsharded_cpu.int8_matmul.default"), (torch.randn(17, 32), "fsharded.int8_matmul.default")):
        gm = make_fx(lambda x, q, s: int8_matmul(x, q, s), tracing_mode="fake")(rows, q, s)
        assert op in [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_the_cpp_product_in_a_compiled_graph_and_under_vmap():
    # A decode step compiled by Inductor calls the C++ op itself (no Python custom op in
    # between), with the eager numbers; the virtual mesh's vmap batches it.
    torch.manual_seed(0)
    q, s = quantize_weight(torch.randn(64, 24))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    calls = []

    def backend(gm, inputs):
        calls.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, inputs)

    fn = torch.compile(lambda x: torch.relu(int8_matmul(x, q, s)) * 2, backend=backend, fullgraph=True)
    torch.testing.assert_close(fn(x), torch.relu(int8_matmul_reference(x, q, s)) * 2, rtol=0, atol=0)
    assert any("fsharded_cpu.int8_matmul" in c for c in calls) and not any("fsharded.int8_matmul" in c
                                                                            for c in calls), calls
    from fsharded.kernels.weight_int8 import rows_matmul

    w = torch.randn(64, 24)
    calls.clear()
    with torch.no_grad():
        fn = torch.compile(lambda x: torch.relu(rows_matmul(x, w)), backend=backend, fullgraph=True)
        torch.testing.assert_close(fn(x.float()), torch.relu(torch.ops.fsharded_cpu.rows_matmul(x.float(), w)),
                                   rtol=0, atol=0)
    assert any("fsharded_cpu.rows_matmul" in c for c in calls), calls
    xs = torch.randn(3, 2, 64)  # shared weights: one product of every batch's rows
    torch.testing.assert_close(torch.vmap(lambda x: int8_matmul(x, q, s))(xs),
                               torch.stack([int8_matmul_reference(x, q, s) for x in xs]), rtol=1e-5, atol=1e-5)
    qs = torch.stack([q, q.flip(0)])
    ss = torch.stack([s, s.flip(0)])  # weights per batch entry: one product each
    got = torch.vmap(lambda x, q, s: int8_matmul(x, q, s))(xs[:2], qs, ss)
    torch.testing.assert_close(got, torch.stack([int8_matmul_reference(xs[i], qs[i], ss[i]) for i in range(2)]),
                               rtol=1e-5, atol=1e-5)


def test_input_widths_the_packed_cpu_product_gets_wrong_take_the_reference():
    # torch 2.13's _weight_int8pack_mm is wrong where K is not a multiple of 16 (and crashed
    # at K=172 with 3 rows): auto must not send those there.
    for K in (36, 100, 168, 172, 180):
        q, s = quantize_weight(torch.randn(K, 64))
        x = torch.randn(3, K, dtype=torch.bfloat16)
        torch.testing.assert_close(int8_matmul(x, q, s), int8_matmul_reference(x, q, s), rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="a multiple of 16"):
            int8_matmul(x, q, s, impl="cpu")


def test_bad_input_is_named():
    q, s = quantize_weight(torch.randn(32, 8), 16)
    with pytest.raises(ValueError, match="positive divisor of the 32 input features"):
        quantize_weight(torch.randn(32, 8), 5)
    with pytest.raises(ValueError, match="2-D float32"):
        quantize_weight(torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match="x has 16 features but the weight 32"):
        int8_matmul(torch.randn(2, 16), q, s)
    with pytest.raises(ValueError, match="scales must be fp32"):
        int8_matmul(torch.randn(2, 32), q, s.half())
    with pytest.raises(ValueError, match="no gradient rule"):
        int8_matmul(torch.randn(2, 32, requires_grad=True), q, s)
    with pytest.raises(RuntimeError, match="one scale per output channel"):
        int8_matmul(torch.randn(2, 32), q, s, impl="cpu")


def _rows_cases():
    # (rows of x, K, N): column tails past 16 and 8 lanes, K past the 4-row passes and the
    # 64-row blocks of a thread
    return [(1, 512, 1376), (2, 1376, 512), (3, 37, 23), (4, 5, 16), (1, 64, 17), (4, 300, 9), (2, 130, 70)]


def _check_rows(rows_matmul):
    torch.manual_seed(3)
    for R, K, N in _rows_cases():
        w = torch.randn(K, N)
        for dtype in (torch.float32, torch.bfloat16):
            x, wd = torch.randn(R, K).to(dtype), w.to(dtype)
            got = rows_matmul(x, wd)
            assert got.dtype == dtype and got.shape == (R, N)
            exact = x.double() @ wd.double()
            # fp32 sums in another order, and (bf16) one rounding of the result to bf16
            mag = x.double().abs() @ wd.double().abs()
            tol = mag * 1e-6 + exact.abs() * (ULP[dtype] if dtype != torch.float32 else 0) + 1e-6
            assert bool(((got.double() - exact).abs() <= tol).all()), (R, K, N, dtype)


def test_rows_matmul_equals_the_exact_product_and_falls_back_where_it_does_not_apply():
    from fsharded.kernels import weight_int8

    assert weight_int8.load() is not None, "the C++ products must build here (gcc is present)"
    _check_rows(weight_int8.rows_matmul)
    _check_rows(lambda x, w: torch.ops.fsharded_cpu.rows_matmul(x, w))
    # torch's product where the C++ one does not apply: more rows, a gradient
    real = torch.ops.fsharded_cpu.rows_matmul
    w = torch.randn(32, 8)
    x5 = torch.randn(5, 32)
    torch.testing.assert_close(weight_int8.rows_matmul(x5, w), x5 @ w, rtol=0, atol=0)
    x = torch.randn(2, 32, requires_grad=True)
    y = weight_int8.rows_matmul(x, w)
    y.sum().backward()  # (torch's product: it has a gradient)
    torch.testing.assert_close(x.grad, w.sum(1).expand(2, 32))
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        real(torch.randn(5, 32), w)
    with pytest.raises(RuntimeError, match="of x's dtype"):
        real(torch.randn(2, 32), w.double())
    # leading dims pass through; under vmap (the virtual mesh) a weight per batch entry
    x3 = torch.randn(2, 1, 32)
    torch.testing.assert_close(weight_int8.rows_matmul(x3, w), x3 @ w, rtol=1e-5, atol=1e-5)
    ws = torch.randn(3, 32, 8)
    xs = torch.randn(3, 1, 32)
    with torch.no_grad():
        got = torch.vmap(weight_int8.rows_matmul)(xs, ws)
    torch.testing.assert_close(got, xs @ ws, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_the_other_instruction_set_builds_give_the_same_products(isa):
    # The builds an older or a non-x86 CPU takes (chosen when the library loads), forced on
    # this machine in a fresh process.
    import subprocess
    import sys

    code = ("import torch, test_kernels_weight_int8 as T\n"
            "from fsharded.kernels import weight_int8 as W\n"
            "assert W.load() is not None\n"
            "T._check_rows(W.rows_matmul)\n"
            "for M, K, N, G in T._cases():\n"
            "    q, s = W.quantize_weight(torch.randn(K, N), G)\n"
            "    x = torch.randn(min(M, 16), K)\n"
            "    torch.testing.assert_close(W.int8_matmul(x, q, s, impl='cpp'), W.int8_matmul_reference(x, q, s),"
            " rtol=1e-5, atol=1e-4)\n"
            "print('ok')\n")
    env = {**os.environ, "FSHARDED_DECODE_ISA": isa}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                       cwd=os.path.dirname(__file__))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_rows_matmul_gives_the_same_bits_for_any_thread_count():
    # Fixed blocks of the weight's rows, added in block order: 1 and 2 threads agree
    # bitwise (a virtual mesh and real ranks may run with different thread counts).
    from fsharded.kernels import weight_int8

    torch.manual_seed(5)
    w, x = torch.randn(1100, 300), torch.randn(2, 1100)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = weight_int8.rows_matmul(x, w)
        torch.set_num_threads(2)
        two = weight_int8.rows_matmul(x, w)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)
    # a weight that is not contiguous, and no rows: torch's product
    wt = torch.randn(8, 32).T
    torch.testing.assert_close(weight_int8.rows_matmul(x[:, :32], wt), x[:, :32] @ wt, rtol=0, atol=0)
    assert weight_int8.rows_matmul(torch.randn(0, 32), wt).shape == (0, 8)
