"""``fsharded bench gpu``: the Triton kernels on an NVIDIA GPU, against their peers.

    fsharded bench gpu                  # needs CUDA; ~2 minutes on one H200
    fsharded bench gpu --save fsharded/bench/results/gpu-DATE.json
    fsharded bench gpu --smoke          # tiny shapes on CPU under TRITON_INTERPRET=1

Sections (each ours vs the peer measured in the same run):

- fused AdamW over one bucket of parameters (fp32 master, fp32 grads, with and without a
  bf16 copy of the parameters) against the memory-bandwidth limit — a measured device
  copy's bandwidth, with AdamW moving 28 bytes per parameter (30 with the bf16 copy) —
  and against ``torch.optim.AdamW(fused=True)``'s kernel. Target: >= 85% of the limit.
- causal flash attention forward + backward (bf16, head dim 128, with and without GQA)
  against ``torch.nn.functional.scaled_dot_product_attention``. Target: >= 0.9x its
  throughput (ours/peer time <= 1.11).
- cross-entropy forward + backward at a 128k vocabulary (bf16 logits): peak memory
  against the naive ``F.cross_entropy(logits.float(), ...)``. Target: <= 0.25x.
- LayerNorm / RMSNorm forward + backward against torch's, and int8 blockwise
  quantisation against the copy bandwidth (informational).

Times are medians of CUDA-event timed repetitions after warm-up (``--smoke``: wall clock).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from fsharded.bench import Qty, Report, Row, Section, add_output_args

__all__ = ["main", "build_parser"]


# -- timing and memory -----------------------------------------------------------------------


def _timer(device: torch.device) -> Callable[[Callable[[], object], int, int], float]:
    """Median seconds per call of ``fn`` (``reps`` timed calls after ``warmup``)."""

    def cuda(fn: Callable[[], object], warmup: int, reps: int) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)

    def wall(fn: Callable[[], object], warmup: int, reps: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return cuda if device.type == "cuda" else wall


def _peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from fsharded.tools import memory

    with memory.track() as mem:
        fn()
    return mem.peak_bytes


def copy_bandwidth(device: torch.device, nbytes: int, timer) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src), 3, 10)
    return 2 * src.numel() * 4 / t


# -- sections ------------------------------------------------------------------------------


def _bucket(n: int, device: torch.device, *, pieces: int = 64) -> list[torch.Tensor]:
    """``n`` parameters split into tensors of uneven sizes (a realistic bucket)."""
    g = torch.Generator().manual_seed(0)
    w = torch.rand(pieces, generator=g) + 0.2
    sizes = (w / w.sum() * n).long().clamp(min=1)
    sizes[-1] += n - int(sizes.sum())
    return [torch.randn(int(s), device=device) for s in sizes]


def _adamw_case(n: int, device, timer) -> tuple[float, float, float | None]:
    """Seconds per fused AdamW step over ``n`` parameters: fp32 only, with the bf16 copy,
    and torch's fused kernel on the same tensors (CUDA only)."""
    from fsharded.kernels import fused_optim

    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    params = _bucket(n, device)
    grads = [torch.randn_like(p) for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    half = [p.to(torch.bfloat16) for p in params]
    step = [1]

    def ours(half_params=None):
        step[0] += 1
        fused_optim.fused_adamw_(params, grads, m, v, step=step[0], half_params=half_params,
                                 impl="triton", **hp)

    t_ours = timer(ours, 3, 20)
    t_half = timer(lambda: ours(half), 3, 20)
    if device.type != "cuda":
        return t_ours, t_half, None
    counts = [torch.zeros((), device=device) for _ in params]

    def peer():
        torch._foreach_add_(counts, 1)
        torch._fused_adamw_(params, grads, m, v, [], counts, lr=hp["lr"], beta1=hp["beta1"],
                            beta2=hp["beta2"], weight_decay=hp["weight_decay"], eps=hp["eps"],
                            amsgrad=False, maximize=False)

    return t_ours, t_half, timer(peer, 3, 20)


def adamw_section(device, timer, sizes: Sequence[int], bw: float) -> list[Section]:
    limit_rows, torch_rows, notes = [], [], []
    for n in sizes:
        t_ours, t_half, t_torch = _adamw_case(n, device, timer)
        size = f"{n / 1e6:g}M params"
        limit, limit_half = 28 * n / bw, 30 * n / bw
        limit_rows.append(Row("fused AdamW (fp32) vs bandwidth limit", size, t_ours, limit))
        limit_rows.append(Row("fused AdamW + bf16 copy vs bandwidth limit", size, t_half, limit_half))
        notes.append(f"{size}: {limit / t_ours:.0%} of the limit (fp32), "
                     f"{limit_half / t_half:.0%} with the bf16 copy")
        if t_torch is not None:
            torch_rows.append(Row("fused AdamW vs torch _fused_adamw_", size, t_ours, t_torch))
    out = [Section("fused AdamW vs the memory-bandwidth limit",
                   f"28 bytes per parameter (30 with the bf16 copy) at the measured copy "
                   f"bandwidth {bw / 1e9:.0f} GB/s", tuple(limit_rows), target=1 / 0.85,
                   notes=tuple(notes))]
    if torch_rows:
        out.append(Section("fused AdamW vs torch.optim.AdamW(fused=True)'s kernel",
                           "torch._fused_adamw_ on the same tensor list (step counters included)",
                           tuple(torch_rows), target=1.0))
    return out


def _fwd_bwd(f: Callable[[], torch.Tensor], inputs: tuple, grad_out: torch.Tensor | None):
    """A callable running ``f`` and the gradients of its output wrt ``inputs``."""

    def go():
        out = f()
        return torch.autograd.grad(out, inputs, grad_out, allow_unused=True)

    return go


def _attention_case(shape, device, dtype, timer) -> tuple[float, float]:
    import torch.nn.functional as F

    from fsharded.kernels import attention

    B, Hq, Hkv, S, D = shape
    q = torch.randn(B, Hq, S, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(B, Hq, S, D, device=device, dtype=dtype)
    ours = _fwd_bwd(lambda: attention.flash_attention(q, k, v, causal=True, impl="triton"),
                    (q, k, v), do)
    peer = _fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                           enable_gqa=Hq != Hkv), (q, k, v), do)
    return timer(ours, 3, 10), timer(peer, 3, 10)


def attention_section(device, timer, shapes) -> list[Section]:
    rows, notes = [], []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for B, Hq, Hkv, S, D in shapes:
        t_ours, t_peer = _attention_case((B, Hq, Hkv, S, D), device, dtype, timer)
        # Causal: half of the S x S score matrix; forward 2 matmuls, backward 5.
        flops = 3.5 * 4 * B * Hq * S * S * D / 2
        size = f"B={B} Hq={Hq} Hkv={Hkv} S={S} D={D}"
        rows.append(Row("flash attention fwd+bwd vs SDPA", size, t_ours, t_peer))
        notes.append(f"{size}: ours {flops / t_ours / 1e12:.1f} TFLOP/s, "
                     f"SDPA {flops / t_peer / 1e12:.1f} TFLOP/s")
    return [Section("causal flash attention, forward + backward",
                    "torch.nn.functional.scaled_dot_product_attention(is_causal=True) "
                    "(its fastest backend for the inputs)", tuple(rows), target=1 / 0.9,
                    notes=tuple(notes))]


def _cross_entropy_case(N: int, V: int, device, dtype, timer) -> tuple[int, int, float, float]:
    import torch.nn.functional as F

    from fsharded.kernels import losses as ce

    logits = torch.randn(N, V, device=device, dtype=dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), device=device)
    ours = _fwd_bwd(lambda: ce.cross_entropy(logits, targets, impl="triton"), (logits,), None)
    naive = _fwd_bwd(lambda: F.cross_entropy(logits.float(), targets), (logits,), None)
    return (_peak_bytes(ours, device), _peak_bytes(naive, device),
            timer(ours, 2, 10), timer(naive, 2, 10))


def cross_entropy_section(device, timer, shapes) -> list[Section]:
    mem_rows, time_rows = [], []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for N, V in shapes:
        m_ours, m_naive, t_ours, t_naive = _cross_entropy_case(N, V, device, dtype, timer)
        size = f"N={N} V={V}"
        mem_rows.append(Qty("cross-entropy fwd+bwd peak memory vs naive", size, m_ours,
                            m_naive, unit="B"))
        time_rows.append(Row("cross-entropy fwd+bwd time vs naive", size, t_ours, t_naive))
    return [
        Section("cross-entropy peak memory (above the logits)",
                "F.cross_entropy(logits.float(), targets) and its backward", tuple(mem_rows),
                target=0.25, notes=("the dlogits the step needs (input dtype) are included "
                                    "on both sides",)),
        Section("cross-entropy time", "the same naive path", tuple(time_rows)),
    ]


def _norm_case(R: int, C: int, device, dtype, timer) -> list[Row]:
    import torch.nn.functional as F

    from fsharded.kernels import norm

    x = torch.randn(R, C, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(C, device=device, dtype=dtype, requires_grad=True)
    b = torch.zeros(C, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(R, C, device=device, dtype=dtype)
    size = f"{R}x{C}"
    rows = [Row("LayerNorm fwd+bwd vs torch", size,
                timer(_fwd_bwd(lambda: norm.layer_norm(x, w, b, impl="triton"), (x, w, b), dy), 3, 10),
                timer(_fwd_bwd(lambda: F.layer_norm(x, (C,), w, b), (x, w, b), dy), 3, 10))]
    if hasattr(F, "rms_norm"):
        rows.append(Row("RMSNorm fwd+bwd vs torch", size,
                        timer(_fwd_bwd(lambda: norm.rms_norm(x, w, impl="triton"), (x, w), dy), 3, 10),
                        timer(_fwd_bwd(lambda: F.rms_norm(x, (C,), w, eps=1e-6), (x, w), dy), 3, 10)))
    return rows


def norm_quant_section(device, timer, rows_cols, bw: float) -> list[Section]:
    from fsharded.kernels import quant

    rows, qrows, notes = [], [], []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for R, C in rows_cols:
        rows += _norm_case(R, C, device, dtype, timer)
        flat = torch.randn(R * C, device=device)
        t_q = timer(functools.partial(quant.quantize_int8, flat, impl="triton"), 3, 10)
        limit = flat.numel() * (4 + 1) / bw  # read fp32, write int8 (scales are ~1%)
        qrows.append(Row("int8 blockwise quantize vs bandwidth limit", f"{flat.numel():,}",
                         t_q, limit))
        notes.append(f"{R}x{C}: quantize at {limit / t_q:.0%} of the copy bandwidth")
    return [Section("LayerNorm / RMSNorm forward + backward", "torch.nn.functional", tuple(rows)),
            Section("int8 blockwise quantisation", "5 bytes per element at the copy bandwidth",
                    tuple(qrows), notes=tuple(notes))]


# -- main ------------------------------------------------------------------------------------


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or "fsharded bench gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(p)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on CPU under TRITON_INTERPRET=1: checks the script, "
                        "measures nothing meaningful")
    p.add_argument("--sections", default="adamw,attention,cross_entropy,norm",
                   help="comma-separated subset of adamw,attention,cross_entropy,norm")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - {"adamw", "attention", "cross_entropy", "norm"}
    if unknown:
        raise SystemExit(f"--sections: unknown {sorted(unknown)}")
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise SystemExit("--smoke runs Triton's interpreter: set TRITON_INTERPRET=1")
        device = torch.device("cpu")
        sizes, att, ce, nq = [4096], [(1, 2, 1, 32, 16)], [(16, 300)], [(8, 64)]
        copy_bytes = 1 << 20
    else:
        if not torch.cuda.is_available():
            print("fsharded bench gpu needs an NVIDIA GPU (torch.cuda.is_available() is False); "
                  "`--smoke` checks the script on CPU under TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        sizes = [10_000_000, 50_000_000, 200_000_000]
        att = [(4, 16, 16, 4096, 128), (4, 32, 8, 4096, 128), (2, 16, 16, 8192, 64)]
        ce = [(8192, 128_256), (16384, 128_256)]
        nq = [(16384, 4096), (8192, 8192)]
        copy_bytes = 2 << 30
    timer = _timer(device)
    if args.smoke:  # one call each: the smoke run checks the script, not the speed
        base = timer
        timer = lambda fn, warmup, reps: base(fn, 0, 1)  # noqa: E731
    bw = copy_bandwidth(device, copy_bytes, timer)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter smoke run)"
    report = Report("gpu", params={
        "device": name, "torch": torch.__version__, "triton": _triton_version(),
        "copy bandwidth": f"{bw / 1e9:.1f} GB/s (device copy_, read + write)",
    })
    if "adamw" in sections:
        report.sections += adamw_section(device, timer, sizes, bw)
    if "attention" in sections:
        report.sections += attention_section(device, timer, att)
    if "cross_entropy" in sections:
        report.sections += cross_entropy_section(device, timer, ce)
    if "norm" in sections:
        report.sections += norm_quant_section(device, timer, nq, bw)
    report.finish()
    report.emit(args)
    return 0


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:  # pragma: no cover - triton missing
        return "not installed"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
