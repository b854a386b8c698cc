"""Pictures of a run's JSONL metrics (``fsharded train --metrics m.jsonl``):
``fsharded plot m.jsonl [more.jsonl ...] -o curves.png``.

One panel per metric (loss first, then grad_norm, lr, the rest in file order; ``--keys``
picks them), steps on the x axis, one line per file, so runs on different meshes or
precisions can be laid over each other.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

__all__ = ["read_metrics", "plot_metrics"]

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_metrics(p) for p in paths]
    names = list(labels) if labels else [os.path.basename(str(p)) for p in paths]
    drawn = _keys(runs, keys)
    cols = min(3, len(drawn))
    rows = math.ceil(len(drawn) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
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
    plt.close(fig)
    return drawn
