"""Triton kernels behind :mod:`fsharded.kernels.norm` (imported lazily: importing
``fsharded`` never imports Triton).

Both kernels see the input as a contiguous ``(M, N)`` matrix of rows (every leading dim
folded into ``M``) and normalise each row over its ``N`` columns, holding a whole row in
registers: ``N <= norm.MAX_HIDDEN`` (the caller checks). Statistics and all arithmetic are
fp32 (fp64 for fp64 inputs) whatever the input dtype; outputs are cast back at the store.

- ``norm_fwd_kernel``: a ``(BLOCK_M, BLOCK_N)`` tile of rows per program; LayerNorm
  ``(x - mean) * rstd * w + b`` or RMSNorm ``x * rstd * w``.
- ``norm_bwd_kernel``: grid ``(groups, P)``; program ``(g, p)`` walks a contiguous run of the
  rows of group ``g``, recomputes mean/rstd (cheaper than storing them: the row is loaded
  anyway), writes ``dx`` and accumulates its partial ``dweight`` / ``dbias`` in registers,
  stored once into a ``(groups, P, N)`` buffer that the host sums over ``P``. ``groups > 1``
  gives one ``dweight`` per group of rows: per-sample weight grads under ``vmap``.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._dispatch import triton_interpreting


@triton.jit
def _row_stats(x, mask, N, eps, RMS: tl.constexpr):
    """(xhat, rstd[:, None]) of a tile of rows; masked entries of ``xhat`` are 0."""
    if RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        xhat = x * rstd[:, None]
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
        xhat = xc * rstd[:, None]
    return xhat, rstd[:, None]


@triton.jit
def norm_fwd_kernel(
    X,  # (M, N)
    W,  # (N,) or dummy
    B,  # (N,) or dummy
    Y,  # (M, N)
    M,
    N,
    eps,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    RMS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = (rows < M)[:, None] & cmask[None, :]
    offs = rows[:, None] * N + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(ACC)
    y, _ = _row_stats(x, mask, N, eps, RMS)
    if HAS_W:
        y = y * tl.load(W + cols, mask=cmask, other=0.0).to(ACC)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=cmask, other=0.0).to(ACC)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def norm_bwd_kernel(
    DY,  # (M, N)
    X,  # (M, N)
    W,  # (N,) or dummy
    DX,  # (M, N)
    DW,  # (groups, P, N) partial sums, or dummy
    DB,  # (groups, P, N) partial sums, or dummy
    rows_per_group,
    rows_per_prog,
    N,
    eps,
    HAS_W: tl.constexpr,
    NEED_DB: tl.constexpr,
    RMS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    g = tl.program_id(0)
    p = tl.program_id(1)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    group_end = (g + 1).to(tl.int64) * rows_per_group
    first = g.to(tl.int64) * rows_per_group + p.to(tl.int64) * rows_per_prog
    last = tl.minimum(first + rows_per_prog, group_end)
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(ACC)
    dw = tl.zeros([BLOCK_N], dtype=ACC)
    db = tl.zeros([BLOCK_N], dtype=ACC)
    for r in range(0, rows_per_prog, BLOCK_M):
        rows = first + r + tl.arange(0, BLOCK_M)
        mask = (rows < last)[:, None] & cmask[None, :]
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(ACC)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(ACC)
        xhat, rstd = _row_stats(x, mask, N, eps, RMS)
        if HAS_W:
            wdy = dy * w[None, :]
        else:
            wdy = dy
        # d/dx of xhat-then-affine: rstd * (wdy - xhat*mean(xhat*wdy) [- mean(wdy)])
        dx = wdy - xhat * (tl.sum(xhat * wdy, axis=1) / N)[:, None]
        if not RMS:
            dx = dx - (tl.sum(wdy, axis=1) / N)[:, None]
        tl.store(DX + offs, (dx * rstd).to(DX.dtype.element_ty), mask=mask)
        if HAS_W:
            dw += tl.sum(dy * xhat, axis=0)
        if NEED_DB:
            db += tl.sum(dy, axis=0)
    part = (g * tl.num_programs(1) + p).to(tl.int64) * N + cols
    if HAS_W:
        tl.store(DW + part, dw, mask=cmask)
    if NEED_DB:
        tl.store(DB + part, db, mask=cmask)


_TL = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tile(n: int, rows: int, elems: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): several short rows per program so that a program moves
    ~``elems`` elements; wide rows get one row and more warps (registers per thread stay
    around 32 fp32 values at the 16384 maximum with 16 warps)."""
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(16, elems // block_n, triton.next_power_of_2(max(rows, 1))))
    tile = block_m * block_n
    warps = 4 if tile <= 2048 else 8 if tile <= 8192 else 16
    return block_m, block_n, (1 if triton_interpreting() else warps)


def _on(device: torch.device):
    """Triton launches on the current CUDA device, not on the arguments' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def forward(x: torch.Tensor, weight, bias, eps: float, rms: bool) -> torch.Tensor:
    """``y`` (M, N) in x's dtype for a contiguous ``x`` (M, N)."""
    m, n = x.shape
    y = torch.empty_like(x)
    if m == 0:
        return y
    block_m, block_n, warps = _tile(n, m, 4096)
    with _on(x.device):
        norm_fwd_kernel[(triton.cdiv(m, block_m),)](
            x,
            weight if weight is not None else x,
            bias if bias is not None else x,
            y,
            m,
            n,
            float(eps),
            HAS_W=weight is not None,
            HAS_B=bias is not None,
            RMS=rms,
            ACC=_TL[acc_dtype(x.dtype)],
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=warps,
        )
    return y


def backward(dy, x, weight, eps: float, rms: bool, need_db: bool, groups: int):
    """``(dx, dw, db)`` for contiguous ``dy, x`` (M, N): ``dw``/``db`` are (groups, N) sums
    over each group's rows in the accumulation dtype, or None when not asked for."""
    m, n = x.shape
    acc = acc_dtype(x.dtype)
    dx = torch.empty_like(x)
    rows = m // groups
    if rows == 0:
        grad = torch.zeros((groups, n), dtype=acc, device=x.device)
        return dx, (grad if weight is not None else None), (grad.clone() if need_db else None)
    block_m, block_n, warps = _tile(n, rows, 2048)
    # Enough programs to fill the GPU a few times over; each partial row is N floats.
    target = 2 if triton_interpreting() else 4 * _sm_count(x.device)
    progs = max(1, min(triton.cdiv(rows, block_m), triton.cdiv(target, groups)))
    per_prog = triton.cdiv(triton.cdiv(rows, progs), block_m) * block_m
    progs = max(1, triton.cdiv(rows, per_prog))
    # Every program stores its whole partial row: no memset needed.
    dw = torch.empty((groups, progs, n), dtype=acc, device=x.device) if weight is not None else None
    db = torch.empty((groups, progs, n), dtype=acc, device=x.device) if need_db else None
    with _on(x.device):
        norm_bwd_kernel[(groups, progs)](
            dy,
            x,
            weight if weight is not None else x,
            dx,
            dw if dw is not None else x,
            db if db is not None else x,
            rows,
            per_prog,
            n,
            float(eps),
            HAS_W=weight is not None,
            NEED_DB=need_db,
            RMS=rms,
            ACC=_TL[acc],
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=warps,
        )
    return dx, (dw.sum(1) if dw is not None else None), (db.sum(1) if db is not None else None)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
