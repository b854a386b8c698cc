"""The Triton kernel of :mod:`fsharded.kernels.weight_int8` (imported only when it runs).

Each program computes a ``(BM, BN)`` tile of ``x @ W``: it walks ``K`` in steps of ``BK``,
loads a ``(BM, BK)`` tile of ``x`` and a ``(BN, BK)`` tile of ``q`` (int8, each output
channel's weights contiguous), scales the ``q`` tile in registers by the scale of each
element's group (``k // G``) and output channel, and accumulates ``x_tile @ w_tile.T``
in fp32. The weights are read once as int8 and never written out dequantized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, G, n_groups,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)  # (64-bit offsets: M * N may pass 2**31)
    rn = (pn * BN + tl.arange(0, BN)).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        live = (rn[:, None] < N) & (rk[None, :] < K)
        q = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=live, other=0)
        s = tl.load(s_ptr + rn[:, None] * n_groups + rk[None, :] // G, mask=live, other=0.0)
        w = q.to(tl.float32) * s  # (BN, BK)
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` (M, K) float, ``q`` (N, K) int8, ``scales`` (N, K // G) fp32 -> (M, N)."""
    x, q, scales = x.contiguous(), q.contiguous(), scales.contiguous()
    M, K = x.shape
    N = q.shape[0]
    n_groups = scales.shape[1]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    BM = 16 if M <= 16 else 64
    BN, BK = 64, 64
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    _kernel[grid](x, q, scales, y, M, N, K, K // n_groups, n_groups, BM=BM, BN=BN, BK=BK)
    return y
