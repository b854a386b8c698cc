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
of action, and the bytes it sent beside the table's sends. Each framework's peak memory
per rank is measured on one more step. On 4 ranks, our 1F1B on pipe=2 x data=2 also runs
under ZeRO-3 (each stage's state sharded over data), beside ZeRO-0.
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
    def __init__(self, job: Job, schedule: str, params: dict, *, mesh: dict | None = None, zero: int = 0) -> None:
        import fsharded as fs
        from fsharded.models import gpt_stages

        v, mesh = _virtual(schedule), fs.Mesh(mesh or {"pipe": job.ranks})
        loss = fs.parallel.pipeline.pipelined(gpt_stages.pipeline_stages(params, mesh.shape["pipe"] * v),
                                              schedule=schedule, microbatches=job.m * mesh.shape["pipe"] // mesh.size,
                                              virtual=v)
        specs = {"param_specs": fs.parallel.zero(zero, axis="data")(fs.P(), params)} if zero else {}
        self.step = fs.train_step(loss, fs.optim.adamw(job.lr, weight_decay=0.0), mesh=mesh, donate=True, **specs)
        self.state = self.step.init(params)

    def __call__(self, batch: dict) -> torch.Tensor:
        self.state, metrics = self.step(self.state, batch)
        return metrics["loss"]

    def kept(self) -> list:
        """The tensors this rank keeps between steps (its stages' weights and moments)."""
        return [self.state.params, self.state.opt_state]


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

    def kept(self) -> list:
        return [[p for mod in self.mods for p in mod.parameters()], list(self.opt.state.values())]


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

    def kept(self) -> list:
        opt = self.engine.optimizer
        opt = getattr(opt, "optimizer", opt)  # (a wrapper's torch optimizer)
        return [list(self.engine.module.parameters()), list(opt.state.values())]


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

    _quiet()
    torch.set_num_threads(1)
    names = job.frameworks()
    if job.deepspeed:
        os.environ.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=job.extensions_dir)
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")
    runners = {n: _build(job, n) for n in names}
    return _timed(job, runners, lambda rd: names[rd % len(names):] + names[:rd % len(names)])


def _timed(job: Job, runners: dict, order: Any) -> dict:
    """``runners`` after ``job.warmup`` steps each (their first-step losses): ``job.rounds``
    rounds of ``job.iters`` steps, the runners of a round in ``order(round)``; then one more
    step each under the memory tracker (not timed)."""
    import torch.distributed as dist

    losses = {n: [float(r(job.batch(i))) for i in range(job.warmup)] for n, r in runners.items()}
    times: dict = {n: [] for n in runners}
    for rd in range(job.rounds):
        for n in order(rd):
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(job.iters):
                out = runners[n](job.batch(job.warmup + rd * job.iters + i))
            float(out)
            dist.barrier()
            times[n].append((time.perf_counter() - t0) / job.iters)
    memory = {}
    for n, r in runners.items():
        dist.barrier()
        memory[n] = _peak_bytes(r, job.batch(0))
    return {"times": times, "losses": losses, "memory": memory}


def _peak_bytes(runner: Any, batch: dict) -> int:
    """A rank's peak in one step (``fs.memory.track``, counting each storage once): what it
    keeps between steps (weights, optimizer state; registered first, for every framework
    alike: our step registers its state itself) and what the step allocates."""
    import fsharded as fs

    with fs.memory.track() as mem:
        mem.register(runner.kept(), "parameters")
        runner(batch)
    return mem.peak_bytes


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
    out["latency"] = _latency(job)
    for name in OURS:
        v = _virtual(name)
        stages = gpt_stages.pipeline_stages(params, job.ranks * v)
        sched = pp.make(name, job.ranks, job.m, v)
        parts = {s: stages.params_of(params, s) for s in range(stages.n) if sched.rank_of(s) == me}
        runs = []
        # One transport for the runs, as a training step keeps one: the first run learns
        # each value's shape (its header); the later ones post their receives ahead.
        transport = pp.PointToPoint(dist.group.WORLD, list(range(job.ranks)), job.m)
        for i in range(job.warmup + job.rounds):
            micro = pp.split_batch(job.batch(i), job.m)
            dist.barrier()
            before = transport.sent_bytes
            res = pp.run(sched, stages, parts, micro, ranks=[me], transport=transport)
            if i >= job.warmup:
                runs.append({"wall": res.wall_s, "busy": res.busy_s[me], "spent": res.spent[me],
                             "spans": [(e - b, a) for b, e, a in res.spans[me]],
                             "sent": transport.sent_bytes - before,
                             "sends": sum(a.kind == "SEND" for a in sched.actions[me]),
                             "value": micro[0]["tokens"].shape[0] * (micro[0]["tokens"].shape[1] - 1)
                             * job.model["d_model"] * 4})
        out[name] = runs
    return out


def _latency(job: Job, rounds: int = 30) -> float:
    """Seconds one activation takes from a rank's send to the next rank's receive (the
    transport the executor uses, gloo point to point): half the median round trip
    between ranks 0 and 1; the others wait."""
    import torch.distributed as dist

    me = dist.get_rank()
    x = torch.zeros(job.micro, job.model["seq_len"], job.model["d_model"])
    trips = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        if me == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif me == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
        trips.append(time.perf_counter() - t0)
    dist.barrier()
    got = [0.0] * dist.get_world_size()
    dist.all_gather_object(got, statistics.median(trips[rounds // 3:]) / 2)
    return got[0]


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


def _bubble_sections(job: Job, runs: list[dict], size: str) -> list[Section]:
    """The measured idle fraction beside the table's bubble, planned under the run's own
    durations: of the compute actions alone, and with the sends and receives."""
    from fsharded.parallel import pipeline as pp

    rows: dict[bool, list] = {False: [], True: []}
    latency = runs[0]["latency"]
    for name in OURS:
        measured, planned = [], {False: [], True: []}
        for k in range(job.rounds):
            per_rank = [r[name][k] for r in runs]
            wall = max(x["wall"] for x in per_rank)
            measured.append(1 - sum(x["busy"] for x in per_rank) / (job.ranks * wall))
            took = {(r, a): sec for r, x in enumerate(per_rank) for sec, a in x["spans"]}
            sched = pp.make(name, job.ranks, job.m, _virtual(name))
            cost = lambda r, a, took=took: took[(r, a)]  # noqa: E731
            # A send keeps its rank as long as it did; its value arrives one transfer later.
            comm = lambda r, a, took=took: took[(r, a)] if a.kind == "SEND" else latency  # noqa: E731
            planned[False].append(float(pp.check(sched, cost).bubble))
            planned[True].append(float(pp.check(sched, cost, comm).bubble))
        for with_comm in (True, False):
            rows[with_comm].append(Qty(f"{name}: measured idle fraction vs the table's bubble", size,
                                       statistics.median(measured), statistics.median(planned[with_comm]), unit=""))
    measured_note = (f"measured: 1 - (the ranks' compute time) / (ranks x the slowest rank's wall time) of one "
                     f"run of the schedule; median over {job.rounds} runs")
    return [
        Section(title=f"our executor's bubble on {job.ranks} gloo ranks, {job.m} micro-batches",
                peer="the table's bubble (check(schedule, costs, comm)) with each compute action and send "
                     "taking the time it took in the run, and each value arriving one transfer after its send",
                rows=tuple(rows[True]), target=1.1,
                notes=(measured_note, f"a transfer: {latency * 1e3:.3f} ms, half the median round trip of one "
                                      f"activation between ranks 0 and 1 over gloo, measured before the runs",
                       "the bubble counts the time not computing, so sending and waiting count as idle in both")),
        Section(title=f"the same, the table's bubble without communication, {job.ranks} gloo ranks",
                peer="the table's bubble (check(schedule, costs)) with the compute actions taking the time they "
                     "took in the run and the sends and receives none", rows=tuple(rows[False]),
                notes=(measured_note,)),
    ]


def _memory_section(job: Job, timing: list[dict], size: str) -> Section:
    names = job.frameworks()
    most = {n: max(t["memory"][n] for t in timing) for n in names}  # the rank that needs most
    peers = [(s, f"torch {TORCH[s]}") for s in OURS if job.torch_pp]
    if job.deepspeed:
        peers.insert(0, ("1f1b", DS))
    rows = tuple(Qty(f"ours {'ZB-H1' if o == 'zb' else o} vs {p}", size, most[f"fsharded {o}"], most[p], unit="B")
                 for o, p in peers)
    return Section(title=f"peak memory of the rank that needs most, {job.ranks} gloo ranks, {job.m} micro-batches",
                   peer="the same peers, the same step", rows=rows,
                   notes=("per rank: the most bytes alive at once in one step, counting what it keeps between "
                          "steps (its stages' weights and optimizer state) and what the step allocates "
                          "(fs.memory.track, a dispatch mode counting each tensor storage once); the largest "
                          "rank's",))


def _bytes_section(job: Job, runs: list[dict], size: str) -> Section:
    rows = []
    for name in OURS:
        per_rank = [r[name][-1] for r in runs]
        rows.append(Qty(f"{name}: bytes sent per step by the rank that sends most", size,
                        max(x["sent"] for x in per_rank), max(x["sends"] * x["value"] for x in per_rank), unit="B"))
    return Section(title=f"our point-to-point bytes per step, {job.ranks} gloo ranks, {job.m} micro-batches",
                   peer="the table's sends times one micro-batch's activation (fp32)", rows=tuple(rows),
                   notes=("measured: every byte PointToPoint sent in one run of the schedule, a later run of "
                          "one transport (the first sends a small header with the first value of each kind)",))


def zero_worker(job: Job) -> dict:
    """Our 1F1B on pipe=2 x data=2, the stages' state replicated over data (ZeRO-0) and
    sharded over it (ZeRO-3: gathered for the step, reduce-scattered back): step times in
    alternating order, and each rank's peak bytes."""

    _quiet()
    torch.set_num_threads(1)
    params = job.params()
    runners = {zero: _Ours(job, "1f1b", params, mesh={"pipe": 2, "data": 2}, zero=zero) for zero in (0, 3)}
    return _timed(job, runners, lambda rd: (0, 3) if rd % 2 == 0 else (3, 0))


def _zero_section(job: Job, out: list[dict], size: str) -> Section:
    per_round = {k: [max(t["times"][k][r] for t in out) for r in range(job.rounds)] for k in (0, 3)}
    most = {k: max(t["memory"][k] for t in out) for k in (0, 3)}
    first = {k: out[-1]["losses"][k][0] for k in (0, 3)}
    return Section(title="pipe x ZeRO-3: our 1F1B on 4 gloo ranks, pipe=2 x data=2",
                   peer="the same pipeline with each stage's state replicated over data (ZeRO-0); no peer "
                        "runs a pipeline under ZeRO-3",
                   rows=(Row.from_samples("step time, ZeRO-3 vs ZeRO-0", size, per_round[3], per_round[0]),
                         Qty("peak bytes of the rank that needs most, ZeRO-3 vs ZeRO-0", size, most[3], most[0],
                             unit="B")),
                   notes=(f"first-step losses: ZeRO-0 {first[0]:.5f}, ZeRO-3 {first[3]:.5f}",
                          f"{job.m // 2} micro-batches of {job.micro} rows per data shard; {job.rounds} rounds of "
                          f"{job.iters} steps, alternating; per round the slowest rank's time, median"))


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
        report.sections.append(_memory_section(job, timing, size))
        _log(f"pipe={p}: our executor's bubble ...")
        runs = run_on_new_ranks(bubble_worker, p, replace(job, deepspeed=False, torch_pp=False))
        report.sections += _bubble_sections(job, runs, size)
        report.sections.append(_bytes_section(job, runs, size))
    if 4 in ranks or args.quick:
        _log("pipe=2 x data=2: ZeRO-3 ...")
        job = Job(model=model, ranks=4, batches=batches, micro=rows // m, m=m, rounds=rounds, iters=iters,
                  deepspeed=False, torch_pp=False)
        report.sections.append(_zero_section(job, run_on_new_ranks(zero_worker, 4, job), size))
    report.finish()
    report.emit(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
