"""Triton kernels for :mod:`fsharded.kernels.quant` (imported only when they run).

Both kernels work on rows ``(R, n)`` cut into ``nb = ceil(n / BS)`` blocks of ``BS``
elements (the last one zero-padded); each program handles a tile of ``ROWS`` consecutive
blocks (of any rows), ``ROWS * BS`` elements. The arithmetic is the reference's, step for
step, so ``q`` and the scales match it bit for bit: fp32 absmax, ``scale = absmax / 127``
and ``x / scale`` correctly rounded (``div_rn``: Triton's ``/`` is approximate on GPU),
round half to even by the ``1.5 * 2**23`` trick (exact for ``|t| < 2**22``; libdevice's
``rint`` has no interpreter version), clamp to [-127, 127].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: adding and subtracting it rounds half to even
_TILE = 4096  # elements per program


@triton.jit
def _round_bf16(y):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32: the cast after it is
    then exact. The interpreter's own fp32 -> bf16 cast truncates, the GPU's rounds."""
    bits = y.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(y != y, y, bits.to(tl.float32, bitcast=True))


@triton.jit
def _quant_kernel(
    x_ptr,  # (R, n) contiguous, fp16/bf16/fp32
    q_ptr,  # (R, nb * BS) int8 out
    s_ptr,  # (R, nb) fp32 out
    n,
    nb,
    total,  # R * nb
    BS: tl.constexpr,
    ROWS: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,) block ids
    live = blk < total
    r = blk // nb
    pos = (blk - r * nb)[:, None] * BS + tl.arange(0, BS)[None, :]  # (ROWS, BS) in-row index
    x = tl.load(x_ptr + r[:, None] * n + pos, mask=live[:, None] & (pos < n), other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    # tl.max may drop NaNs; the reference's amax propagates them, so do it explicitly.
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    amax = tl.where(has_nan, float("nan"), amax)
    scale = tl.math.div_rn(amax, tl.full([ROWS], 127.0, tl.float32))
    ok = (scale > 0.0) & (scale < float("inf"))  # false for 0, inf and nan
    safe = tl.where(ok, scale, 1.0)
    t = tl.math.div_rn(x, tl.broadcast_to(safe[:, None], (ROWS, BS)))
    t = (t + _ROUND) - _ROUND
    t = tl.minimum(tl.maximum(t, -127.0), 127.0)
    t = tl.where(ok[:, None], t, 0.0)
    q_offs = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    tl.store(q_ptr + q_offs, t.to(tl.int8), mask=live[:, None])
    tl.store(s_ptr + blk, scale, mask=live)


@triton.jit
def _dequant_kernel(
    q_ptr,  # (R, nb * BS) int8
    s_ptr,  # (R, nb) fp32
    y_ptr,  # (R, n) out, contiguous
    n,
    nb,
    total,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = blk < total
    r = blk // nb
    pos = (blk - r * nb)[:, None] * BS + tl.arange(0, BS)[None, :]
    q = tl.load(q_ptr + blk[:, None] * BS + tl.arange(0, BS)[None, :], mask=live[:, None], other=0)
    s = tl.load(s_ptr + blk, mask=live, other=0.0)
    y = q.to(tl.float32) * s[:, None]
    if y_ptr.dtype.element_ty == tl.bfloat16:
        y = _round_bf16(y)
    tl.store(
        y_ptr + r[:, None] * n + pos, y.to(y_ptr.dtype.element_ty), mask=live[:, None] & (pos < n)
    )


def _launch(block_size: int, total: int) -> tuple[tuple[int], int, int]:
    rows = max(1, _TILE // block_size)
    warps = 8 if rows * block_size >= 8192 else 4
    return (triton.cdiv(total, rows),), rows, warps


def quantize(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (R, n) -> ``q`` (R, nb * block_size) int8, ``scales`` (R, nb) fp32."""
    R, n = x.shape
    nb = -(-n // block_size)
    q = torch.empty((R, nb * block_size), dtype=torch.int8, device=x.device)
    s = torch.empty((R, nb), dtype=torch.float32, device=x.device)
    total = R * nb
    if total == 0:
        return q, s
    grid, rows, warps = _launch(block_size, total)
    _quant_kernel[grid](
        x.contiguous(), q, s, n, nb, total, BS=block_size, ROWS=rows, num_warps=warps
    )
    return q, s


def dequantize(
    q: torch.Tensor, scales: torch.Tensor, n: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """``q`` (R, nb * block_size), ``scales`` (R, nb) -> (R, n) of ``dtype``."""
    R, nb = scales.shape
    y = torch.empty((R, n), dtype=dtype, device=q.device)
    total = R * nb
    if total == 0 or n == 0:
        return y
    grid, rows, warps = _launch(block_size, total)
    _dequant_kernel[grid](
        q.contiguous(),
        scales.contiguous(),
        y,
        n,
        nb,
        total,
        BS=block_size,
        ROWS=rows,
        num_warps=warps,
    )
    return y
