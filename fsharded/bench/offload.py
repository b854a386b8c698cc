"""``fsharded bench offload``: the optimizer state in device memory, in host memory and in
NVMe files, ours beside DeepSpeed's ZeRO-Offload and ZeRO-Infinity.

    fsharded bench offload                          # GPT of ~110M parameters, 2 gloo ranks
    fsharded bench offload --quick                  # a small GPT, few steps (smoke run)
    fsharded bench offload --nvme-path /local_nvme  # where the NVMe tier's files go
    fsharded bench offload --no-deepspeed

Two gloo ranks (one torch thread each) train the same functional GPT (fp32, AdamW lr 1e-4
weight decay 0.01, clipping 1.0) at ZeRO-3 on the same batches, with the optimizer state:

- in device memory: ``fs.parallel.zero(3)``;
- in host memory: ``zero(3, offload_optimizer="cpu")``, and with the parameters there too
  (``offload_params="cpu"``);
- in files under ``--nvme-path``: ``zero(3, offload_optimizer="nvme", nvme_path=...)``;
- and with the parameters there too (ZeRO-Infinity): ``zero(3, offload_optimizer="nvme",
  offload_params="nvme", nvme_path=...)``;
- ZenFlow's overlapped update over the host tier: ``zero(3, offload_optimizer="cpu",
  zenflow=ZenFlow(0.1))``: a tenth of the rows updated at once, the rest one step stale in
  a thread beside the next step (other numbers from the second step on, by design); and
  the same over the NVMe tier (``offload_optimizer="nvme"``).

DeepSpeed (when importable) runs the same model as an ``nn.Module`` whose forward is
``gpt.loss``, at ZeRO-3 (built under ``deepspeed.zero.Init``, each block's weights freed
after forward), with its ``AdamW`` and ``offload_optimizer`` ``none``, ``cpu`` and ``nvme``
(DeepSpeedCPUAdam; its NVMe swapper needs its ``async_io`` op, which needs ``libaio``: where
that cannot be built the row says so), and ``offload_param`` ``cpu`` beside
``offload_optimizer`` ``cpu``. Its ``offload_param`` ``nvme`` is not run: its swapper wants
a buffer per parameter gathered at once (74 when the model is loaded, each the size of the
largest partition: 4 GB per rank here). On a CPU-only machine the "device" is host memory:
the host tier moves nothing out of RAM, and what it shows is the cost of its copies.

Each framework runs in fresh processes of its own (``ru_maxrss`` is a per-process
high-water mark): warm-up steps, then timed steps (the slowest rank's time per step, the
median), and the peak RSS of the rank that needs most (after the warm-up, every framework's
process hands the heap memory it freed back to the system, ``malloc_trim``, so the peak
counts what the framework holds, not what the allocator kept), and the resident set after
the timed steps (what each tier keeps in RAM between steps). The NVMe tier's bandwidth is
measured on the same disk in the same run: a large file written and read back by the same
I/O pool, ``O_DIRECT``, 4 MiB requests; against it, the time our NVMe update spent moving
the moments per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import logging
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsharded.bench import Qty, Report, Row, Section, add_output_args

TIERS = ("none", "cpu", "cpu+params", "nvme", "nvme+params", "zenflow", "zenflow+nvme")
OURS, DS = "fsharded", "DeepSpeed"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Job:
    model: dict
    ranks: int
    batches: tuple
    nvme_path: str
    micro: int = 2
    lr: float = 1e-4
    wd: float = 0.01
    clip: float = 1.0
    warmup: int = 1
    steps: int = 3
    extensions_dir: str = ""

    def params(self) -> dict:
        from fsharded.models import gpt

        return gpt.init(gpt.GPTConfig(**self.model), 0)

    def local(self, i: int) -> dict:
        import torch.distributed as dist

        b = self.batches[i % len(self.batches)]["tokens"]
        r = dist.get_rank()
        return {"tokens": b[r * self.micro:(r + 1) * self.micro]}

    def batch(self, i: int) -> dict:
        return self.batches[i % len(self.batches)]

    def block_numel(self) -> int:
        import optree

        return sum(x.numel() for x in optree.tree_leaves(self.params()["blocks"][0]))


class _Ours:
    def __init__(self, job: Job, tier: str) -> None:
        import fsharded as fs
        from fsharded import P
        from fsharded.models import gpt
        from fsharded.parallel.offload import ZenFlow

        params = job.params()
        kw = {} if tier == "none" else {"offload_optimizer": tier.split("+")[0], "nvme_path": job.nvme_path}
        if tier.endswith("+params"):
            kw["offload_params"] = kw["offload_optimizer"]
        if tier.startswith("zenflow"):
            kw = {"offload_optimizer": "nvme" if tier == "zenflow+nvme" else "cpu", "zenflow": ZenFlow(0.1),
                  "nvme_path": job.nvme_path}
        self.step = fs.train_step(gpt.loss, fs.optim.adamw(job.lr, weight_decay=job.wd), mesh=fs.Mesh({"data": job.ranks}),
                                  param_specs=fs.parallel.zero(3, **kw)(P(), params), clip=job.clip, donate=True,
                                  blocks="blocks")
        self.state = self.step.init(params)
        self.job = job

    def __call__(self, i: int) -> float:
        self.state, m = self.step(self.state, self.job.batch(i))
        return float(m["loss"])


class _DeepSpeed:
    def __init__(self, job: Job, tier: str) -> None:
        import deepspeed
        import torch.distributed as dist

        from fsharded.bench._zero_peers import FunctionalGPT

        zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "stage3_prefetch_bucket_size": job.block_numel(), "stage3_max_reuse_distance": 0}
        if tier != "none":
            device = tier.split("+")[0]
            zero["offload_optimizer"] = {"device": device, "nvme_path": job.nvme_path, "pin_memory": False}
            if tier.endswith("+params"):
                zero["offload_param"] = {"device": device, "nvme_path": job.nvme_path, "pin_memory": False}
        cfg = {"train_micro_batch_size_per_gpu": job.micro, "gradient_accumulation_steps": 1,
               "gradient_clipping": job.clip, "zero_optimization": zero, "steps_per_print": 1 << 30,
               "optimizer": {"type": "AdamW", "params": {"lr": job.lr, "weight_decay": job.wd}},
               "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                       "overlap_events": True}}
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = FunctionalGPT(job.params())
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            if dist.get_rank() == 0:
                model.load_functional(job.params())
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        self.job = job

    def __call__(self, i: int) -> float:
        import torch.distributed as dist

        loss = self.engine(self.job.local(i)["tokens"])
        self.engine.backward(loss)
        self.engine.step()
        mean = loss.detach().clone()  # the global batch's loss, as ours reports it
        dist.all_reduce(mean)
        return float(mean) / dist.get_world_size()


def _quiet() -> None:
    import warnings

    sys.stdout.flush()
    os.dup2(2, 1)  # the report is the parent's stdout
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=UserWarning)


def worker(job: Job, framework: str, tier: str) -> dict:
    """One framework and tier in these (fresh) processes: losses, step times, peak RSS, and
    for our NVMe tier the seconds and bytes of its state's streaming."""
    import torch.distributed as dist

    _quiet()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"rss_base_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    io = {"s": 0.0, "bytes": 0}
    if framework == DS:
        os.environ["DS_ACCELERATOR"] = "cpu"
        os.environ["TORCH_EXTENSIONS_DIR"] = job.extensions_dir
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")
        run: Any = _DeepSpeed(job, tier)
    else:
        from fsharded.parallel import offload

        streamed = offload.stream_update

        def timed(step, params, grads, moments, decay, off):
            t0 = time.perf_counter()
            try:
                return streamed(step, params, grads, moments, decay, off)
            finally:
                io["s"] += time.perf_counter() - t0
                io["bytes"] += 2 * sum(m.numel() * m.element_size() for ms in moments for m in ms)
                if off.params == "nvme":
                    io["bytes"] += 2 * sum(p.numel() * p.element_size() for p in params)

        offload.stream_update = timed
        run = _Ours(job, tier)
    losses, times = [], []
    for i in range(job.warmup):
        losses.append(run(i))
    out["init_peak_kb"] = _hwm_kb()  # building the model and the state, and the first step
    _trim()
    _reset_hwm()
    io["s"], io["bytes"] = 0.0, 0
    for i in range(job.warmup, job.warmup + job.steps):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(run(i))
        times.append(time.perf_counter() - t0)
    out.update(losses=losses, times=times, peak_rss_kb=_hwm_kb(),
               io_s=io["s"] / job.steps, io_bytes=io["bytes"] / job.steps)
    gc.collect()
    _trim()
    out["held_rss_kb"] = _status_kb("VmRSS") or 0  # what the process keeps between steps
    return out


def _status_kb(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``); None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:  # pragma: no cover - not Linux
        pass
    return None


def _hwm_kb() -> int:
    """This process's peak resident set (``VmHWM``) since it started or was last reset."""
    hwm = _status_kb("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _trim() -> None:
    """Give the heap memory this process freed back to the system (glibc's ``malloc_trim``;
    nothing elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


def _reset_hwm() -> None:
    """Start the peak anew from what is resident now (Linux: ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # pragma: no cover - not Linux, or not allowed
        pass


def disk_bandwidth(path: str, nbytes: int = 1 << 29, request: int = 1 << 22) -> tuple[float, float]:
    """Bytes/s writing then reading ``nbytes`` under ``path`` with the NVMe tier's own I/O
    pool (``O_DIRECT`` where allowed, ``request``-byte requests, all in flight)."""
    from fsharded.kernels import aio

    fname = os.path.join(path, "fsharded-bench-disk.bin")
    f = aio.File.create(fname, nbytes)
    try:
        bufs = [aio.aligned_empty(request) for _ in range(8)]
        for b in bufs:
            b.fill_(7)
        rates = []
        for write in (True, False):
            t0 = time.perf_counter()
            pend = []
            for k, off in enumerate(range(0, nbytes, request)):
                if len(pend) >= len(bufs):
                    pend.pop(0).wait()
                buf = bufs[k % len(bufs)]
                pend.append((f.write if write else f.read)(off, buf, min(request, nbytes - off), check=False))
            for p in pend:
                p.wait()
            if write:
                f.sync(drop=True)
            rates.append(nbytes / (time.perf_counter() - t0))
        return rates[0], rates[1]
    finally:
        f.close()
        os.unlink(fname)


def _deepspeed_nvme_ok(ext: str) -> tuple[bool, str]:
    """Whether DeepSpeed's async_io op (its NVMe swapper) builds here."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["TORCH_EXTENSIONS_DIR"] = ext
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        b = AsyncIOBuilder()
        if not b.is_compatible(verbose=False):
            return False, "DeepSpeed's async_io op is not compatible here (libaio-dev missing)"
        return True, ""
    except Exception as e:  # pragma: no cover - depends on the install
        return False, f"DeepSpeed's async_io op: {e}"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small GPT and few steps")
    p.add_argument("--nvme-path", default=None, help="directory for the NVMe tier (default: a temporary "
                   "directory on the disk holding the system's temp dir)")
    p.add_argument("--no-deepspeed", action="store_true", help="ours only")
    p.add_argument("--steps", type=int, default=None, help="timed steps per framework")
    add_output_args(p)
    return p


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    from fsharded.models import gpt
    from fsharded.testing import run_on_new_ranks

    args = build_parser(prog).parse_args(argv)
    if args.quick:
        model = dataclasses.asdict(gpt.GPTConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=4,
                                                 seq_len=128, tied_embeddings=False))
        steps = args.steps or 2
    else:  # ~110M parameters: GPT-2 small's width and depth, a 32k vocabulary
        model = dataclasses.asdict(gpt.GPTConfig(vocab_size=32768, d_model=768, n_layers=12, n_heads=12,
                                                 seq_len=128, tied_embeddings=False))
        steps = args.steps or 3
    root = args.nvme_path or tempfile.gettempdir()
    nvme = tempfile.mkdtemp(prefix="fsharded-bench-offload-", dir=root)
    ext = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(tempfile.gettempdir(), "fsharded-ds-ext")
    deepspeed = not args.no_deepspeed and importlib.util.find_spec("deepspeed") is not None
    g = torch.Generator().manual_seed(0)
    ranks, micro = 2, 2
    batches = tuple({"tokens": torch.randint(0, model["vocab_size"], (ranks * micro, model["seq_len"] + 1),
                                             generator=g)} for _ in range(4))
    job = Job(model=model, ranks=ranks, batches=batches, nvme_path=nvme, micro=micro, steps=steps, extensions_dir=ext)
    n_params = gpt.param_count(job.params())
    report = Report("offload", params={"torch": torch.__version__, "threads per rank": 1,
                                       "model": f"GPT {n_params / 1e6:.1f}M params (d_model={model['d_model']} "
                                                f"layers={model['n_layers']} vocab={model['vocab_size']} "
                                                f"seq={model['seq_len']}), fp32, ZeRO-3 over data=2",
                                       "deepspeed": deepspeed, "nvme path": root})
    try:
        _log("the disk ...")
        write_bw, read_bw = disk_bandwidth(nvme)
        runs: dict[tuple[str, str], Any] = {}
        ds_nvme, why = _deepspeed_nvme_ok(ext) if deepspeed else (False, "")
        for framework in (OURS, DS) if deepspeed else (OURS,):
            for tier in TIERS:
                if framework == DS and (tier in ("nvme+params", "zenflow", "zenflow+nvme")
                                        or (tier == "nvme" and not ds_nvme)):  # (see the module doc)
                    continue
                _log(f"{framework}, optimizer state {tier} ...")
                runs[(framework, tier)] = run_on_new_ranks(worker, ranks, job, framework, tier)
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    size = f"{n_params / 1e6:.0f}M params"
    report.sections += _sections(job, runs, size, (write_bw, read_bw), deepspeed, ds_nvme, why)
    report.finish()
    report.emit(args)
    return 0


def _step(runs: dict, key: tuple[str, str]) -> float:
    per_rank = [r["times"] for r in runs[key]]
    return statistics.median(max(ts) for ts in zip(*per_rank))


def _rss(runs: dict, key: tuple[str, str], what: str = "peak_rss_kb") -> float:
    return max(r[what] for r in runs[key]) * 1024.0


def _name(key: tuple[str, str]) -> str:
    fw, tier = key
    if tier.endswith("+params"):
        return f"{fw}, parameters and optimizer state " + ("on NVMe" if tier.startswith("nvme") else "in host memory")
    if tier.startswith("zenflow"):
        return f"{fw}, ZenFlow over the " + ("NVMe tier" if tier == "zenflow+nvme" else "host tier")
    return f"{fw}, optimizer state " + {"none": "in memory", "cpu": "in host memory", "nvme": "on NVMe"}[tier]


def _sections(job: Job, runs: dict, size: str, disk: tuple[float, float], deepspeed: bool, ds_nvme: bool,
              why: str) -> list[Section]:
    o = {t: (OURS, t) for t in TIERS}
    d = {t: (DS, t) for t in TIERS if (DS, t) in runs}
    ref = runs[o["none"]][-1]["losses"][0]
    tol = {OURS: 0.0, DS: 1e-3}  # our tiers: the same numbers; DeepSpeed: the same model, its own kernels
    losses = "; ".join(f"{_name(k)} {runs[k][-1]['losses'][0]:.5f}"
                       + (" MISMATCH" if abs(runs[k][-1]["losses"][0] - ref) > tol[k[0]] else "") for k in runs)
    notes = [f"first-step losses: {losses}",
             f"{job.warmup} warm-up step, then {job.steps} timed steps per framework, each framework in fresh "
             f"processes; per step the slowest rank's time, the median"]
    if deepspeed and not ds_nvme:
        notes.append(f"DeepSpeed's NVMe offload not run: {why}")
    out = [Section(title=f"step time, NVMe offload against the state in memory, {job.ranks} gloo ranks",
                   peer="ours with the optimizer state in memory, the same step", target=1.3,
                   rows=(Row(f"{_name(o['nvme'])} vs in memory", size, _step(runs, o["nvme"]),
                             _step(runs, o["none"])),
                         Row(f"{_name(o['nvme+params'])} vs in memory", size, _step(runs, o["nvme+params"]),
                             _step(runs, o["none"])),
                         Row(f"{_name(o['cpu'])} vs in memory", size, _step(runs, o["cpu"]),
                             _step(runs, o["none"])),
                         Row(f"{_name(o['cpu+params'])} vs in memory", size, _step(runs, o["cpu+params"]),
                             _step(runs, o["none"])),
                         Row(f"{_name(o['zenflow'])} vs in memory", size, _step(runs, o["zenflow"]),
                             _step(runs, o["none"])),
                         Row(f"{_name(o['zenflow'])} vs the exact host tier", size, _step(runs, o["zenflow"]),
                             _step(runs, o["cpu"])),
                         Row(f"{_name(o['zenflow+nvme'])} vs the exact NVMe tier", size,
                             _step(runs, o["zenflow+nvme"]), _step(runs, o["nvme"]))), notes=tuple(notes))]
    if d:
        rows = tuple(Row(f"{_name(o[t])} vs {_name(d[t])}", size, _step(runs, o[t]), _step(runs, d[t])) for t in d)
        out.append(Section(title=f"step time against DeepSpeed, {job.ranks} gloo ranks",
                           peer="DeepSpeed ZeRO-3 with the same offload_optimizer device", target=0.8, rows=rows))
    rss = [Qty(f"{_name(o['nvme'])} vs in memory", size, _rss(runs, o["nvme"]), _rss(runs, o["none"]), unit="B"),
           Qty(f"{_name(o['nvme+params'])} vs in memory", size, _rss(runs, o["nvme+params"]), _rss(runs, o["none"]),
               unit="B"),
           Qty(f"{_name(o['cpu'])} vs in memory", size, _rss(runs, o["cpu"]), _rss(runs, o["none"]), unit="B"),
           Qty(f"{_name(o['cpu+params'])} vs in memory", size, _rss(runs, o["cpu+params"]), _rss(runs, o["none"]),
               unit="B"),
           Qty(f"{_name(o['zenflow'])} vs in memory", size, _rss(runs, o["zenflow"]), _rss(runs, o["none"]),
               unit="B"),
           Qty(f"{_name(o['zenflow+nvme'])} vs in memory", size, _rss(runs, o["zenflow+nvme"]),
               _rss(runs, o["none"]), unit="B")]
    rss += [Qty(f"{_name(o[t])} vs {_name(d[t])}", size, _rss(runs, o[t]), _rss(runs, d[t]), unit="B") for t in d]
    init = "; ".join(f"{_name(k)} {max(r['init_peak_kb'] for r in runs[k]) * 1024 / 1e9:.2f} GB" for k in runs)
    out.append(Section(title="peak RSS of the rank that needs most, while training", target=0.4,
                       peer="ours in memory (first rows), DeepSpeed (the others)", rows=tuple(rss),
                       notes=("the peak resident set (VmHWM) of each rank's process over the timed steps, started "
                              "anew after the warm-up step and malloc_trim (the process's imports and what it keeps "
                              "count; the peaks of building the model and the state do not); on a CPU-only machine "
                              "the host tier stays in the same RAM",
                              f"the peak up to the end of the warm-up step (building the model and the state, the "
                              f"first step): {init}")))
    if DS in {k[0] for k in runs}:
        out[-1] = dataclasses.replace(out[-1], notes=out[-1].notes + (
            "DeepSpeed's offload_param on NVMe (a swap buffer per parameter gathered at once, each as large as the "
            "largest partition) and its ZenFlow (stages 1-2, a CUDA device) are not run here",))
    held = tuple(Qty(f"{_name(o[t])} vs in memory", size, _rss(runs, o[t], "held_rss_kb"),
                     _rss(runs, o["none"], "held_rss_kb"), unit="B") for t in TIERS if t != "none")
    held += tuple(Qty(f"{_name(o[t])} vs {_name(d[t])}", size, _rss(runs, o[t], "held_rss_kb"),
                      _rss(runs, d[t], "held_rss_kb"), unit="B") for t in d)
    out.append(Section(title="RSS between steps of the rank that holds most: what each tier keeps in RAM",
                       peer="ours in memory (first rows), DeepSpeed (the others)", rows=held,
                       notes=("the resident set (VmRSS) after the timed steps, garbage collected and the heap "
                              "trimmed: the training state a tier leaves in memory, the process itself, and none of "
                              "a step's transients (activations, gathered weights, unreduced gradients), which the "
                              "peak above counts",)))
    io_s = statistics.median(r["io_s"] for r in runs[o["nvme"]])
    io_b = max(r["io_bytes"] for r in runs[o["nvme"]])
    # Every rank streams its state at once, to the same disk: the floor is the time the disk
    # takes for all ranks' bytes (as much read as written).
    floor = job.ranks * (io_b / 2 / disk[1] + io_b / 2 / disk[0])
    out.append(Section(title="the NVMe tier's update against the disk", target=1.25,
                       peer="the disk's floor for the same bytes, every rank's (they share the disk): each read "
                            "at the measured read rate, each write at the write rate", rows=(Row("our NVMe update's time per step (moments read, "
                                                           "updated, written)", f"{io_b / 1e6:.0f} MB moved",
                                                           io_s, floor),),
                       notes=(f"the disk, measured in this run with the same I/O pool (O_DIRECT, 4 MiB requests): "
                              f"write {disk[0] / 1e9:.2f} GB/s, read {disk[1] / 1e9:.2f} GB/s",
                              f"our update moved {io_b / 1e6:.0f} MB per step per rank in {io_s * 1e3:.0f} ms, "
                              f"{job.ranks} ranks at once: {job.ranks * io_b / max(io_s, 1e-9) / 1e9:.2f} GB/s, the "
                              f"update's kernel and copies included; "
                              f"target: at least 80% of the disk's (ratio <= 1.25)")))
    return out


if __name__ == "__main__":
    sys.exit(main())
