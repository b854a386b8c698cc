"""``fsharded bench zero``: ZeRO stages 0-3 side by side with DeepSpeed and FSDP2.

    fsharded bench zero                   # GPT "small" (0.84 M params), 2 gloo ranks
    fsharded bench zero --quick           # tiny model, few steps (smoke run)
    fsharded bench zero --no-deepspeed    # ours and FSDP2 only
    fsharded bench zero --stages 0,3 --markdown

Two gloo ranks (one torch thread each) train the same functional GPT (fp32, seq 128,
batch 8 per rank, AdamW lr 1e-3 weight decay 0.01, gradient clipping 1.0) on the same
batches from the same initial weights, at each ZeRO stage:

- ours: ``fs.train_step(gpt.loss, fs.optim.adamw(...), mesh=fs.Mesh({"data": 2}),
  param_specs=fs.parallel.zero(stage)(P(), params), clip=1.0, donate=True)`` (in-place
  updates through the fused C++ AdamW, as the peers update in place);
- DeepSpeed (when importable): the same model as an ``nn.Module`` whose parameters are the
  pytree leaves and whose forward calls ``gpt.loss`` (exactly the same math),
  ``deepspeed.initialize`` with ``zero_optimization.stage`` set, ``torch.optim.AdamW`` as
  the client optimizer, ``gradient_clipping`` 1.0; stage 3 builds the model under
  ``deepspeed.zero.Init`` with ``stage3_param_persistence_threshold: 0``, and (as ours and
  FSDP2 do by default) frees each block's weights after forward and gathers them again in
  backward: ``stage3_prefetch_bucket_size`` one block's parameters (prefetch one block
  ahead, like ours) and ``stage3_max_reuse_distance: 0``. Its defaults (a 5e7-element
  prefetch bucket, reuse distance 1e9) keep every gathered weight of a model this small
  from forward to backward: the ``--zero3-keep`` comparison;
- FSDP2 (``fully_shard`` on every block and the root, same module): the peer of stage 3,
  and with ``reshard_after_forward=False`` the stage-2-like peer;
- the floor, at stages 0-2: the same forward and backward by plain autograd, the flat
  gradient all-reduced (stage 0) or reduce-scattered with each rank updating its shard and
  all-gathering the weights (stages 1 and 2) over our transport, and our fused AdamW, with
  no bookkeeping (the same losses to ~1e-6): what an engine's step costs at best here.

Reported per stage and framework: the median step time (every framework timed in turn
in the same two processes, the order rotating each round), the bytes each rank sends per
step, and the peak RSS per rank (each framework and stage in fresh processes of its own,
since ``ru_maxrss`` is a per-process high-water mark). Bytes are counted the same way for
every framework: ``torch.distributed``'s collectives are wrapped (before DeepSpeed is
imported) and each call is charged the ring-algorithm bytes of ``fsharded/spmd/_prims.py``;
ours are also read from ``step.collectives(state, batch)`` and checked to agree. Every
framework's losses are printed next to ours: same init and data, so in fp32 they agree to
~1e-6 at the first step and stay close.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsharded.bench import Qty, Report, Row, Section, add_output_args, format_bytes
from fsharded.bench._zero_peers import ByteCounter, FunctionalGPT, _Floor

OURS = "fsharded"
DS = "DeepSpeed"
FSDP2 = "FSDP2"
FSDP2_NORESHARD = "FSDP2 (reshard_after_forward=False)"
FLOOR = "the floor"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the job -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """What every worker needs (picklable: it travels to the spawned ranks)."""

    model: dict  # GPTConfig fields
    batches: tuple  # global batches, {"tokens": (world * micro, T + 1)}
    stages: tuple[int, ...]
    micro: int = 8
    lr: float = 1e-3
    wd: float = 0.01
    clip: float = 1.0
    deepspeed: bool = True
    fsdp: bool = True
    extensions_dir: str = ""
    warmup: int = 3
    rounds: int = 7
    iters: int = 5
    counted: int = 2
    memory_stages: tuple[int, ...] = ()
    memory_steps: int = 3
    # ZeRO-3: keep gathered block weights from forward to backward (everyone) instead of
    # freeing them after forward and gathering again in backward (everyone).
    keep: bool = False
    # Our collectives between the two ranks over shared memory (False: gloo, as the peers).
    shm: bool = True

    def transport(self) -> None:
        """Select our collectives' transport in this worker (before its first collective)."""
        os.environ["FSHARDED_SHM"] = "1" if self.shm else "0"

    def config(self):
        from fsharded.models import gpt

        return gpt.GPTConfig(**self.model)

    def block_numel(self) -> int:
        """Parameters of one block of the model."""
        import optree

        from fsharded.models import gpt

        return sum(x.numel() for x in optree.tree_leaves(gpt.init(self.config(), 0)["blocks"][0]))

    def batch(self, i: int) -> tuple[dict, dict]:
        """Global batch ``i`` and this rank's ``micro`` rows of it: ``train_step`` takes the
        global batch and trains on its rows; the peers are given their rows directly."""
        import torch.distributed as dist

        g = self.batches[i % len(self.batches)]
        r = dist.get_rank()
        return g, {"tokens": g["tokens"][r * self.micro:(r + 1) * self.micro]}


class _Ours:
    def __init__(self, job: Job, stage: int, params: dict):
        import torch.distributed as dist

        import fsharded as fs
        from fsharded.models import gpt

        self.step_fn = fs.train_step(
            gpt.loss, fs.optim.adamw(job.lr, weight_decay=job.wd),
            mesh=fs.Mesh({"data": dist.get_world_size()}),
            param_specs=fs.parallel.zero(stage, reshard_after_forward=not job.keep)(fs.P(), params),
            clip=job.clip, donate=True, blocks="blocks")  # in place, as the peers' optimizers update
        self.state = self.step_fn.init(params)

    def __call__(self, global_batch: dict, local_batch: dict) -> torch.Tensor:
        # A step takes the global batch (the same on every rank) and trains on its rows.
        self.state, m = self.step_fn(self.state, global_batch)
        return m["loss"]  # already averaged over the ranks

    def manifest_bytes(self, global_batch: dict) -> int:
        return self.step_fn.collectives(self.state, global_batch).total_bytes()


def _deepspeed_config(job: Job, stage: int) -> dict:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        # Without it every parameter of a small model stays unpartitioned (PEERS.md).
        zero["stage3_param_persistence_threshold"] = 0
        if not job.keep:
            # Free each block's weights after its forward and gather them again in backward,
            # as ours and FSDP2 do: no reuse window, and a prefetch of one block ahead
            # (DeepSpeed keeps what its prefetch already fetched for a later use, so its
            # default 5e7-element bucket would keep every weight of a small model).
            zero["stage3_prefetch_bucket_size"] = job.block_numel()
            zero["stage3_max_reuse_distance"] = 0
    return {
        "train_micro_batch_size_per_gpu": job.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": job.clip,
        "zero_optimization": zero,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _client_adamw(params, job: Job) -> torch.optim.Optimizer:
    """torch.optim.AdamW with its fastest CPU implementation (fused; PEERS.md)."""
    return torch.optim.AdamW(params, lr=job.lr, weight_decay=job.wd, fused=True)


class _DeepSpeed:
    def __init__(self, job: Job, stage: int, params: dict):
        import deepspeed
        import torch.distributed as dist

        cfg = _deepspeed_config(job, stage)
        if stage == 3:
            with deepspeed.zero.Init(config_dict_or_path=cfg):
                model = FunctionalGPT(params)
            with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
                if dist.get_rank() == 0:
                    model.load_functional(params)
        else:
            model = FunctionalGPT(params)
        opt = _client_adamw(model.parameters(), job)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

    def __call__(self, global_batch: dict, local_batch: dict) -> torch.Tensor:
        loss = self.engine(local_batch["tokens"])
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()


class _FSDP2:
    _mesh = None

    def __init__(self, job: Job, reshard_after_forward: bool, params: dict):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if _FSDP2._mesh is None:
            _FSDP2._mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = FunctionalGPT(params)
        for b in model.blocks:
            fully_shard(b, mesh=_FSDP2._mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=_FSDP2._mesh, reshard_after_forward=reshard_after_forward)
        self.model = model
        self.opt = _client_adamw(model.parameters(), job)
        self.clip = job.clip

    def __call__(self, global_batch: dict, local_batch: dict) -> torch.Tensor:
        from fsharded.bench._zero_peers import module_step

        return module_step(self.model, self.opt, self.clip, local_batch["tokens"])


def _frameworks(job: Job, stage: int) -> list[str]:
    names = [OURS]
    if job.deepspeed:
        names.append(DS)
    if job.fsdp and stage == 3:
        names.append(FSDP2)
    if job.fsdp and stage == 2:
        names.append(FSDP2_NORESHARD)
    if stage in (0, 1, 2):
        names.append(FLOOR)
    return names


def _build(job: Job, name: str, stage: int):
    from fsharded.models import gpt

    params = gpt.init(job.config(), 0)
    if name == OURS:
        return _Ours(job, stage, params)
    if name == DS:
        return _DeepSpeed(job, stage, params)
    if name == FLOOR:
        return _Floor(job, params, sharded=stage > 0)
    return _FSDP2(job, name == FSDP2 and not job.keep, params)


def _init_deepspeed(job: Job) -> float:
    """Import DeepSpeed for the CPU and wrap the gloo group; seconds taken (the first use
    of an extensions dir includes JIT-building DeepSpeed's shared-memory comm op)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["TORCH_EXTENSIONS_DIR"] = job.extensions_dir
    t0 = time.perf_counter()
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    return time.perf_counter() - t0


def _quiet_stdout() -> None:
    """Spawned ranks write their logs (DeepSpeed's, JIT builds) to stderr: stdout is the
    report. DeepSpeed's calls of the deprecated all_gather_into_tensor would warn each step."""
    import warnings

    sys.stdout.flush()
    os.dup2(2, 1)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


# Modules whose first import during the training steps shows up in the peak RSS.
_WATCH = ("torch._dynamo", "torch._inductor", "sympy", "triton", "torch.distributed.fsdp",
          "torch.distributed.tensor", "deepspeed")


# -- workers (module level: run_on_ranks spawns them by name) -------------------------------


def time_worker(job: Job) -> dict:
    """Every framework of every stage in these processes: losses, bytes sent (counted over
    ``job.counted`` steps after the warm-up), then step times in rotating order."""
    import torch.distributed as dist

    job.transport()

    _quiet_stdout()
    counter = ByteCounter()  # before DeepSpeed keeps references to the collectives
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "stages": {}}
    if job.deepspeed:
        out["deepspeed_init_s"] = _init_deepspeed(job)
        out["threads_after_deepspeed"] = torch.get_num_threads()
    for stage in job.stages:
        names = _frameworks(job, stage)
        runners = {n: _build(job, n, stage) for n in names}
        losses: dict[str, list[float]] = {n: [] for n in names}
        times: dict[str, list[float]] = {n: [] for n in names}
        sent: dict[str, dict] = {}
        for i in range(job.warmup):
            for n in names:
                losses[n].append(float(runners[n](*job.batch(i))))
        for n in names:
            with counter.counting():
                for i in range(job.warmup, job.warmup + job.counted):
                    losses[n].append(float(runners[n](*job.batch(i))))
            sent[n] = {"bytes": counter.total() / job.counted,
                       "ops": {k: (counter.calls[k] / job.counted, counter.bytes[k] / job.counted)
                               for k in sorted(counter.calls)}}
        manifest = runners[OURS].manifest_bytes(job.batch(job.warmup)[0])
        for rd in range(job.rounds):
            first = job.warmup + job.counted + rd * job.iters
            k = rd % len(names)
            for n in names[k:] + names[:k]:
                dist.barrier()
                step_losses = []
                t0 = time.perf_counter()
                for i in range(first, first + job.iters):
                    step_losses.append(runners[n](*job.batch(i)))
                float(step_losses[-1])
                times[n].append((time.perf_counter() - t0) / job.iters)
                losses[n] += [float(x) for x in step_losses]
        out["stages"][stage] = {"times": times, "losses": losses, "sent": sent,
                                "manifest_bytes": manifest}
        del runners
    from fsharded.comm import _shm

    out["shm"] = _shm.in_use()
    return out


def memory_worker(job: Job, name: str, stage: int) -> dict:
    """One framework at one stage in fresh processes: peak RSS per rank."""
    job.transport()
    _quiet_stdout()
    if name == DS:
        _init_deepspeed(job)
    out: dict[str, Any] = {"rss_base_kb": _current_rss_kb()}
    loaded = set(sys.modules)
    runner = _build(job, name, stage)
    for i in range(job.memory_steps):
        float(runner(*job.batch(i)))
    out["peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["lazy_imports"] = [m for m in _WATCH if m in sys.modules and m not in loaded]
    return out


def _current_rss_kb() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except OSError:  # pragma: no cover - not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# -- reporting -------------------------------------------------------------------------------


def _peer_label(name: str, stage: int) -> str:
    if name == FLOOR:
        return f"ZeRO-{stage} vs the floor"
    if name == DS:
        return f"ZeRO-{stage} vs DeepSpeed ZeRO-{stage}"
    if name == FSDP2:
        return f"ZeRO-{stage} vs FSDP2 fully_shard"
    return f"ZeRO-{stage} vs FSDP2 fully_shard(reshard_after_forward=False)"


def _losses_note(stage: int, losses: dict[str, list[float]]) -> str:
    ours = losses[OURS]
    parts = []
    for n, ls in losses.items():
        seg = f"{n} {ls[0]:.5f} -> {ls[-1]:.5f}"
        if n != OURS:
            d1 = abs(ls[0] - ours[0])
            dmax = max(abs(a - b) for a, b in zip(ls, ours))
            seg += f" (|diff| step 1 {d1:.1e}, max {dmax:.1e})"
            if d1 > 1e-4:
                seg += " MISMATCH"
        parts.append(seg)
    return f"ZeRO-{stage} losses over {len(ours)} steps: " + "; ".join(parts)


def _mean_over_ranks(per_rank: list[list[float]]) -> list[float]:
    return [statistics.fmean(v) for v in zip(*per_rank)]


def _sent(timing: list[dict], stage: int, name: str) -> dict:
    """Bytes sent per step, mean over ranks, with the per-op breakdown."""
    per_rank = [t["stages"][stage]["sent"][name] for t in timing]
    ops = sorted({k for p in per_rank for k in p["ops"]})
    return {"bytes": statistics.fmean(p["bytes"] for p in per_rank),
            "ops": {k: tuple(statistics.fmean(p["ops"].get(k, (0, 0))[i] for p in per_rank)
                             for i in (0, 1)) for k in ops}}


def build_sections(job: Job, timing: list[dict], memory: dict, size: str,
                   nparams: int) -> list[Section]:
    stages = job.stages
    peers = [n for n in (DS, FSDP2, FSDP2_NORESHARD)
             if any(n in _frameworks(job, s) for s in stages)]
    sections = []
    rounds_note = (f"{job.rounds} rounds of {job.iters} steps per framework after {job.warmup} "
                   f"warm-up steps, every framework in the same 2 processes, the order rotating "
                   f"each round; per round the slower rank's time; median over rounds")
    loss_notes = []
    for stage in stages:
        losses = {}
        for n in _frameworks(job, stage):
            per_rank = [t["stages"][stage]["losses"][n] for t in timing]
            losses[n] = per_rank[0] if n == OURS else _mean_over_ranks(per_rank)
        loss_notes.append(_losses_note(stage, losses))
    floored = [s for s in stages if FLOOR in _frameworks(job, s)]
    if floored:  # the bound of a data-parallel step: time only
        rows = []
        for s in floored:
            t = [x["stages"][s]["times"] for x in timing]
            ours = [max(v) for v in zip(*(x[OURS] for x in t))]
            floor = [max(v) for v in zip(*(x[FLOOR] for x in t))]
            rows.append(Row.from_samples(_peer_label(FLOOR, s), size, ours, floor))
        sections.append(Section(
            title=f"step time, GPT {nparams:,} params fp32, 2 gloo ranks: fsharded vs the floor",
            peer=_peer_desc(FLOOR), rows=tuple(rows),
            notes=(rounds_note, *(loss_notes[stages.index(s)] for s in floored))))
    for peer in peers:
        peer_stages = [s for s in stages if peer in _frameworks(job, s)]
        # step time
        rows = []
        for s in peer_stages:
            t = [x["stages"][s]["times"] for x in timing]
            ours = [max(v) for v in zip(*(x[OURS] for x in t))]
            theirs = [max(v) for v in zip(*(x[peer] for x in t))]
            rows.append(Row.from_samples(_peer_label(peer, s), size, ours, theirs))
        notes = [rounds_note] + [n for s, n in zip(stages, loss_notes) if s in peer_stages]
        sections.append(Section(
            title=f"step time, GPT {nparams:,} params fp32, 2 gloo ranks: fsharded vs {peer}",
            peer=_peer_desc(peer, job.keep), rows=tuple(rows), target=1.0, notes=tuple(notes)))
        # bytes
        rows, notes = [], []
        for s in peer_stages:
            a, b = _sent(timing, s, OURS), _sent(timing, s, peer)
            ours = timing[0]["stages"][s]["manifest_bytes"]  # == a["bytes"], checked in main
            rows.append(Qty(_peer_label(peer, s), size, ours, b["bytes"], unit="B"))
            notes.append(f"ZeRO-{s}: ours {_ops(a['ops'])}; {peer} {_ops(b['ops'])}")
        if 3 in peer_stages and not job.keep:
            notes.append("ZeRO-3 re-gathers in backward: ours every block but the last (whose "
                         "backward follows its forward at once), DeepSpeed likewise (prefetch "
                         "one block ahead, reuse distance 0), FSDP2 every block")
        if 3 in peer_stages and job.keep:
            notes.append("--zero3-keep: ours reshard_after_forward=False and FSDP2 "
                         "reshard_after_forward=False keep gathered weights until backward, as "
                         "DeepSpeed's default ZeRO-3 settings do on a model this small")
        notes.append(
            "ours: step.collectives(state, batch).total_bytes(); the peer: torch.distributed's "
            "collectives wrapped and each call charged the same ring bytes as "
            "fsharded/spmd/_prims.py (all-reduce 2(n-1)/n x tensor, all-gather (n-1) x shard, "
            "reduce-scatter (n-1)/n x input, broadcast (n-1)/n x tensor), mean over ranks and "
            f"over {job.counted} steps after {job.warmup} warm-up steps; ours counted that way "
            "too gives the manifest's bytes (per-op breakdowns above are those counts)")
        sections.append(Section(
            title=f"bytes sent per rank per step: fsharded vs {peer}",
            peer=_peer_desc(peer, job.keep), rows=tuple(rows), target=1.0, notes=tuple(notes)))
        # memory
        rows, notes = [], []
        ds_init = " and deepspeed.init_distributed"
        for s in peer_stages:
            if (peer, s) not in memory:
                continue
            a, b = memory[(OURS, s)], memory[(peer, s)]
            rows.append(Qty(f"{_peer_label(peer, s)}: peak RSS", size,
                            a["peak_rss_kb"] * 1024, b["peak_rss_kb"] * 1024, unit="B"))
            rows.append(Qty(f"{_peer_label(peer, s)}: peak RSS above baseline", size,
                            a["above_base_kb"] * 1024, b["above_base_kb"] * 1024, unit="B"))
            notes.append(
                f"ZeRO-{s} baseline (RSS after imports{ds_init if peer == DS else ''}): "
                f"ours {format_bytes(a['rss_base_kb'] * 1024)}, "
                f"{peer} {format_bytes(b['rss_base_kb'] * 1024)}; "
                f"first imported while building and stepping: ours {_mods(a)}, {peer} {_mods(b)}")
        notes.append("ru_maxrss of each rank in fresh processes running only that framework "
                     "(max over ranks); the baseline is the RSS before the model is built, i.e. "
                     "torch + fsharded (+ deepspeed) imported and the process group up")
        if not rows:
            continue
        sections.append(Section(
            title=f"peak RSS per rank: fsharded vs {peer}",
            peer=_peer_desc(peer, job.keep), rows=tuple(rows), target=None, notes=tuple(notes)))
    shown = {s for p in peers for s in stages if p in _frameworks(job, s)}
    if len(stages) > 1 or not peers:  # our stages against each other (and any losses not shown)
        rows = []
        for s in stages:
            t = [x["stages"][s]["times"][OURS] for x in timing]
            t0 = [x["stages"][stages[0]]["times"][OURS] for x in timing]
            rows.append(Row.from_samples(f"ZeRO-{s} vs ZeRO-{stages[0]}", size,
                                         [max(v) for v in zip(*t)], [max(v) for v in zip(*t0)]))
        sections.append(Section(
            title="step time of our stages against each other", peer=f"our ZeRO-{stages[0]}",
            rows=tuple(rows),
            notes=tuple([rounds_note] + [n for s, n in zip(stages, loss_notes) if s not in shown])))
    return sections


def _mods(p: dict) -> str:
    return "+".join(p["lazy_imports"]) or "nothing watched"


def _ops(ops: dict) -> str:
    if not ops:
        return "no collectives"
    return ", ".join(f"{k} x{c:g} {format_bytes(b)}" for k, (c, b) in ops.items())


def _peer_desc(peer: str, keep: bool = False) -> str:
    if peer == FLOOR:
        return ("the floor: the same forward and backward by plain autograd on this rank's rows, "
                "the flat gradient reduced over our transport (stage 0: all-reduced; stages 1 and 2: "
                "reduce-scattered, each rank updating its shard of the flat weights and "
                "all-gathering them), the clipping factor from its norm and our fused C++ AdamW in "
                "place, with no checks, typing, agreement, key scope or metrics (an engine can only "
                "add to it)")
    if peer == DS:
        return ("DeepSpeed " + _ds_version() + " engine on the same model as an nn.Module "
                "(parameters = the pytree leaves, forward = gpt.loss), client optimizer "
                "torch.optim.AdamW(fused=True), gradient_clipping 1.0, default ZeRO settings "
                "(stage 3: zero.Init, stage3_param_persistence_threshold 0"
                + (")" if keep else ", re-gather in backward: stage3_prefetch_bucket_size = "
                   "one block, stage3_max_reuse_distance 0)"))
    reshard = "True (ZeRO-3-like)" if peer == FSDP2 and not keep else "False (ZeRO-2-like)"
    return ("torch.distributed.fsdp.fully_shard on each block and the root of the same "
            f"nn.Module, reshard_after_forward={reshard}, torch.optim.AdamW(fused=True), "
            "clip_grad_norm_ 1.0")


def _ds_version() -> str:
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:  # noqa: BLE001
        return "(version unknown)"


def deepspeed_available() -> tuple[bool, str]:
    """Whether ``import deepspeed`` would find the installed package (not a folder named
    ``deepspeed`` in the working directory, which shadows it)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        return False, "deepspeed is not installed"
    if spec.origin is None or not spec.origin.endswith("__init__.py"):
        where = list(spec.submodule_search_locations or [])
        return False, (f"a folder named deepspeed ({where}) shadows the package; run from "
                       f"another directory")
    return True, ""


# -- main ------------------------------------------------------------------------------------


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or "fsharded bench zero", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny model, few steps, peak RSS of the last stage only (smoke run)")
    add_output_args(p)
    p.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed peer")
    p.add_argument("--no-fsdp", action="store_true", help="skip the FSDP2 peer")
    p.add_argument("--no-shm", action="store_true",
                   help="our collectives over gloo too (default: over shared memory between "
                        "the ranks of this host, FSHARDED_SHM)")
    p.add_argument("--stages", default="0,1,2,3",
                   help="comma-separated ZeRO stages (default 0,1,2,3)")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7; quick 2)")
    p.add_argument("--iters", type=int, default=None,
                   help="steps per framework per round (default 5; quick 2)")
    p.add_argument("--d-model", type=int, default=None,
                   help="model width (default: GPT small's 128)")
    p.add_argument("--layers", type=int, default=None, help="blocks (default: GPT small's 4)")
    p.add_argument("--zero3-keep", action="store_true",
                   help="ZeRO-3 keeps gathered weights from forward to backward: ours "
                        "reshard_after_forward=False, DeepSpeed's default prefetch bucket and "
                        "reuse distance, FSDP2 "
                        "reshard_after_forward=False (default: every framework frees them after "
                        "forward and gathers again in backward)")
    p.add_argument("--jobs", type=int, default=2,
                   help="peak-RSS runs at a time, after the timing (default 2)")
    p.add_argument("--extensions-dir",
                   default=os.path.join(tempfile.gettempdir(), "fsharded-bench-zero-extensions"),
                   help="TORCH_EXTENSIONS_DIR for DeepSpeed's JIT builds (kept between runs)")
    return p


def _stages(text: str) -> tuple[int, ...]:
    try:
        stages = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        stages = ()
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise SystemExit(f"--stages: give a comma-separated subset of 0,1,2,3, got {text!r}")
    return tuple(dict.fromkeys(stages))


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    import fsharded as fs
    from fsharded.models import gpt
    from fsharded.testing import (
        run_on_new_ranks as run_on_ranks,  # fresh processes: clean peaks and caches
    )

    args = build_parser(prog).parse_args(argv)
    stages = _stages(args.stages)
    t_start = time.perf_counter()
    world, micro = 2, 8
    if args.quick:
        cfg = gpt.GPTConfig.tiny(vocab_size=256)
        source, rounds, iters, warmup, counted, mem_steps = "stdlib:200000", 2, 2, 2, 1, 2
        memory_stages = stages[-1:]
    else:
        cfg = gpt.GPTConfig.small()
        source, rounds, iters, warmup, counted, mem_steps = "stdlib", 7, 5, 3, 2, 3
        memory_stages = stages
    over = {k: v for k, v in (("d_model", args.d_model), ("n_layers", args.layers)) if v}
    if over:
        cfg = cfg.replace(**over)
    rounds, iters = args.rounds or rounds, args.iters or iters

    use_ds = not args.no_deepspeed
    notes = []
    if use_ds:
        use_ds, why = deepspeed_available()
        if not use_ds:
            _log(f"skipping DeepSpeed: {why}")
            notes.append(f"DeepSpeed skipped: {why}")
    data = fs.data.Batches(fs.data.load_tokens(source), world * micro, cfg.seq_len, seed=0)
    n_batches = warmup + counted + rounds * iters
    job = Job(model=dataclasses.asdict(cfg),
              batches=tuple(data.batch_at(i) for i in range(n_batches)),
              stages=stages, micro=micro, deepspeed=use_ds, fsdp=not args.no_fsdp,
              extensions_dir=args.extensions_dir, warmup=warmup, rounds=rounds, iters=iters,
              counted=counted, memory_stages=memory_stages, memory_steps=mem_steps,
              keep=args.zero3_keep, shm=not args.no_shm)
    nparams = gpt.param_count(gpt.init(cfg, 0))
    report = Report("zero", params={
        "torch": torch.__version__,
        "deepspeed": _ds_version() if use_ds else "not run",
        "model": f"GPT d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads} "
                 f"vocab={cfg.vocab_size} seq={cfg.seq_len}, {nparams:,} params, fp32",
        "batch": f"{micro} sequences per rank, {world} gloo ranks, 1 torch thread per rank",
    })

    _log(f"timing stages {','.join(map(str, stages))} on {world} gloo ranks ...")
    t0 = time.perf_counter()
    timing = run_on_ranks(time_worker, world, job)
    t_timing = time.perf_counter() - t0
    todo = [(n, s) for s in memory_stages for n in _frameworks(job, s) if n != FLOOR]
    _log(f"peak RSS: {len(todo)} fresh runs, {args.jobs} at a time ...")
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        memory = dict(zip(todo, pool.map(lambda ns: _memory(job, *ns), todo)))
    t_memory = time.perf_counter() - t0
    for s in stages:
        counted_ours = _sent(timing, s, OURS)["bytes"]
        manifest = timing[0]["stages"][s]["manifest_bytes"]
        if manifest != counted_ours:
            notes.append(f"ZeRO-{s}: our manifest says {manifest:,} bytes/rank/step, the "
                         f"torch.distributed count {counted_ours:,.0f}")
    size = f"{micro}x{cfg.seq_len}/rank"
    report.sections += build_sections(job, timing, memory, size, nparams)
    report.finish()
    t_total = time.perf_counter() - t_start
    report.params["threads per rank"] = timing[0]["threads"]
    report.params["fsharded collectives"] = (
        "same-host shared memory (C++, csrc/shm_comm.cpp); the peers use gloo"
        if timing[0]["shm"] else "gloo, as the peers" + (" (--no-shm)" if not job.shm else
                                                          " (shared memory unavailable)"))
    if use_ds:
        report.params["DeepSpeed setup"] = (
            f"import + init_distributed took {timing[0]['deepspeed_init_s']:.1f} s in the timing "
            f"processes (the first run with a TORCH_EXTENSIONS_DIR JIT-builds its shm comm op, "
            f"~1 min); threads per rank after it: {timing[0]['threads_after_deepspeed']}")
    if not notes:
        notes.append("our collective manifests match the torch.distributed count at every stage")
    report.params["notes"] = "; ".join(notes)
    report.params["wall time"] = (f"{t_total:.0f} s (timing processes {t_timing:.0f} s, "
                                  f"peak-RSS runs {t_memory:.0f} s, {args.jobs} at a time)")
    report.emit(args)
    return 0


def _memory(job: Job, name: str, stage: int) -> dict:
    from fsharded.testing import (
        run_on_new_ranks as run_on_ranks,  # fresh processes: clean peaks and caches
    )

    for attempt in range(2):  # a port taken by a concurrent run fails the first try
        try:
            per_rank = run_on_ranks(memory_worker, 2, job, name, stage)
            break
        except RuntimeError as e:
            if attempt or "address already in use" not in str(e).lower():
                raise
    return {
        "peak_rss_kb": max(p["peak_rss_kb"] for p in per_rank),
        "above_base_kb": max(p["peak_rss_kb"] - p["rss_base_kb"] for p in per_rank),
        "rss_base_kb": max(p["rss_base_kb"] for p in per_rank),
        "lazy_imports": sorted({m for p in per_rank for m in p["lazy_imports"]}),
    }


if __name__ == "__main__":
    sys.exit(main())
