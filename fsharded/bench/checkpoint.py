"""``fsharded bench checkpoint``: saving and loading a training state, against DCP.

    fsharded bench checkpoint             # the GPT at ~6.4 M params, AdamW state, 2 gloo ranks
    fsharded bench checkpoint --quick     # tiny model, a smoke run
    fsharded bench checkpoint --markdown

The state is a ``train_step`` state at ZeRO-3 (fp32 master weights, AdamW moments, step
and key): each rank holds half of it. Section 1, 2 gloo ranks: ``step.save`` /
``step.load`` (the spec-addressed format of ``fsharded.checkpoint``: each rank writes its
own shards, checksummed, into a temporary directory renamed when complete) against
``torch.distributed.checkpoint`` (DCP: ``dcp.save`` / ``dcp.load`` of the same state as
its flat dict of DTensors, what FSDP2 and torchtitan write), each timed from the call on
every rank to the slowest rank's return, rounds alternating; bytes on disk beside. Section
2, one process: loading that checkpoint laid out for another mesh and stage (ZeRO-1 on a
one-device mesh: every leaf whole) against DCP loading its own checkpoint into the same
layout. Each load is checked to give the saved values back exactly. Page cache: files are
read back warm (what a resume right after a save sees); ``--drop`` is not offered, as
dropping caches needs root.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import optree
import torch

import fsharded as fs
from fsharded import P
from fsharded.bench import Qty, Report, Row, Section
from fsharded.models import gpt


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Job:
    d_model: int
    layers: int
    rounds: int
    root: str
    steps: int = 3  # training steps timed with and without a save in the background
    deepspeed: bool = False  # also DeepSpeed's save_checkpoint / load_checkpoint (ZeRO-3)
    extensions_dir: str = ""


def _config(job: Job) -> gpt.GPTConfig:
    return gpt.GPTConfig.small(d_model=job.d_model, n_layers=job.layers)


def _step(mesh: fs.Mesh, stage: int, config: gpt.GPTConfig):
    params = gpt.init(config, 0)
    plan = fs.parallel.zero(stage, min_size=16)(P(), params)
    step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=mesh, param_specs=plan, blocks="blocks")
    return step, params


def _trained(step, params, config) -> fs.TrainState:
    """A state with non-zero moments: two steps on a fixed batch."""
    g = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, config.vocab_size, (4, 65), generator=g)}
    state = step.init(params)
    for _ in range(2):
        state, _ = step(state, batch)
    return state


def _bytes_under(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs_ in os.walk(path) for f in fs_)


def _leaves(state) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(state) if isinstance(x, torch.Tensor)]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_leaves(a), _leaves(b), strict=True))


def rank_worker(job: Job) -> dict:
    """Save and load the ZeRO-3 state with ours and with DCP, alternating, on this rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = _config(job)
    mesh = fs.Mesh({"data": world})
    step, params = _step(mesh, 3, config)
    state = _trained(step, params, config)
    specs = step.state_specs(state)
    like = step.init(params)
    ours_dir, dcp_dir = os.path.join(job.root, "ours"), os.path.join(job.root, "dcp")

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()  # done when the slowest rank is
        return time.perf_counter() - t0

    def ours_save() -> None:
        step.save(state, ours_dir, overwrite=True)

    def dcp_save() -> None:
        if rank == 0 and os.path.isdir(dcp_dir):
            shutil.rmtree(dcp_dir)
        dist.barrier()
        dcp.save(fs.checkpoint.dcp_state_dict(state, specs, mesh), checkpoint_id=dcp_dir)

    loaded: dict = {}

    def ours_load() -> None:
        loaded["ours"] = step.load(ours_dir, like)

    def dcp_load() -> None:
        loaded["dcp"] = fs.checkpoint.load_dcp(dcp_dir, like, specs, mesh)

    pending: dict = {}

    def ours_async() -> None:  # timed: until the call returns (training may go on)
        pending["ours"] = step.save_async(state, ours_dir + "-async", overwrite=True)

    def dcp_async() -> None:
        if rank == 0 and os.path.isdir(dcp_dir + "-async"):
            shutil.rmtree(dcp_dir + "-async")
        dist.barrier()
        pending["dcp"] = dcp.async_save(fs.checkpoint.dcp_state_dict(state, specs, mesh),
                                        checkpoint_id=dcp_dir + "-async")

    def ours_async_done() -> None:  # the call and the background write, to the end
        ours_async()
        pending.pop("ours").wait()

    def dcp_async_done() -> None:
        dcp_async()
        pending.pop("dcp").result()

    asyncs = [ours_async, dcp_async]
    saves, loads = [ours_save, dcp_save], [ours_load, dcp_load]
    ds_dir = os.path.join(job.root, "deepspeed")
    if job.deepspeed:
        engine = _deepspeed_engine(job, params, config)

        def ds_save() -> None:
            engine.save_checkpoint(ds_dir, tag="t")

        def ds_load() -> None:
            engine.load_checkpoint(ds_dir, tag="t")

        saves.append(ds_save)
        loads.append(ds_load)
    times: dict[str, list[float]] = {fn.__name__: [] for fn in saves + loads + asyncs}
    times.update(ours_async_done=[], dcp_async_done=[])
    for rd in range(job.rounds):
        for group in (saves, loads):
            k = rd % len(group)  # rotate who goes first
            for fn in group[k:] + group[:k]:
                times[fn.__name__].append(timed(fn))
        for fn in (asyncs if rd % 2 == 0 else asyncs[::-1]):
            times[fn.__name__].append(timed(fn))
            who = "ours" if fn is ours_async else "dcp"
            p = pending.pop(who)
            p.wait() if who == "ours" else p.result()
            dist.barrier()
        for fn in ((ours_async_done, dcp_async_done) if rd % 2 == 0 else (dcp_async_done, ours_async_done)):
            times[fn.__name__].append(timed(fn))
    # A step's cost while a save is written in the background (the save started just before
    # the steps, its wait() after them, untimed) against the same steps without one.
    g = torch.Generator().manual_seed(1)
    batch = {"tokens": torch.randint(0, config.vocab_size, (8, 65), generator=g)}
    train_state = _trained(step, params, config)
    times["steps_async"], times["steps_plain"] = [], []
    for rd in range(job.rounds):
        for with_save in ((True, False) if rd % 2 == 0 else (False, True)):
            p = step.save_async(train_state, ours_dir + "-bg", overwrite=True) if with_save else None
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(job.steps):
                train_state, m = step(train_state, batch)
            float(m["loss"])
            dt = (time.perf_counter() - t0) / job.steps
            if p is not None:
                p.wait()
            dist.barrier()
            times["steps_async" if with_save else "steps_plain"].append(dt)
    exact = {k: _same(v, state) for k, v in loaded.items()}
    shard_bytes = sum(x.numel() * x.element_size() for x in _leaves(state))
    sizes = {"ours": _bytes_under(ours_dir), "dcp": _bytes_under(dcp_dir)}
    if job.deepspeed:
        sizes["deepspeed"] = _bytes_under(ds_dir)
    return {"times": times, "exact": exact, "shard_bytes": shard_bytes, "bytes": sizes}


def _deepspeed_engine(job: Job, params: dict, config: gpt.GPTConfig):
    """DeepSpeed at ZeRO-3 on the same GPT (bench zero's set-up), after two steps, so its
    optimizer state is as large as ours."""
    from fsharded.bench import zero as Z

    Z._quiet_stdout()  # DeepSpeed's JIT build logs go to stderr: stdout is the report
    zj = Z.Job(model=dataclasses.asdict(config), batches=(), stages=(3,), micro=2,
               extensions_dir=job.extensions_dir)
    Z._init_deepspeed(zj)
    ds = Z._DeepSpeed(zj, 3, params)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, 65), generator=g)
    for _ in range(2):
        ds({}, {"tokens": tokens})
    return ds.engine


def two_ranks(job: Job) -> tuple[Section, dict]:
    from fsharded.testing import run_on_ranks

    res = run_on_ranks(rank_worker, 2, job)
    bad = [(r, k) for r, x in enumerate(res) for k, ok in x["exact"].items() if not ok]
    if bad:
        raise AssertionError(f"bench checkpoint: a load did not give the saved state back: {bad}")
    t, b = res[0]["times"], res[0]["bytes"]
    total = sum(x["shard_bytes"] for x in res)
    title = f"a ZeRO-3 training state ({total / 1e6:.1f} MB: fp32 weights + AdamW moments), 2 gloo ranks"
    note = (f"{job.rounds} rounds each, the order rotating; a round ends when the slower rank "
            f"returns; our and DCP's loads checked bit-exact against the saved state; ours also "
            f"writes a CRC-32 per block and verifies it on load")
    rows = [Row.from_samples(f"{w} (step.{w} vs dcp.{w})", "ZeRO-3 state", t[f"ours_{w}"], t[f"dcp_{w}"])
            for w in ("save", "load")]
    rows.append(Row.from_samples("async save, until the call returns (step.save_async vs "
                                 "dcp.async_save)", "ZeRO-3 state", t["ours_async"], t["dcp_async"]))
    rows.append(Row.from_samples("async save, until written (wait() vs Future.result())",
                                 "ZeRO-3 state", t["ours_async_done"], t["dcp_async_done"]))
    rows.append(Qty("bytes on disk", "whole checkpoint", b["ours"], b["dcp"], unit="B"))
    step_row = Row.from_samples("a ZeRO-3 step while save_async writes vs without a save",
                                "8x64 global", t["steps_async"], t["steps_plain"])
    sections = [Section(title=title, rows=tuple(rows), target=1.0, notes=(note,),
                        peer="torch.distributed.checkpoint (dcp.save / dcp.load of the state's "
                             "flat DTensor dict)")]
    sections.append(Section(
        title="the step-time overhead of saving in the background (the same state, 2 gloo ranks)",
        peer="the same steps with no save in flight", rows=(step_row,), target=1.05,
        notes=(f"{job.steps} steps timed per round, {job.rounds} rounds alternating; the save "
               f"starts just before the steps and is waited for after them",)))
    if "deepspeed" in b:
        rows = [Row.from_samples(f"{w} (step.{w} vs engine.{w}_checkpoint)", "ZeRO-3 state",
                                 t[f"ours_{w}"], t[f"ds_{w}"]) for w in ("save", "load")]
        rows.append(Qty("bytes on disk", "whole checkpoint", b["ours"], b["deepspeed"], unit="B"))
        sections.append(Section(
            title=title, rows=tuple(rows), target=1.0,
            notes=(note.replace("our and DCP's", "our"), "ours fsyncs its files and directories before "
                   "the rename that makes the checkpoint visible (a crash leaves the previous one "
                   "loadable); DeepSpeed's torch.save leaves the data in the page cache"),
            peer="DeepSpeed ZeRO-3 (the same GPT, bench zero's set-up): save_checkpoint / "
                 "load_checkpoint (its own format; module and optimizer state)"))
    for s in sections:
        for r in s.rows:
            _log(f"  {r.case}: ratio {r.ratio:.2f}")
    return sections, res[0]


def resharded(job: Job, rounds: int) -> Section:
    """Load the 2-rank checkpoints on one process at ZeRO-1 (every leaf whole)."""
    config = _config(job)
    step, params = _step(fs.Mesh({"data": 1}), 1, config)
    like = step.init(params)
    specs = step.state_specs(like)
    ours_dir, dcp_dir = os.path.join(job.root, "ours"), os.path.join(job.root, "dcp")
    out: dict = {}

    def ours() -> float:
        t0 = time.perf_counter()
        out["ours"] = step.load(ours_dir, like)
        return time.perf_counter() - t0

    def peer() -> float:
        t0 = time.perf_counter()
        out["dcp"] = fs.checkpoint.load_dcp(dcp_dir, like, specs, step.mesh)
        return time.perf_counter() - t0

    a, b = [], []
    for rd in range(rounds):
        for fn, sink in (((ours, a), (peer, b)) if rd % 2 == 0 else ((peer, b), (ours, a))):
            sink.append(fn())
    if not _same(out["ours"], out["dcp"]):
        raise AssertionError("bench checkpoint: the resharded loads differ between ours and DCP")
    row = Row.from_samples("load, 2 ranks ZeRO-3 -> 1 process ZeRO-1", "whole state", a, b)
    _log(f"  {row.case}: ratio {row.ratio:.2f}")
    return Section(
        title="resharding on load: the 2-rank checkpoint read into one process",
        peer="DCP loading its own checkpoint into the same layout (it reshards too)",
        rows=(row,), target=1.0,
        notes=(f"{rounds} alternating rounds; both loads give the same state",))


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or "fsharded bench checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few rounds (a smoke run)")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables")
    p.add_argument("--rounds", type=int, help="alternating rounds")
    p.add_argument("--dir", help="where to write the checkpoints (default: a temporary directory)")
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed (compared where installed)")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    d_model, layers, rounds = (32, 2, 2) if args.quick else (256, 8, 7)
    rounds = args.rounds or rounds
    root = tempfile.mkdtemp(prefix="fsharded-bench-ckpt-", dir=args.dir)
    try:
        with_ds = not args.no_deepspeed and importlib.util.find_spec("deepspeed") is not None
        job = Job(d_model, layers, rounds, root, deepspeed=with_ds,
                  extensions_dir=os.path.join(tempfile.gettempdir(), "fsharded-bench-zero-extensions"))
        config = _config(job)
        report = Report("checkpoint", params={
            "torch": torch.__version__,
            "model": f"GPT d={d_model} layers={layers}, {gpt.param_count(gpt.init(config, 0)):,} params",
            "disk": root})
        _log("2 gloo ranks ...")
        secs, _ = two_ranks(job)
        report.sections.extend(secs)
        _log("one process, resharded ...")
        report.sections.append(resharded(job, rounds))
        report.finish()
        report.print(markdown=args.markdown)
        return 0 if all(math.isfinite(r.ratio) for s in report.sections for r in s.rows) else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
