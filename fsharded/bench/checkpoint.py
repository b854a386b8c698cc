"""``fsharded bench checkpoint``: saving and loading a training state, against DCP and DeepSpeed.

    fsharded bench checkpoint                  # GPTs of ~5 M and ~50 M params, AdamW state
    fsharded bench checkpoint --sizes 5m       # one of them
    fsharded bench checkpoint --quick          # tiny model, a smoke run
    fsharded bench checkpoint --markdown

The state is a ``train_step`` state at ZeRO-3 (fp32 master weights, AdamW moments, step
and key). On 2 gloo ranks (each holding half of it): ``step.save`` / ``step.load`` (the
spec-addressed format of ``fsharded.checkpoint``: each rank writes its own shards,
checksummed, fsynced, into a temporary directory renamed when complete) against
``torch.distributed.checkpoint`` (DCP: ``dcp.save`` / ``dcp.load`` of the same state as its
flat dict of DTensors, what FSDP2 and torchtitan write) and, where installed, DeepSpeed's
``save_checkpoint`` / ``load_checkpoint`` of the same GPT at ZeRO-3, each timed from the
call on every rank to the slowest rank's return, rounds alternating; bytes on disk beside;
the step time while a save is written in the background. Resharding: the 2-rank
checkpoint loaded into one process at ZeRO-1, and a checkpoint saved on 4 ranks at ZeRO-3
loaded on 2 ranks at ZeRO-1, against DCP loading its own checkpoints into the same
layouts. Each load is checked to give the saved values back exactly. Page cache: every
timed call starts with the checkpoints' files synced and evicted from it
(``posix_fadvise(DONTNEED)``, which needs no root), so loads read from the disk, as a
resume in a new job does, and no peer reads what another left cached.
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
from fsharded.bench import Qty, Report, Row, Section, add_output_args
from fsharded.models import gpt


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


STEPS = 3  # training steps per timed round, with a save in the background or without
STEP_ROUNDS = 15  # at least, for the step-time rows (a step varies by ~10% here, a save costs ~5%)
SIZES = {"5m": (256, 6), "50m": (640, 10)}  # d_model, layers: 4.8 M and 49.5 M params


@dataclass(frozen=True)
class Job:
    d_model: int
    layers: int
    rounds: int
    root: str
    label: str = ""  # the size column
    steps: int = STEPS  # training steps timed with and without a save in the background
    step_rounds: int = STEP_ROUNDS  # at least this many rounds of them
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


def _cold(root: str) -> None:
    """Every file under ``root`` on the disk and out of the page cache (clean pages are
    dropped by DONTNEED; where the OS has no fadvise, nothing)."""
    os.sync()
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for d, _, names in os.walk(root):
        for n in names:
            try:
                fd = os.open(os.path.join(d, n), os.O_RDONLY)
            except OSError:  # removed meanwhile
                continue
            try:
                advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


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
        # Each call starts on a clean page cache: no replaced checkpoint still being removed,
        # no dirty pages of an earlier call (another writer's, left for the kernel to flush
        # later) written back while this one runs.
        fs.checkpoint._api._wait_removals()
        _cold(job.root)
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
    # DCP's async_save runs its collectives in its thread: on the default group they would
    # interleave with this thread's barriers in a different order on each rank (a hang);
    # a group of its own, as torchtitan gives it.
    dcp_group = dist.new_group(backend="gloo")

    def ours_async() -> None:  # timed: until the call returns (training may go on)
        pending["ours"] = step.save_async(state, ours_dir + "-async", overwrite=True)

    def dcp_async() -> None:
        if rank == 0 and os.path.isdir(dcp_dir + "-async"):
            shutil.rmtree(dcp_dir + "-async")
        dist.barrier()
        pending["dcp"] = dcp.async_save(fs.checkpoint.dcp_state_dict(state, specs, mesh),
                                        checkpoint_id=dcp_dir + "-async", process_group=dcp_group)

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

        def ds_save_durable() -> None:  # the same, on disk when it returns, as ours is
            engine.save_checkpoint(ds_dir, tag="t")
            os.sync()

        saves.append(ds_save)
        saves.append(ds_save_durable)
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
    exact = {k: _same(v, state) for k, v in loaded.items()}
    shard_bytes = sum(x.numel() * x.element_size() for x in _leaves(state))
    sizes = {"ours": _bytes_under(ours_dir), "dcp": _bytes_under(dcp_dir)}
    if job.deepspeed:
        sizes["deepspeed"] = _bytes_under(ds_dir)
    return {"times": times, "exact": exact, "shard_bytes": shard_bytes, "bytes": sizes}


def steps_worker(job: Job) -> dict:
    """A step's cost while a save is written in the background against the same steps
    without one, in processes that run nothing else (no peer's threads or memory around):
    timed from the save_async call (the copy it blocks for counts) through the steps to its
    wait(), on a batch the step has already run once (the first call on a new batch shape
    costs more and would land in one bucket only)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    config = _config(job)
    step, params = _step(fs.Mesh({"data": dist.get_world_size()}), 3, config)
    ours_dir = os.path.join(job.root, "ours")
    times: dict[str, list[float]] = {}
    g = torch.Generator().manual_seed(1)
    batch = {"tokens": torch.randint(0, config.vocab_size, (8, 65), generator=g)}
    train_state = _trained(step, params, config)
    train_state, m = step(train_state, batch)
    step.save_async(train_state, ours_dir + "-bg", overwrite=True).wait()  # the staging arena made
    times["steps_async"], times["steps_plain"] = [], []
    for rd in range(max(job.rounds, job.step_rounds)):
        for with_save in ((True, False) if rd % 2 == 0 else (False, True)):
            fs.checkpoint._api._wait_removals()
            os.sync()
            dist.barrier()
            t0 = time.perf_counter()
            p = step.save_async(train_state, ours_dir + "-bg", overwrite=True) if with_save else None
            for _ in range(job.steps):
                train_state, m = step(train_state, batch)
            float(m["loss"])
            if p is not None:
                p.wait()
            dt = (time.perf_counter() - t0) / job.steps
            dist.barrier()
            times["steps_async" if with_save else "steps_plain"].append(dt)
    return times


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


def two_ranks(job: Job) -> dict[str, list]:
    """Rows of the 2-rank runs: {"dcp": ..., "deepspeed": ..., "steps": ...}."""
    from fsharded.testing import (
        run_on_new_ranks as run_on_ranks,  # fresh processes: clean peaks and caches
    )

    res = run_on_ranks(rank_worker, 2, job)
    steps = run_on_ranks(steps_worker, 2, job)[0]
    bad = [(r, k) for r, x in enumerate(res) for k, ok in x["exact"].items() if not ok]
    if bad:
        raise AssertionError(f"bench checkpoint: a load did not give the saved state back: {bad}")
    t, b = res[0]["times"], res[0]["bytes"]
    size = f"{job.label}, {sum(x['shard_bytes'] for x in res) / 1e6:.3g} MB"
    out: dict[str, list] = {"dcp": [Row.from_samples(f"{w} (step.{w} vs dcp.{w})", size, t[f"ours_{w}"],
                                                     t[f"dcp_{w}"]) for w in ("save", "load")]}
    out["dcp"].append(Row.from_samples("async save, until the call returns (step.save_async vs "
                                       "dcp.async_save)", size, t["ours_async"], t["dcp_async"]))
    out["dcp"].append(Row.from_samples("async save, until written (wait() vs Future.result())",
                                       size, t["ours_async_done"], t["dcp_async_done"]))
    out["dcp"].append(Qty("bytes on disk", size, b["ours"], b["dcp"], unit="B"))
    out["steps"] = [Row.from_samples("a ZeRO-3 step (8x64 global) while save_async writes vs without a save",
                                     size, steps["steps_async"], steps["steps_plain"])]
    if "deepspeed" in b:
        out["deepspeed"] = [Row.from_samples(f"{w} (step.{w} vs engine.{w}_checkpoint)", size,
                                             t[f"ours_{w}"], t[f"ds_{w}"]) for w in ("save", "load")]
        out["deepspeed"].append(Row.from_samples("save, both on disk at return (step.save vs "
                                                 "save_checkpoint + os.sync)", size, t["ours_save"],
                                                 t["ds_save_durable"]))
        out["deepspeed"].append(Qty("bytes on disk", size, b["ours"], b["deepspeed"], unit="B"))
    for rows in out.values():
        for r in rows:
            _log(f"  {r.case} [{r.size}]: ratio {r.ratio:.2f}")
    return out


def resharded(job: Job, rounds: int) -> Row:
    """Load the 2-rank checkpoints on one process at ZeRO-1 (every leaf whole)."""
    config = _config(job)
    step, params = _step(fs.Mesh({"data": 1}), 1, config)
    like = step.init(params)
    specs = step.state_specs(like)
    ours_dir, dcp_dir = os.path.join(job.root, "ours"), os.path.join(job.root, "dcp")
    out: dict = {}

    def ours() -> float:
        _cold(job.root)
        t0 = time.perf_counter()
        out["ours"] = step.load(ours_dir, like)
        return time.perf_counter() - t0

    def peer() -> float:
        _cold(job.root)
        t0 = time.perf_counter()
        out["dcp"] = fs.checkpoint.load_dcp(dcp_dir, like, specs, step.mesh)
        return time.perf_counter() - t0

    a, b = [], []
    for rd in range(rounds):
        for fn, sink in (((ours, a), (peer, b)) if rd % 2 == 0 else ((peer, b), (ours, a))):
            sink.append(fn())
    if not _same(out["ours"], out["dcp"]):
        raise AssertionError("bench checkpoint: the resharded loads differ between ours and DCP")
    row = Row.from_samples("load, 2 ranks ZeRO-3 -> 1 process ZeRO-1", job.label, a, b)
    _log(f"  {row.case} [{row.size}]: ratio {row.ratio:.2f}")
    return row


def save_on_four(job: Job) -> None:
    """On 4 ranks: the ZeRO-3 state saved with ours and with DCP (for ``load_on_two``)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    config = _config(job)
    mesh = fs.Mesh({"data": dist.get_world_size()})
    step, params = _step(mesh, 3, config)
    state = _trained(step, params, config)
    step.save(state, os.path.join(job.root, "ours-4"), overwrite=True)
    dcp.save(fs.checkpoint.dcp_state_dict(state, step.state_specs(state), mesh),
             checkpoint_id=os.path.join(job.root, "dcp-4"))


def load_on_two(job: Job) -> dict:
    """On 2 ranks at ZeRO-1: the 4-rank checkpoints loaded, ours and DCP alternating."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    config = _config(job)
    mesh = fs.Mesh({"data": dist.get_world_size()})
    step, params = _step(mesh, 1, config)
    like = step.init(params)
    specs = step.state_specs(like)
    got: dict = {}
    times: dict[str, list[float]] = {"ours": [], "dcp": []}

    def ours() -> None:
        got["ours"] = step.load(os.path.join(job.root, "ours-4"), like)

    def peer() -> None:
        got["dcp"] = fs.checkpoint.load_dcp(os.path.join(job.root, "dcp-4"), like, specs, mesh)

    for rd in range(job.rounds):
        for name, fn in ((("ours", ours), ("dcp", peer)) if rd % 2 == 0 else (("dcp", peer), ("ours", ours))):
            if dist.get_rank() == 0:
                _cold(job.root)
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    return {"times": times, "same": _same(got["ours"], got["dcp"])}


def four_to_two(job: Job) -> Row:
    from fsharded.testing import (
        run_on_new_ranks as run_on_ranks,  # fresh processes: clean peaks and caches
    )

    run_on_ranks(save_on_four, 4, job)
    res = run_on_ranks(load_on_two, 2, job)
    if not all(r["same"] for r in res):
        raise AssertionError("bench checkpoint: the 4 -> 2 rank loads differ between ours and DCP")
    t = res[0]["times"]
    row = Row.from_samples("load, 4 ranks ZeRO-3 -> 2 ranks ZeRO-1", job.label, t["ours"], t["dcp"])
    _log(f"  {row.case} [{row.size}]: ratio {row.ratio:.2f}")
    return row


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or "fsharded bench checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few rounds (a smoke run)")
    p.add_argument("--sizes", default="5m,50m", help=f"comma-separated model sizes of {sorted(SIZES)}")
    add_output_args(p)
    p.add_argument("--rounds", type=int, help="alternating rounds (default: 7 at 5m, 3 at 50m)")
    p.add_argument("--dir", help="where to write the checkpoints (default: a temporary directory)")
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed (compared where installed)")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    names = [n.strip().lower() for n in args.sizes.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown or not names:
        parser.error(f"--sizes: {', '.join(unknown) or 'none given'}; choose from {', '.join(SIZES)}")
    sizes = [(32, 2, 2)] if args.quick else [(*SIZES[n], 7 if n == "5m" else 3) for n in names]
    step_rounds = 2 if args.quick else STEP_ROUNDS
    with_ds = not args.no_deepspeed and importlib.util.find_spec("deepspeed") is not None
    rows: dict[str, list] = {"dcp": [], "deepspeed": [], "steps": [], "reshard": []}
    models, rounds_used = [], []
    for d_model, layers, rounds in sizes:
        rounds = args.rounds or rounds
        rounds_used.append(rounds)
        root = tempfile.mkdtemp(prefix="fsharded-bench-ckpt-", dir=args.dir)
        try:
            job = Job(d_model, layers, rounds, root, deepspeed=with_ds, step_rounds=step_rounds,
                      extensions_dir=os.path.join(tempfile.gettempdir(), "fsharded-bench-zero-extensions"))
            n = gpt.param_count(gpt.init(_config(job), 0))
            job = dataclasses.replace(job, label=f"{n / 1e6:.3g} M params")
            models.append(f"GPT d={d_model} layers={layers}, {n:,} params")
            _log(f"{job.label}: 2 gloo ranks ...")
            for k, v in two_ranks(job).items():
                rows[k].extend(v)
            _log(f"{job.label}: resharded into one process, and 4 ranks -> 2 ...")
            rows["reshard"].append(resharded(job, rounds))
            rows["reshard"].append(four_to_two(job))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    report = Report("checkpoint", params={"torch": torch.__version__, "models": "; ".join(models),
                                          "disk": args.dir or tempfile.gettempdir()})
    rounds_note = f"{'/'.join(map(str, rounds_used))} rounds each (by size), the order rotating"
    note = (f"{rounds_note}; a round ends when the slower rank returns; loads checked bit-exact "
            f"against the saved state; ours writes a CRC-32C per block and verifies it on load, and "
            f"fsyncs its files and directories before the rename that makes the checkpoint visible")
    report.sections.append(Section(
        title="a ZeRO-3 training state (fp32 weights + AdamW moments), 2 gloo ranks",
        peer="torch.distributed.checkpoint (dcp.save / dcp.load of the state's flat DTensor dict)",
        rows=tuple(rows["dcp"]), target=1.0, notes=(note,)))
    if rows["deepspeed"]:
        report.sections.append(Section(
            title="the same, against DeepSpeed", rows=tuple(rows["deepspeed"]), target=1.0,
            notes=(note, "DeepSpeed's torch.save leaves its files in the page cache (no fsync): a "
                   "power loss after it returns may lose them; the durable row adds os.sync() to its "
                   "save (every call starts with no dirty pages, so that syncs DeepSpeed's files only)"),
            peer="DeepSpeed ZeRO-3 (the same GPT, bench zero's set-up): save_checkpoint / "
                 "load_checkpoint (its own format; module and optimizer state)"))
    report.sections.append(Section(
        title="the step-time overhead of saving in the background (the same state, 2 gloo ranks)",
        peer="the same steps with no save in flight", rows=tuple(rows["steps"]), target=1.05,
        notes=(*(f"{r.size}: a save costs the loop {(r.ours_s - r.peer_s) * STEPS * 1e3:+.0f} ms, "
                 f"{(r.ours_s - r.peer_s) * STEPS / r.peer_s:+.0%} of one step" for r in rows["steps"]),
               f"{STEPS} steps timed per round, at least {step_rounds} rounds alternating, medians; timed from "
               f"the save_async call (the copy it blocks for included) to its wait() after the steps; "
               f"the copy goes into the staging memory the step keeps from its previous save",)))
    report.sections.append(Section(
        title="resharding on load: checkpoints read into another mesh and stage",
        peer="DCP loading its own checkpoint into the same layout (it reshards too)",
        rows=tuple(rows["reshard"]), target=1.0,
        notes=(f"{rounds_note}; ours and DCP's loads give the same state",)))
    report.finish()
    report.emit(args)
    return 0 if all(math.isfinite(r.ratio) for s in report.sections for r in s.rows) else 1
