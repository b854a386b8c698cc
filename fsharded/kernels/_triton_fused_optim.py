"""Triton kernels behind :mod:`fsharded.kernels.fused_optim` (imported lazily: importing
``fsharded`` never imports Triton).

One launch updates a whole bucket of tensors of different sizes ("multi-tensor apply").
The host builds one int64 *table* per bucket::

    table[r * n + i]      address of tensor i in row r  (rows: params, grads, state0, state1,
                          half params; 0 for a row the optimizer does not use)
    table[5 * n + i]      numel of tensor i
    table[6 * n + 2 * b]      tensor index of chunk b
    table[6 * n + 2 * b + 1]  index of chunk b inside its tensor (first element: that times
                              the chunk size)

and launches one program per chunk of ``BLOCK * ITERS`` elements. A program loads its
tensor's addresses and bitcasts them to typed pointers (this works on CUDA and in Triton's
CPU interpreter alike, where addresses are host addresses). Full chunks run unmasked and,
when every address of the bucket is 16-byte aligned (``ALIGNED``), with that alignment
visible to the compiler, so loads and stores vectorise; the last chunk of a tensor is masked. Every bucket's grads share one
dtype and its half params one dtype (the host groups mixed lists into several launches).

Non-finite gradients: ``nonfinite_kernel`` writes 1 into a one-byte device flag when any
unscaled gradient is inf/nan; ``update_kernel`` reads the flag first and, when set, touches
nothing. Both run back to back on the stream, so no host synchronisation is needed. With
``check=False`` the check launches are skipped (one read of the gradients less) and the flag
stays 0.

All math is fp32: grads are upcast and multiplied by ``inv_scale`` on load; the host passes
every derived scalar (``1 - beta``, ``lr / bias_correction1``, ...) already computed in
float64 so that rounding matches ``torch.optim``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from ._dispatch import triton_interpreting

ADAM, LION, ADAGRAD = 0, 1, 2

# update_kernel's runtime scalars, in order (the host computes them in float64).
_SCALARS = ("lr", "beta1", "omb1", "beta2", "omb2", "eps", "wd", "decay", "step_size", "bc2_sqrt", "inv_scale")  # fmt: skip

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _chunk(table, n, pid, CHUNK: tl.constexpr):
    """(tensor index, first element, numel) of chunk ``pid``; the first element is computed
    as ``index * CHUNK`` so the compiler knows its alignment."""
    t = tl.load(table + 6 * n + 2 * pid)
    start = tl.load(table + 6 * n + 2 * pid + 1) * CHUNK
    numel = tl.load(table + 5 * n + t)
    return t, start, numel


@triton.jit
def _ptr(table, n, row, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    ptr = tl.load(table + row * n + t).to(tl.pointer_type(DTYPE), bitcast=True)
    if ALIGNED:
        # The host checked every address is 16-byte aligned; saying so lets the compiler use
        # 128-bit loads and stores (it cannot see through the integer-to-pointer cast).
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _load(ptr, offs, numel, FULL: tl.constexpr):
    # Full chunks go unmasked: a mask against a numel read from memory (alignment unknown)
    # would stop the compiler from vectorising.
    if FULL:
        x = tl.load(ptr + offs)
    else:
        x = tl.load(ptr + offs, mask=offs < numel, other=0.0)
    return x


@triton.jit
def _store(ptr, offs, x, numel, FULL: tl.constexpr):
    if FULL:
        tl.store(ptr + offs, x)
    else:
        tl.store(ptr + offs, x, mask=offs < numel)


@triton.jit
def _to_bf16(x):
    """fp32 -> bf16 rounding to nearest even, done on the bits: the same result as a GPU's
    ``cvt.rn`` and as ``torch``'s cast, also under the interpreter (whose cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF)
    out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(x != x, x.to(tl.bfloat16), out)


@triton.jit
def _any_nonfinite(g_ptr, start, numel, inv_scale, BLOCK: tl.constexpr, ITERS: tl.constexpr, FULL: tl.constexpr):  # fmt: skip
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        g = _load(g_ptr, offs, numel, FULL).to(tl.float32) * inv_scale
        bad = bad | ((g != g) | (tl.abs(g) == float("inf"))).to(tl.int32)
    return tl.max(bad, 0)


@triton.jit(do_not_specialize=["n"])
def nonfinite_kernel(
    table,
    n,
    flag,
    inv_scale,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    """Sets ``*flag = 1`` when any ``grad * inv_scale`` of this chunk is inf or nan."""
    t, start, numel = _chunk(table, n, tl.program_id(0), BLOCK * ITERS)
    g_ptr = _ptr(table, n, 1, t, G_DTYPE, ALIGNED)
    if start + BLOCK * ITERS <= numel:
        any_bad = _any_nonfinite(g_ptr, start, numel, inv_scale, BLOCK, ITERS, True)
    else:
        any_bad = _any_nonfinite(g_ptr, start, numel, inv_scale, BLOCK, ITERS, False)
    # Every writer stores the same value, so the race between programs is benign.
    tl.store(flag, any_bad.to(tl.uint8), mask=any_bad > 0)


@triton.jit
def _update_chunk(
    p_ptr, g_ptr, m_ptr, v_ptr, h_ptr, start, numel,
    lr, beta1, omb1, beta2, omb2, eps, wd, decay, step_size, bc2_sqrt, inv_scale,
    KIND: tl.constexpr, DECOUPLED: tl.constexpr, HALF_DTYPE: tl.constexpr,
    HAS_HALF: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr, FULL: tl.constexpr,
):  # fmt: skip
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        p = _load(p_ptr, offs, numel, FULL)
        g = _load(g_ptr, offs, numel, FULL).to(tl.float32) * inv_scale
        m = _load(m_ptr, offs, numel, FULL)
        if KIND == 0:  # Adam / AdamW; m = exp_avg, v = exp_avg_sq
            v = _load(v_ptr, offs, numel, FULL)
            if DECOUPLED:
                p = p * decay
            else:
                g = g + wd * p
            m = m + omb1 * (g - m)
            v = v * beta2 + omb2 * (g * g)
            denom = tl.sqrt(v) / bc2_sqrt + eps
            p = p - step_size * (m / denom)
            _store(v_ptr, offs, v, numel, FULL)
        elif KIND == 1:  # Lion; m = exp_avg
            c = beta1 * m + omb1 * g
            update = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
            p = p * decay - lr * update
            m = m * beta2 + omb2 * g
        else:  # Adagrad; m = state_sum
            g = g + wd * p
            m = m + g * g
            p = p - step_size * (g / (tl.sqrt(m) + eps))
        _store(p_ptr, offs, p, numel, FULL)
        _store(m_ptr, offs, m, numel, FULL)
        if HAS_HALF:
            if HALF_DTYPE == tl.bfloat16:
                _store(h_ptr, offs, _to_bf16(p), numel, FULL)
            else:
                _store(h_ptr, offs, p.to(HALF_DTYPE), numel, FULL)


@triton.jit(do_not_specialize=["n"])
def update_kernel(
    table,
    n,
    flag,
    lr,
    beta1,
    omb1,  # 1 - beta1
    beta2,
    omb2,  # 1 - beta2
    eps,
    wd,
    decay,  # 1 - lr * wd (decoupled decay)
    step_size,  # Adam: lr / (1 - beta1**step); Adagrad: the decayed lr
    bc2_sqrt,  # Adam: sqrt(1 - beta2**step)
    inv_scale,
    KIND: tl.constexpr,
    DECOUPLED: tl.constexpr,
    G_DTYPE: tl.constexpr,
    HALF_DTYPE: tl.constexpr,
    HAS_HALF: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    """One optimizer step on one chunk, unless ``*flag`` says a gradient was non-finite."""
    if tl.load(flag) == 0:
        t, start, numel = _chunk(table, n, tl.program_id(0), BLOCK * ITERS)
        p_ptr = _ptr(table, n, 0, t, tl.float32, ALIGNED)
        g_ptr = _ptr(table, n, 1, t, G_DTYPE, ALIGNED)
        m_ptr = _ptr(table, n, 2, t, tl.float32, ALIGNED)
        v_ptr = p_ptr
        if KIND == 0:
            v_ptr = _ptr(table, n, 3, t, tl.float32, ALIGNED)
        h_ptr = p_ptr
        if HAS_HALF:
            h_ptr = _ptr(table, n, 4, t, HALF_DTYPE, ALIGNED)
        if start + BLOCK * ITERS <= numel:
            _update_chunk(
                p_ptr, g_ptr, m_ptr, v_ptr, h_ptr, start, numel,
                lr, beta1, omb1, beta2, omb2, eps, wd, decay, step_size, bc2_sqrt, inv_scale,
                KIND, DECOUPLED, HALF_DTYPE, HAS_HALF, BLOCK, ITERS, True,
            )  # fmt: skip
        else:
            _update_chunk(
                p_ptr, g_ptr, m_ptr, v_ptr, h_ptr, start, numel,
                lr, beta1, omb1, beta2, omb2, eps, wd, decay, step_size, bc2_sqrt, inv_scale,
                KIND, DECOUPLED, HALF_DTYPE, HAS_HALF, BLOCK, ITERS, False,
            )  # fmt: skip


def _config() -> tuple[int, int, int]:
    """(BLOCK, ITERS, num_warps): 4096-element chunks on a GPU (elementwise, memory bound:
    enough bytes in flight per program, few programs' worth of table); tiny under the
    interpreter, which runs programs one by one in Python."""
    return (128, 2, 1) if triton_interpreting() else (1024, 4, 4)


@functools.lru_cache(maxsize=64)
def _table(device: torch.device, addrs: tuple[int, ...], numels: tuple[int, ...], chunk: int):
    """The launch table (layout in the module doc) and its chunk count.

    Cached on the addresses themselves: the table is a pure function of its key, so a hit
    can never be stale, and a training loop that steps the same buffers reuses one device
    copy instead of paying a host-to-device copy per step.
    """
    n = len(numels)
    counts = torch.tensor([-(-k // chunk) for k in numels], dtype=torch.int64)
    n_chunks = int(counts.sum())
    owner = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), counts)
    first = torch.cumsum(counts, 0) - counts  # first chunk of each tensor
    index = torch.arange(n_chunks, dtype=torch.int64) - first[owner]  # chunk within tensor
    head = torch.tensor(list(addrs) + list(numels), dtype=torch.int64)
    table = torch.cat([head, torch.stack([owner, index], 1).reshape(-1)])
    if device.type == "cuda":  # pinned + non_blocking: the copy does not sync the host
        return table.pin_memory().to(device, non_blocking=True), n_chunks
    return table, n_chunks


def step(
    kind: int, rows: dict, scalars: dict, *, decoupled: bool, check: bool = True
) -> torch.Tensor:
    """Run one fused step of ``kind`` (ADAM / LION / ADAGRAD) in place.

    ``rows`` maps ``params``, ``grads``, ``s0``, ``s1`` (Adam's second moment, else None),
    ``half`` (or None) to equal-length lists of non-empty, validated tensors on one device.
    Returns the 0-d bool ``found_inf`` on that device; no host synchronisation. With
    ``check=False`` no check kernel runs (the flag stays 0, ``found_inf`` is False) and
    non-finite gradients reach the parameters.
    """
    params = rows["params"]
    device = params[0].device
    flag = torch.zeros((), dtype=torch.uint8, device=device)
    block, iters, warps = _config()
    # One bucket per (grad dtype, half dtype): the pointer element types are compile-time.
    buckets: dict[tuple, list[int]] = {}
    for i, g in enumerate(rows["grads"]):
        h = rows["half"][i].dtype if rows["half"] is not None else None
        buckets.setdefault((g.dtype, h), []).append(i)
    launches = []
    for (g_dtype, h_dtype), idx in buckets.items():
        addrs = []
        for row in ("params", "grads", "s0", "s1", "half"):
            lst = rows[row]
            addrs += [lst[i].data_ptr() for i in idx] if lst is not None else [0] * len(idx)
        numels = tuple(params[i].numel() for i in idx)
        table, n_chunks = _table(device, tuple(addrs), numels, block * iters)
        aligned = all(a % 16 == 0 for a in addrs)  # the unused rows' 0 counts as aligned
        launches.append((table, len(idx), n_chunks, g_dtype, h_dtype, aligned))
    with _on(device):
        _launch(launches, flag, scalars, kind, decoupled, check, block, iters, warps)
    return flag.view(torch.bool)


def _on(device: torch.device):
    """Triton launches on the current CUDA device, not on the arguments' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _launch(launches, flag, scalars, kind, decoupled, check, block, iters, warps) -> None:
    # All checks finish before any update starts (same stream): a bad grad anywhere in the
    # list leaves every bucket untouched.
    for table, n, n_chunks, g_dtype, _, aligned in launches if check else ():
        nonfinite_kernel[(n_chunks,)](
            table,
            n,
            flag,
            float(scalars["inv_scale"]),
            G_DTYPE=TL_DTYPES[g_dtype],
            ALIGNED=aligned,
            BLOCK=block,
            ITERS=iters,
            num_warps=warps,
        )
    args = [float(scalars[k]) for k in _SCALARS]
    for table, n, n_chunks, g_dtype, h_dtype, aligned in launches:
        update_kernel[(n_chunks,)](
            table,
            n,
            flag,
            *args,
            KIND=kind,
            DECOUPLED=decoupled,
            G_DTYPE=TL_DTYPES[g_dtype],
            HALF_DTYPE=TL_DTYPES[h_dtype or torch.float32],
            HAS_HALF=h_dtype is not None,
            ALIGNED=aligned,
            BLOCK=block,
            ITERS=iters,
            num_warps=warps,
        )
