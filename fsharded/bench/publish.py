"""The benchmark pages of the docs and the README's headline table, made from the result
files (``fsharded bench NAME --save fsharded/bench/results/FILE.json``) and nothing else.

    python -m fsharded.bench.publish            # rewrite docs/benchmarks/ and the README's table
    python -m fsharded.bench.publish --check    # exit 1 if a published table differs from its files
    python -m fsharded.bench.publish --convert OLD.md   # a printed --markdown report -> result files

Each benchmark's page is ``docs/benchmarks/NAME.md``: its introduction (the prose of
``fsharded/bench/results/NAME.md``, which holds no measured numbers), then every result
file of that benchmark, newest first, with its command, machine and date. The README's
table (between ``<!-- headline:start -->`` and ``<!-- headline:end -->``) takes the rows
``HEADLINE`` names from those files; a row that no file has is an error, not a gap.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fsharded.bench import BENCHMARKS, _results

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "fsharded" / "bench" / "results"
DOCS = ROOT / "docs" / "benchmarks"
README = ROOT / "README.md"
START, END = "<!-- headline:start -->", "<!-- headline:end -->"
OUTPUT_FLAGS_WITH_VALUE = ("--save", "--plot")


@dataclass(frozen=True)
class Headline:
    """One row of the README's table: the row ``case`` (and ``size``, where given) of the
    section whose title starts with ``section`` in the newest result file of ``bench``
    run with ``args`` that has it, shown as ``label``."""

    label: str
    bench: str
    section: str
    case: str
    size: str | None = None
    args: tuple[str, ...] = ()  # the run's flags (``run_args``): the default run unless given


HEADLINE = (
    Headline("train_step in one process vs the eager PyTorch loop", "train",
             "one optimizer step of the GPT", "train_step, one process vs eager + AdamW(foreach)"),
    Headline("`fsharded train`'s default job vs the eager loop, per step", "train",
             "the default `fsharded train` job", "fsharded train (virtual mesh {'data': 2}), per step"),
    Headline("`fsharded train` compiled vs `--no-compile`, per token", "compile",
             "the default `fsharded train` job, compiled and eager",
             "fsharded train --compile vs --no-compile (virtual mesh {'data': 2}), per token"),
    Headline("ZeRO-3 compiled vs FSDP2 + per-block torch.compile, 2 ranks", "compile",
             "ZeRO-3 on 2 gloo ranks", "ZeRO-3 compiled vs FSDP2 + per-block torch.compile"),
    Headline("ZeRO-1 step vs DeepSpeed, 2 ranks", "zero", "step time, GPT 842,496 params fp32, 2 gloo ranks: "
             "fsharded vs DeepSpeed", "ZeRO-1 vs DeepSpeed ZeRO-1"),
    Headline("ZeRO-3 step vs DeepSpeed, 2 ranks", "zero", "step time, GPT 842,496 params fp32, 2 gloo ranks: "
             "fsharded vs DeepSpeed", "ZeRO-3 vs DeepSpeed ZeRO-3"),
    Headline("ZeRO-3 step vs FSDP2, 2 ranks", "zero", "step time, GPT 842,496 params fp32, 2 gloo ranks: "
             "fsharded vs FSDP2", "ZeRO-3 vs FSDP2 fully_shard"),
    Headline("ZeRO-2 bytes sent per rank vs DeepSpeed", "zero", "bytes sent per rank per step: fsharded vs "
             "DeepSpeed", "ZeRO-2 vs DeepSpeed ZeRO-2"),
    Headline("ZeRO-3 of a nanoGPT-style nn.Module vs FSDP2, 2 ranks", "nn", "one ZeRO-3 step",
             "ZeRO-3 via fs.nn (blocks=fm.blocks) vs FSDP2 fully_shard"),
    Headline("Ulysses attention, 4096 tokens, 2 ranks, vs DeepSpeed-Ulysses", "seq",
             "step time on 2 ranks", "ulysses vs DeepSpeed-Ulysses", "4096 tokens"),
    Headline("1F1B pipeline step, 2 ranks, vs DeepSpeed's pipeline engine", "pipeline",
             "step time, GPT on 2 gloo ranks", "ours 1f1b vs DeepSpeed 1F1B"),
    Headline("ZeRO-3 step, optimizer state on NVMe, 135M params, vs DeepSpeed ZeRO-Infinity", "offload",
             "step time against DeepSpeed", "fsharded, optimizer state on NVMe vs DeepSpeed, optimizer state on NVMe",
             args=("--nvme-path", "/work")),  # (a directory on this machine's disk, not the temp dir)
    Headline("MoE layer, top-2, 4096 tokens per rank, vs DeepSpeed's MoE", "moe",
             "step time on 2 ranks", "top-2", "4096 tokens/rank"),
    Headline("Decoding with a compiled step, 22M params, batch 1, vs transformers' generate", "inference",
             "generation vs transformers' generate on the same weights (22.4M",
             "decode per token, ours compiled vs transformers (dynamic cache)", "batch 1, prompt 128"),
    Headline("Continuous batching vs static batching, same cache memory", "inference",
             "continuous batching vs static batching", "the trace's wall time: Engine vs generate on groups"),
    Headline("C++ CPU AdamW, 5e7 parameters, vs torch's fused AdamW", "optim",
             "AdamW step on fp32 master weights: ours vs torch fused", "AdamW vs torch fused", "5e7 params"),
    Headline("psum of 4 MiB per rank, 2 ranks, vs torch.distributed.all_reduce (gloo)", "spmd",
             "fsharded collectives vs torch.distributed", "psum vs all_reduce", "4 MiB"),
)


class PublishError(ValueError):
    pass


def results(directory: pathlib.Path = RESULTS) -> list[tuple[pathlib.Path, dict[str, Any]]]:
    """Every result file under ``directory`` with its contents, newest first."""
    out = [(p, _results.load(p)) for p in sorted(directory.glob("*.json"))]
    return sorted(out, key=lambda pd: (datetime.datetime.fromisoformat(pd[1]["date"]), pd[0].name), reverse=True)


def run_args(command: str) -> tuple[str, ...]:
    """The flags a run's command gave its benchmark, without the output flags
    (``--markdown``, ``--save FILE``, ``--plot PNG``): what makes it one variant of the
    benchmark."""
    words = command.split()
    rest = words[words.index("bench") + 2:] if "bench" in words else words
    out, skip = [], False
    for w in rest:
        if skip:
            skip = False
        elif w == "--markdown":
            continue
        elif w.startswith(OUTPUT_FLAGS_WITH_VALUE):
            skip = "=" not in w  # the value is the next word
        else:
            out.append(w)
    return tuple(out)


def _title(d: dict[str, Any]) -> str:
    date = datetime.datetime.fromisoformat(d["date"])
    return f"`{' '.join(('fsharded bench', d['bench'], *run_args(d['command'])))}`, {date:%Y-%m-%d}"


def _find(found: list[tuple[pathlib.Path, dict[str, Any]]], h: Headline) -> tuple[pathlib.Path, dict, dict]:
    for path, d in found:
        if d["bench"] != h.bench or run_args(d["command"]) != h.args:
            continue
        for s in d["sections"]:
            if s["title"].startswith(h.section):
                for r in s["rows"]:
                    if r["cells"][0] == h.case and h.size in (None, r["cells"][1]):
                        return path, d, r
    raise PublishError(f"the headline row {h.label!r} ({h.bench}: {h.section!r} / {h.case!r}) is in no result "
                       f"file under {RESULTS.relative_to(ROOT)}: run the benchmark with --save, or change HEADLINE")


def headline(found: list[tuple[pathlib.Path, dict[str, Any]]], *, link_prefix: str = "docs/benchmarks/") -> str:
    """The README's table: each HEADLINE row's ours, peer and ratio, its run's date and page."""
    out = ["| | ours | peer | ours/peer | run |", "|---|---:|---:|---:|---|"]
    for h in HEADLINE:
        _, d, r = _find(found, h)
        c = r["cells"]
        date = datetime.datetime.fromisoformat(d["date"])
        out.append(f"| {h.label} | {c[2]} | {c[3]} | {c[-1]} | [{date:%Y-%m-%d}]({link_prefix}{h.bench}.md) |")
    return "\n".join(out) + "\n"


def pages(found: list[tuple[pathlib.Path, dict[str, Any]]]) -> dict[str, str]:
    """``docs/benchmarks/`` as it should be: file name -> text."""
    out: dict[str, str] = {}
    names = sorted({d["bench"] for _, d in found}, key=lambda n: list(BENCHMARKS).index(n) if n in BENCHMARKS else 99)
    for name in names:
        intro_path = RESULTS / f"{name}.md"
        intro = intro_path.read_text().rstrip() + "\n" if intro_path.exists() else f"# `fsharded bench {name}`\n"
        body = [intro]
        runs = [(path, d) for path, d in found if d["bench"] == name]  # newest first
        runs.sort(key=lambda pd: run_args(pd[1]["command"]) != ())  # the default run first (stable)
        body += [f"<!-- generated from fsharded/bench/results/{path.name} -->\n" + _results.render(d, title=_title(d))
                 for path, d in runs]
        out[f"{name}.md"] = "\n".join(body)
    index = ["# Benchmarks", "",
             "Every table on these pages is generated from a result file in `fsharded/bench/results/` "
             "(`fsharded bench NAME --save FILE`), which records the command, the machine and the date; "
             "`python -m fsharded.bench.publish` rewrites the pages and the README's table from them, "
             "and the test suite checks that they match. Each benchmark runs ours and its peer in the "
             "same run, alternating, and reports medians and the ratio: run them on your own hardware "
             "with the same commands.", "", "## Headline", "", headline(found, link_prefix=""), "## Pages", ""]
    for name in names:
        summary = BENCHMARKS[name].summary if name in BENCHMARKS else ""
        index.append(f"- [`fsharded bench {name}`]({name}.md): {summary}")
    unrun = [n for n in BENCHMARKS if n not in names]
    if unrun:
        index += ["", "No result file yet (their pages appear once a run is saved):", ""]
        index += [f"- `fsharded bench {n}`: {BENCHMARKS[n].summary}" for n in unrun]
    out["index.md"] = "\n".join(index) + "\n"
    return out


def readme(text: str, table: str) -> str:
    """``text`` with the headline table between its markers replaced."""
    if START not in text or END not in text:
        raise PublishError(f"README.md has no {START} ... {END} block for the headline table")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}{END}{tail}"


def publish(check: bool = False, docs: pathlib.Path = DOCS, readme_path: pathlib.Path = README) -> list[str]:
    """Write (or with ``check``, compare) the pages and the README's table; returns the
    files that differed."""
    found = results()
    want = {docs / k: v for k, v in pages(found).items()}
    want[readme_path] = readme(readme_path.read_text(), headline(found))
    stale = [p for p in docs.glob("*.md") if p not in want]
    differ = [str(p.relative_to(ROOT)) for p, text in want.items() if not p.exists() or p.read_text() != text]
    differ += [f"{p.relative_to(ROOT)} (no result file makes it)" for p in stale]
    if not check:
        docs.mkdir(parents=True, exist_ok=True)
        for p, text in want.items():
            if not p.exists() or p.read_text() != text:
                p.write_text(text)
        for p in stale:
            p.unlink()
    return differ


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fsharded.bench.publish", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare only; exit 1 if a published file differs")
    p.add_argument("--convert", metavar="MD", nargs="+",
                   help="convert printed --markdown reports into result files under fsharded/bench/results/")
    args = p.parse_args(argv)
    if args.convert:
        for md in args.convert:
            for d in _results.from_markdown(pathlib.Path(md).read_text(), md):
                stamp = datetime.datetime.fromisoformat(d["date"])
                path = _results.save(d, RESULTS / f"{d['bench']}-{stamp:%Y%m%d-%H%M}.json")
                print(f"wrote {path.relative_to(ROOT)}")
        return 0
    differ = publish(check=args.check)
    for f in differ:
        print(f"{'differs' if args.check else 'wrote'}: {f}")
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
