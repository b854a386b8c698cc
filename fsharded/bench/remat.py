"""``fsharded bench remat``: what each remat policy keeps of the activations and what its
recomputation costs.

    fsharded bench remat             # GPT of 8 blocks, d_model 512, 8 x 512 tokens per step
    fsharded bench remat --quick     # a small GPT (smoke run)

One process, one device (``data=1``), fp32, AdamW (donated), ``torch.get_num_threads()``
threads. The same GPT trains on the same batch under each policy of
``train_step(remat=...)``: none, ``blocks,dots`` (all 8 selectively: their matrix
products kept, the element-wise ops recomputed), ``blocks:4`` (2 of the 8 blocks
recomputed), ``blocks:2`` (4), ``blocks`` (all 8) and ``blocks,offload`` (all 8, their
inputs copied to host memory between forward and backward). The peer of every row is the same step keeping every
activation (``remat=None``):

- time: the median step time over rounds, each policy in a fresh process of its own (one
  warm-up step, then the timed ones): in one process the policies timed after one another
  disturbed each other's heaps (the step keeping every activation took 1.4 times its own
  time alone);
- memory: the peak bytes of activations in one step, as the memory tracker counts them
  (``fs.memory.track``: saved activations, temporaries and activation gradients; the
  offloaded inputs are not activations on the device), and beside it what
  ``fs.estimate_memory(..., remat=policy)`` predicts.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from fsharded.bench import Qty, Report, Row, Section, add_output_args

POLICIES = ("none", "blocks,dots", "blocks:4", "blocks:2", "blocks", "blocks,offload")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _batch(cfg: Any, rows: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"tokens": torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=g)}


def _timed(model: dict, rows: int, name: str, rounds: int) -> tuple[float, list[float]]:
    """In a fresh process: the first step's loss under policy ``name``, and the times of
    ``rounds`` steps after it."""
    import fsharded as fs
    from fsharded import P
    from fsharded.models import gpt

    cfg = gpt.GPTConfig(**model)
    params, batch = gpt.init(cfg, 0), _batch(cfg, rows)
    step = fs.train_step(gpt.loss, fs.optim.adamw(1e-4, weight_decay=0.01), mesh=fs.Mesh({"data": 1}),
                         param_specs=fs.parallel.zero(0)(P(), params), blocks="blocks",
                         remat=None if name == "none" else name, donate=True)
    state, m = step(step.init(params), batch)
    first, times = float(m["loss"]), []
    for _ in range(rounds):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        float(m["loss"])
        times.append(time.perf_counter() - t0)
    return first, times


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small GPT and few rounds")
    p.add_argument("--rounds", type=int, default=None, help="timed steps per policy")
    add_output_args(p)
    return p


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    import fsharded as fs
    from fsharded import P
    from fsharded.models import gpt

    args = build_parser(prog).parse_args(argv)
    if args.quick:
        cfg = gpt.GPTConfig(vocab_size=1024, d_model=128, n_layers=8, n_heads=4, seq_len=128)
        rows, rounds = 4, args.rounds or 2
    else:
        cfg = gpt.GPTConfig(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, seq_len=512)
        rows, rounds = 8, args.rounds or 5
    params, batch = gpt.init(cfg, 0), _batch(cfg, rows)
    mesh = fs.Mesh({"data": 1})
    specs = fs.parallel.zero(0)(P(), params)
    opt = fs.optim.adamw(1e-4, weight_decay=0.01)
    n_params = gpt.param_count(params)
    size = f"{n_params / 1e6:.1f}M params, {rows}x{cfg.seq_len} tokens"
    report = Report("remat", params={"torch": torch.__version__, "threads": torch.get_num_threads(),
                                     "model": f"GPT {n_params / 1e6:.1f}M params (d_model={cfg.d_model} "
                                              f"blocks={cfg.n_layers} seq={cfg.seq_len}), fp32, one device",
                                     "batch": f"{rows} x {cfg.seq_len} tokens"})
    losses, acts, est, times = {}, {}, {}, {}
    ctx = multiprocessing.get_context("spawn")
    for name in POLICIES:
        _log(f"{name} ...")
        with ctx.Pool(1) as pool:
            losses[name], times[name] = pool.apply(_timed, (dataclasses.asdict(cfg), rows, name, rounds))
    for name in POLICIES:
        policy = None if name == "none" else name
        step = fs.train_step(gpt.loss, opt, mesh=mesh, param_specs=specs, blocks="blocks", remat=policy,
                             donate=True)
        state, _ = step(step.init(params), batch)
        with fs.memory.track() as mem:
            mem.register(state.params, "parameters")
            mem.register(state.opt_state, "optimizer state")
            state, _ = step(state, batch)
        acts[name] = mem.peak_of(("activations",))
        est[name] = fs.estimate_memory(params, specs, opt, mesh=mesh, loss=gpt.loss, batch=batch,
                                       remat=policy).activations
        del step, state
    med = {name: statistics.median(ts) for name, ts in times.items()}
    first = "; ".join(f"{k} {v:.6f}" for k, v in losses.items())
    notes = (f"first-step losses (the same numbers under every policy): {first}",
             f"each policy in a fresh process: a warm-up step, then {rounds} timed steps; the median step")
    others = [p for p in POLICIES if p != "none"]
    report.sections = [
        Section(title="step time of each policy against keeping every activation", peer="remat=None, the same step",
                rows=tuple(Row(p, size, med[p], med["none"]) for p in others), notes=notes),
        Section(title="peak activations on the device in one step against keeping every activation",
                peer="remat=None, the same step (memory tracker)",
                rows=tuple(Qty(p, size, float(acts[p]), float(acts["none"]), unit="B") for p in others),
                notes=tuple([f"keeping every activation: {acts['none'] / 1e6:.1f} MB"]
                            + [f"fs.estimate_memory(remat={p!r}).activations: {est[p] / 1e6:.1f} MB "
                               f"(tracked {acts[p] / 1e6:.1f} MB)" for p in POLICIES])),
    ]
    report.finish()
    report.emit(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
