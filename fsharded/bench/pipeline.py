"""``fsharded bench pipeline``: our pipeline schedules against DeepSpeed's pipeline engine
and ``torch.distributed.pipelining``, on gloo ranks.

    fsharded bench pipeline                 # GPT small with 8 blocks, 2 and 4 ranks
    fsharded bench pipeline --ranks 2       # one pipe size
    fsharded bench pipeline --quick         # tiny model, few steps (smoke run)
    fsharded bench pipeline --markdown

The same functional GPT (fp32, an untied head, seq 128) is cut into the same stages
(``gpt_stages.pipeline_stages``: blocks balanced by parameter count, the embeddings on the
first stage and the head on the last) and trained on the same batches (16 sequences per
step as 8 micro-batches of 2) with AdamW (no weight decay, no clipping), one torch thread
per rank:

- ours: ``train_step(pipelined(stages, schedule=..., microbatches=8), ...)`` on
  ``Mesh({"pipe": p})`` for GPipe, 1F1B, interleaved 1F1B (2 stages per rank) and
  zero-bubble (ZB-H1);
- DeepSpeed (when importable): ``PipelineModule`` over the same layers, cut where ours are,
  ``engine.train_batch`` (its 1F1B);
- torch: ``PipelineStage`` per stage with ``ScheduleGPipe``, ``Schedule1F1B``,
  ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` (2 stages per rank).

Every framework runs in the same processes, the order rotating each round; per round the
slowest rank's time, median over rounds. The losses of the first step are compared. The
second table runs our executor alone (``fs.parallel.pipeline.run``, point to point on the
ranks) and sets each schedule's measured idle fraction (one minus the ranks' compute time
over their wall time) beside the table's bubble under the measured mean cost of each kind
of action.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from fsharded.bench import Qty, Report, Row, Section, add_output_args

OURS = ("gpipe", "1f1b", "interleaved", "zb")
TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
         "zb": "ScheduleInterleavedZeroBubble"}
DS = "DeepSpeed 1F1B"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Job:
    """What every rank needs (picklable)."""

    model: dict
    ranks: int
    batches: tuple
    micro: int = 2
    m: int = 8
    lr: float = 1e-3
    warmup: int = 2
    rounds: int = 5
    iters: int = 2
    deepspeed: bool = True
    torch_pp: bool = True
    extensions_dir: str = ""

    def params(self) -> dict:
        from fsharded.models import gpt

        return gpt.init(gpt.GPTConfig(**self.model), 0)

    def batch(self, i: int) -> dict:
        return self.batches[i % len(self.batches)]

    def frameworks(self) -> list[str]:
        names = [f"fsharded {s}" for s in OURS]
        if self.deepspeed:
            names.append(DS)
        if self.torch_pp:
            names += [f"torch {TORCH[s]}" for s in OURS]
        return names


def _virtual(name: str) -> int:
    return 2 if ("interleaved" in name.lower() or "ZeroBubble" in name) else 1


class _Ours:
    def __init__(self, job: Job, schedule: str, params: dict) -> None:
        import fsharded as fs
        from fsharded.models import gpt_stages

        v = _virtual(schedule)
        loss = fs.parallel.pipeline.pipelined(gpt_stages.pipeline_stages(params, job.ranks * v), schedule=schedule,
                                              microbatches=job.m, virtual=v)
        self.step = fs.train_step(loss, fs.optim.adamw(job.lr, weight_decay=0.0), mesh=fs.Mesh({"pipe": job.ranks}),
                                  donate=True)
        self.state = self.step.init(params)

    def __call__(self, batch: dict) -> torch.Tensor:
        self.state, metrics = self.step(self.state, batch)
        return metrics["loss"]


class _Torch:
    def __init__(self, job: Job, cls: str, params: dict) -> None:
        import torch.distributed as dist
        from torch.distributed import pipelining

        from fsharded.bench._pipeline_peers import stage_module, token_loss
        from fsharded.models import gpt_stages

        v = _virtual(cls)
        n = job.ranks * v
        ranges = gpt_stages.pipeline_stages(params, n).ranges
        me = dist.get_rank()
        mine = [s for s in range(n) if s % job.ranks == me]
        self.mods = [stage_module(params, ranges, s) for s in mine]
        stages = [pipelining.PipelineStage(mod, s, n, torch.device("cpu")) for mod, s in zip(self.mods, mine)]
        self.schedule = getattr(pipelining, cls)(stages if v > 1 else stages[0], n_microbatches=job.m,
                                                 loss_fn=token_loss)
        self.opt = torch.optim.AdamW([p for mod in self.mods for p in mod.parameters()], lr=job.lr,
                                     weight_decay=0.0, foreach=True)
        self.first, self.last = 0 in mine, n - 1 in mine

    def __call__(self, batch: dict) -> torch.Tensor:
        x, y = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        losses: list = []
        if self.first and self.last:
            self.schedule.step(x, target=y, losses=losses)
        elif self.first:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().detach() if losses else torch.tensor(float("nan"))


class _DeepSpeed:
    def __init__(self, job: Job, params: dict) -> None:
        from fsharded.bench._pipeline_peers import deepspeed_engine
        from fsharded.models import gpt_stages

        self.engine = deepspeed_engine(params, gpt_stages.pipeline_stages(params, job.ranks).ranges,
                                       micro=job.micro, m=job.m, lr=job.lr)
        self.job = job

    def __call__(self, batch: dict) -> torch.Tensor:
        t, k = batch["tokens"], self.job.micro
        data = iter([(t[i * k:(i + 1) * k, :-1], t[i * k:(i + 1) * k, 1:]) for i in range(self.job.m)])
        return self.engine.train_batch(data_iter=data).detach()


def _build(job: Job, name: str) -> Any:
    params = job.params()
    if name == DS:
        return _DeepSpeed(job, params)
    if name.startswith("torch "):
        return _Torch(job, name.split(" ", 1)[1], params)
    return _Ours(job, name.split(" ", 1)[1], params)


def _quiet() -> None:
    """Spawned ranks write their logs to stderr: stdout is the report."""
    sys.stdout.flush()
    os.dup2(2, 1)


# -- workers (module level: run_on_ranks spawns them by name) -------------------------------


def time_worker(job: Job) -> dict:
    """Every framework in these processes: first-step losses, then step times in rotating order."""
    import torch.distributed as dist

    _quiet()
    torch.set_num_threads(1)
    names = job.frameworks()
    if job.deepspeed:
        os.environ.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=job.extensions_dir)
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")
    runners = {n: _build(job, n) for n in names}
    losses = {n: [float(runners[n](job.batch(i))) for i in range(job.warmup)] for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for rd in range(job.rounds):
        k = rd % len(names)
        for n in names[k:] + names[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(job.iters):
                out = runners[n](job.batch(job.warmup + rd * job.iters + i))
            float(out)
            dist.barrier()
            times[n].append((time.perf_counter() - t0) / job.iters)
    return {"times": times, "losses": losses}


def bubble_worker(job: Job) -> dict:
    """Our executor alone, each schedule ``job.rounds`` times: per rank its compute time by
    kind of action and its wall time per run."""
    import torch.distributed as dist

    from fsharded.models import gpt_stages
    from fsharded.parallel import pipeline as pp

    _quiet()
    torch.set_num_threads(1)
    params = job.params()
    me, out = dist.get_rank(), {}
    for name in OURS:
        v = _virtual(name)
        stages = gpt_stages.pipeline_stages(params, job.ranks * v)
        sched = pp.make(name, job.ranks, job.m, v)
        parts = {s: stages.params_of(params, s) for s in range(stages.n) if sched.rank_of(s) == me}
        runs = []
        for i in range(job.warmup + job.rounds):
            micro = pp.split_batch(job.batch(i), job.m)
            dist.barrier()
            res = pp.run(sched, stages, parts, micro, ranks=[me],
                         transport=pp.PointToPoint(dist.group.WORLD, list(range(job.ranks)), job.m))
            if i >= job.warmup:
                runs.append({"wall": res.wall_s, "busy": res.busy_s[me], "spent": res.spent[me],
                             "spans": [(e - b, a) for b, e, a in res.spans[me] if a.kind not in ("SEND", "RECV")]})
        out[name] = runs
    return out


# -- reporting -------------------------------------------------------------------------------


def _step_section(job: Job, timing: list[dict], size: str) -> tuple[Section, list[str]]:
    names = job.frameworks()
    per_round = {n: [max(t["times"][n][r] for t in timing) for r in range(job.rounds)] for n in names}
    last = timing[-1]  # the rank of the last stage (v = 1) reports the loss; every rank has ours
    rows, notes = [], []
    peers = [(s, f"torch {TORCH[s]}") for s in OURS if job.torch_pp]
    if job.deepspeed:
        peers.insert(0, ("1f1b", DS))
    for ours, peer in peers:
        label = "ZB-H1" if ours == "zb" else ours
        rows.append(Row.from_samples(f"ours {label} vs {peer}", size, per_round[f"fsharded {ours}"], per_round[peer]))
    rows.append(Row.from_samples("ours ZB-H1 vs ours 1F1B", size, per_round["fsharded zb"], per_round["fsharded 1f1b"]))
    ref = last["losses"]["fsharded 1f1b"][0]
    parts = []
    for n in names:
        vals = [t["losses"][n][0] for t in timing if t["losses"][n][0] == t["losses"][n][0]]
        first = vals[-1] if vals else float("nan")
        parts.append(f"{n} {first:.5f}" + (" MISMATCH" if abs(first - ref) > 1e-4 else ""))
    notes.append("first-step losses: " + "; ".join(parts))
    notes.append(f"{job.rounds} rounds of {job.iters} steps per framework after {job.warmup} warm-up steps, every "
                 f"framework in the same {job.ranks} processes, the order rotating each round; per round the "
                 f"slowest rank's time; median over rounds")
    return Section(title=f"step time, GPT on {job.ranks} gloo ranks (pipe={job.ranks}), {job.m} micro-batches of "
                   f"{job.micro}", peer="DeepSpeed's PipelineEngine (1F1B) and torch.distributed.pipelining, "
                   "same layers cut at the same blocks, same batches", rows=tuple(rows), target=0.9,
                   notes=tuple(notes)), notes


def _bubble_section(job: Job, runs: list[dict], size: str) -> Section:
    from fsharded.parallel import pipeline as pp

    rows = []
    for name in OURS:
        measured, planned = [], []
        for k in range(job.rounds):
            per_rank = [r[name][k] for r in runs]
            wall = max(x["wall"] for x in per_rank)
            measured.append(1 - sum(x["busy"] for x in per_rank) / (job.ranks * wall))
            took = {(r, a): sec for r, x in enumerate(per_rank) for sec, a in x["spans"]}
            planned.append(float(pp.check(pp.make(name, job.ranks, job.m, _virtual(name)),
                                          lambda r, a, took=took: took[(r, a)]).bubble))
        rows.append(Qty(f"{name}: measured idle fraction vs the table's bubble", size,
                        statistics.median(measured), statistics.median(planned), unit=""))
    return Section(title=f"our executor's bubble on {job.ranks} gloo ranks, {job.m} micro-batches",
                   peer="the table's bubble (check(schedule, costs)) with each compute action taking the time "
                        "it took in the run", rows=tuple(rows), target=1.1,
                   notes=(f"measured: 1 - (the ranks' compute time) / (ranks x the slowest rank's wall time) of "
                          f"one run of the schedule; median over {job.rounds} runs",))


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or "fsharded bench pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke run)")
    p.add_argument("--ranks", default="2,4", help="pipe sizes to run, e.g. 2 or 2,4 (default 2,4)")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out")
    p.add_argument("--no-torch", action="store_true", help="leave torch.distributed.pipelining out")
    p.add_argument("--rounds", type=int, default=None)
    add_output_args(p)
    return p


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    import importlib.util

    from fsharded.models import gpt
    from fsharded.testing import run_on_new_ranks

    args = build_parser(prog).parse_args(argv)
    ranks = [int(x) for x in str(args.ranks).split(",") if x]
    if args.quick:
        model = dataclasses.asdict(gpt.GPTConfig.tiny(vocab_size=256, n_layers=8, tied_embeddings=False))
        seq, rows, m, rounds, iters = model["seq_len"], 8, 4, args.rounds or 2, 1
    else:
        model = dataclasses.asdict(gpt.GPTConfig.small(n_layers=8, tied_embeddings=False))
        seq, rows, m, rounds, iters = model["seq_len"], 16, 8, args.rounds or 5, 2
    deepspeed = not args.no_deepspeed and importlib.util.find_spec("deepspeed") is not None
    g = torch.Generator().manual_seed(0)
    batches = tuple({"tokens": torch.randint(0, model["vocab_size"], (rows, seq + 1), generator=g)} for _ in range(4))
    report = Report("pipeline", params={"torch": torch.__version__, "threads per rank": 1,
                                        "model": f"GPT d_model={model['d_model']} layers={model['n_layers']} "
                                                 f"seq={seq}, untied head, fp32",
                                        "deepspeed": deepspeed})
    ext = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(tempfile.gettempdir(), "fsharded-ds-ext")
    size = f"{rows}x{seq}"
    for p in ranks:
        job = Job(model=model, ranks=p, batches=batches, micro=rows // m, m=m, rounds=rounds, iters=iters,
                  deepspeed=deepspeed, torch_pp=not args.no_torch, extensions_dir=ext)
        _log(f"pipe={p}: every framework ...")
        timing = run_on_new_ranks(time_worker, p, job)
        report.sections.append(_step_section(job, timing, size)[0])
        _log(f"pipe={p}: our executor's bubble ...")
        runs = run_on_new_ranks(bubble_worker, p, replace(job, deepspeed=False, torch_pp=False))
        report.sections.append(_bubble_section(job, runs, size))
    report.finish()
    report.emit(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
