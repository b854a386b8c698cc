"""Triton kernels behind :mod:`fsharded.kernels.moe` (imported lazily: importing ``fsharded``
never imports Triton).

Every tensor arrives contiguous (the caller copies). Arithmetic is fp32 (fp64 for fp64 rows
in the gather / segment-sum kernels); results are cast at the store.

- ``gather_kernel``: grid ``(row blocks, feature blocks)``; ``out[n] = scale[n] * src[idx[n]]``
  and, optionally, the partial row dots ``sum_cols src[idx[n]] * other[n]`` of its feature
  block (summed over the blocks by the host). Serves ``permute`` and ``unpermute``'s backward.
- ``segment_sum_kernel``: grid ``(token blocks, feature blocks)``; ``out[t] = sum_j w[n_j]
  src[n_j]`` over the rows ``n_j`` mapped to token ``t``, read through the inverse mapping
  (``order``, ``starts``): a gather and weighted sum, no atomics, so results are
  deterministic and in the same order as ``index_add``'s (increasing ``n``). Serves
  ``unpermute`` and ``permute``'s backward.
- ``gmm_kernel``: grid ``(row tiles, column tiles)``; group boundaries need not be aligned
  to tiles: a tile straddling groups ``g0..g1`` (host-computed per tile) runs one K loop
  per group with the rows outside that group masked to zero, summing into one fp32
  accumulator. The extra work is at most one tile-matmul per group boundary.
- ``gmm_dw_kernel``: grid ``(groups, d_in tiles, d_out tiles)``; ``dw_g = x_g^T dy_g``,
  each program walking its group's rows (empty groups store zeros).

Out-of-range indices (the public functions reject them; under ``vmap`` or tracing they are
not checked) never touch memory outside the buffers: a gathered row reads as zero and a
scattered one is dropped.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._dispatch import triton_interpreting
from ._triton_norm import _TL, acc_dtype  # noqa: F401 - the dtype table and accumulation rule, shared


def _on(device: torch.device):
    """Triton launches on the current CUDA device, not on the arguments' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _row_tile(rows: int, d: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for the memory-bound row kernels: ~4096 elements a
    program, whole rows up to 1024 features."""
    block_d = min(1024, triton.next_power_of_2(max(d, 1)))
    block_r = max(1, min(64, 4096 // block_d, triton.next_power_of_2(max(rows, 1))))
    return block_r, block_d, (1 if triton_interpreting() else 4)


# ------------------------------------------------------------------------- permute family


@triton.jit
def gather_kernel(
    SRC,  # (M, D)
    IDX,  # (N,) int64
    SCALE,  # (N,) or dummy
    OTHER,  # (N, D) or dummy
    OUT,  # (N, D)
    DOT,  # (n_dblocks, N) fp32/fp64 partial row dots, or dummy
    N,
    M,
    D,
    HAS_SCALE: tl.constexpr,
    HAS_DOT: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < N
    cmask = cols < D
    idx = tl.load(IDX + rows, mask=rmask, other=-1)
    valid = rmask & (idx >= 0) & (idx < M)
    v = tl.load(
        SRC + idx[:, None] * D + cols[None, :], mask=valid[:, None] & cmask[None, :], other=0.0
    ).to(ACC)
    offs = rows[:, None] * D + cols[None, :]
    mask = rmask[:, None] & cmask[None, :]
    if HAS_DOT:
        o = tl.load(OTHER + offs, mask=mask, other=0.0).to(ACC)
        tl.store(DOT + tl.program_id(1).to(tl.int64) * N + rows, tl.sum(v * o, axis=1), mask=rmask)
    if HAS_SCALE:
        v = v * tl.load(SCALE + rows, mask=rmask, other=0.0).to(ACC)[:, None]
    tl.store(OUT + offs, v.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def segment_sum_kernel(
    SRC,  # (N, D)
    ORDER,  # (N,) int64: rows sorted (stably) by target token
    STARTS,  # (T + 1,) int64: token t's rows are ORDER[STARTS[t]:STARTS[t + 1]]
    W,  # (N,) or dummy
    OUT,  # (T, D)
    T,
    D,
    HAS_W: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = toks < T
    cmask = cols < D
    start = tl.load(STARTS + toks, mask=tmask, other=0)
    count = tl.load(STARTS + toks + 1, mask=tmask, other=0) - start
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=ACC)
    # Tokens of a block share the loop up to the block's largest count (k for top-k routing).
    for j in range(0, tl.max(count, axis=0)):
        m = j < count
        n = tl.load(ORDER + start + j, mask=m, other=0)
        v = tl.load(
            SRC + n[:, None] * D + cols[None, :], mask=m[:, None] & cmask[None, :], other=0.0
        )
        v = v.to(ACC)
        if HAS_W:
            v = v * tl.load(W + n, mask=m, other=0.0).to(ACC)[:, None]
        acc += v
    offs = toks[:, None] * D + cols[None, :]
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])


def gather(src, idx, scale=None, other=None):
    """``(scale[:, None] * src[idx], rowdot(src[idx], other) or None)``; ``other`` (N, D)."""
    m, d = src.shape
    n = idx.shape[0]
    out = torch.empty((n, d), dtype=src.dtype, device=src.device)
    block_r, block_d, warps = _row_tile(n, d)
    grid = (triton.cdiv(n, block_r), triton.cdiv(d, block_d))
    acc = acc_dtype(src.dtype)
    dot = torch.empty((grid[1], n), dtype=acc, device=src.device) if other is not None else None
    if n and d:
        with _on(src.device):
            gather_kernel[grid](
                src,
                idx,
                scale if scale is not None else src,
                other if other is not None else src,
                out,
                dot if dot is not None else src,
                n,
                m,
                d,
                HAS_SCALE=scale is not None,
                HAS_DOT=other is not None,
                ACC=_TL[acc],
                BLOCK_R=block_r,
                BLOCK_D=block_d,
                num_warps=warps,
            )
    elif dot is not None:
        dot.zero_()
    return out, (dot.sum(0) if dot is not None else None)


def inverse(idx: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, starts)``: the rows ``n`` with ``idx[n] == t`` are ``order[starts[t]:
    starts[t + 1]]``, in increasing ``n``. Out-of-range entries belong to no token."""
    sorted_idx, order = torch.sort(idx, stable=True)
    tokens = torch.arange(num_tokens + 1, device=idx.device, dtype=idx.dtype)
    return order, torch.searchsorted(sorted_idx, tokens)


def segment_sum(src, idx, weights, num_tokens: int):
    """``out[t] = sum_{n: idx[n] == t} weights[n] * src[n]`` (``weights`` None: 1), (T, D)."""
    n, d = src.shape
    out = torch.empty((num_tokens, d), dtype=src.dtype, device=src.device)
    if num_tokens == 0 or d == 0:
        return out
    order, starts = inverse(idx, num_tokens)
    block_t, block_d, warps = _row_tile(num_tokens, d)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(d, block_d))
    with _on(src.device):
        segment_sum_kernel[grid](
            src,
            order,
            starts,
            weights if weights is not None else src,
            out,
            num_tokens,
            d,
            HAS_W=weights is not None,
            ACC=_TL[acc_dtype(src.dtype)],
            BLOCK_T=block_t,
            BLOCK_D=block_d,
            num_warps=warps,
        )
    return out


# ------------------------------------------------------------------------- grouped matmul


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32. ``UPCAST`` (interpreter + bfloat16 only): Triton 3.9's
    interpreter multiplies bfloat16 tiles as raw bits, so it gets fp32 copies instead."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def gmm_kernel(
    X,  # (N, K)
    W,  # (WN, ., .): group g multiplies by W[g % WN], read as (K, NOUT) through strides
    Y,  # (N, NOUT)
    OFFS,  # (G + 1,) int64 group boundaries
    FIRST,  # (row tiles,) int32: first group meeting the tile
    LAST,  # (row tiles,) int32: last group meeting the tile
    N,
    K,
    NOUT,
    WN,
    s_we,
    s_wk,
    s_wn,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < NOUT
    ks0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g_first = tl.load(FIRST + pid_m)
    g_last = tl.load(LAST + pid_m)
    for g in range(g_first, g_last + 1):
        lo = tl.load(OFFS + g)
        hi = tl.load(OFFS + g + 1)
        if hi > lo:  # empty groups between the tile's first and last do nothing
            rmask = (rows >= lo) & (rows < hi) & (rows < N)
            w_base = W + (g % WN).to(tl.int64) * s_we
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + ks0
                kmask = ks < K
                a = tl.load(
                    X + rows[:, None] * K + ks[None, :],
                    mask=rmask[:, None] & kmask[None, :],
                    other=0.0,
                )
                b = tl.load(
                    w_base + ks[:, None] * s_wk + cols[None, :] * s_wn,
                    mask=kmask[:, None] & cmask[None, :],
                    other=0.0,
                )
                acc = _dot(a, b, acc, PRECISION, UPCAST)
    offs = rows[:, None] * NOUT + cols[None, :]
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=(rows < N)[:, None] & cmask[None, :])


@triton.jit
def gmm_dw_kernel(
    X,  # (N, K)
    DY,  # (N, NOUT)
    DW,  # (G, K, NOUT)
    OFFS,  # (G + 1,)
    K,
    NOUT,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    g = tl.program_id(0)
    ks = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(2).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = ks < K
    cmask = cols < NOUT
    lo = tl.load(OFFS + g)
    hi = tl.load(OFFS + g + 1)
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = rows < hi
        xt = tl.load(
            X + rows[None, :] * K + ks[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0
        )  # (BLOCK_K, BLOCK_M)
        dy = tl.load(
            DY + rows[:, None] * NOUT + cols[None, :],
            mask=rmask[:, None] & cmask[None, :],
            other=0.0,
        )
        acc = _dot(xt, dy, acc, PRECISION, UPCAST)
    offs = g.to(tl.int64) * K * NOUT + ks[:, None] * NOUT + cols[None, :]
    tl.store(DW + offs, acc.to(DW.dtype.element_ty), mask=kmask[:, None] & cmask[None, :])


def _mm_meta(dtype: torch.dtype) -> dict:
    exact = dtype != torch.float32 or torch.get_float32_matmul_precision() == "highest"
    return dict(
        PRECISION="ieee" if exact else "tf32",
        UPCAST=triton_interpreting() and dtype == torch.bfloat16,
    )


def _mm_tile(k: int, nout: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps); untuned defaults (tl.dot needs dims >= 16)."""
    if triton_interpreting():
        return 16, 16, 16, 1
    block_n = min(128, max(16, triton.next_power_of_2(nout)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    return 64, block_n, block_k, 4


def _tile_groups(offsets: torch.Tensor, n: int, block_m: int):
    """(first, last) int32 per row tile: the groups whose rows meet the tile."""
    g = offsets.numel() - 1
    start = torch.arange(0, n, block_m, device=offsets.device, dtype=offsets.dtype)
    end = (start + block_m).clamp(max=n) - 1
    first = torch.searchsorted(offsets, start, right=True) - 1
    last = torch.searchsorted(offsets, end, right=True) - 1
    first, last = first.clamp(0, g - 1), last.clamp(0, g - 1)
    return first.to(torch.int32), torch.maximum(first, last).to(torch.int32)


def grouped_matmul(x, w, offsets, transpose_w: bool = False):
    """``y[rows of g] = x[rows of g] @ w[g % WN]`` (``w[g % WN].T`` with ``transpose_w``)."""
    n, k = x.shape
    wn = w.shape[0]
    nout = w.shape[1] if transpose_w else w.shape[2]
    y = torch.empty((n, nout), dtype=x.dtype, device=x.device)
    if n == 0 or nout == 0:
        return y
    if k == 0 or offsets.numel() < 2 or wn == 0:
        return y.zero_()
    block_m, block_n, block_k, warps = _mm_tile(k, nout)
    first, last = _tile_groups(offsets, n, block_m)
    s_we, s_a, s_b = w.stride()
    s_wk, s_wn = (s_b, s_a) if transpose_w else (s_a, s_b)
    grid = (triton.cdiv(n, block_m), triton.cdiv(nout, block_n))
    with _on(x.device):
        gmm_kernel[grid](
            x,
            w,
            y,
            offsets,
            first,
            last,
            n,
            k,
            nout,
            wn,
            s_we,
            s_wk,
            s_wn,
            **_mm_meta(x.dtype),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=warps,
        )
    return y


def grouped_matmul_dw(x, dy, offsets, dtype: torch.dtype):
    """``dw[g] = x[rows of g].T @ dy[rows of g]``, (G, K, NOUT) in ``dtype``."""
    k, nout = x.shape[1], dy.shape[1]
    groups = offsets.numel() - 1
    dw = torch.empty((groups, k, nout), dtype=dtype, device=x.device)
    if dw.numel() == 0:
        return dw
    block_m, block_n, block_k, warps = _mm_tile(k, nout)
    grid = (groups, triton.cdiv(k, block_k), triton.cdiv(nout, block_n))
    with _on(x.device):
        gmm_dw_kernel[grid](
            x,
            dy,
            dw,
            offsets,
            k,
            nout,
            **_mm_meta(x.dtype),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=warps,
        )
    return dw
