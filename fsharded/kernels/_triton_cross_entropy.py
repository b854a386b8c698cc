"""Triton kernels for :mod:`fsharded.kernels.losses` (imported only when they run).

Forward: one program per row streams the vocabulary in ``BLOCK_V`` chunks, keeping a
running max and a per-lane running sum of ``exp(x - max)`` in fp32; it writes the row's
logsumexp and the logit of its target (0 when the target id is outside ``[0, V)``, i.e.
ignored or owned by another vocabulary shard). Backward: a (row, chunk) grid recomputes
``exp(x - lse)`` chunk by chunk and writes
``dlogits = exp(x - lse) * d_lse + onehot(target) * d_target`` in the logits' dtype.
Neither kernel allocates anything of size ``N * V`` besides the gradient itself.

Rows are addressed as ``(B, N, V)`` with arbitrary strides for ``B`` and ``N`` and unit
stride along ``V``, so the folded vmap dims of the virtual mesh need no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fsharded.kernels._dispatch import triton_interpreting

# Chunk sizes for the interpreter: small enough that the tests' tiny vocabularies span
# several chunks, including a partial last one.
_INTERP_BLOCK_V = 32


@triton.jit
def _ce_fwd_kernel(
    x_ptr,  # (B, N, V) logits, unit stride along V
    t_ptr,  # (B * N,) int64 target ids, local to this shard
    lse_ptr,  # (B * N,) fp32 out
    xt_ptr,  # (B * N,) fp32 out: logit of the target, 0 when not in [0, V)
    N,
    V,
    stride_b,
    stride_n,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    b = r // N
    row = x_ptr + b * stride_b + (r - b * N) * stride_n
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")  # running max of the row
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)  # per-lane sum of exp(x - m)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        x = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # A row that is -inf so far would give exp(-inf - -inf) = nan: shift by 0 instead.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    shift = tl.where(m == float("-inf"), 0.0, m)
    lse = shift + tl.log(tl.sum(acc, axis=0))
    t = tl.load(t_ptr + r)
    own = (t >= 0) & (t < V)
    xt = tl.load(row + tl.where(own, t, 0), mask=own, other=0.0).to(tl.float32)
    tl.store(lse_ptr + r, lse)
    tl.store(xt_ptr + r, xt)


@triton.jit
def _ce_bwd_kernel(
    x_ptr,  # (B, N, V) logits, unit stride along V
    t_ptr,  # (B * N,) int64 local target ids
    lse_ptr,  # (B * N,) fp32 local logsumexp from the forward
    dlse_ptr,  # (B * N,) fp32 cotangent of lse
    dxt_ptr,  # (B * N,) fp32 cotangent of the target logit
    dx_ptr,  # (B * N, V) out, contiguous, logits' dtype
    N,
    V,
    stride_b,
    stride_n,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    b = r // N
    row = x_ptr + b * stride_b + (r - b * N) * stride_n
    offs = c * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    x = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + r)
    d_lse = tl.load(dlse_ptr + r)
    d_xt = tl.load(dxt_ptr + r)
    t = tl.load(t_ptr + r)
    g = tl.exp(x - lse) * d_lse
    g = tl.where(offs == t, g + d_xt, g)
    tl.store(dx_ptr + r * V + offs, g.to(dx_ptr.dtype.element_ty), mask=mask)


# H200: rows of 32k-256k bf16 logits; the forward is one program per row (memory bound,
# one exp per element), the backward a 2-D grid so short row counts still fill the SMs.
_FWD_CONFIGS = [
    triton.Config({"BLOCK_V": bv}, num_warps=w)
    for bv, w in ((2048, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16))
]
_BWD_CONFIGS = [
    triton.Config({"BLOCK_V": bv}, num_warps=w)
    for bv, w in ((1024, 4), (2048, 4), (4096, 8), (8192, 8))
]
_ce_fwd_tuned = triton.autotune(configs=_FWD_CONFIGS, key=["V"])(_ce_fwd_kernel)
_ce_bwd_tuned = triton.autotune(configs=_BWD_CONFIGS, key=["V"])(_ce_bwd_kernel)


def _rows3(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``x`` (..., V) as a (B, N, V) view with unit stride along V (a copy only when no
    such view exists)."""
    V = x.shape[-1]
    if x.stride(-1) != 1 and V > 1:
        x = x.contiguous()
    if x.dim() == 3:
        return x, x.shape[0], x.shape[1]
    try:
        return x.view(1, -1, V), 1, x.numel() // V
    except RuntimeError:
        pass
    if x.dim() > 3:
        try:
            x3 = x.view(x.shape[0], -1, V)
            return x3, x3.shape[0], x3.shape[1]
        except RuntimeError:
            pass
    x = x.contiguous()
    return x.view(1, -1, V), 1, x.numel() // V


def forward(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row logsumexp and target logit of ``logits`` (..., V): two fp32 tensors (...)."""
    lead = logits.shape[:-1]
    V = logits.shape[-1]
    lse = torch.empty(lead, dtype=torch.float32, device=logits.device)
    xt = torch.empty(lead, dtype=torch.float32, device=logits.device)
    if lse.numel() == 0:
        return lse, xt
    x3, _, N = _rows3(logits)
    t = targets.reshape(-1).contiguous()
    rows = lse.numel()
    args = (x3, t, lse, xt, N, V, x3.stride(0), x3.stride(1))
    if triton_interpreting():
        _ce_fwd_kernel[(rows,)](*args, BLOCK_V=_INTERP_BLOCK_V)
    else:
        _ce_fwd_tuned[(rows,)](*args)
    return lse, xt


def backward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    d_lse: torch.Tensor,
    d_target: torch.Tensor,
) -> torch.Tensor:
    """``exp(x - lse) * d_lse + onehot(target) * d_target`` in the logits' dtype."""
    V = logits.shape[-1]
    dx = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if dx.numel() == 0:
        return dx
    x3, _, N = _rows3(logits)
    rows = dx.numel() // V

    def flat(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return v.reshape(-1).to(dtype).contiguous()

    args = (
        x3,
        flat(targets, torch.int64),
        flat(lse, torch.float32),
        flat(d_lse, torch.float32),
        flat(d_target, torch.float32),
        dx,
        N,
        V,
        x3.stride(0),
        x3.stride(1),
    )
    if triton_interpreting():
        _ce_bwd_kernel[(rows, triton.cdiv(V, _INTERP_BLOCK_V))](*args, BLOCK_V=_INTERP_BLOCK_V)
    else:
        _ce_bwd_tuned[lambda meta: (rows, triton.cdiv(V, meta["BLOCK_V"]))](*args)
    return dx
