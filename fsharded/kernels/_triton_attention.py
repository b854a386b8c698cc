"""Triton kernels for causal / sliding-window flash attention, forward and backward.

Private: imported lazily by :mod:`fsharded.kernels.attention` when the Triton path runs, so
importing ``fsharded`` never imports Triton. Layout ``(batch, heads, seq, head_dim)`` with any
strides; ``k``/``v`` may have fewer heads than ``q`` (GQA/MQA: query head ``h`` reads kv head
``h // group``). The caller validates shapes (``attention._check``).

Per (batch, query head) and query row ``i`` at position ``p = i + Sk - Sq`` (queries are the
last ``Sq`` positions), keys ``j`` are visible when ``j < Sk``, ``j <= p`` (``CAUSAL``) and
``j > p - window`` (``HAS_WINDOW``):

- ``_attn_fwd``: one program per (query block, head, batch); online softmax over the visible
  key blocks in fp32 (exp2 with the scale folded in), writes ``out`` and the natural-log
  ``lse`` (fp32);
- ``_bwd_preprocess``: ``delta = rowsum(dO * O) - dlse`` (the ``lse`` gradient enters here:
  d lse_i / d s_ij = P_ij, so ``dS = P * (dP - delta)`` covers both outputs);
- ``_attn_bwd_dkdv``: one program per (key block, kv head, batch), recomputing ``P`` from
  ``lse``; it walks the query blocks of every query head of its group, so dK/dV are summed
  over the group in registers (no atomics: deterministic);
- ``_attn_bwd_dq``: one program per (query block, head, batch) over the key blocks.

Blocks are visited in three phases: the window's left edge (masked), the blocks every row of
the tile sees in full (no mask arithmetic), and the diagonal / ragged end (masked); blocks no
row sees are skipped. Head dims up to 256 (non powers of two are padded to the next one with
masked loads). Block sizes: on GPU an autotune per (head dim, causal, window, dtypes) over a
few Hopper configs; under the interpreter a fixed 16x16 (``tl.dot`` needs dims >= 16).
"""

import torch
import triton
import triton.language as tl

from ._dispatch import triton_interpreting

__all__ = ["MAX_HEAD_DIM", "backward", "forward"]

MAX_HEAD_DIM = 256
_INTERPRET_BLOCK = 16
_NEG_BIG = tl.constexpr(-1.0e30)  # finite running-max sentinel: exp2(-inf - it) = 0, not NaN
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)

# fmt: off
# Kernel argument lists are laid out by hand: a tensor, then its strides, on one line.


@triton.jit
def _kv_range(start_m, Sq, Sk, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key range ``[lo, hi)`` seen by query rows ``[start_m, start_m + BLOCK_M)``, split at
    ``b1 <= b2`` so that key blocks in ``[b1, b2)`` are visible to every row (no mask)."""
    off = Sk - Sq
    if CAUSAL:
        hi = tl.minimum(Sk, start_m + BLOCK_M + off)
        full_hi = ((start_m + off + 1) // BLOCK_N) * BLOCK_N
    else:
        hi = Sk
        full_hi = Sk
    full_hi = tl.minimum(full_hi, (Sk // BLOCK_N) * BLOCK_N)
    if HAS_WINDOW:
        lo = (tl.maximum(start_m + off - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M + off - window, 0), BLOCK_N) * BLOCK_N
    else:
        lo = 0
        full_lo = 0
    b1 = tl.minimum(tl.maximum(full_lo, lo), hi)
    b2 = tl.minimum(tl.maximum(full_hi, b1), hi)
    return lo, b1, b2, hi


@triton.jit
def _q_range(start_n, Sq, Sk, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Query range ``[lo, hi)`` that sees some key of ``[start_n, start_n + BLOCK_N)``, split at
    ``b1 <= b2`` so that query blocks in ``[b1, b2)`` see every key of the block (no mask)."""
    off = Sk - Sq
    if CAUSAL:
        lo = (tl.maximum(start_n - off, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - off, 0), BLOCK_M) * BLOCK_M
    else:
        lo = 0
        full_lo = 0
    if HAS_WINDOW:
        hi = tl.minimum(Sq, tl.maximum(start_n + BLOCK_N - 1 + window - off, 0))
        full_hi = (tl.maximum(start_n + window - off, 0) // BLOCK_M) * BLOCK_M
    else:
        hi = Sq
        full_hi = Sq
    full_hi = tl.minimum(full_hi, (Sq // BLOCK_M) * BLOCK_M)
    full_hi = tl.where(start_n + BLOCK_N <= Sk, full_hi, 0)  # padding keys: mask everything
    b1 = tl.minimum(tl.maximum(full_lo, lo), hi)
    b2 = tl.minimum(tl.maximum(full_hi, b1), hi)
    return lo, b1, b2, hi


@triton.jit
def _phase(lo, b1, b2, hi, PHASE: tl.constexpr):
    """Bounds of phase 0 (masked left edge), 1 (unmasked middle) or 2 (masked right end)."""
    if PHASE == 0:
        return lo, b1
    elif PHASE == 1:
        return b1, b2
    else:
        return b2, hi


@triton.jit
def _query_block(BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """First row of this program's query block. Causal rows further down see more keys, so
    the grid hands them out first: less of a tail of long programs at the end."""
    if CAUSAL:
        return (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    return tl.program_id(0) * BLOCK_M


@triton.jit
def _visible(pos_q, offs_n, Sq, Sk, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Mask of the keys ``offs_n`` visible from the queries at positions ``pos_q`` (broadcast:
    pass rows as a column and keys as a row, or the transpose)."""
    ok = (offs_n < Sk) & (pos_q - (Sk - Sq) < Sq)
    if CAUSAL:
        ok = ok & (offs_n <= pos_q)
    if HAS_WINDOW:
        ok = ok & (offs_n > pos_q - window)
    return ok


@triton.jit
def _load_tile(base, offs_r, offs_d, stride_r, stride_d, n_rows, HEAD_DIM: tl.constexpr,
               MASK_R: tl.constexpr, EVEN_D: tl.constexpr, TRANS: tl.constexpr):
    """Rows ``offs_r`` x dims ``offs_d`` as a (rows, BLOCK_D) tile, or (BLOCK_D, rows) with
    ``TRANS``; zero past ``n_rows`` (checked only with ``MASK_R``) and ``HEAD_DIM``."""
    if TRANS:
        r = offs_r[None, :]
        d = offs_d[:, None]
    else:
        r = offs_r[:, None]
        d = offs_d[None, :]
    ptrs = base + r * stride_r + d * stride_d
    if MASK_R:
        if EVEN_D:
            return tl.load(ptrs, mask=r < n_rows, other=0.0)
        return tl.load(ptrs, mask=(r < n_rows) & (d < HEAD_DIM), other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=d < HEAD_DIM, other=0.0)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` accumulated in fp32. ``UPCAST`` (interpreter + bfloat16 only): Triton
    3.9's interpreter multiplies bfloat16 tiles as their raw uint16 bits, so it gets fp32
    copies of the (already bf16-rounded) values instead; compiled code never sets it."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


# ----------------------------------------------------------------------------- forward


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, pos_q, offs_d, k_base, skn, skd, v_base, svn, svd,
               n_lo, n_hi, Sq, Sk, window, qk_scale, HEAD_DIM: tl.constexpr,
               BLOCK_N: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
               UPCAST: tl.constexpr):
    for start_n in range(n_lo, n_hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load_tile(k_base, offs_n, offs_d, skn, skd, Sk, HEAD_DIM, MASK, EVEN_D, True)
        s = _dot(q, kt, None, PRECISION, UPCAST) * qk_scale  # (BM, BN), log2 units
        if MASK:
            ok = _visible(pos_q[:, None], offs_n[None, :], Sq, Sk, window, CAUSAL, HAS_WINDOW)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_base, offs_n, offs_d, svn, svd, Sk, HEAD_DIM, MASK, EVEN_D, False)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, sqb, sqh, sqm, sqd,
              K, skb, skh, skn, skd,
              V, svb, svh, svn, svd,
              O, sob, soh, som, sod,
              LSE, H, GROUP, Sq, Sk, window, qk_scale,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    pid_bh = b * H + h
    hk = h // GROUP
    start_m = _query_block(BLOCK_M, CAUSAL)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    pos_q = offs_m + (Sk - Sq)
    q = _load_tile(Q + b * sqb + h * sqh, offs_m, offs_d, sqm, sqd, Sq, HEAD_DIM, True, EVEN_D,
                   False)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, b1, b2, hi = _kv_range(start_m, Sq, Sk, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    for phase in tl.static_range(3):
        n_lo, n_hi = _phase(lo, b1, b2, hi, phase)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, pos_q, offs_d, k_base, skn, skd,
                                   v_base, svn, svd, n_lo, n_hi, Sq, Sk, window, qk_scale,
                                   HEAD_DIM, BLOCK_N, phase != 1, EVEN_D, CAUSAL, HAS_WINDOW,
                                   PRECISION, UPCAST)
    # A row that sees no key (only when Sk == 0) gives out = 0 and lse = -inf.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * _LN2)
    o_ptrs = O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod
    tl.store(o_ptrs, (acc / l_safe[:, None]).to(O.dtype.element_ty),
             mask=(offs_m[:, None] < Sq) & (offs_d[None, :] < HEAD_DIM))
    tl.store(LSE + pid_bh * Sq + offs_m, lse, mask=offs_m < Sq)


# ----------------------------------------------------------------------------- backward


@triton.jit
def _bwd_preprocess(O, sob, soh, som, sod,
                    DO, sdb, sdh, sdm, sdd,
                    DLSE, DELTA, H, Sq, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr):
    """``delta = rowsum(dO * O) - dlse`` in fp32, (B, H, Sq) contiguous."""
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    pid_bh = b * H + h
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < Sq) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
                mask=mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd,
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    rows = pid_bh * Sq + offs_m
    if HAS_DLSE:
        delta -= tl.load(DLSE + rows, mask=offs_m < Sq, other=0.0)
    tl.store(DELTA + rows, delta, mask=offs_m < Sq)


@triton.jit
def _dkdv_inner(dk, dv, k, v, offs_n, offs_d, q_base, sqh, sqm, sqd, do_base, sdh, sdm, sdd,
                lse_base, delta_base, m_lo, m_hi, GROUP, Sq, Sk, window, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
                EVEN_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Accumulate query blocks ``[m_lo, m_hi)`` of every query head of the kv group. One flat
    loop over (head, block): a head loop around a block loop spilled registers on sm_90."""
    n_m = tl.cdiv(tl.maximum(m_hi - m_lo, 0), BLOCK_M)
    for it in range(0, GROUP * n_m):
        g = it // n_m
        start_m = tl.multiple_of(m_lo + (it - g * n_m) * BLOCK_M, BLOCK_M)
        g = g.to(tl.int64)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = g * Sq + offs_m  # row of head g in the group's (GROUP, Sq) lse / delta
        qt = _load_tile(q_base + g * sqh, offs_m, offs_d, sqm, sqd, Sq, HEAD_DIM, MASK, EVEN_D,
                        True)
        if MASK:
            lse = tl.load(lse_base + rows, mask=offs_m < Sq, other=0.0)
            delta = tl.load(delta_base + rows, mask=offs_m < Sq, other=0.0)
        else:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        st = _dot(k, qt, None, PRECISION, UPCAST) * qk_scale  # (BN, BM), log2 units
        pt = tl.math.exp2(st - lse[None, :] * _LOG2E)
        if MASK:
            pos_q = offs_m + (Sk - Sq)
            ok = _visible(pos_q[None, :], offs_n[:, None], Sq, Sk, window, CAUSAL, HAS_WINDOW)
            pt = tl.where(ok, pt, 0.0)
        do = _load_tile(do_base + g * sdh, offs_m, offs_d, sdm, sdd, Sq, HEAD_DIM, MASK, EVEN_D,
                        False)
        dv = _dot(pt.to(do.dtype), do, dv, PRECISION, UPCAST)
        dpt = _dot(v, tl.trans(do), None, PRECISION, UPCAST)
        dst = pt * (dpt - delta[None, :])
        dk = _dot(dst.to(qt.dtype), tl.trans(qt), dk, PRECISION, UPCAST)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, sqb, sqh, sqm, sqd,
                   K, skb, skh, skn, skd,
                   V, svb, svh, svn, svd,
                   DO, sdb, sdh, sdm, sdd,
                   LSE, DELTA, DQ, DK, DV, H, GROUP, Sq, Sk, window, qk_scale, scale,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK, dV (contiguous (B, Hkv, Sk, D), input dtype) of one key block, summed over the
    query heads of its kv group. ``DQ`` is unused (shared argument list with ``_attn_bwd_dq``)."""
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    pid_bh = b * (H // GROUP) + hk
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tile(K + b * skb + hk * skh, offs_n, offs_d, skn, skd, Sk, HEAD_DIM, True, EVEN_D,
                   False)
    v = _load_tile(V + b * svb + hk * svh, offs_n, offs_d, svn, svd, Sk, HEAD_DIM, True, EVEN_D,
                   False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    h0 = hk * GROUP  # the group's first query head
    q_base = Q + b * sqb + h0 * sqh
    do_base = DO + b * sdb + h0 * sdh
    row0 = (b * H + h0) * Sq
    lo, b1, b2, hi = _q_range(start_n, Sq, Sk, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    for phase in tl.static_range(3):
        m_lo, m_hi = _phase(lo, b1, b2, hi, phase)
        dk, dv = _dkdv_inner(dk, dv, k, v, offs_n, offs_d, q_base, sqh, sqm, sqd,
                             do_base, sdh, sdm, sdd, LSE + row0, DELTA + row0, m_lo, m_hi,
                             GROUP, Sq, Sk, window, qk_scale, HEAD_DIM, BLOCK_M, phase != 1,
                             EVEN_D, CAUSAL, HAS_WINDOW, PRECISION, UPCAST)
    out = (pid_bh * Sk + offs_n[:, None]) * HEAD_DIM + offs_d[None, :]
    mask = (offs_n[:, None] < Sk) & (offs_d[None, :] < HEAD_DIM)
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, pos_q, offs_d, k_base, skn, skd, v_base, svn, svd,
              n_lo, n_hi, Sq, Sk, window, qk_scale, HEAD_DIM: tl.constexpr,
              BLOCK_N: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr,
              CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
              UPCAST: tl.constexpr):
    for start_n in range(n_lo, n_hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load_tile(k_base, offs_n, offs_d, skn, skd, Sk, HEAD_DIM, MASK, EVEN_D, True)
        vt = _load_tile(v_base, offs_n, offs_d, svn, svd, Sk, HEAD_DIM, MASK, EVEN_D, True)
        p = tl.math.exp2(_dot(q, kt, None, PRECISION, UPCAST) * qk_scale - lse[:, None])
        if MASK:
            ok = _visible(pos_q[:, None], offs_n[None, :], Sq, Sk, window, CAUSAL, HAS_WINDOW)
            p = tl.where(ok, p, 0.0)
        dp = _dot(do, vt, None, PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(kt.dtype), tl.trans(kt), dq, PRECISION, UPCAST)
    return dq


@triton.jit
def _attn_bwd_dq(Q, sqb, sqh, sqm, sqd,
                 K, skb, skh, skn, skd,
                 V, svb, svh, svn, svd,
                 DO, sdb, sdh, sdm, sdd,
                 LSE, DELTA, DQ, DK, DV, H, GROUP, Sq, Sk, window, qk_scale, scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ (contiguous (B, H, Sq, D), input dtype) of one query block. ``DK``/``DV`` unused."""
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    pid_bh = b * H + h
    hk = h // GROUP
    start_m = _query_block(BLOCK_M, CAUSAL)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    pos_q = offs_m + (Sk - Sq)
    q = _load_tile(Q + b * sqb + h * sqh, offs_m, offs_d, sqm, sqd, Sq, HEAD_DIM, True, EVEN_D,
                   False)
    do = _load_tile(DO + b * sdb + h * sdh, offs_m, offs_d, sdm, sdd, Sq, HEAD_DIM, True, EVEN_D,
                    False)
    rows = pid_bh * Sq + offs_m
    lse = tl.load(LSE + rows, mask=offs_m < Sq, other=0.0) * _LOG2E
    delta = tl.load(DELTA + rows, mask=offs_m < Sq, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, b1, b2, hi = _kv_range(start_m, Sq, Sk, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    for phase in tl.static_range(3):
        n_lo, n_hi = _phase(lo, b1, b2, hi, phase)
        dq = _dq_inner(dq, q, do, lse, delta, pos_q, offs_d, k_base, skn, skd, v_base, svn, svd,
                       n_lo, n_hi, Sq, Sk, window, qk_scale, HEAD_DIM, BLOCK_N, phase != 1,
                       EVEN_D, CAUSAL, HAS_WINDOW, PRECISION, UPCAST)
    out = rows[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DQ + out, (dq * scale).to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < Sq) & (offs_d[None, :] < HEAD_DIM))


# fmt: on
# ----------------------------------------------------------------------------- launchers

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head-dim class (padded head dim <= 64, 128,
# 256), from an sm_90 compile sweep (bf16, causal): no register spills and at most 227 KB of
# shared memory, except at head dim 256, where the dK/dV kernel spills in every tiling and the
# forward in most (the least-spilling ones are kept). Configs that do not fit (fp32 inputs
# need twice the shared memory) are skipped by the autotuner. dK/dV tiles are (queries, keys).
_TABLES = {
    "fwd": {
        64: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 3), (128, 32, 8, 3),
             (128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2)],
        128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 3), (128, 128, 8, 2),
              (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)],
        256: [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2), (64, 32, 4, 2)],
    },
    "dkdv": {
        64: [(32, 128, 8, 3), (16, 128, 8, 3), (64, 128, 8, 3), (32, 64, 8, 3),
             (32, 64, 4, 3), (64, 64, 8, 3), (32, 32, 4, 2)],
        128: [(16, 128, 8, 3), (32, 64, 8, 2), (32, 64, 8, 3), (16, 64, 4, 2), (32, 32, 4, 2)],
        256: [(32, 64, 8, 2), (32, 64, 8, 3), (32, 32, 4, 2), (16, 32, 4, 2)],
    },
    "dq": {
        64: [(128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3),
             (64, 32, 4, 3), (64, 32, 8, 3)],
        128: [(128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2),
              (64, 32, 4, 3), (64, 32, 8, 3)],
        256: [(128, 32, 8, 3), (64, 32, 8, 3), (64, 32, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2)],
    },
}  # fmt: skip
_KEY = ["HEAD_DIM", "CAUSAL", "HAS_WINDOW"]  # the autotuner adds the tensors' dtypes


def _shape(config):
    return (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps,
            config.num_stages)  # fmt: skip


def _autotuned(kernel, kind):
    table = _TABLES[kind]
    shapes = sorted({s for shapes in table.values() for s in shapes})
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in shapes
    ]

    def prune(configs, named_args, **kwargs):
        block_d = kwargs["BLOCK_D"]
        keep = set(table[64 if block_d <= 64 else 128 if block_d <= 128 else 256])
        return [c for c in configs if _shape(c) in keep]

    return triton.autotune(configs, key=_KEY, prune_configs_by={"early_config_prune": prune})(
        kernel
    )


if triton_interpreting():  # autotuning under the interpreter would take minutes
    _fwd, _dkdv, _dq = _attn_fwd, _attn_bwd_dkdv, _attn_bwd_dq
    _FIXED = {"BLOCK_M": _INTERPRET_BLOCK, "BLOCK_N": _INTERPRET_BLOCK}
else:
    _fwd = _autotuned(_attn_fwd, "fwd")
    _dkdv = _autotuned(_attn_bwd_dkdv, "dkdv")
    _dq = _autotuned(_attn_bwd_dq, "dq")
    _FIXED = {}


def _meta(q, causal, window):
    D = q.shape[-1]
    exact = q.dtype != torch.float32 or torch.get_float32_matmul_precision() == "highest"
    return dict(
        HEAD_DIM=D,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        CAUSAL=bool(causal),
        HAS_WINDOW=window is not None,
        PRECISION="ieee" if exact else "tf32",  # only matters for fp32 inputs
        UPCAST=triton_interpreting() and q.dtype == torch.bfloat16,
    )


def forward(q, k, v, causal, window, scale):
    """``(out, lse)``: out (B, H, Sq, D) in q's dtype, lse (B, H, Sq) fp32 natural log."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    out = torch.empty((B, H, Sq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    grid = lambda meta: (triton.cdiv(Sq, meta["BLOCK_M"]), H, B)  # noqa: E731
    _fwd[grid](
        q, *q.stride(), k, *k.stride(), v, *v.stride(), out, *out.stride(),
        lse, H, H // Hkv, Sq, Sk, window or 0, scale * _LOG2E.value,
        **_meta(q, causal, window), **_FIXED,
    )  # fmt: skip
    return out, lse


def backward(dout, dlse, q, k, v, out, lse, causal, window, scale):
    """``(dq, dk, dv)`` of a loss whose gradients w.r.t. ``out`` and ``lse`` are ``dout`` and
    ``dlse`` (None: lse unused); dk, dv are summed over each kv head's query group."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    meta = _meta(q, causal, window)
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    pre_m = _INTERPRET_BLOCK if triton_interpreting() else 64
    dlse = None if dlse is None else dlse.float().contiguous()
    _bwd_preprocess[(triton.cdiv(Sq, pre_m), H, B)](
        out, *out.stride(), dout, *dout.stride(), dlse if dlse is not None else lse, delta,
        H, Sq, HEAD_DIM=D, BLOCK_D=meta["BLOCK_D"], HAS_DLSE=dlse is not None, BLOCK_M=pre_m,
    )  # fmt: skip
    args = (
        q, *q.stride(), k, *k.stride(), v, *v.stride(), dout, *dout.stride(),
        lse, delta, dq, dk, dv, H, H // Hkv, Sq, Sk, window or 0, scale * _LOG2E.value, scale,
    )  # fmt: skip
    _dkdv[lambda m: (triton.cdiv(Sk, m["BLOCK_N"]), Hkv, B)](*args, **meta, **_FIXED)
    _dq[lambda m: (triton.cdiv(Sq, m["BLOCK_M"]), H, B)](*args, **meta, **_FIXED)
    return dq, dk, dv
