"""Result files: a benchmark run saved as JSON (``fsharded bench NAME --save FILE``), and
the Markdown every table is rendered from.

A result file holds what the run printed and what it was measured on, so that a table
published anywhere can be regenerated from it and never drift from its numbers::

    {"format": 1, "bench": "zero", "date": "2026-12-05T05:20:00+00:00",
     "command": "python -m fsharded bench zero --markdown",
     "machine": {"cpu": "AMD EPYC 9B14", "cores": 2, "arch": "x86_64", "python": "3.11.7",
                 "torch": "2.13.0+cpu", "gpu": null},
     "load": {"before": [1.87, 1.61, 1.43], "after": [2.47, 1.84, 1.53]},
     "params": {"deepspeed": "0.19.8", ...},
     "sections": [{"title": ..., "peer": ..., "target": 1.0, "notes": [...],
                   "columns": ["case", "size", "ours", "peer", "ours/peer"],
                   "rows": [{"case": ..., "size": ..., "ours": 0.1099, "peer": 0.1058,
                             "unit": "s", "cells": ["ZeRO-0 ...", "8x128/rank", "109.91 ms",
                                                    "105.84 ms", "1.04"]}]}]}

``cells`` are the table's text as the benchmark formatted it; ``ours`` and ``peer`` the
numbers behind them (``null`` where a file was converted from a table and the text is
all there was: then ``converted_from`` names the source).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
from typing import Any

__all__ = ["FORMAT", "machine", "render", "header_lines", "save", "load", "ResultFileError"]

FORMAT = 1
COLUMNS = ["case", "size", "ours", "peer", "ours/peer"]


class ResultFileError(ValueError):
    """A result file that is not one: names the file and the field."""


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """What this process runs on: CPU model and cores, architecture, Python, torch and the
    GPU where CUDA has one."""
    out: dict[str, Any] = {"cpu": _cpu_model(), "cores": os.cpu_count(), "arch": platform.machine(),
                           "python": platform.python_version(), "torch": None, "gpu": None}
    try:
        import torch

        out["torch"] = torch.__version__
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return out


def _machine_line(m: dict[str, Any]) -> str:
    parts = []
    if m.get("cpu"):
        parts.append(f"{m['cpu']} ({m.get('cores')} cores)" if m.get("cores") else str(m["cpu"]))
    elif m.get("cores"):
        parts.append(f"nproc={m['cores']}")
    parts += [str(m[k]) for k in ("arch",) if m.get(k)]
    if m.get("python"):
        parts.append(f"python {m['python']}")
    if m.get("gpu"):
        parts.append(f"GPU {m['gpu']}")
    return ", ".join(parts)


def header_lines(d: dict[str, Any]) -> list[str]:
    """The conditions of a run, one line each: date, command, machine, load, then the
    benchmark's own parameters."""

    def la(x: list[float] | None) -> str:
        return "n/a" if not x else " ".join(f"{v:.2f}" for v in x)

    date = datetime.datetime.fromisoformat(d["date"])
    lines = [f"date: {date:%Y-%m-%d %H:%M} UTC", f"command: {d['command']}",
             f"machine: {_machine_line(d['machine'])}"]
    load = d.get("load") or {}
    if load.get("before") or load.get("after"):
        lines.append(f"load average (1/5/15 min): before {la(load.get('before'))}, after {la(load.get('after'))}")
    lines += [f"{k}: {v}" for k, v in d.get("params", {}).items()]
    if d.get("converted_from"):
        lines.append(f"converted from: {d['converted_from']} (the numbers are its printed text)")
    return lines


def render(d: dict[str, Any], *, level: int = 2, title: str | None = None) -> str:
    """A result as Markdown: its heading (``level``), the run's conditions, then one table
    per section with the peer, the target's summary and the notes."""
    h = "#" * level
    out = [f"{h} {title or 'fsharded bench ' + d['bench']}", ""]
    out += [f"- {line}" for line in header_lines(d)]
    for s in d["sections"]:
        cols = s.get("columns") or COLUMNS
        out += ["", f"{h}# {s['title']}", "", f"peer: {s['peer']}", ""]
        out += ["| " + " | ".join(cols) + " |", "|" + "|".join("---" if i < 2 else "---:" for i in range(len(cols))) + "|"]
        out += ["| " + " | ".join(r["cells"]) + " |" for r in s["rows"]]
        extra = [x for x in (s.get("summary"), *s.get("notes", ())) if x]
        if extra:
            out.append("")
            out += [f"- {x}" for x in extra]
    return "\n".join(out) + "\n"


def save(d: dict[str, Any], path: str | os.PathLike) -> pathlib.Path:
    """Write a result (``Report.to_dict()``) to ``path`` as JSON, checked first."""
    _check(d, str(path))
    p = pathlib.Path(path)
    if p.parent != pathlib.Path(""):
        p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(d, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, p)
    return p


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read a result file, checking that it has every field a table is made from."""
    try:
        d = json.loads(pathlib.Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ResultFileError(f"{path}: not JSON ({e})") from None
    _check(d, str(path))
    return d


def _check(d: Any, where: str) -> None:
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ResultFileError(f"{where}: {what}")

    need(isinstance(d, dict), "a result file holds one JSON object")
    need(d.get("format") == FORMAT, f"format {d.get('format')!r}, expected {FORMAT}")
    for k in ("bench", "date", "command"):
        need(isinstance(d.get(k), str) and d[k], f"field {k!r} missing or empty")
    try:
        datetime.datetime.fromisoformat(d["date"])
    except ValueError:
        need(False, f"date {d['date']!r} is not an ISO date")
    need(isinstance(d.get("machine"), dict), "field 'machine' missing")
    need(isinstance(d.get("sections"), list) and d["sections"], "no sections")
    for i, s in enumerate(d["sections"]):
        for k in ("title", "peer", "rows"):
            need(k in s, f"sections[{i}] has no {k!r}")
        ncol = len(s.get("columns") or COLUMNS)
        for j, r in enumerate(s["rows"]):
            cells = r.get("cells")
            need(isinstance(cells, list) and len(cells) == ncol,
                 f"sections[{i}] ({s['title']!r}) row {j}: {ncol} cells expected, got {cells!r}")


# -- converting a printed report (``--markdown`` output) into result files ---------------


def from_markdown(text: str, source: str) -> list[dict[str, Any]]:
    """The result files of the reports in ``text`` (each as ``--markdown`` prints it,
    starting ``## fsharded bench NAME``). The numbers stay as printed: rows keep their
    cells, ``ours``/``peer`` are null, ``converted_from`` names ``source``."""
    out = []
    blocks = text.split("\n## fsharded bench ")
    if not text.startswith("## fsharded bench "):
        blocks = blocks[1:]
    else:
        blocks[0] = blocks[0][len("## fsharded bench "):]
    for b in blocks:
        out.append(_parse_block(b, source))
    return out


def _parse_block(block: str, source: str) -> dict[str, Any]:
    lines = block.splitlines()
    d: dict[str, Any] = {"format": FORMAT, "bench": lines[0].strip(), "machine": {}, "params": {},
                         "load": {}, "sections": [], "converted_from": source}
    i = 1
    while i < len(lines) and not lines[i].startswith("### "):
        ln = lines[i]
        i += 1
        if not ln.startswith("- "):
            continue
        key, _, value = ln[2:].partition(": ")
        if key == "date":
            d["date"] = datetime.datetime.strptime(value, "%Y-%m-%d %H:%M UTC").replace(
                tzinfo=datetime.timezone.utc).isoformat()
        elif key == "command":
            d["command"] = value
        elif key == "machine":
            parts = [p.strip() for p in value.split(",")]
            for p in parts:
                if p.startswith("nproc="):
                    d["machine"]["cores"] = int(p[len("nproc="):])
                elif p.startswith("python "):
                    d["machine"]["python"] = p[len("python "):]
                else:
                    d["machine"]["arch"] = p
        elif key.startswith("load average"):
            before, _, after = value.partition(", after ")
            d["load"] = {"before": [float(x) for x in before.removeprefix("before ").split()],
                         "after": [float(x) for x in after.split()]}
        else:
            d["params"][key] = value
            if key == "torch":
                d["machine"]["torch"] = value
    while i < len(lines):
        title = lines[i][4:]
        i += 1
        s: dict[str, Any] = {"title": title, "peer": "", "target": None, "summary": None, "notes": [],
                             "columns": None, "rows": []}
        while i < len(lines) and not lines[i].startswith("### "):
            ln = lines[i]
            i += 1
            if ln.startswith("peer: ") and not s["peer"]:
                s["peer"] = ln[len("peer: "):]
            elif ln.startswith("|") and s["columns"] is None:
                s["columns"] = [c.strip() for c in ln.strip("|").split("|")]
            elif ln.startswith("|---") or ln.startswith("|:--"):
                continue
            elif ln.startswith("| "):
                s["rows"].append({"case": None, "size": None, "ours": None, "peer": None, "unit": None,
                                  "cells": [c.strip() for c in ln.strip()[1:-1].split(" | ")]})
            elif ln.startswith("- target ours/peer <= "):
                s["summary"] = ln[2:]
                s["target"] = float(ln[len("- target ours/peer <= "):].split(":")[0])
            elif ln.startswith("- "):
                s["notes"].append(ln[2:])
        for r in s["rows"]:
            r["case"], r["size"] = r["cells"][0], r["cells"][1] if len(r["cells"]) > 1 else ""
        d["sections"].append(s)
    return d
