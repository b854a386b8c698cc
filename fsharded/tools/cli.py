"""The ``fsharded`` command line.

    fsharded train                        # train the bundled GPT (fsharded train --help)
    fsharded generate --checkpoint checkpoints --prompt 'def '   # continue a prompt
    fsharded serve --checkpoint checkpoints --http 8000          # serve it
    fsharded bench --list                 # the registered benchmarks
    fsharded bench spmd --quick           # run one; options after the name go to it
    fsharded bench spmd --help
    fsharded plot metrics.jsonl -o curves.png   # a run's metrics as a picture
    python -m fsharded bench spmd --markdown

Each subcommand is a function ``_add_<name>(subparsers)`` that registers its parser and
sets ``handler`` (``args -> exit code``); ``main`` parses and dispatches. Benchmarks
themselves are registered in ``fsharded.bench.BENCHMARKS``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

__all__ = ["main", "build_parser"]

Handler = Callable[[argparse.Namespace], int]


def _err(msg: str) -> None:
    print(f"fsharded: {msg}", file=sys.stderr)


# -- fsharded bench --------------------------------------------------------------------------


def _bench_list() -> str:
    from fsharded.bench import BENCHMARKS

    width = max(len(n) for n in BENCHMARKS)
    return "\n".join(f"  {b.name.ljust(width)}  {b.summary}" for b in BENCHMARKS.values())


def _run_bench(args: argparse.Namespace) -> int:
    from fsharded.bench import get

    if args.list:
        print("benchmarks (run one with `fsharded bench NAME [options]`):")
        print(_bench_list())
        return 0
    if args.name is None:
        _err("bench: name a benchmark, or --list; available:\n" + _bench_list())
        return 2
    try:
        bench = get(args.name)
    except KeyError as e:
        _err(f"bench: {e.args[0]}")
        return 2
    return bench.main(args.args, prog=f"fsharded bench {bench.name}")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark against its peer (fsharded bench --list)",
        description="Run a benchmark from fsharded.bench: ours and the peer a user would "
        "otherwise pick, alternated in one run, medians and ratios printed. Options after "
        "NAME belong to the benchmark (fsharded bench NAME --help).",
    )
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("name", nargs="?", metavar="NAME", help="benchmark to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(handler=_run_bench)


# -- fsharded train -------------------------------------------------------------------------


def _run_train(args: argparse.Namespace) -> int:
    from fsharded.tools import train

    return train.main(args.args, prog="fsharded train")


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train the bundled GPT (fsharded train --help)",
        description="Train the bundled GPT with train_step on the virtual mesh, or on real "
        "ranks under torchrun. Options are those of `python -m fsharded.train`.",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(handler=_run_train)


# -- fsharded generate ----------------------------------------------------------------------


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="continue a prompt with a GPT trained by fsharded train (fsharded generate --help)",
        description="Generate with a KV cache from a checkpoint of fsharded train.",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a GPT trained by fsharded train: continuous batching, JSON lines or HTTP "
        "(fsharded serve --help)",
        description="Serve a checkpoint of fsharded train with continuous batching.",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


# -- fsharded export ------------------------------------------------------------------------


def _run_export(args: argparse.Namespace) -> int:
    import torch

    from fsharded import checkpoint
    from fsharded.tools import _train_resume

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    try:
        record = _train_resume.read_job(args.checkpoint) if (args.select == "params" and not args.all) else None
        meta = {"fsharded.model": json.dumps(record["model"]), "fsharded.encoding": json.dumps(record.get("encoding"))} \
            if record is not None and "model" in record else None
        names = checkpoint.export_safetensors(args.checkpoint, args.out,
                                              select=None if args.all else args.select,
                                              dtype=dtypes.get(args.dtype), metadata=meta)
    except (ValueError, OSError) as e:
        _err(str(e))
        return 2
    print(f"fsharded export: {len(names)} tensors -> {args.out}")
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint's full parameters to a .safetensors file",
        description="Consolidate a checkpoint (step.save / fsharded train --save-every) into "
        "one .safetensors file, leaf by leaf; a train state's params are named as the model's "
        "parameters (what load_state_dict / from_pretrained read).",
    )
    p.add_argument("checkpoint", help="a checkpoint directory (e.g. checkpoints/step-00000100)")
    p.add_argument("out", help="the .safetensors file to write")
    p.add_argument("--select", default="params", help="subtree to export (default: params)")
    p.add_argument("--all", action="store_true", help="every tensor of the checkpoint, by path")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating tensors")
    p.set_defaults(handler=_run_export)


# -- fsharded plot ---------------------------------------------------------------------------


def _run_plot(args: argparse.Namespace) -> int:
    from fsharded.tools.plot import plot_metrics

    try:
        drawn = plot_metrics(args.metrics, args.out, keys=args.keys.split(",") if args.keys else None,
                             labels=args.labels.split(",") if args.labels else None)
    except (OSError, ValueError) as e:
        _err(str(e))
        return 1
    print(f"fsharded plot: {', '.join(drawn)} of {len(args.metrics)} run(s) -> {args.out}")
    return 0


def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot",
        help="draw a run's JSONL metrics (loss curves and the rest) as a picture",
        description="One panel per metric of fsharded train --metrics files, steps on the x axis, "
        "one line per file.",
    )
    p.add_argument("metrics", nargs="+", help="JSONL metrics files (fsharded train --metrics)")
    p.add_argument("-o", "--out", default="metrics.png", help="the picture to write (default: metrics.png)")
    p.add_argument("--keys", help="comma-separated metrics to draw (default: all, loss first)")
    p.add_argument("--labels", help="comma-separated names of the runs (default: the file names)")
    p.set_defaults(handler=_run_plot)


# -- top level -------------------------------------------------------------------------------

_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_bench, _add_train, _add_generate,
                                                                       _add_serve, _add_export, _add_plot)


def build_parser() -> argparse.ArgumentParser:
    from fsharded import __version__

    parser = argparse.ArgumentParser(
        prog="fsharded",
        description="fsharded: JAX-style shard_map and differentiable collectives on PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"fsharded {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fsharded`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # every option after `train` belongs to the training job
        from fsharded.tools import train

        return train.main(argv[1:], prog="fsharded train")
    if argv[:1] == ["generate"]:  # and after `generate`, to generation
        from fsharded.tools import _generate as generate

        return generate.main(argv[1:], prog="fsharded generate")
    if argv[:1] == ["serve"]:
        from fsharded.tools import _serve as serve

        return serve.main(argv[1:], prog="fsharded serve")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_any_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
