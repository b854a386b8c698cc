"""Flash attention: the Triton kernels (interpreter on CPU, tiny shapes) against the torch
reference, the reference against torch's scaled_dot_product_attention, merge_attention, the
custom-op rules (opcheck, grad, vmap, make_fx) and bad-input errors."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from fsharded.kernels import attention as A
from fsharded.kernels._dispatch import triton_available
from fsharded.kernels.attention import (
    flash_attention,
    flash_attention_reference,
    flash_attention_with_lse,
    merge_attention,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not triton_available(DEV), reason="Triton missing (or no GPU and TRITON_INTERPRET unset)"
)


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)


def _inputs(B, Hq, Hkv, Sq, Sk, D, dtype=torch.float32, seed=0):
    return (
        _rand(B, Hq, Sq, D, dtype=dtype, seed=seed),
        _rand(B, Hkv, Sk, D, dtype=dtype, seed=seed + 1),
        _rand(B, Hkv, Sk, D, dtype=dtype, seed=seed + 2),
    )


def _mask_by_loops(Sq, Sk, causal, window):
    """The visibility rule written out element by element (independent of the module)."""
    m = torch.zeros(Sq, Sk, dtype=torch.bool)
    for i in range(Sq):
        p = i + Sk - Sq
        for j in range(Sk):
            m[i, j] = (not causal or j <= p) and (window is None or j > p - window)
    return m.to(DEV)


def _value_and_grads(fn, q, k, v, g, gl, **opts):
    """``(out, lse, dq, dk, dv)`` of ``fn`` for the loss ``sum(out * g) + sum(lse * gl)``."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v, **opts)
    loss = (out.double() * g).sum() + (lse.double() * gl).sum()
    return (out.detach(), lse.detach(), *torch.autograd.grad(loss, (q, k, v)))


def _ground_truth(q, k, v, g, gl, **opts):
    """The reference in float64, differentiated by torch autograd."""

    def ref(q, k, v, *, causal, window, scale=None):
        scale = A._check("test", q, k, v, causal, window, scale)
        return A._reference_with_lse(q, k, v, causal, window, scale)

    q, k, v = (x.double() for x in (q, k, v))
    return _value_and_grads(ref, q, k, v, g, gl, **opts)


# id, B, Hq, Hkv, Sq, Sk, D, causal, window: seq lengths are not multiples of the 16-wide
# interpreter blocks, so every case has ragged blocks; D=24 exercises the padded head dim.
# "window" is wide enough (35 > 2 blocks) to have fully visible, unmasked blocks between
# its masked left edge and the diagonal; the kv-cache case has a window narrower than a block.
CASES = {
    "causal": (2, 2, 2, 40, 40, 16, True, None),
    "non_causal_sq_ne_sk": (1, 2, 2, 24, 40, 32, False, None),
    "window": (1, 2, 2, 72, 72, 16, True, 35),
    "gqa": (1, 4, 2, 33, 33, 32, True, None),
    "mqa_kv_cache_window": (1, 4, 1, 20, 36, 16, True, 12),
    "head_dim_24": (1, 2, 1, 17, 17, 24, True, None),
    "kv_cache_wide_window": (1, 1, 1, 49, 52, 16, True, 34),
}


def _case(name, dtype=torch.float32):
    B, Hq, Hkv, Sq, Sk, D, causal, window = CASES[name]
    q, k, v = _inputs(B, Hq, Hkv, Sq, Sk, D, dtype=dtype)
    if name == "gqa":  # (B, S, H, D) storage seen through a transpose: strided inputs
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    g = _rand(B, Hq, Sq, D, dtype=torch.float64, seed=7)
    gl = _rand(B, Hq, Sq, dtype=torch.float64, seed=8)
    return q, k, v, g, gl, dict(causal=causal, window=window)


def _assert_close(got, want, atol, rtol):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(
            a.double(), b, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}"
        )


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_triton_fp32_matches_reference(name):
    q, k, v, g, gl, opts = _case(name)
    got = _value_and_grads(flash_attention_with_lse, q, k, v, g, gl, impl="triton", **opts)
    # fp32 kernel vs fp64 truth: the online softmax only reorders fp32 sums (errors ~1e-6 on
    # O(1) values); a masking or indexing bug is O(0.1). 1e-4 separates the two. (The fp32
    # matmuls run exactly: float32_matmul_precision is "highest" by default.)
    _assert_close(got, _ground_truth(q, k, v, g, gl, **opts), atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("name", ["gqa", "window"])
def test_triton_bf16_matches_reference(name):
    q, k, v, g, gl, opts = _case(name, dtype=torch.bfloat16)
    got = _value_and_grads(flash_attention_with_lse, q, k, v, g, gl, impl="triton", **opts)
    # Same bf16 inputs, truth in fp64. The kernel rounds P and dS to bf16 for the tensor-core
    # matmuls (2^-9 relative each) and rounds out/dq/dk/dv to bf16: one ulp is 0.03 at the
    # largest gradients here (~5.7). Measured worst error 0.027 (dv); atol = rtol = 4e-2
    # allows >= 0.04 + 4% while a masking bug (O(0.1) and up) still fails. lse is fp32.
    _assert_close(got, _ground_truth(q, k, v, g, gl, **opts), atol=4e-2, rtol=4e-2)


def test_reference_op_backward_matches_autograd():
    # The op's reference path has a hand-written backward; torch autograd is the truth.
    q, k, v, g, gl, opts = _case("mqa_kv_cache_window")
    q, k, v = (x.double() for x in (q, k, v))
    got = _value_and_grads(flash_attention_with_lse, q, k, v, g, gl, impl="reference", **opts)
    _assert_close(got, _ground_truth(q, k, v, g, gl, **opts), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_sdpa(causal):
    q, k, v = _inputs(2, 4, 2, 24, 24, 16)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    # fp32 vs fp32 with a different summation order: 1e-5 is ~100 ulps on O(1) values.
    for impl in ("reference", None):
        got = flash_attention(q, k, v, causal=causal, impl=impl)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got = flash_attention_reference(q, k, v, causal=causal)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_reference_kv_cache_window_and_lse_match_explicit_mask():
    # Sq < Sk (queries are the last positions) and a sliding window, against SDPA with the
    # mask written out by loops; lse against logsumexp of the same masked scores.
    q, k, v = _inputs(1, 2, 2, 5, 12, 16)
    mask = _mask_by_loops(5, 12, True, 4)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out, lse = flash_attention_with_lse(q, k, v, window=4, impl="reference")
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    s = (q @ k.transpose(-1, -2) / math.sqrt(16)).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


def test_merge_attention_split_keys_equals_full():
    q, k, v = _inputs(1, 2, 2, 9, 14, 16, dtype=torch.float64)
    opts = dict(causal=False, impl="reference")  # float64: the reference path
    full_out, full_lse = flash_attention_with_lse(q, k, v, **opts)
    a = flash_attention_with_lse(q, k[:, :, :6], v[:, :, :6], **opts)
    b = flash_attention_with_lse(q, k[:, :, 6:], v[:, :, 6:], **opts)
    out, lse = merge_attention(*a, *b)
    torch.testing.assert_close(out, full_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, full_lse, atol=1e-12, rtol=1e-12)

    # An empty key set (lse = -inf) is the identity of the merge, both ways round.
    empty = flash_attention_with_lse(q, k[:, :, :0], v[:, :, :0], **opts)
    assert torch.isneginf(empty[1]).all() and (empty[0] == 0).all()
    torch.testing.assert_close(merge_attention(*empty, *a)[0], a[0])
    torch.testing.assert_close(merge_attention(*a, *empty)[1], a[1])
    with pytest.raises(ValueError, match="merge_attention"):
        merge_attention(a[0], a[1], a[0][..., 1:], a[1])


@needs_triton
def test_merge_ring_step_matches_causal_with_kv_cache():
    # A ring-attention step for the second query chunk: the first key chunk is entirely in
    # its past (non-causal), the second is the diagonal (causal, Sq == Sk). Merged, that is
    # causal attention of the chunk over all keys with queries at the last positions;
    # gradients flow through lse into the kernels' backward.
    c = 16
    q, k, v = _inputs(1, 2, 1, c, 2 * c, 16)

    def ring(q, k, v):
        past = flash_attention_with_lse(q, k[:, :, :c], v[:, :, :c], causal=False, impl="triton")
        diag = flash_attention_with_lse(q, k[:, :, c:], v[:, :, c:], causal=True, impl="triton")
        return merge_attention(*past, *diag)

    g = _rand(1, 2, c, 16, dtype=torch.float64, seed=9)
    gl = torch.zeros(1, 2, c, dtype=torch.float64)
    got = _value_and_grads(ring, q, k, v, g, gl)
    # fp32 kernels + an fp32 merge vs fp64 truth: as in test_triton_fp32_matches_reference.
    _assert_close(got, _ground_truth(q, k, v, g, gl, causal=True, window=None), 1e-4, 1e-4)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton),
                                     pytest.param("cpu", marks=pytest.mark.skipif(DEV != "cpu", reason="CPU kernel"))])
def test_opcheck(backend):
    q, k, v = _inputs(1, 2, 1, 16, 16, 16)
    window = None if backend == "cpu" else 4  # the CPU kernel has no window
    torch.library.opcheck(A._attention_op, (q, k, v, True, window, 0.25, backend))
    out, lse = A._attention_op(q, k, v, True, window, 0.25, backend)
    dout = _rand(*out.shape, seed=3)
    for dlse in (None, _rand(*lse.shape, seed=4)):
        args = (dout, dlse, q, k, v, out, lse, True, window, 0.25, backend)
        torch.library.opcheck(A._attention_backward_op, args)


# Cases torch's fused CPU kernel computes (no window; causal only with Sq == Sk).
CPU_CASES = ["causal", "non_causal_sq_ne_sk", "gqa", "head_dim_24"]


@pytest.mark.skipif(DEV != "cpu", reason="torch's fused CPU kernel")
@pytest.mark.parametrize("name", CPU_CASES)
def test_cpu_kernel_matches_reference(name):
    """auto on CPU runs torch's fused flash kernels; out, lse and all three gradients (the
    lse's too, entering through the extra column) match the fp64 ground truth."""
    q, k, v, g, gl, opts = _case(name)
    assert A._backend(None, q, k, v, opts["causal"], opts["window"]) == "cpu"
    got = _value_and_grads(flash_attention_with_lse, q, k, v, g, gl, **opts)
    _assert_close(got, _ground_truth(q, k, v, g, gl, **opts), 2e-5, 2e-5)
    got64 = _value_and_grads(flash_attention_with_lse, *(x.double() for x in (q, k, v)), g, gl, **opts)
    _assert_close(got64, _ground_truth(q, k, v, g, gl, **opts), 1e-12, 1e-12)
    # Without an lse gradient the kernel's backward runs as it is.
    got = _value_and_grads(flash_attention_with_lse, q, k, v, g, torch.zeros_like(gl), **opts)
    _assert_close(got, _ground_truth(q, k, v, g, torch.zeros_like(gl), **opts), 2e-5, 2e-5)


@pytest.mark.skipif(DEV != "cpu", reason="torch's fused CPU kernel")
def test_cpu_kernel_choice():
    """The fused CPU kernel runs only where its semantics are ours; elsewhere the reference,
    and impl='reference' or FSHARDED_KERNELS=reference always get the reference."""
    q, k, v = _inputs(1, 2, 1, 8, 8, 16)
    assert A._backend(None, q, k, v, True, None) == "cpu"
    assert A._backend(None, q, k, v, True, 4) == "reference"  # a window
    assert A._backend(None, q, k[:, :, :6], v[:, :, :6], False, None) == "cpu"
    assert A._backend(None, q[:, :, :6], k, v, True, None) == "reference"  # causal, Sq != Sk
    assert A._backend(None, q, k[:, :, :0], v[:, :, :0], False, None) == "reference"  # no keys
    assert A._backend("reference", q, k, v, True, None) == "reference"
    assert A._backend(None, q, k.double(), v.double(), True, None) == "reference"  # mixed dtypes
    meta = [x.to("meta") for x in (q, k, v)]  # dry runs count what the CPU would allocate
    assert A._backend(None, *meta, True, None) == "cpu"


def test_cpu_kernel_choice_forced_reference(monkeypatch):
    monkeypatch.setenv("FSHARDED_KERNELS", "reference")
    q, k, v = _inputs(1, 2, 1, 8, 8, 16)
    assert A._backend(None, q, k, v, True, None) == "reference"


@pytest.mark.skipif(DEV != "cpu", reason="torch's fused CPU kernel")
def test_cpu_kernel_under_vmap_and_grad_like_the_virtual_mesh():
    """On the virtual mesh the op runs under vmap(grad): the vmapped dim folds into the
    batch of one fused call; values and gradients equal the per-sample reference."""
    qs, ks, vs = (_rand(3, 1, 2, 12, 16, seed=s) for s in (1, 2, 3))

    def loss(q, k, v, impl):
        return (flash_attention(q, k, v, impl=impl) ** 2).sum()

    got = torch.func.vmap(torch.func.grad(lambda q, k, v: loss(q, k, v, None), argnums=(0, 1, 2)))(qs, ks, vs)
    for i in range(3):
        q, k, v = (x[i].clone().requires_grad_() for x in (qs, ks, vs))
        ref = torch.autograd.grad(loss(q, k, v, "reference"), (q, k, v))
        for a, b in zip(got, ref):
            torch.testing.assert_close(a[i], b, atol=2e-5, rtol=2e-5)


@needs_triton
def test_func_grad_vmap_and_make_fx():
    q, k, v = _inputs(1, 2, 1, 20, 20, 16)

    def loss(fn, **kw):
        return lambda q, k, v: fn(q, k, v, window=9, **kw).sum()

    grads = torch.func.grad(loss(flash_attention, impl="triton"), argnums=(0, 1, 2))(q, k, v)
    want = torch.func.grad(loss(flash_attention_reference), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(grads, want):  # fp32 vs fp32 truth: see test_triton_fp32_matches_reference
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)

    # vmap folds the mapped dim into batch: a batch of queries against shared k/v, and the
    # gradient of it (the backward op's vmap rule).
    qs = torch.stack([q, 2 * q, -q])
    out = torch.func.vmap(lambda q: flash_attention(q, k, v, window=9, impl="triton"))(qs)
    for i in range(3):
        want_i = flash_attention_reference(qs[i], k, v, window=9)
        torch.testing.assert_close(out[i], want_i, atol=1e-5, rtol=1e-5)
    dqs = torch.func.vmap(torch.func.grad(loss(flash_attention, impl="triton")), (0, None, None))
    dqs = dqs(qs, k, v)
    want0 = torch.func.grad(loss(flash_attention_reference))(qs[1], k, v)
    torch.testing.assert_close(dqs[1], want0, atol=1e-4, rtol=1e-4)

    gm = make_fx(torch.func.grad(loss(flash_attention, impl="triton")))(q, k, v)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "fsharded.flash_attention.default" in targets
    assert "fsharded.flash_attention_backward.default" in targets
    torch.testing.assert_close(gm(q, k, v), grads[0])


def test_nested_vmap_grad_like_the_virtual_mesh():
    # grad(vmap(vmap(f))) with batched q and k/v mapped at different levels and dims, on the
    # reference path of the op (same rules as the Triton path), against a Python loop.
    q = _rand(2, 3, 1, 2, 6, 8, dtype=torch.float64)  # (mesh a, mesh b, B, H, S, D)
    kv = _rand(2, 1, 1, 6, 8, dtype=torch.float64).movedim(0, 3)  # mapped on dim 3, level a

    def f(q, kv):
        inner = torch.func.vmap(
            lambda q, kv: flash_attention(q, kv, kv, window=3, impl="reference"), (0, None)
        )
        return torch.func.vmap(inner, (0, 3))(q, kv).square().sum()

    got = torch.func.grad(f, argnums=(0, 1))(q, kv)
    q_, kv_ = q.detach().requires_grad_(), kv.detach().requires_grad_()
    loss = sum(
        flash_attention_reference(q_[a, b], kv_[:, :, :, a], kv_[:, :, :, a], window=3)
        .square()
        .sum()
        for a in range(2)
        for b in range(3)
    )
    want = torch.autograd.grad(loss, (q_, kv_))
    for a, b in zip(got, want):  # fp64 both ways
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_op_autograd_and_no_double_backward():
    # The op itself is differentiable with plain autograd (registered rule) ...
    q, k, v = (x.requires_grad_() for x in _inputs(1, 2, 2, 8, 8, 16, dtype=torch.float64))
    out, _ = torch.ops.fsharded.flash_attention(q, k, v, True, None, 0.25, "reference")
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    want = torch.autograd.grad(flash_attention_reference(q, k, v, scale=0.25).sum(), q)[0]
    torch.testing.assert_close(dq, want, atol=1e-12, rtol=1e-12)
    # ... and the public function refuses second derivatives instead of returning zeros.
    out = flash_attention(q, k, v, impl="reference")
    dq = torch.autograd.grad(out.sum(), q, create_graph=True)[0]
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(dq.sum(), q)


@pytest.mark.parametrize(
    "shapes, kw, err, match",
    [
        (((1, 2, 8, 16), (1, 2, 8, 32), (1, 2, 8, 32)), {}, ValueError, "head_dim mismatch"),
        (((1, 3, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), {}, ValueError, "multiple of"),
        (((2, 8, 16), (2, 8, 16), (2, 8, 16)), {}, ValueError, "must be 4-D"),
        (((1, 2, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)), {}, ValueError, "batch mismatch"),
        (((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 9, 16)), {}, ValueError, "same shape"),
        (((1, 2, 9, 16), (1, 2, 8, 16), (1, 2, 8, 16)), {}, ValueError, "seq_q <= seq_k"),
        (((1, 2, 8, 16),) * 3, {"causal": False, "window": 4}, ValueError, "causal=True"),
        (((1, 2, 8, 16),) * 3, {"window": 0}, ValueError, "window must be"),
        (((1, 2, 8, 16),) * 3, {"impl": "cuda"}, ValueError, "impl="),
    ],
)
def test_bad_input_errors(shapes, kw, err, match):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(err, match=match):
        flash_attention(q, k, v, **kw)


def test_dtype_errors():
    q = torch.zeros(1, 2, 8, 16)
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attention(q, q.bfloat16(), q)
    with pytest.raises(TypeError, match="floating-point"):
        flash_attention(q.long(), q.long(), q.long())
    if triton_available("cpu"):
        with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
            flash_attention(q.double(), q.double(), q.double(), impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(
    "D, window, dtype",
    [(64, None, torch.bfloat16), (128, 300, torch.bfloat16), (256, None, torch.float16)],
)
def test_gpu_autotuned_matches_reference(D, window, dtype):
    q, k, v = _inputs(2, 8, 2, 1000, 1000, D, dtype=dtype)
    g = _rand(2, 8, 1000, D, dtype=torch.float64, seed=7)
    gl = _rand(2, 8, 1000, dtype=torch.float64, seed=8)
    opts = dict(causal=True, window=window)
    got = _value_and_grads(flash_attention_with_lse, q, k, v, g, gl, impl="triton", **opts)
    want = _ground_truth(q, k, v, g, gl, **opts)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        # Error relative to the tensor's largest entry: the rounding of 16-bit operands
        # (2^-9 relative) summed over up to 1000 keys with fp32 accumulation; measured ~0.8%
        # at 256 keys under the interpreter. A masking bug is O(1).
        err = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert err < 2e-2, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("impl", [None, "reference"])
def test_backward_of_one_key_block_against_the_whole_output_is_its_share(impl):
    """flash_attention_backward with the out and lse of attention over all keys and k, v
    one block of them gives that block's dk, dv and its part of dq (what ring attention's
    backward adds up), for the fused CPU kernels and the reference alike."""
    q, k, v = _inputs(1, 2, 1, 8, 12, 16, dtype=torch.float64)
    out, lse = flash_attention_with_lse(q, k, v, causal=False)
    dout = _rand(*out.shape, dtype=torch.float64, seed=5)
    dq, dk, dv = A.flash_attention_backward(dout, q, k, v, out, lse, causal=False, impl=impl)
    parts = [A.flash_attention_backward(dout, q, k[:, :, c], v[:, :, c], out, lse, causal=False, impl=impl)
             for c in (slice(0, 5), slice(5, 12))]
    torch.testing.assert_close(parts[0][0] + parts[1][0], dq, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]], 2), dk, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]], 2), dv, atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match=r"lse \(1, 2, 7\) \(expected \(1, 2, 8\)\)"):
        A.flash_attention_backward(dout, q, k, v, out, lse[:, :, :7], causal=False, impl=impl)


@pytest.mark.skipif(DEV != "cpu", reason="torch's fused CPU kernel")
def test_cpu_kernel_is_not_given_what_it_cannot_read():
    """Rows must be contiguous in the head dim for the fused kernels (a transposed or
    strided head dim runs the reference), and an empty head dim never reaches them; the
    results are right either way."""
    q, k, v = _inputs(1, 2, 2, 8, 8, 4)
    strided = [_rand(1, 2, 4, 8, seed=9).transpose(-1, -2), _rand(1, 2, 8, 8, seed=10)[..., ::2]]
    for x in strided:
        for args in ((x, k, v), (q, x, v), (q, k, x)):
            assert A._backend(None, *args, True, None) == "reference"
            g = _rand(1, 2, 8, 4, dtype=torch.float64, seed=7)
            gl = _rand(1, 2, 8, dtype=torch.float64, seed=8)
            got = _value_and_grads(flash_attention_with_lse, *args, g, gl, causal=True, window=None)
            _assert_close(got, _ground_truth(*args, g, gl, causal=True, window=None), 2e-5, 2e-5)
    empty = [torch.randn(1, 2, 4, 0, requires_grad=True)] + [torch.randn(1, 2, 5, 0, requires_grad=True)] * 2
    assert A._backend(None, *empty, False, None) == "reference"
    _, lse = flash_attention_with_lse(*empty, causal=False)
    assert all(g.shape == x.shape for g, x in zip(torch.autograd.grad(lse.sum(), empty[:2]), empty))
