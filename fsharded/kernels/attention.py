"""Flash attention (causal, sliding window, GQA/MQA): Triton kernels and a torch reference.

Layout is torch's ``scaled_dot_product_attention`` one: ``q`` (B, Hq, Sq, D), ``k`` and ``v``
(B, Hkv, Sk, D) with ``Hq % Hkv == 0``; query head ``h`` reads kv head ``h // (Hq // Hkv)``.
For every query row ``i``,

    out_i = sum_j softmax_j(scale * q_i . k_j) v_j,   lse_i = log sum_j exp(scale * q_i . k_j)

over the keys ``j`` visible from ``i``:

- ``causal=True``: queries are the **last** ``Sq`` of the ``Sk`` positions (decoding with a KV
  cache, or a query chunk at the end of its keys), so row ``i`` sits at position
  ``p = i + Sk - Sq`` and sees keys ``j <= p``; ``Sq > Sk`` is an error. ``Sq == Sk`` is the
  usual causal mask, identical to ``scaled_dot_product_attention(is_causal=True)``.
- ``window=w`` (only with ``causal=True``): additionally ``j > p - w``, i.e. the last ``w``
  keys up to and including the query's own position (sliding-window attention).
- ``causal=False``: every key, any ``Sq`` and ``Sk``.

``scale`` defaults to ``1 / sqrt(D)``. ``flash_attention_with_lse`` also returns ``lse``
(float32, float64 for float64 inputs; shape (B, Hq, Sq)) and is differentiable in both
outputs, so attentions over disjoint key sets can be combined exactly with
:func:`merge_attention` (ring / blockwise attention).

Implementations (``impl``, see :mod:`fsharded.kernels._dispatch`): ``"triton"`` runs the fused
online-softmax kernels of ``_triton_attention`` (float16 / bfloat16 / float32, any head dim up
to 256, fp32 accumulation; float32 matmuls follow ``torch.get_float32_matmul_precision()``:
``"highest"`` keeps them exact, otherwise TF32); ``"reference"`` runs
:func:`flash_attention_reference`'s math (fp32, fp64 for fp64 inputs). On CPU ``auto`` runs
torch's fused CPU flash kernels (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward: no score matrix kept, 5-15x faster than the reference at 1-2k tokens) wherever
they compute the same thing — no window, and a causal mask only for ``Sq == Sk`` — and the
reference elsewhere; the lse's gradient reaches their backward through one extra zero
column (``_cpu_backward``). When ``auto`` picks Triton for inputs the kernel does not take
(float64, head dim > 256) the reference runs instead; asking for ``impl="triton"`` with them
raises.

All run as the custom op ``torch.ops.fsharded.flash_attention`` -> (out, lse), with fake,
autograd (saving lse; the backward is the op ``fsharded::flash_attention_backward``) and vmap
rules (the vmapped dim is folded into batch). The public functions call it through a
``torch.autograd.Function``, because ``torch.func.grad``/``vmap`` reject the autograd.Function
that custom ops generate; so ``grad``, ``vmap`` (nested too), ``make_fx`` and
``torch.compile`` of the forward + backward work. Not supported (they raise): double
backward, and ``torch.compile`` around ``torch.func.grad`` (compile the graph that
``make_fx`` traced from it instead).

Example::

    >>> q, k, v = (torch.randn(2, 4, 16, 32) for _ in range(3))
    >>> flash_attention(q, k, v).shape
    torch.Size([2, 4, 16, 32])
"""

import math

import torch
from torch import Tensor

from ._dispatch import choose, forced

__all__ = [
    "flash_attention",
    "flash_attention_backward",
    "flash_backend",
    "flash_attention_reference",
    "flash_attention_with_lse",
    "merge_attention",
]

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TRITON_MAX_HEAD_DIM = 256  # == _triton_attention.MAX_HEAD_DIM, kept here to avoid the import


# ----------------------------------------------------------------------------- checks, masks


def _check(name: str, q, k, v, causal: bool, window, scale) -> float:
    """Validate shapes / dtypes / options; return the scale to use."""
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name}: {arg} must be 4-D (batch, heads, seq, head_dim), got shape "
                f"{tuple(t.shape)}; for (batch, seq, heads, head_dim) inputs pass "
                f"{arg}.transpose(1, 2)"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name}: {arg} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{name}: q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
            "cast them to the same dtype"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"{name}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    B, Hq, Sq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"{name}: k and v must have the same shape (batch, kv_heads, seq_k, head_dim), got "
            f"k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    Bk, Hkv, Sk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"{name}: batch mismatch, q has {B} and k/v have {Bk}")
    if Dk != D:
        raise ValueError(
            f"{name}: head_dim mismatch, q has {D} and k/v have {Dk}; q, k and v need the same "
            "last dim"
        )
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(
            f"{name}: q's {Hq} heads must be a multiple of k/v's {Hkv} heads (GQA/MQA groups "
            "query heads over kv heads)"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"{name}: causal must be a bool, got {causal!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"{name}: window must be an int >= 1 or None, got {window!r}")
        if not causal:
            raise ValueError(f"{name}: window={window} needs causal=True (a causal sliding window)")
    if causal and Sq > Sk:
        raise ValueError(
            f"{name}: causal attention aligns the {Sq} queries with the last positions of the "
            f"{Sk} keys, so it needs seq_q <= seq_k; pass causal=False or more keys"
        )
    if scale is None:
        return 1.0 / math.sqrt(D) if D else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name}: scale must be a float or None, got {scale!r}")
    return float(scale)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _visible(sq: int, sk: int, causal: bool, window, device) -> Tensor | None:
    """(sq, sk) bool mask of the keys each query row sees, or None when it sees all."""
    if not causal:
        return None
    pos = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    mask = j <= pos
    if window is not None:
        mask = mask & (j > pos - window)
    return mask


def _scores(q, k, causal, window, scale):
    """Masked scores (B, Hq, Sq, Sk) in the accumulation dtype, k repeated over its group."""
    ct = _acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    kf = k.to(ct).repeat_interleave(group, dim=1)
    s = torch.matmul(q.to(ct), kf.transpose(-1, -2)) * scale
    mask = _visible(q.shape[2], k.shape[2], causal, window, q.device)
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _probs(s: Tensor, lse: Tensor) -> Tensor:
    # Rows with no key (Sk == 0) have lse = -inf: shift by 0 so they give p = 0, not NaN.
    return torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))


def _reference_with_lse(q, k, v, causal, window, scale) -> tuple[Tensor, Tensor]:
    s = _scores(q, k, causal, window, scale)
    lse = torch.logsumexp(s, dim=-1)
    group = q.shape[1] // k.shape[1]
    out = torch.matmul(_probs(s, lse), v.to(s.dtype).repeat_interleave(group, dim=1))
    return out.to(q.dtype), lse


def _reference_backward(dout, dlse, q, k, v, out, lse, causal, window, scale):
    """Closed-form gradients of (out, lse) in the accumulation dtype; dk, dv summed over
    each kv head's query group. The row term is ``rowsum(dout * out)`` from the given
    ``out`` (as the fused kernels form it), so with ``out`` and ``lse`` of the attention
    over all keys and ``k``/``v`` one block of them it gives that block's share."""
    s = _scores(q, k, causal, window, scale)
    p = _probs(s, lse.to(s.dtype))
    ct = s.dtype
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    kf = k.to(ct).repeat_interleave(group, dim=1)
    vf = v.to(ct).repeat_interleave(group, dim=1)
    do = dout.to(ct)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    delta = (do * out.to(ct)).sum(-1)  # rowsum(p * dp) when k, v are all the keys
    if dlse is not None:
        delta = delta - dlse.to(ct)
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, kf) * scale
    dk = (torch.matmul(ds.transpose(-1, -2), q.to(ct)) * scale).view(B, Hkv, group, Sk, D)
    dv = torch.matmul(p.transpose(-1, -2), do).view(B, Hkv, group, Sk, D)
    return dq.to(q.dtype), dk.sum(2).to(k.dtype), dv.sum(2).to(v.dtype)


# ----------------------------------------------------------------------------- CPU kernels

_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _cpu_fits(q: Tensor, k: Tensor, v: Tensor, causal: bool, window) -> bool:
    """Whether torch's fused CPU flash kernel computes these semantics: CPU (or meta, for
    dry runs) tensors of one float dtype, no window, and a causal mask only for ``Sq == Sk``
    (its causal mask is aligned at the first key, ours at the last)."""
    return ({t.device.type for t in (q, k, v)} <= {"cpu", "meta"} and q.dtype in _CPU_DTYPES
            and q.dtype == k.dtype == v.dtype and window is None and q.shape[2] > 0 and k.shape[2] > 0
            and q.shape[3] > 0 and all(t.stride(-1) == 1 for t in (q, k, v))  # the kernels read rows
            and (not causal or q.shape[2] == k.shape[2]))


def _repeat_kv(x: Tensor, group: int) -> Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _bshd(x: Tensor) -> Tensor:
    """``x`` (B, H, S, ...) stored sequence-major, as torch's CPU kernels write their outputs
    (a no-op when it already is): the (B, S, H, D) layout models keep, so their transposes
    back to it are free."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _cpu_forward(q, k, v, causal, scale) -> tuple[Tensor, Tensor]:
    """(out, lse) by torch's fused CPU flash kernel (online softmax over key blocks, no
    score matrix kept); kv heads repeated over their query groups."""
    group = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _repeat_kv(k, group), _repeat_kv(v, group), 0.0, causal, scale=scale)
    return _bshd(out), _bshd(lse)


def _cpu_backward(dout, dlse, q, k, v, out, lse, causal, scale) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients by torch's fused CPU backward, which knows only ``dout``: it forms
    ``delta = rowsum(dout * out)`` and uses ``out`` for nothing else. A gradient of the
    lse enters as ``delta - dlse`` (d lse / d scores = the probabilities); one zero column
    on q, k and v and the pair (1, -dlse) on (out, dout) give exactly that, with the
    scores, probabilities and the other columns' gradients unchanged."""
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    k, v = _repeat_kv(k, group), _repeat_kv(v, group)
    out, dout = (t if t.stride(-1) == 1 else t.contiguous() for t in (out, dout))
    if dlse is not None:
        pad = torch.nn.functional.pad
        q, k, v = pad(q, (0, 1)), pad(k, (0, 1)), pad(v, (0, 1))
        out = torch.cat([out, torch.ones_like(out[..., :1])], dim=-1)
        dout = torch.cat([dout, -dlse.unsqueeze(-1).to(dout.dtype)], dim=-1)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if dlse is not None:
        dq, dk, dv = dq[..., :D], dk[..., :D], dv[..., :D]
    if group > 1:
        dk, dv = (g.unflatten(1, (Hkv, group)).sum(2) for g in (dk, dv))
    return _bshd(dq), _bshd(dk), _bshd(dv)


def _bshd_like(x: Tensor, shape, dtype=None) -> Tensor:
    """An empty (B, H, S, ...) tensor stored sequence-major (``_bshd``'s layout)."""
    return x.new_empty((shape[0], shape[2], shape[1], *shape[3:]), dtype=dtype).transpose(1, 2)


def flash_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
) -> Tensor:
    """Attention by explicit masked scores in fp32 (fp64 for fp64 inputs): the ground truth.

    Same semantics as :func:`flash_attention` (see the module docstring); plain torch, so
    autograd, vmap and compile see through it. Memory is O(B * Hq * Sq * Sk).
    """
    scale = _check("flash_attention_reference", q, k, v, causal, window, scale)
    return _reference_with_lse(q, k, v, causal, window, scale)[0]


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("fsharded::flash_attention", mutates_args=())
def _attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    window: int | None,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """(out, lse) by ``backend`` (``_backend``'s choice); inputs already validated."""
    if backend == "triton":
        from . import _triton_attention

        return _triton_attention.forward(q, k, v, causal, window, scale)
    if backend == "cpu":
        return _cpu_forward(q, k, v, causal, scale)
    return _reference_with_lse(q, k, v, causal, window, scale)


@_attention_op.register_fake
def _attention_fake(q, k, v, causal, window, scale, backend):
    if backend == "cpu":
        return _bshd_like(q, q.shape), _bshd_like(q, q.shape[:3], _acc_dtype(q.dtype))
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_acc_dtype(q.dtype))


@torch.library.custom_op("fsharded::flash_attention_backward", mutates_args=())
def _attention_backward_op(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    window: int | None,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) given the gradients of ``out`` and (optionally) ``lse``."""
    if backend == "triton":
        from . import _triton_attention

        return _triton_attention.backward(dout, dlse, q, k, v, out, lse, causal, window, scale)
    if backend == "cpu":
        return _cpu_backward(dout, dlse, q, k, v, out, lse, causal, scale)
    return _reference_backward(dout, dlse, q, k, v, out, lse, causal, window, scale)


@_attention_backward_op.register_fake
def _attention_backward_fake(dout, dlse, q, k, v, out, lse, causal, window, scale, backend):
    if backend == "cpu":
        return _bshd_like(q, q.shape), _bshd_like(k, k.shape), _bshd_like(v, v.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, window, scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = (causal, window, scale, backend)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _attention_backward_op(dout, dlse, q, k, v, out, lse, *ctx.options)
    return dq, dk, dv, None, None, None, None


# For plain autograd (and torch.compile) on the op itself; torch.func does not accept the
# autograd.Function that custom_op generates, so the public path goes through _FlashAttention.
_attention_op.register_autograd(_backward, setup_context=_setup_context)


class _FlashAttention(torch.autograd.Function):
    """The op as a torch.func-compatible Function: its vmap rule is generated from the ops'
    own vmap rules (forward and backward both run under vmap as single ops)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, causal, window, scale, backend):
        return _attention_op(q, k, v, causal, window, scale, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)  # an unused lse passes None, not a tensor of zeros

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        args = (dout, dlse, q, k, v, out, lse, *ctx.options)
        if torch.compiler.is_compiling():
            # Dynamo cannot trace a Function applied in a backward; compiled graphs refuse
            # double backward themselves, so the op may run unrecorded here.
            with torch.no_grad():
                dq, dk, dv = _attention_backward_op(*args)
        else:
            dq, dk, dv = _FlashAttentionBackward.apply(*args)
        return dq, dk, dv, None, None, None, None


class _FlashAttentionBackward(torch.autograd.Function):
    """The backward op as a Function, so that differentiating it again raises (instead of the
    op's generated autograd.Function, which torch.func rejects)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*args):
        return _attention_backward_op(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "flash_attention: double backward (gradients of gradients) is not implemented; "
            "use flash_attention_reference for higher-order derivatives"
        )


def _fold(x: Tensor | None, dim: int | None, size: int) -> Tensor | None:
    """Move the vmapped dim to the front (broadcasting unbatched inputs) and merge it into
    the batch dim: (size, B, ...) -> (size * B, ...)."""
    if x is None:
        return None
    x = x.expand(size, *x.shape) if dim is None else x.movedim(dim, 0)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _unfold(x: Tensor, size: int) -> Tensor:
    return x.reshape(size, x.shape[0] // size, *x.shape[1:])


@_attention_op.register_vmap
def _attention_vmap(info, in_dims, q, k, v, causal, window, scale, backend):
    n = info.batch_size
    q, k, v = (_fold(x, d, n) for x, d in zip((q, k, v), in_dims[:3]))
    out, lse = _attention_op(q, k, v, causal, window, scale, backend)
    return (_unfold(out, n), _unfold(lse, n)), (0, 0)


@_attention_backward_op.register_vmap
def _attention_backward_vmap(info, in_dims, *args):
    n = info.batch_size
    tensors = [_fold(x, d, n) for x, d in zip(args[:7], in_dims[:7])]
    grads = _attention_backward_op(*tensors, *args[7:])
    return tuple(_unfold(g, n) for g in grads), (0, 0, 0)


# ----------------------------------------------------------------------------- public API


def _backend(impl: str | None, q: Tensor, k: Tensor, v: Tensor, causal: bool, window) -> str:
    """``"triton"``, ``"cpu"`` (torch's fused CPU kernel, where ``auto`` finds it computes
    the same semantics) or ``"reference"``."""
    want = (impl or "auto").lower()
    if choose("flash_attention", q, k, v, impl=impl) != "triton":
        if want == "auto" and forced() in ("auto", "cpp") and _cpu_fits(q, k, v, causal, window):
            return "cpu"
        return "reference"
    problem: Exception | None = None
    if q.dtype not in _TRITON_DTYPES:
        problem = TypeError(
            f"flash_attention: the Triton kernel takes float16, bfloat16 or float32, got "
            f"{q.dtype}; pass impl='reference' (impl='auto' falls back to it by itself)"
        )
    elif q.shape[-1] > _TRITON_MAX_HEAD_DIM:
        problem = ValueError(
            f"flash_attention: the Triton kernel takes head_dim <= {_TRITON_MAX_HEAD_DIM}, "
            f"got {q.shape[-1]}; pass impl='reference' (impl='auto' falls back to it by itself)"
        )
    if problem is None:
        return "triton"
    if want != "auto" or forced() != "auto":
        raise problem
    return "reference"


def flash_backend(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, window: int | None = None,
                  impl: str | None = None) -> str:
    """Which implementation :func:`flash_attention` would run on these inputs: ``"triton"``,
    ``"cpu"`` (torch's fused CPU kernels) or ``"reference"`` (scores kept, O(Sq * Sk) memory).

    >>> q = torch.randn(1, 2, 8, 16)
    >>> flash_backend(q, q, q), flash_backend(q, q, q, window=4)
    ('cpu', 'reference')
    """
    _check("flash_backend", q, k, v, causal, window, None)
    return _backend(impl, q, k, v, causal, window)


def flash_attention_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    impl: str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)``: attention output (B, Hq, Sq, D) in q's dtype and the per-row
    log-sum-exp of the scaled, masked scores (B, Hq, Sq), float32 (float64 for float64 inputs).

    Both outputs are differentiable. Rows that see no key (only when ``Sk == 0``) give
    ``out = 0`` and ``lse = -inf``, which :func:`merge_attention` treats as empty.

    Example::

        >>> q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
        >>> out, lse = flash_attention_with_lse(q, k, v, causal=False)
        >>> lse.shape
        torch.Size([1, 2, 8])
    """
    scale = _check("flash_attention", q, k, v, causal, window, scale)
    return _FlashAttention.apply(q, k, v, causal, window, scale, _backend(impl, q, k, v, causal, window))


def flash_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    dlse: Tensor | None = None,
    impl: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``: the backward of :func:`flash_attention_with_lse` run by hand,
    without autograd, given the gradient ``dout`` of ``out`` (and ``dlse`` of ``lse``).

    For blockwise schemes (ring attention) that compute the gradients themselves: with
    ``out`` and ``lse`` of the attention over *all* keys, and ``k``/``v`` one block of
    them, the result is exactly that block's share (``dk``, ``dv``) and the block's
    contribution to ``dq`` — the probabilities ``exp(s - lse)`` and the row term
    ``rowsum(dout * out)`` are the global ones. Same layout and options as
    :func:`flash_attention` (no window); the implementation is the one
    :func:`flash_backend` names for these inputs.
    """
    scale = _check("flash_attention_backward", q, k, v, causal, None, scale)
    stats = (("dout", dout, q.shape), ("out", out, q.shape), ("lse", lse, q.shape[:3]))
    if dlse is not None:
        stats += (("dlse", dlse, q.shape[:3]),)
    bad = [f"{name} {tuple(t.shape)} (expected {tuple(want)})" for name, t, want in stats if t.shape != want]
    if bad:
        raise ValueError(f"flash_attention_backward: {', '.join(bad)} for q {tuple(q.shape)}")
    backend = _backend(impl, q, k, v, causal, None)
    return _attention_backward_op(dout, dlse, q, k, v, out, lse, causal, None, scale, backend)


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    impl: str | None = None,
) -> Tensor:
    """Memory-efficient exact attention; see the module docstring for the semantics.

    ``q`` (B, Hq, Sq, D), ``k``/``v`` (B, Hkv, Sk, D), ``Hq % Hkv == 0``, any strides.
    ``causal`` aligns the queries with the last ``Sq`` keys (needs ``Sq <= Sk``); ``window``
    (with ``causal``) keeps the last ``window`` keys of each query; ``scale`` defaults to
    ``1 / sqrt(D)``; ``impl`` is ``None``/``"auto"``, ``"triton"`` or ``"reference"``.

    Example::

        >>> q = torch.randn(1, 4, 10, 16)
        >>> kv = torch.randn(1, 2, 10, 16)  # 2 kv heads shared by 4 query heads
        >>> flash_attention(q, kv, kv, window=4).shape
        torch.Size([1, 4, 10, 16])
    """
    out, _ = flash_attention_with_lse(q, k, v, causal=causal, window=window, scale=scale, impl=impl)
    return out


def merge_attention(
    out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor
) -> tuple[Tensor, Tensor]:
    """Combine attentions of the same queries over two disjoint key sets into the attention
    over their union: ``lse = logaddexp(lse1, lse2)``,
    ``out = exp(lse1 - lse) * out1 + exp(lse2 - lse) * out2``.

    ``out*`` (..., S, D), ``lse*`` (..., S) as returned by :func:`flash_attention_with_lse`.
    Computed in the lse dtype (at least float32); ``out`` comes back in the promoted dtype of
    ``out1``/``out2`` (pass float32 partial outputs to keep a running merge in float32).
    Differentiable. Rows empty on both sides (lse -inf) stay ``out = 0``, ``lse = -inf``.

    Example::

        >>> q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
        >>> a = flash_attention_with_lse(q, k[:, :, :2], v[:, :, :2], causal=False)
        >>> b = flash_attention_with_lse(q, k[:, :, 2:], v[:, :, 2:], causal=False)
        >>> out, lse = merge_attention(*a, *b)
        >>> torch.allclose(out, flash_attention(q, k, v, causal=False), atol=1e-6)
        True
    """
    if out1.shape != out2.shape or lse1.shape != lse2.shape or out1.shape[:-1] != lse1.shape:
        raise ValueError(
            "merge_attention: out1/out2 must share a shape (..., S, D) and lse1/lse2 the shape "
            f"(..., S); got out1 {tuple(out1.shape)}, lse1 {tuple(lse1.shape)}, out2 "
            f"{tuple(out2.shape)}, lse2 {tuple(lse2.shape)}"
        )
    ct = torch.promote_types(torch.promote_types(lse1.dtype, lse2.dtype), torch.float32)
    lse1, lse2 = lse1.to(ct), lse2.to(ct)
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isneginf(lse), 0.0, lse)
    w1 = torch.exp(lse1 - safe).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).unsqueeze(-1)
    out = w1 * out1.to(ct) + w2 * out2.to(ct)
    return out.to(torch.promote_types(out1.dtype, out2.dtype)), lse
