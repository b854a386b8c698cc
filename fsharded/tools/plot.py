"""Pictures: a run's JSONL metrics, memory per device, bytes per step per axis.

``plot_metrics`` draws the metrics ``fsharded train --metrics m.jsonl`` writes
(``fsharded plot m.jsonl [more.jsonl ...] -o curves.png``): one panel per metric (loss
first, then grad_norm, lr, the rest in file order; ``--keys`` picks them), steps on the x
axis, one line per file, so runs on different meshes or precisions can be laid over each
other.

``memory_figure({label: fs.estimate_memory(...)})``: the peak per device as stacked bars by
category (one bar per label, e.g. per ZeRO stage). ``collectives_figure({label:
step.collectives(state, batch)})``: bytes each rank sends per step, stacked by collective
and mesh axis, the calls inside backward hatched. ``pipeline_figure(schedule_or_plan)``: a
pipeline schedule's planned timeline, one row per rank. Each returns a matplotlib figure
(shown by a notebook).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fsharded.parallel import pipeline

__all__ = ["read_metrics", "plot_metrics", "memory_figure", "collectives_figure", "pipeline_figure"]

_FIRST = ("loss", "lm_loss", "grad_norm", "lr", "loss_scale")
_SKIP = ("step",)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL metrics file; a line that is not a JSON object is an error
    naming the file and the line."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: a metrics line must be a JSON object, got {type(rec).__name__}")
            out.append(rec)
    if not out:
        raise ValueError(f"{path}: no metrics records")
    return out


def _keys(runs: list[list[dict]], keys: Sequence[str] | None) -> list[str]:
    seen: list[str] = []
    for recs in runs:
        for rec in recs:
            for k, v in rec.items():
                if k not in seen and k not in _SKIP and isinstance(v, (int, float)) and not isinstance(v, bool):
                    seen.append(k)
    if keys:
        missing = [k for k in keys if k not in seen]
        if missing:
            raise ValueError(f"fsharded plot: no metric {missing} in the files; they have {seen}")
        return list(keys)
    return [k for k in _FIRST if k in seen] + [k for k in seen if k not in _FIRST]


def plot_metrics(paths: Sequence[str | os.PathLike], out: str | os.PathLike, *,
                 keys: Sequence[str] | None = None, labels: Sequence[str] | None = None) -> list[str]:
    """Draw the metrics of ``paths`` into the picture ``out``; returns the metrics drawn."""
    from matplotlib.figure import Figure  # no pyplot: the caller's backend stays as it is

    runs = [read_metrics(p) for p in paths]
    names = list(labels) if labels else [os.path.basename(str(p)) for p in paths]
    drawn = _keys(runs, keys)
    cols = min(3, len(drawn))
    rows = math.ceil(len(drawn) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.0 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, k in zip(axes.flat, drawn):
        for recs, name in zip(runs, names):
            pts = [(r.get("step", i + 1), r[k]) for i, r in enumerate(recs) if isinstance(r.get(k), (int, float))]
            if pts:
                ax.plot(*zip(*pts), label=name, linewidth=1.2)
        ax.set_title(k, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(drawn):]:
        ax.set_visible(False)
    if len(runs) > 1:
        axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return drawn


_MEMORY_COLOURS = {"parameters": "#4c72b0", "master weights": "#55a868", "optimizer state": "#c44e52",
                   "gathered weights": "#8172b2", "comm buffers": "#937860", "activations": "#dd8452",
                   "gradients": "#da8bc3", "ZeRO gather": "#8c8c8c"}


def _unit(largest: float) -> tuple[float, str]:
    for div, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= div:
            return div, name
    return 1, "B"


def memory_figure(estimates: Any, *, title: str = "memory per device at the peak", ax: Any = None) -> Any:
    """Stacked bars of the peak per device by category, one bar per ``{label: MemoryEstimate}``
    item (a lone estimate: one bar); each bar's height is the estimate's ``peak`` and its
    label names the moment of the peak (``MemoryEstimate.breakdown``)."""
    import matplotlib.pyplot as plt

    if not isinstance(estimates, Mapping):
        estimates = {"": estimates}
    if not estimates:
        raise ValueError("memory_figure: no estimates")
    rows = {label: est.breakdown() for label, est in estimates.items()}
    div, unit = _unit(max(sum(parts.values()) for _, parts in rows.values()))
    fig, ax = (plt.subplots(figsize=(1.6 + 1.3 * len(rows), 3.4)) if ax is None else (ax.figure, ax))
    cats = [c for c in _MEMORY_COLOURS if any(parts.get(c) for _, parts in rows.values())]
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for c in cats:
        h = [parts.get(c, 0) / div for _, parts in rows.values()]
        ax.bar(x, h, bottom=bottom, color=_MEMORY_COLOURS[c], label=c, width=0.6, edgecolor="white")
        bottom = [b + v for b, v in zip(bottom, h)]
    for i, ((moment, _), top) in enumerate(zip(rows.values(), bottom)):
        ax.text(i, top, f"{top:,.0f}\n({moment})", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x), [str(k) for k in rows], fontsize=8)
    ax.set_ylabel(unit, fontsize=8)
    ax.set_ylim(0, max(bottom) * 1.25)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def collectives_figure(manifests: Any, *, title: str = "bytes sent per rank per step", ax: Any = None) -> Any:
    """Stacked bars of the bytes each rank sends in one step, one bar per ``{label:
    Manifest}`` item, one segment per (collective, mesh axis), hatched for the calls made
    inside backward (the manifest's ``phase``; a step's gradient reduction after backward
    is solid); the total on top. Collectives that send nothing (a
    size-1 axis, ``pvary``) are left out."""
    import matplotlib.pyplot as plt

    if not isinstance(manifests, Mapping):
        manifests = {"": manifests}
    if not manifests:
        raise ValueError("collectives_figure: no manifests")
    keys: list[tuple[str, str]] = []
    sums: dict[str, dict[tuple[str, str, str], int]] = {}
    for label, man in manifests.items():
        acc: dict[tuple[str, str, str], int] = {}
        for e in man:
            if e.bytes_sent:  # in backward (hatched), or outside it (forward, reduce, update: solid)
                k = (e.op, e.axis, "backward" if e.phase == "backward" else "forward")
                acc[k] = acc.get(k, 0) + e.bytes_sent
                if (e.op, e.axis) not in keys:
                    keys.append((e.op, e.axis))
        sums[label] = acc
    totals = [sum(acc.values()) for acc in sums.values()]
    div, unit = _unit(max(totals) if totals else 0)
    fig, ax = (plt.subplots(figsize=(1.6 + 1.3 * len(sums), 3.4)) if ax is None else (ax.figure, ax))
    cmap = plt.get_cmap("tab10")
    x = range(len(sums))
    bottom = [0.0] * len(sums)
    for j, (op, axis) in enumerate(keys):
        for phase, hatch in (("forward", None), ("backward", "///")):
            h = [acc.get((op, axis, phase), 0) / div for acc in sums.values()]
            if not any(h):
                continue
            ax.bar(x, h, bottom=bottom, color=cmap(j % 10), hatch=hatch, width=0.6, edgecolor="white",
                   label=f"{op} over {axis}" + (" (in backward)" if phase == "backward" else ""))
            bottom = [b + v for b, v in zip(bottom, h)]
    for i, t in enumerate(totals):
        ax.text(i, t / div, f"{t / div:,.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x), [str(k) for k in sums], fontsize=8)
    ax.set_ylabel(unit, fontsize=8)
    ax.set_ylim(0, (max(totals) / div if any(totals) else 1) * 1.2)
    ax.set_title(title, fontsize=9)
    if keys:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


_PIPE_COLORS = {"F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#72b7b2"}


def _pipeline_rows(ax: Any, spans: Any, s: Any, end: float, scale: float) -> None:
    """One row per rank of ``spans`` (start, end, action), times multiplied by ``scale``."""
    for r, row in enumerate(spans):
        for b, e, a in row:
            b, e = float(b) * scale, float(e) * scale
            ax.barh(r, e - b, left=b, height=0.8, color=_PIPE_COLORS[a.kind], edgecolor="white")
            ax.text((b + e) / 2, r, a.label(s.virtual), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(s.ranks), [f"rank {r}" for r in range(s.ranks)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end)


def pipeline_figure(schedule: Any, *, ax: Any = None, title: str | None = None, measured: Any = None) -> Any:
    """A pipeline schedule's timeline as the table plans it (``pipeline.check``): one row
    per rank, a box per forward (F), backward (B) or its input- and weight-gradient halves
    (I, W) labelled with its micro-batch, idle time blank; the bubble in the title.

    ``measured``: a run of it (``pipeline.run``'s ``Result``, or ``{rank: spans}``), drawn
    below the plan as it happened, in milliseconds, with its idle fraction in the title."""
    import matplotlib.pyplot as plt

    plan = schedule if isinstance(schedule, pipeline.Plan) else pipeline.check(schedule)
    s = plan.schedule
    if ax is None:
        rows = 2 if measured is not None else 1
        fig, axes = plt.subplots(rows, 1, squeeze=False,
                                 figsize=(min(2 + 0.35 * float(plan.makespan), 16), rows * (0.6 + 0.45 * s.ranks)))
        ax = axes[0][0]
        low = axes[1][0] if measured is not None else None
    elif measured is not None:
        raise ValueError("pipeline_figure: measured= draws a second panel below the plan; leave ax= out")
    else:
        fig, low = ax.figure, None
    _pipeline_rows(ax, plan.spans, s, float(plan.makespan), 1.0)
    ax.set_xlabel("time (one forward = 1)", fontsize=8)
    ax.set_title(title or f"{s.name}: p={s.ranks}, v={s.virtual}, m={s.microbatches}, bubble {float(plan.bubble):.3f}",
                 fontsize=9)
    if low is not None:
        spans = getattr(measured, "spans", measured)
        ran = [[(b, e, a) for b, e, a in spans.get(r, []) if a.kind in _PIPE_COLORS] for r in range(s.ranks)]
        end = max((e for row in ran for _, e, _ in row), default=0.0)
        busy = sum(e - b for row in ran for b, e, _ in row)
        _pipeline_rows(low, ran, s, end * 1e3, 1e3)
        low.set_xlabel("time (ms)", fontsize=8)
        idle = 1 - busy / (s.ranks * end) if end else 0.0
        low.set_title(f"measured: idle {idle:.3f}", fontsize=9)
    fig.tight_layout()
    return fig
