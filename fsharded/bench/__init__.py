"""Benchmarks: ours side by side with the peer a user would otherwise pick, in one run.

Run one with the CLI (``fsharded bench --list`` names them all)::

    fsharded bench spmd --quick
    fsharded bench spmd --save fsharded/bench/results/spmd.json

``--save`` writes the run as a result file (``_results``: the rows, the peers, the machine,
the date and the command); the docs' benchmark pages and the README's headline table are
generated from those files (``python -m fsharded.bench.publish``).

Each benchmark is a module ``fsharded.bench.<name>`` with ``main(argv, *, prog) -> int``,
registered in ``BENCHMARKS``. Benchmarks never run as tests. This package also holds the
pieces every benchmark reports with: alternating timing, medians, ratio tables (plain text,
Markdown, or rich when it is installed) and the machine's load average.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

from fsharded.bench import _results

__all__ = [
    "Benchmark",
    "BENCHMARKS",
    "get",
    "Row",
    "Section",
    "Report",
    "alternate",
    "calibrate",
    "format_time",
    "format_bytes",
    "Qty",
    "invocation",
    "add_output_args",
]


# -- registry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Benchmark:
    """A registered benchmark: ``fsharded bench <name>`` runs ``<module>.main``."""

    name: str
    module: str
    summary: str

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def main(self, argv: Sequence[str], *, prog: str | None = None) -> int:
        return int(self.load().main(list(argv), prog=prog or f"fsharded bench {self.name}"))


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            "spmd",
            "fsharded.bench.spmd",
            "shard_map on the virtual mesh vs plain torch; collectives on 2 gloo ranks vs "
            "torch.distributed",
        ),
        Benchmark(
            "train",
            "fsharded.bench.train",
            "train_step vs the eager PyTorch loop on the GPT; tokens/s of the default "
            "`fsharded train` job",
        ),
        Benchmark(
            "compile",
            "fsharded.bench.compile",
            "train_step(compile=True) vs our eager step, the eager PyTorch loop, torch.compile of its loss and "
            "the matmul floor; the default `fsharded train` job with and without --compile",
        ),
        Benchmark(
            "nn",
            "fsharded.bench.nn",
            "a nanoGPT-style nn.Module through fs.nn.functional: train_step vs its eager loop "
            "(one process) and ZeRO-3 vs FSDP2 (2 gloo ranks)",
        ),
        Benchmark(
            "zero",
            "fsharded.bench.zero",
            "ZeRO stages 0-3 on 2 gloo ranks vs DeepSpeed and FSDP2: step time, bytes sent "
            "per rank, peak RSS, losses",
        ),
        Benchmark(
            "remat",
            "fsharded.bench.remat",
            "each remat policy (none, blocks:K, blocks, blocks,offload) on one device: step time and peak "
            "activations against keeping every activation",
        ),
        Benchmark(
            "offload",
            "fsharded.bench.offload",
            "the optimizer state in memory, host memory and NVMe files (ZeRO-3, 2 gloo ranks) vs DeepSpeed's "
            "ZeRO-Offload / ZeRO-Infinity: step time, peak RSS, the NVMe update against the disk",
        ),
        Benchmark(
            "pipeline",
            "fsharded.bench.pipeline",
            "pipeline schedules (GPipe, 1F1B, interleaved, zero-bubble) on 2 and 4 gloo ranks vs "
            "DeepSpeed's pipeline engine and torch.distributed.pipelining: step time, losses, bubble",
        ),
        Benchmark(
            "checkpoint",
            "fsharded.bench.checkpoint",
            "saving and loading a ZeRO-3 training state on 2 gloo ranks vs DCP: time, bytes "
            "on disk, and loading it resharded into one process",
        ),
        Benchmark(
            "gpu",
            "fsharded.bench.gpu",
            "Triton kernels on an NVIDIA GPU: fused AdamW vs HBM bandwidth, flash attention "
            "vs SDPA, cross-entropy memory vs naive, norms, int8 quantisation",
        ),
        Benchmark(
            "seq",
            "fsharded.bench.seq",
            "sequence-parallel attention on gloo ranks: Ulysses, ring, hybrid vs DeepSpeed-Ulysses' "
            "DistributedAttention and vs the whole sequence on one rank: time, peak bytes, bytes sent",
        ),
        Benchmark(
            "moe",
            "fsharded.bench.moe",
            "expert-parallel MoE layer (top-1, top-2) on 2 gloo ranks vs DeepSpeed's MoE with the same "
            "weights: step time, bytes sent, peak bytes, drop counts, output differences",
        ),
        Benchmark(
            "inference",
            "fsharded.bench.inference",
            "generation vs transformers' generate on the same weights (prefill, decode at batch 1 and 16), "
            "fp32/int8 vs bf16 decoding, continuous vs static batching on a mixed trace, DeepSpeed init_inference",
        ),
        Benchmark(
            "optim",
            "fsharded.bench.optim",
            "C++ CPU AdamW (fp32, + bf16 copy) vs torch fused/foreach AdamW and "
            "DeepSpeedCPUAdam: parameters/s and % of the memory-bandwidth limit",
        ),
    )
}


def get(name: str) -> Benchmark:
    """The registered benchmark ``name``; ``KeyError`` naming the known ones otherwise."""
    try:
        return BENCHMARKS[name]
    except KeyError:
        raise KeyError(
            f"no benchmark named {name!r}; known: {', '.join(sorted(BENCHMARKS))} "
            f"(`fsharded bench --list`)"
        ) from None


# -- timing --------------------------------------------------------------------------------


def calibrate(fn: Callable[[], object], target_s: float, *, lo: int = 1, hi: int = 1000) -> int:
    """How many calls of ``fn`` take about ``target_s`` (one warm call measured)."""
    t0 = time.perf_counter()
    fn()
    dt = max(time.perf_counter() - t0, 1e-7)
    return max(lo, min(hi, round(target_s / dt)))


def alternate(
    ours: Callable[[], float], peer: Callable[[], float], rounds: int
) -> tuple[list[float], list[float]]:
    """Run ``ours`` and ``peer`` (each returns seconds per call for one timed block) in
    ``rounds`` alternating rounds, swapping which goes first every round so slow drifts
    in the machine's load fall on both alike. Returns the two lists of per-round times."""
    a: list[float] = []
    b: list[float] = []
    for r in range(rounds):
        if r % 2 == 0:
            a.append(ours())
            b.append(peer())
        else:
            b.append(peer())
            a.append(ours())
    return a, b


def format_time(s: float) -> str:
    if s != s:  # NaN
        return "n/a"
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


# -- reporting -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One comparison: median seconds per call of ours and of the peer."""

    case: str
    size: str
    ours_s: float
    peer_s: float

    @property
    def ratio(self) -> float:
        return self.ours_s / self.peer_s if self.peer_s > 0 else float("nan")

    @classmethod
    def from_samples(
        cls, case: str, size: str, ours: Sequence[float], peer: Sequence[float]
    ) -> Row:
        return cls(case, size, statistics.median(ours), statistics.median(peer))


@dataclass(frozen=True)
class Qty(Row):
    """A row whose values are bytes (``unit="B"``), counts of another ``unit``
    (``"tokens"``) or plain numbers (``unit=""``, four decimals: losses) rather than
    seconds."""

    unit: str = "s"


def format_bytes(b: float) -> str:
    if b != b:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _cell(r: Row, v: float) -> str:
    unit = getattr(r, "unit", "s")
    if unit == "B":
        return format_bytes(v)
    if unit == "":
        return f"{v:.4f}"
    return format_time(v) if unit == "s" else f"{v:,.0f} {unit}"


@dataclass(frozen=True)
class Section:
    """A table of rows against one peer; ``target`` is the ours/peer ratio aimed for."""

    title: str
    peer: str
    rows: tuple[Row, ...]
    target: float | None = None
    notes: tuple[str, ...] = ()

    def summary(self) -> str | None:
        if self.target is None or not self.rows:
            return None
        met = sum(r.ratio <= self.target for r in self.rows)
        return f"target ours/peer <= {self.target:.2f}: met by {met} of {len(self.rows)} rows"


def _num(v: float) -> float | None:
    return None if v != v else float(v)  # NaN (a peer not run) as null: JSON has no NaN


def add_output_args(p: argparse.ArgumentParser) -> None:
    """A benchmark's output flags: ``--markdown`` and ``--save FILE`` (``Report.emit``)."""
    p.add_argument("--markdown", action="store_true", help="print Markdown tables")
    p.add_argument("--save", metavar="FILE", help="also write the run as a JSON result file (its rows, "
                   "peers, machine, date and command), e.g. fsharded/bench/results/NAME.json; "
                   "python -m fsharded.bench.publish makes the docs' tables from those files")


def _loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:  # pragma: no cover - not on every platform
        return None


def invocation() -> str:
    """The command line this process was started with, as a user would retype it."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        name = spec.name.removesuffix(".__main__")
        head = ["python", "-m", name]
    else:
        head = [os.path.basename(sys.argv[0]) or "python"]
    return shlex.join(head + sys.argv[1:])


@dataclass
class Report:
    """Sections plus the conditions they were measured under (load average before/after)."""

    name: str
    sections: list[Section] = field(default_factory=list)
    params: dict[str, object] = field(default_factory=dict)
    started: datetime.datetime = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc)
    )
    load_before: tuple[float, float, float] | None = field(default_factory=_loadavg)
    load_after: tuple[float, float, float] | None = None
    command: str = field(default_factory=invocation)

    def finish(self) -> None:
        self.load_after = _loadavg()

    def to_dict(self) -> dict[str, object]:
        """The run as a result file holds it (``_results``): conditions, and per section
        the rows' numbers with the cells this report prints for them."""
        return {
            "format": _results.FORMAT,
            "bench": self.name,
            "date": self.started.isoformat(timespec="seconds"),
            "command": self.command,
            "machine": _results.machine(),
            "load": {"before": list(self.load_before) if self.load_before else None,
                     "after": list(self.load_after) if self.load_after else None},
            "params": {k: str(v) for k, v in self.params.items()},
            "sections": [{
                "title": s.title, "peer": s.peer, "target": s.target, "summary": s.summary(),
                "notes": list(s.notes), "columns": list(_results.COLUMNS),
                "rows": [{"case": r.case, "size": r.size, "ours": _num(r.ours_s), "peer": _num(r.peer_s),
                          "unit": getattr(r, "unit", "s"), "cells": list(c)}
                         for r, c in zip(s.rows, self._cells(s))],
            } for s in self.sections],
        }

    def header_lines(self) -> list[str]:
        return _results.header_lines(self.to_dict())

    # -- renderers ---------------------------------------------------------------------------

    def _cells(self, s: Section) -> list[tuple[str, ...]]:
        """One row of table cells per comparison: times, or bytes for ``Qty`` rows in
        bytes (benchmarks of other units override this)."""
        return [(r.case, r.size, _cell(r, r.ours_s), _cell(r, r.peer_s), f"{r.ratio:.2f}")
                for r in s.rows]

    def markdown(self) -> str:
        return _results.render(self.to_dict())

    def text(self) -> str:
        out = [f"fsharded bench {self.name}"] + [f"  {line}" for line in self.header_lines()]
        head = ("case", "size", "ours", "peer", "ours/peer")
        for s in self.sections:
            cells = self._cells(s)
            widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]

            def fmt(c: tuple[str, ...], widths: list[int] = widths) -> str:
                left = [c[i].ljust(widths[i]) for i in range(2)]
                right = [c[i].rjust(widths[i]) for i in range(2, len(c))]
                return "  ".join(left + right)

            out += ["", s.title, f"peer: {s.peer}", fmt(head), "-" * len(fmt(head))]
            out += [fmt(c) for c in cells]
            out += [x for x in (s.summary(), *s.notes) if x]
        return "\n".join(out) + "\n"

    def emit(self, args: argparse.Namespace, *, file=None) -> None:
        """Print as ``add_output_args``' flags ask (``--markdown``), and write the result
        file of ``--save FILE``."""
        self.print(markdown=args.markdown, file=file)
        if getattr(args, "save", None):
            path = _results.save(self.to_dict(), args.save)
            print(f"saved {path}", file=sys.stderr)

    def print(self, *, markdown: bool = False, file=None) -> None:
        """Markdown when asked; rich when installed and writing to a terminal; else text."""
        file = file or sys.stdout
        if markdown:
            file.write(self.markdown())
            return
        if file.isatty():
            try:
                self._print_rich(file)
                return
            except ImportError:
                pass
        file.write(self.text())

    def _print_rich(self, file) -> None:
        from rich.console import Console
        from rich.table import Table

        console = Console(file=file)
        for line in [f"fsharded bench {self.name}", *self.header_lines()]:
            console.print(line, highlight=False)
        for s in self.sections:
            t = Table(title=s.title, caption=f"peer: {s.peer}")
            for col, just in (
                ("case", "left"),
                ("size", "left"),
                ("ours", "right"),
                ("peer", "right"),
                ("ours/peer", "right"),
            ):
                t.add_column(col, justify=just)
            for r, c in zip(s.rows, self._cells(s)):
                style = "red" if s.target is not None and r.ratio > s.target else None
                t.add_row(*c, style=style)
            console.print(t)
            for x in (s.summary(), *s.notes):
                if x:
                    console.print(x, highlight=False)
