"""``fsharded bench optim``: the C++ CPU AdamW step against torch.optim, DeepSpeed and the
memory bandwidth.

    fsharded bench optim                    # 1e6, 1e7 and 5e7 parameters
    fsharded bench optim --quick            # 1e5 and 1e6 (smoke run)
    fsharded bench optim --threads 1 --no-deepspeed --markdown

At each size, one flat fp32 parameter (what a ZeRO-Offload rank updates on its CPU), AdamW
lr 1e-3, betas (0.9, 0.999), weight decay 0.01, in three cases: the plain step with an fp32
gradient; the step also writing a bf16 copy of the updated parameters (what goes back to
the GPU); the step with the gradient arriving in bf16. For timing, every framework and
case updates the same parameter, exp_avg, exp_avg_sq and bf16-copy buffers with the same
gradient (where a buffer lies in physical memory moves its bandwidth by a few %, which
would otherwise favour whichever framework allocated last), and is timed once per round,
the order rotating each round; the tables give medians over rounds:

- ours: ``fsharded.kernels.cpu_optim.adamw_`` (C++, ``torch.get_num_threads()`` threads)
  with ``check_finite=False``: one pass, no inf/nan check, like the peers (none of them
  checks). It writes the bf16 copy in the same pass and reads bf16 gradients as they are;
- "ours with the non-finite check": the same step with ``check_finite=True`` (what fp16 loss
  scaling needs: every gradient is checked before anything is written, so the gradients are
  read twice, 4 B/param more). The check alone is timed too, as a checked step whose last
  gradient is inf (nothing is written);
- ``torch.optim.AdamW(fused=True)`` and ``(foreach=True)``, and
  ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (adamw_mode) when deepspeed imports and its
  ``cpu_adam`` op builds (JIT, first in a subprocess with a time limit: a failing or slow
  build skips DeepSpeed instead of stopping the benchmark). Their bf16-copy case adds
  ``half.copy_(param)`` after the step; their bf16-gradient case first copies the gradient
  into their fp32 ``.grad`` (all three take fp32 gradients for fp32 parameters);
- the memory-bandwidth limit: the least bytes per parameter each case moves (28 B for
  AdamW: the gradient read; parameter, exp_avg, exp_avg_sq read and written; 30 B with the
  bf16 copy, 26 B with bf16 gradients) at the measured bandwidth. The bandwidth is measured
  with in-place torch ops on 128 MiB fp32 buffers, run by ``torch.get_num_threads()``
  threads like the steps: ``a.mul_(s)`` (8 B/element read + written), ``a.add_(b, alpha=s)``
  (12 B) and ``a.addcmul_(b, c, value=s)`` (16 B). They are timed in the same rounds as
  the steps, and the limit at each size is the best of them (the highest bytes read +
  written per second in any of that size's rounds: the bandwidth a VM gets on a shared host
  drifts over minutes, so each size is held to what the memory gave beside its own steps).
  The notes give every framework's % of it. In-place, like AdamW: a store into a line that
  was not just read (``copy_``'s destination) first reads that line from memory, traffic
  that "read + write" bytes do not count, so ``copy_`` shows only ~2/3 of what the in-place
  probes measure. ``copy_`` is still timed and reported, for reference.

Cells show the time per step and parameters updated per second; ours/peer < 1 is ours
faster. Before timing, every framework takes one step from the same state in buffers of its
own, and the results are compared with ours.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fsharded.bench import Report, Row, Section, add_output_args, calibrate, format_time

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
OURS = "ours"  # check_finite=False: one pass, like the peers
CHECKED = "ours with the non-finite check"  # check_finite=True
CHECK_ONLY = "ours, check only"  # the last gradient is inf: the check runs, nothing is written
FUSED, FOREACH, DS = "torch fused", "torch foreach", "DeepSpeedCPUAdam"

TARGET_FRACTION = 0.85


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- reporting -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rate(Row):
    """A row of step times for ``n`` parameters (cells also show parameters per second)."""

    n: int = 0


def format_rate(per_s: float) -> str:
    if per_s != per_s:
        return "n/a"
    if per_s >= 1e9:
        return f"{per_s / 1e9:.2f} G/s"
    return f"{per_s / 1e6:.0f} M/s"


class OptimReport(Report):
    """``Report`` whose cells give parameters per second beside the times."""

    def _cells(self, s: Section) -> list[tuple[str, ...]]:
        def cell(r: Row, t: float) -> str:
            n = getattr(r, "n", 0)
            return f"{format_time(t)} ({format_rate(n / t)})" if n and t > 0 else format_time(t)

        return [
            (r.case, r.size, cell(r, r.ours_s), cell(r, r.peer_s), f"{r.ratio:.2f}") for r in s.rows
        ]


def _size(n: int) -> str:
    mant, exp = f"{n:.0e}".split("e")
    return f"{mant}e{int(exp)} params" if float(f"{n:.0e}") == n else f"{n:,} params"


# -- memory bandwidth ------------------------------------------------------------------------


# The in-place probes give the limit; copy_ is reported only (see the module doc).
INPLACE = ("mul_", "add_", "addcmul_")
PROBES = (*INPLACE, "copy_")


def bandwidth_probes(nbytes: int = 128 << 20) -> dict[str, Callable[[], None]]:
    """The bandwidth probes on ``nbytes`` fp32 buffers (well above the caches), each with
    ``.moved``: the bytes one call reads + writes. In-place ``mul_`` (one buffer read and
    written), ``add_`` (and one more read), ``addcmul_`` (and two more reads), all run by
    torch with ``torch.get_num_threads()`` threads; and ``copy_`` between two buffers. The
    factors keep the values finite and normal over many calls."""
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.rand(nbytes // 4, generator=gen) + 0.5 for _ in range(3))
    d = torch.empty_like(a)
    fns = {
        "mul_": (lambda: a.mul_(1.0), 2),
        "add_": (lambda: a.add_(b, alpha=1e-30), 3),
        "addcmul_": (lambda: a.addcmul_(b, c, value=1e-30), 4),
        "copy_": (lambda: d.copy_(a), 2),
    }
    out = {}
    for name, (fn, buffers) in fns.items():

        def probe(fn=fn) -> None:
            fn()

        probe.moved = buffers * nbytes
        out[name] = probe
    return out


# -- DeepSpeed -------------------------------------------------------------------------------


def deepspeed_cpu_adam(ext_dir: str, timeout: float) -> tuple[type | None, str]:
    """``DeepSpeedCPUAdam`` with its ``cpu_adam`` op built (in a subprocess first, within
    ``timeout`` seconds, into ``ext_dir``), or ``None`` and why not."""
    from fsharded.bench.zero import deepspeed_available

    ok, why = deepspeed_available()
    if not ok:
        return None, why
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": ext_dir}
    code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None, f"building its cpu_adam op took over {timeout:.0f} s"
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return None, "its cpu_adam op failed to build: " + " / ".join(tail)
    _log(f"DeepSpeed cpu_adam ready ({time.perf_counter() - t0:.0f} s)")
    # Set for the rest of the process: DeepSpeedCPUAdam loads the op when constructed.
    os.environ.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=ext_dir)
    try:
        import logging

        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        deepspeed.utils.logger.setLevel(logging.WARNING)
    except Exception as e:  # noqa: BLE001 - any failure only skips the peer
        return None, f"import failed: {type(e).__name__}: {e}"
    return DeepSpeedCPUAdam, ""


# -- the steps ---------------------------------------------------------------------------------


# The three cases every framework runs: plain fp32 step; writing a bf16 copy of the
# parameters; with the gradient arriving in bf16 (ours reads it as is, the peers first copy
# it into their fp32 .grad). Suffixes of the framework names in the tables.
PLAIN, HALF_COPY, BF16_GRADS = "", " + bf16 copy", ", bf16 grads"
VARIANTS = (PLAIN, HALF_COPY, BF16_GRADS)
# Least bytes per parameter each case moves: the gradient read (4 B, or 2 in bf16);
# parameter, exp_avg, exp_avg_sq read and written (24 B); the bf16 copy written (2 B).
BYTES = {PLAIN: 28, HALF_COPY: 30, BF16_GRADS: 26}


def frameworks(
    n: int, ds_cls: type | None, foreach: bool, *, shared: bool = False
) -> dict[str, Callable[[], None]]:
    """One step function per framework and case at ``n`` parameters, all from the same
    state. Each has ``.param`` (its parameter) and ``.variant`` (the case).

    ``shared=False``: each with its own parameter and states (to compare their results).
    ``shared=True``: all update the same parameter, exp_avg, exp_avg_sq and bf16 copy
    buffers (for timing): where a buffer lies in physical memory changes its bandwidth by a
    few % (on this 2-core VM, buffers allocated earlier in the process ran up to ~8%
    slower), so separate buffers would favour whichever framework is allocated last."""
    from fsharded.kernels import cpu_optim

    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen) * 0.02
    g = torch.randn(n, generator=gen) * 1e-3
    g16 = g.to(torch.bfloat16)
    fns: dict[str, Callable[[], None]] = {}
    if shared:
        buffers = (p0, torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16))
        g32 = g.clone()  # the peers' fp32 .grad that a bf16 gradient is copied into

    def new_buffers() -> tuple[torch.Tensor, ...]:
        if shared:
            return buffers
        return p0.clone(), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)

    def ours_step(grad: torch.Tensor, half: bool, check: bool) -> Callable[[], bool]:
        p, m, v, h = new_buffers()
        steps = itertools.count(1)

        def step() -> bool:
            return bool(
                cpu_optim.adamw_(
                    [p],
                    [grad],
                    [m],
                    [v],
                    lr=LR,
                    beta1=BETAS[0],
                    beta2=BETAS[1],
                    eps=EPS,
                    weight_decay=WD,
                    step=next(steps),
                    half_params=[h] if half else None,
                    check_finite=check,
                )
            )

        step.param = p
        return step

    for variant in VARIANTS:
        grad = g16 if variant == BF16_GRADS else g
        fns[OURS + variant] = ours_step(grad, variant == HALF_COPY, check=False)
        fns[OURS + variant].variant = variant
    fns[CHECKED] = ours_step(g, False, check=True)
    fns[CHECKED].variant = PLAIN
    g_inf = g.clone()
    g_inf[-1] = float("inf")
    inf_step = ours_step(g_inf, False, check=True)

    def check_only() -> None:
        assert inf_step(), "a gradient is inf: found_inf must be set"

    check_only.param, check_only.variant = inf_step.param, None
    fns[CHECK_ONLY] = check_only

    def peer(name: str, make: Callable[[list], torch.optim.Optimizer]) -> None:
        for variant in VARIANTS:
            data, m, v, h = new_buffers()
            p = torch.nn.Parameter(data)  # shares data's memory
            if variant == BF16_GRADS:
                p.grad = g32 if shared else g.clone()
            else:
                p.grad = g
            opt = make([p])
            if shared:  # one step creates the states, which then become the shared ones
                opt.step()
                opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"] = m, v

            def step(opt=opt, p=p, h=h, variant=variant) -> None:
                if variant == BF16_GRADS:
                    p.grad.copy_(g16)
                opt.step()
                if variant == HALF_COPY:
                    h.copy_(p.detach())

            step.param, step.variant = p, variant
            fns[name + variant] = step

    def adamw(**kw):
        return lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)

    peer(FUSED, adamw(fused=True))
    if foreach:
        peer(FOREACH, adamw(foreach=True))
    if ds_cls is not None:
        peer(
            DS, lambda ps: ds_cls(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
        )
    return fns


def first_step_diffs(fns: dict[str, Callable[[], None]]) -> dict[str, float]:
    """One step of every framework from the same state: max |param - ours| (ours of the
    same case)."""
    for fn in fns.values():
        fn()
    return {
        k: float((fn.param.detach() - fns[OURS + fn.variant].param).abs().max())
        for k, fn in fns.items()
        if fn.variant is not None
    }


def time_all(
    fns: dict[str, Callable[[], None]], rounds: int, target_s: float
) -> dict[str, list[float]]:
    """Seconds per step of each function: ``rounds`` rounds, each function once per round
    (a block of calls lasting about ``target_s``), the order rotating each round."""
    iters = {k: calibrate(fn, target_s, hi=50) for k, fn in fns.items()}
    names = list(fns)
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        k0 = r % len(names)
        for k in names[k0:] + names[:k0]:
            t0 = time.perf_counter()
            for _ in range(iters[k]):
                fns[k]()
            out[k].append((time.perf_counter() - t0) / iters[k])
    return out


# -- main ------------------------------------------------------------------------------------


CASE_TEXT = {PLAIN: "AdamW", HALF_COPY: "AdamW + bf16 copy", BF16_GRADS: "AdamW, bf16 grads"}
PEER_TEXT = {PLAIN: "", HALF_COPY: " + bf16 copy_", BF16_GRADS: " (.grad.copy_ + step)"}


def bandwidth(
    results: dict[str, list[float]], moved: dict[str, int]
) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes read + written per second of each probe over one size's rounds: the best
    round and the median."""
    best = {k: moved[k] / min(results[k]) for k in moved}
    med = {k: moved[k] / statistics.median(results[k]) for k in moved}
    return best, med


def build_sections(
    results: dict[int, dict[str, list[float]]],
    moved: dict[str, int],
    peers: Sequence[str],
    diffs: dict[int, dict[str, float]],
) -> list[Section]:
    sizes = sorted(results)
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
    low = {n: {k: min(v) for k, v in r.items()} for n, r in results.items()}
    bw = {n: bandwidth(results[n], moved) for n in sizes}  # (best, median) per probe
    # The limit at each size: the best in-place probe round among that size's rounds, so
    # that it sees the machine as the steps beside it did (on a shared host the bandwidth
    # a VM gets drifts over minutes).
    limit = {n: max(bw[n][0][k] for k in INPLACE) for n in sizes}  # bytes / s
    ours_note = (
        "ours: check_finite=False, one pass without an inf/nan check, as every peer runs "
        "(none checks); 'with the non-finite check' is check_finite=True (fp16 loss scaling: "
        "nothing is modified when a gradient is inf/nan), which reads the gradients twice "
        "(4 more B/param)"
    )
    sections = []
    for peer in peers:
        rows = []
        for n in sizes:
            rows += [
                Rate(
                    f"{CASE_TEXT[c]} vs {peer}{PEER_TEXT[c]}",
                    _size(n),
                    med[n][OURS + c],
                    med[n][peer + c],
                    n,
                )
                for c in VARIANTS
            ]
            rows.append(
                Rate(
                    f"AdamW with the non-finite check vs {peer}",
                    _size(n),
                    med[n][CHECKED],
                    med[n][peer],
                    n,
                )
            )
        notes = [ours_note]
        notes += [
            f"{_size(n)}: after one step from the same state, max |param - ours| = "
            + ", ".join(f"{diffs[n][peer + c]:.1e} ({CASE_TEXT[c]})" for c in VARIANTS)
            for n in sizes
        ]
        sections.append(
            Section(
                title=f"AdamW step on fp32 master weights: ours vs {peer}",
                peer=_peer_desc(peer),
                rows=tuple(rows),
                target=1.0,
                notes=tuple(notes),
            )
        )
    # the bandwidth limit
    rows, notes = [], []
    ours_cases = [(OURS + c, c) for c in VARIANTS] + [(CHECKED, PLAIN)]
    for n in sizes:
        for name, c in ours_cases:
            rows.append(
                Rate(
                    f"{name} vs the limit ({BYTES[c]} B/param)",
                    _size(n),
                    med[n][name],
                    n * BYTES[c] / limit[n],
                    n,
                )
            )
        notes.append(
            f"{_size(n)}: the inf/nan check alone (a checked step whose last gradient is inf, "
            f"so nothing is written) takes {format_time(med[n][CHECK_ONLY])}, "
            f"{100 * med[n][CHECK_ONLY] / med[n][OURS]:.0f}% of ours"
        )
        names = [(OURS + c, c) for c in VARIANTS] + [(CHECKED, PLAIN)]
        names += [(peer + c, c) for peer in peers for c in VARIANTS]
        parts = [
            f"{name} {100 * n * BYTES[c] / limit[n] / med[n][name]:.0f}% "
            f"({100 * n * BYTES[c] / limit[n] / low[n][name]:.0f}%)"
            for name, c in names
        ]
        notes.append(f"{_size(n)}, % of the limit, median step (fastest step): " + ", ".join(parts))
        best, median = bw[n]
        notes.append(
            f"{_size(n)}: limit {limit[n] / 1e9:.1f} GB/s; probe bandwidth best (median) over "
            "these rounds: "
            + ", ".join(f"{k} {best[k] / 1e9:.1f} ({median[k] / 1e9:.1f}) GB/s" for k in PROBES)
        )
    notes.append(
        "the limit at each size: the best bandwidth of the in-place probes (mul_, add_, "
        "addcmul_: bytes read + written per second on 128 MiB fp32 buffers, run by torch with "
        f"{torch.get_num_threads()} thread(s)) over the rounds of that size, which time the "
        "probes beside the steps: on a shared host the bandwidth drifts over minutes. "
        "copy_ is not used: its destination lines are read from memory before they are "
        "written, traffic its read + write bytes do not count (an in-place update such as "
        "AdamW does not pay it). A step above 100% draws more from the memory with its 7 "
        "concurrent streams (4 arrays read, 3 written) than the probes with their 1 to 3: "
        "read ~100% and more as at the memory limit"
    )
    notes.append(
        f"ours/peer <= {1 / TARGET_FRACTION:.2f} is >= {100 * TARGET_FRACTION:.0f}% of the "
        "limit; the bytes are the least each case must move (28 B/param, 30 with the bf16 "
        "copy, 26 with bf16 grads), for every framework alike (the check's second read of "
        "the gradients is not counted)"
    )
    notes.append(
        "sizes whose optimizer state fits in the caches (1e6: 16 MB) beat the memory limit; "
        "the target is for 5e7"
    )
    sections.append(
        Section(
            title="ours vs the memory-bandwidth limit",
            peer="the time to move the bytes of the step at the measured bandwidth",
            rows=tuple(rows),
            target=1 / TARGET_FRACTION,
            notes=tuple(notes),
        )
    )
    return sections


def _peer_desc(peer: str) -> str:
    cases = (
        "; + bf16 copy_: then half.copy_(param); bf16 grads: param.grad.copy_(bf16 "
        "grad) into its fp32 .grad, then the step"
    )
    if peer == FUSED:
        return "torch.optim.AdamW(fused=True) (its CPU fused kernel)" + cases
    if peer == FOREACH:
        return "torch.optim.AdamW(foreach=True)" + cases
    return (
        f"deepspeed {_ds_version()} DeepSpeedCPUAdam(adamw_mode=True), its JIT-built "
        "cpu_adam op" + cases
    )


def _ds_version() -> str:
    from fsharded.bench.zero import _ds_version

    return _ds_version()


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or "fsharded bench optim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="sizes 1e5 and 1e6, 3 rounds")
    add_output_args(p)
    p.add_argument(
        "--sizes",
        default=None,
        help="comma-separated parameter counts (default 1e6,1e7,5e7; quick 1e5,1e6)",
    )
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7; quick 3)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default: torch's, the physical cores)",
    )
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    p.add_argument("--no-foreach", action="store_true", help="skip torch foreach AdamW")
    p.add_argument(
        "--extensions-dir",
        default=os.path.join(tempfile.gettempdir(), "fsharded-bench-optim-extensions"),
        help="TORCH_EXTENSIONS_DIR for DeepSpeed's cpu_adam build (kept between runs)",
    )
    p.add_argument(
        "--ds-build-timeout",
        type=float,
        default=900.0,
        help="seconds allowed for building DeepSpeed's cpu_adam op (default 900)",
    )
    return p


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(float(s)) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--sizes: give comma-separated parameter counts, got {text!r}")
    return sizes


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    from fsharded.kernels import cpu_optim

    args = build_parser(prog).parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    sizes = _sizes(args.sizes or ("1e5,1e6" if args.quick else "1e6,1e7,5e7"))
    rounds = args.rounds or (3 if args.quick else 7)
    target_s = 0.05 if args.quick else 0.2
    _log("building / loading the C++ optimizer ...")
    cpu_optim.load(required=True)
    notes = []
    ds_cls = None
    if not args.no_deepspeed:
        _log("DeepSpeed: building / loading cpu_adam ...")
        ds_cls, why = deepspeed_cpu_adam(args.extensions_dir, args.ds_build_timeout)
        if ds_cls is None:
            _log(f"skipping DeepSpeed: {why}")
            notes.append(f"DeepSpeed skipped: {why}")
    peers = [FUSED] + ([] if args.no_foreach else [FOREACH]) + ([DS] if ds_cls else [])
    report = OptimReport(
        "optim",
        params={
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "deepspeed": _ds_version() if ds_cls else "not run",
            "ours": f"fsharded.kernels.cpu_optim, {cpu_optim.isa()} kernels",
            "step": f"AdamW lr {LR}, betas {BETAS}, eps {EPS}, weight decay {WD}; one flat fp32 "
            "parameter, fp32 gradient; ours without the inf/nan check unless a row says so "
            "(the peers do not check)",
            "timing": f"{rounds} rounds, every framework once per round (a block of steps of "
            f"~{target_s} s) in rotating order; medians",
        },
    )
    probes = bandwidth_probes()
    moved = {k: fn.moved for k, fn in probes.items()}
    results, diffs = {}, {}
    for n in sizes:
        _log(f"{_size(n)}: {', '.join([OURS] + peers)} ...")
        diffs[n] = first_step_diffs(frameworks(n, ds_cls, foreach=FOREACH in peers))
        fns = frameworks(n, ds_cls, foreach=FOREACH in peers, shared=True)
        results[n] = time_all({**fns, **probes}, rounds, target_s)
        del fns
    report.sections += build_sections(results, moved, peers, diffs)
    report.finish()
    report.params["notes"] = "; ".join(notes) or "all peers ran"
    report.params["wall time"] = f"{time.perf_counter() - t_start:.0f} s"
    report.emit(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
