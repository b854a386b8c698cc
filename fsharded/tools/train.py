"""The main job: train the bundled GPT with ``train_step``.

    fsharded train                                   # defaults: ~1 min on a 2-core CPU
    fsharded train --mesh data=2,tensor=2 --steps 200 --precision bf16
    fsharded train --config run.toml --set optimizer.lr=1e-3
    fsharded train --deepspeed-config ds_config.json
    torchrun --nproc_per_node 2 -m fsharded.train --mesh data=2

On one process it runs on the virtual mesh; under ``torchrun`` on real ranks (gloo on
CPU, NCCL on GPU), with the same numbers. Writes a JSONL metrics file when asked and
prints a summary: losses, throughput, parameters, mesh and per-step collective bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import optree
import torch

import fsharded as fs
from fsharded import config as C
from fsharded import optim
from fsharded.config import _deepspeed as ds_config
from fsharded.models import GPTConfig, gpt, gpt_plans
from fsharded.parallel import sequence
from fsharded.step import _estimate as _memory
from fsharded.tools import _train_loop, _train_resume
from fsharded.tools import flops as FL
from fsharded.tools._train_pipeline import check_fits_pipelined, pipeline_loss
from fsharded.tools._train_resume import LENGTH_PARAM, RESUME_CHANGES, lr_schedule, schedule_record

# What `fsharded train` runs with no arguments: the "small" GPT (0.84 M parameters) on
# stdlib bytes, data-parallel over 2 virtual devices, its step compiled (300 steps: compile
# "auto" applies); about a minute on 2 cores the first time, half that with Inductor's cache.
JOB_DEFAULTS: dict[str, Any] = {
    "model": {"preset": "small"},
    "mesh": {"data": 2},
    "steps": 300,
    "micro_batch_size": 8,
    "seq_len": 128,
    "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1},
    "scheduler": {"name": "WarmupCosineLR",
                  "params": {"total_num_steps": 300, "warmup_num_steps": 30, "cos_min_ratio": 0.1,
                             "warmup_type": "linear"}},
    "grad_clip": 1.0,
    "log_every": 25,
}


# The mesh axes the bundled GPT job shards over; any other axis would only replicate.
TRAIN_AXES = ("data", "tensor", "seq", "seq_ring", "expert", "pipe")
SEQ_STRATEGIES = ("ulysses", "ring", "hybrid", "megatron")  # model.seq_parallel


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,tensor=2"`` -> ``{"data": 2, "tensor": 2}``."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        name, eq, size = part.partition("=")
        if not eq or not size.strip().isdigit() or not name.strip():
            raise ValueError(f"--mesh: expected AXIS=SIZE[,AXIS=SIZE...], got {text!r}")
        if name.strip() in out:
            raise ValueError(f"--mesh: axis {name.strip()!r} given twice in {text!r}")
        if int(size) < 1:
            raise ValueError(f"--mesh: axis {name.strip()!r} has size {size.strip()}; sizes are >= 1")
        out[name.strip()] = int(size)
    return out


def check_mesh_axes(mesh: dict[str, int], replicated: Sequence[str] = ()) -> None:
    """Every axis must be one the job shards over (a typo would silently replicate), or
    one declared ``replicated`` (``--replicate-over``: the job runs on it, replicated)."""

    for name in replicated:
        if name in TRAIN_AXES:
            raise ValueError(f"--replicate-over: {name!r} is an axis fsharded train shards over; "
                             "declare only axes it does not use")
        if name not in mesh:
            raise ValueError(f"--replicate-over: axis {name!r} is not in the mesh {mesh}")
    for name in mesh:
        if name not in TRAIN_AXES and name not in replicated:
            near = difflib.get_close_matches(name, TRAIN_AXES, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"mesh axis {name!r} is not one fsharded train shards over "
                             f"({', '.join(TRAIN_AXES)}){hint} (an axis that should only replicate: "
                             f"--replicate-over {name})")


def check_paths(cfg: Any) -> None:
    """The data source and the metrics file's directory, before anything is built."""
    data = os.fspath(cfg.data)
    if not (data == "stdlib" or data.startswith("stdlib:")) and not os.path.isfile(data):
        raise ValueError(f"--data: {data!r} is not a file (give a text file, a .bin token file, "
                         f"or 'stdlib')")
    if cfg.metrics_file:
        if os.path.isdir(cfg.metrics_file):
            raise ValueError(f"--metrics: {cfg.metrics_file!r} is a directory; give the path of a file "
                             f"(e.g. {os.path.join(cfg.metrics_file, 'metrics.jsonl')})")
        if os.path.exists(cfg.metrics_file) and not os.access(cfg.metrics_file, os.W_OK):
            raise ValueError(f"--metrics: cannot write {cfg.metrics_file!r}: the file is not writable")
        parent = os.path.dirname(os.path.abspath(cfg.metrics_file))
        if not os.path.isdir(parent):
            raise ValueError(f"--metrics: the directory {parent} of {cfg.metrics_file!r} does not exist")
        if not os.access(parent, os.W_OK):
            raise ValueError(f"--metrics: cannot write {cfg.metrics_file!r}: {parent} is not writable")


def _at_least(n: int, what: str):
    """An argparse type: an int >= ``n``, refused naming what the flag means."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if v < n:
            raise argparse.ArgumentTypeError(f"must be an int >= {n} ({what}), got {v}")
        return v
    return parse


def _resume_changes(text: str) -> tuple[str, ...]:
    out = tuple(w.strip() for w in text.split(",") if w.strip())
    bad = [w for w in out if w not in RESUME_CHANGES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(RESUME_CHANGES)}, "
                                         f"got {text!r}")
    return out


def build_parser(prog: str = "fsharded train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML or JSON file of TrainConfig fields")
    p.add_argument("--deepspeed-config", help="a DeepSpeed JSON config to read settings from (its "
                   "steps_per_print is log_every; flags and --set override what it gives)")
    p.add_argument("--allow-ignored", action="store_true",
                   help="train even when the DeepSpeed config turns on what fsharded does not support yet "
                        "(offload_param, ZeRO++ quantization, flops_profiler...), "
                        "which is then ignored with a warning naming it (default: an error)")
    p.add_argument("--mesh", help="mesh axes, e.g. data=2,tensor=2 (default data=2; world size under torchrun)")
    p.add_argument("--replicate-over", metavar="AXES", default="",
                   help="mesh axes (comma-separated) the job does not shard over, declared to replicate")
    p.add_argument("--preset", help="GPT preset: tiny, small, llama_style")
    p.add_argument("--steps", type=_at_least(1, "the step to train up to"),
                   help="train up to this step (a resumed run continues to it; default 300); also the "
                        "learning-rate schedule's length unless --schedule-steps gives another")
    p.add_argument("--schedule-steps", type=_at_least(1, "the learning-rate schedule's length"), metavar="N",
                   help="the learning-rate schedule's length (WarmupCosineLR/WarmupDecayLR total_num_steps, "
                        "linear total_steps; the default schedule's warmup is a tenth of it), when it is not "
                        "--steps: e.g. --steps 10 --schedule-steps 20 runs the first half of a 20-step run")
    p.add_argument("--batch", type=int, help="micro-batch size per batch shard (data, or data x expert with an expert axis)")
    p.add_argument("--accum", type=int, help="gradient accumulation steps")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the step as one graph and compile it, or not (--set compile=true/false; "
                        "default auto: for jobs of 200 steps or more where Inductor runs)")
    p.add_argument("--optimizer", choices=["adamw", "adam", "sgd", "lion", "adagrad", "lamb"])
    p.add_argument("--lr", type=float)
    p.add_argument("--schedule", help="constant, linear, WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle")
    p.add_argument("--clip", type=float, help="max gradient norm (0: off)")
    p.add_argument("--seed", type=int)
    p.add_argument("--data", help="'stdlib' (default), a text file, or a nanoGPT .bin of uint16 tokens")
    p.add_argument("--metrics", help="write per-step metrics to this JSONL file (a new run replaces it; a "
                                      "resumed one keeps the records up to the step it resumes at and appends)")
    p.add_argument("--save-dir", default="checkpoints", help="where checkpoints go (default: checkpoints)")
    p.add_argument("--save-every", type=_at_least(1, "a checkpoint every N steps; leave it out to save none"),
                   metavar="N", help="save a checkpoint every N steps (and at the end)")
    p.add_argument("--keep", type=_at_least(1, "the newest checkpoints kept"), default=3,
                   help="checkpoints kept (default 3, the newest)")
    p.add_argument("--force", action="store_true",
                   help="start even when the memory estimate exceeds the memory available")
    p.add_argument("--peak-tflops", type=float,
                   help="the device's peak TFLOP/s for the MFU in the summary (default: a table of known "
                        "GPUs; none on CPU)")
    p.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background while training goes on")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="under torchrun: how long a rank waits for the others in a collective or a "
                        "checkpoint before it names the rank it waits for and stops (default 300)")
    p.add_argument("--resume", metavar="latest|PATH",
                   help="continue from the newest checkpoint in --save-dir, or from PATH (with the "
                        "learning-rate schedule and global batch it was trained with: flags that would change "
                        "them are refused, see --resume-changes)")
    p.add_argument("--resume-changes", type=_resume_changes, default=(), metavar="schedule,batch",
                   help="with --resume: let these differ from the checkpoint's run, deliberately (the schedule "
                        "as the flags now give it from the resumed step on; the global batch: other rows per "
                        "step and another data order)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set optimizer.weight_decay=0.01")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="progress bar (auto: only on a terminal)")
    return p


def make_config(args: argparse.Namespace, world_size: int = 1):
    """Layer: job defaults < --config < --deepspeed-config < flags < --set (a DeepSpeed
    config's steps_per_print and seed count only when it gives them)."""
    base = C.TrainConfig.from_dict(_merge({}, JOB_DEFAULTS, {"mesh": {"data": world_size}} if world_size > 1 else {}))
    if args.config:
        base = _layer_file(base, args.config)
    if args.deepspeed_config:
        if args.mesh is not None:
            mesh = parse_mesh(args.mesh)
        else:  # the ranks are data x sequence parallel, as DeepSpeed counts them
            sp = ds_config.sequence_parallel_size(args.deepspeed_config)
            if base.mesh.get("data", 1) % sp:
                raise ValueError(f"--deepspeed-config: sequence_parallel_size {sp} does not divide the "
                                 f"{base.mesh.get('data', 1)} ranks")
            mesh = {**base.mesh, "data": base.mesh.get("data", 1) // sp}

        ds = C.from_deepspeed(args.deepspeed_config, data_parallel_size=mesh.get("data", 1),
                              allow_ignored=getattr(args, "allow_ignored", False))
        base = _layer_deepspeed(base, ds, ds_config.given(args.deepspeed_config))
    flags: dict[str, Any] = {}
    if args.mesh is not None:
        flags["mesh"] = parse_mesh(args.mesh)
    for flag, key in (("steps", "steps"), ("batch", "micro_batch_size"), ("accum", "grad_accum_steps"),
                      ("seq_len", "seq_len"), ("precision", "precision"), ("optimizer", "optimizer.name"),
                      ("lr", "optimizer.lr"), ("clip", "grad_clip"), ("seed", "seed"), ("data", "data"),
                      ("metrics", "metrics_file"), ("compile", "compile")):
        v = getattr(args, flag)
        if v is not None:
            flags[key] = v
    if args.preset:
        flags["model"] = {**base.model, "preset": args.preset}
    length = getattr(args, "schedule_steps", None)
    if args.schedule:
        flags["scheduler"] = {"name": args.schedule,
                              "params": _schedule_defaults(args.schedule, length or flags.get("steps", base.steps))}
    cfg = _apply(base, flags)
    if length is not None:
        # (--schedule's defaults were derived from the length above: a warmup-only schedule
        # such as WarmupLR takes its warmup from it and has no length of its own to set)
        cfg = _with_schedule_length(cfg, length, derived=bool(args.schedule))
    if args.set:
        cfg = C.apply_overrides(cfg, args.set)
    if length is None and _is_default_schedule(cfg):  # the default schedule follows the steps run
        cfg = _with_schedule_length(cfg, cfg.steps)
    return cfg


def _is_default_schedule(cfg) -> bool:
    default = JOB_DEFAULTS["scheduler"]
    return cfg.scheduler.name == default["name"] and dict(cfg.scheduler.params) == default["params"]


def _with_schedule_length(cfg, n: int, *, derived: bool = False):
    """``cfg`` with its schedule ``n`` steps long (``--schedule-steps``): the default
    schedule whole (its warmup a tenth), another its length parameter only; ``derived``:
    the schedule's defaults were made for ``n`` steps already (``--schedule``)."""
    if _is_default_schedule(cfg):
        return _apply(cfg, {"scheduler": {"name": "WarmupCosineLR", "params": {
            **JOB_DEFAULTS["scheduler"]["params"], "total_num_steps": n, "warmup_num_steps": max(1, n // 10)}}})
    key = LENGTH_PARAM.get(cfg.scheduler.name)
    if key is None and derived:
        return cfg
    if key is None:
        raise ValueError(f"--schedule-steps: the {cfg.scheduler.name} schedule has no length (those with one: "
                         f"{', '.join(LENGTH_PARAM)})")
    return _apply(cfg, {"scheduler": {"name": cfg.scheduler.name, "params": {**cfg.scheduler.params, key: n}}})


def _merge(*ds: dict) -> dict:
    out: dict = {}
    for d in ds:
        for k, v in d.items():
            out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _apply(cfg, flat: dict[str, Any]):
    """Apply ``{"a.b": v}`` / ``{"mesh": {...}}`` onto a TrainConfig (re-deriving batches)."""
    d = cfg.to_dict()
    for key, v in flat.items():
        node = d
        *head, last = key.split(".")
        for h in head:
            node = node[h]
        node[last] = v
    # The batch triple is re-derived from the micro batch, accumulation and mesh.
    d["train_batch_size"] = None
    return C.TrainConfig.from_dict(d)


def _layer_file(base, path: str):
    """Fields the file sets win over the job defaults; a scheduler it names comes whole."""
    from pathlib import Path

    C.load_config(path)  # full validation, with the file's own error messages
    p = Path(path)
    raw = C.read_file(p)
    d = _merge(base.to_dict(), raw)
    if "scheduler" in raw:
        d["scheduler"] = {"name": raw["scheduler"].get("name", "constant"), "params": raw["scheduler"].get("params", {})}
    if not {"train_batch_size"} & raw.keys():
        d["train_batch_size"] = None
    return C.TrainConfig.from_dict(d)


# What a DeepSpeed config decides (and, when it gives them, log_every and seed); the model,
# mesh, data and run length stay ours.
_DS_SECTIONS = ("optimizer", "scheduler", "precision", "loss_scale", "reduce_dtype", "grad_clip",
                "zero_stage", "offload", "micro_batch_size", "grad_accum_steps", "train_batch_size")


def _layer_deepspeed(base, ds, given: Sequence[str] = ()):
    d, dd = base.to_dict(), ds.to_dict()
    for k in (*_DS_SECTIONS, *given):
        d[k] = dd[k]
    d["mesh"] = {**d["mesh"], **dd["mesh"]}  # the data parallel size the batch sizes were read with
    if dd["mesh"].get("seq", 1) > 1:  # sequence_parallel_size: Ulysses over 'seq', as DeepSpeed runs it
        d["model"] = {"seq_parallel": "ulysses", **d["model"]}
    return C.TrainConfig.from_dict(d)


def _schedule_defaults(name: str, steps: int) -> dict:
    n = name.lower()
    warm = max(1, steps // 10)
    if n == "warmupcosinelr":
        return {"total_num_steps": steps, "warmup_num_steps": warm, "warmup_type": "linear"}
    if n == "warmupdecaylr":
        return {"total_num_steps": steps, "warmup_num_steps": warm, "warmup_type": "linear"}
    if n == "warmuplr":
        return {"warmup_num_steps": warm, "warmup_type": "linear"}
    if n == "linear":
        return {"total_steps": steps}
    return {}


# -- building the run --------------------------------------------------------------------


def build_optimizer(cfg):
    """The ``fsharded.optim`` optimizer (with its schedule) a TrainConfig describes."""
    o = cfg.optimizer
    lr = lr_schedule(schedule_record(cfg))  # every parameter resolved, as a checkpoint records it
    kw: dict[str, Any] = {}
    if o.betas is not None:
        kw["b1"], kw["b2"] = o.betas
    if o.eps is not None:
        kw["eps"] = o.eps
    if o.name in ("adamw", "lion", "lamb"):
        return getattr(optim, o.name)(lr, weight_decay=o.weight_decay, mask=optim.decay_mask, **kw)
    if o.name == "adam":
        return optim.adam(lr, weight_decay=o.weight_decay, **kw)
    if o.name == "sgd":
        return optim.sgd(lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay, **o.extra)
    return optim.adagrad(lr, weight_decay=o.weight_decay, **{k: v for k, v in kw.items() if k == "eps"}, **o.extra)


def build_model_config(cfg, data_vocab: int | None = None):
    """The GPT config of ``cfg.model``; a preset takes the data's vocabulary size unless
    ``model.vocab_size`` is given (a preset must run on the default data as given)."""
    m = {k: v for k, v in cfg.model.items() if k not in ("seq_parallel", "seq_layout")}  # the job's, not the model's
    if data_vocab is not None:
        m.setdefault("vocab_size", data_vocab)
    preset = m.pop("preset", "small")
    make = getattr(GPTConfig, preset, None)
    if make is None or preset.startswith("_"):
        raise ValueError(f"model.preset: unknown GPT preset {preset!r}; known: tiny, small, llama_style")
    m.setdefault("seq_len", cfg.seq_len)
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = [k for k in m if k not in fields]
    if unknown:
        hints = [f"  model.{k}" + (f" (did you mean model.{close[0]}?)" if (close := difflib.get_close_matches(
            k, sorted(fields), n=1)) else "") for k in unknown]
        raise ValueError("unknown model settings:\n" + "\n".join(hints)
                         + f"\nThe GPT's settings are: {', '.join(sorted(fields))}")
    return make(**m)


def _batch_axes(mesh) -> tuple[str, ...]:
    """The mesh axes the batch's rows are split over: data, and expert (DeepSpeed's expert
    parallelism inside data parallelism: each expert shard trains on its own rows)."""
    return tuple(a for a in ("data", "expert") if a in mesh.shape)


class _SeqJob:
    """How the job lays out the sequence: the loss, the batch spec, and the batch as the
    step takes it (inputs/targets, in zigzag order for ring attention)."""

    def __init__(self, cfg, mesh, mcfg) -> None:
        import functools

        strategy, layout = cfg.model.get("seq_parallel"), cfg.model.get("seq_layout")
        if strategy is not None and strategy not in SEQ_STRATEGIES:
            raise ValueError(f"model.seq_parallel: {strategy!r} is not one of {', '.join(SEQ_STRATEGIES)}")
        self.megatron = strategy == "megatron"
        if self.megatron:  # the sequence over the tensor axis between the tensor-parallel layers
            tp = mesh.shape.get("tensor", 1)
            if tp == 1 or "seq" in mesh.shape or layout not in (None, "contiguous"):
                raise ValueError("model.seq_parallel=megatron shards the sequence over the 'tensor' axis (e.g. "
                                 "--mesh tensor=2), contiguously, without a 'seq' axis")
            self.strategy, self.layout, self.n, self.chunks = strategy, "contiguous", tp, tp
            if mcfg.seq_len % tp and mcfg.positions == "learned":
                raise ValueError(f"--seq-len {mcfg.seq_len} does not divide over tensor={tp}, and padding would run "
                                 f"past the learned positions: pick a multiple of {tp}, or --set model.positions=rotary")
            self.loss = functools.partial(gpt.loss, seq_parallel="megatron")
            self.batch_spec = fs.P(_batch_axes(mesh)) if _batch_axes(mesh) else fs.P()
            return
        if strategy is not None and "seq" not in mesh.shape:
            raise ValueError(f"model.seq_parallel={strategy} shards the sequence over the mesh axis 'seq', which "
                             f"{mesh!r} lacks (e.g. --mesh seq=2)")
        if ("seq_ring" in mesh.shape) != (strategy == "hybrid"):
            raise ValueError("model.seq_parallel=hybrid runs Ulysses over 'seq' and ring attention over "
                             "'seq_ring': give both (--mesh seq=2,seq_ring=2), and seq_ring only with hybrid")
        self.strategy = strategy or "ulysses"
        self.ulysses = mesh.shape.get("seq", 1) if self.strategy in ("ulysses", "hybrid") else 1
        self.n = mesh.shape.get("seq", 1) * mesh.shape.get("seq_ring", 1)
        self.layout = layout or ("zigzag" if self.strategy == "ring" else "contiguous")
        fs.parallel.sequence.check_layout(self.layout)
        # A length that does not divide is padded at the end and masked (gpt.shift(multiple=)).
        self.chunks = self.n * (2 if self.layout == "zigzag" else 1)
        padded = -(-mcfg.seq_len // self.chunks) * self.chunks
        if self.n > 1 and padded != mcfg.seq_len and mcfg.positions == "learned":
            raise ValueError(f"--seq-len {mcfg.seq_len} does not divide into {self.chunks} sequence chunks "
                             f"(seq={self.n}, {self.layout} layout), and padding it to {padded} would run past "
                             f"the {mcfg.seq_len} learned positions: pick a multiple of {self.chunks}, or "
                             f"--set model.positions=rotary (padded then)")
        heads = mcfg.n_heads // mesh.shape.get("tensor", 1)
        if self.ulysses > 1 and heads % self.ulysses:
            raise ValueError(f"model.seq_parallel={self.strategy} over seq={self.ulysses} splits the {heads} attention "
                             f"heads of a tensor shard, which do not divide by {self.ulysses}: use ring or the "
                             f"hybrid (Ulysses over fewer ranks, --mesh seq_ring=N for the rest)")
        if self.layout == "zigzag" and self.strategy != "ring":
            raise ValueError(f"model.seq_layout=zigzag is ring attention's; {self.strategy} needs contiguous")
        data = _batch_axes(mesh) or None  # the rows: over data, and expert (expert parallelism inside it)
        if self.n > 1:
            axis = ("seq_ring", "seq") if self.strategy == "hybrid" else "seq"
            self.loss = functools.partial(gpt.loss, seq_axis=axis, seq_parallel=self.strategy,
                                          seq_layout=self.layout)
            self.batch_spec = fs.P(data, axis)
        else:
            self.loss, self.batch_spec = gpt.loss, fs.P(data) if data else fs.P()

    def prepare(self, batch: dict) -> dict:
        if self.n == 1:
            return batch
        if self.megatron:  # tokens stay whole on every tensor rank; padded only if they must be
            return gpt.shift(batch, multiple=self.chunks) if (batch["tokens"].shape[1] - 1) % self.chunks else batch

        b = gpt.shift(batch, multiple=self.chunks)
        return {k: sequence.zigzag(v, self.n) for k, v in b.items()} if self.layout == "zigzag" else b

    def describe(self) -> str:
        if self.n == 1:
            return ""
        where = (f"seq_ring x seq={self.n}" if self.strategy == "hybrid" else
                 f"tensor={self.n}" if self.megatron else f"seq={self.n}")
        return f", sequence over {where} ({self.strategy}, {self.layout})"


def _check_fits(cfg, mcfg, mesh, specs_for, dist_on: bool, seq: _SeqJob) -> None:
    """The job's training state and one micro-batch's activations, estimated on meta
    tensors (weights, gradients, optimizer state, buffers; the activations from a dry run
    of the loss), against the memory available: per rank times the ranks on this host, or
    everything on the virtual mesh, which holds every device's part in one process."""
    with torch.device("meta"):
        meta = gpt.init(mcfg, cfg.seed)
    if dist_on:
        est_mesh, specs = mesh, specs_for(meta)
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if not torch.cuda.is_available() else 1
        what = f"the training state on {mesh!r}, per rank,"
    else:
        est_mesh, specs, processes = fs.Mesh({a: 1 for a in mesh.axis_names}), fs.P(), 1
        what = "the training state (the virtual mesh holds all of it in this process)"
    opt, device = build_optimizer(cfg), "cuda" if torch.cuda.is_available() else "cpu"
    hints = ("ZeRO-3 on more ranks (--set zero_stage=3 under torchrun --nproc_per_node N: each rank "
             "holds 1/N of the state)",) if cfg.zero_stage < 3 else ()
    with warnings.catch_warnings():  # (said again when the job builds its loss)
        warnings.simplefilter("ignore")
        piped = pipeline_loss(cfg, mesh, mcfg, meta, seq)
    # (real ranks along a pipe axis each store their own stages' state: the largest's)
    state = _memory.estimate_memory(meta, specs, opt, precision=cfg.policy(), mesh=est_mesh,
                                    activation_bytes=0, blocks="blocks", loss=piped if dist_on else None)
    # The state first (arithmetic): a model that cannot fit is refused without a dry run.
    _memory.check_fits(state.total, who="memory check", what=what, processes=processes, device=device, hints=hints)
    if piped is not None:  # per pipe rank: its stages' micro-batches held at once
        check_fits_pipelined(cfg, mcfg, mesh, specs_for(meta), dist_on, seq, piped, meta, state,
                             dict(who="memory check", processes=processes, device=device, lead="To need less"), what,
                             opt)
        return
    rows = cfg.micro_batch_size * cfg.data_parallel_size  # one micro-batch, global
    tokens = {"tokens": torch.zeros((rows, mcfg.seq_len + 1), dtype=torch.int64)}
    if dist_on:  # this rank's shard of the batch as the step takes it
        loss, batch, batch_spec = seq.loss, seq.prepare(tokens), seq.batch_spec
    else:  # the virtual mesh's process holds every shard's activations: the whole batch, unsharded
        loss, batch, batch_spec = functools.partial(gpt.loss, moe=mcfg.moe), tokens, fs.P()
    batch = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in batch.items()}
    if mcfg.moe is not None and mcfg.moe.bias_update_rate is not None:  # the routing biases, too
        ms, with_state = gpt.init_model_state(meta), loss
        loss = lambda p, b: with_state(p, b, ms)[0]  # noqa: E731
    try:
        est = _memory.estimate_memory(meta, specs, opt, precision=cfg.policy(), mesh=est_mesh, loss=loss,
                                      batch=batch, blocks="blocks", batch_spec=batch_spec)
    except Exception as e:  # noqa: BLE001 - the state alone was checked
        warnings.warn(f"fsharded train: the memory check counted the state only: the activations could "
                      f"not be measured ({type(e).__name__}: {e})", stacklevel=2)
        return
    more = (f"a smaller --batch (now {cfg.micro_batch_size} a data shard, {est.activations / 2**30:,.2f} GiB "
            "of activations)",)
    _memory.check_fits(est.total, who="memory check", processes=processes, device=device,
                       what=what.replace("the training state", "the training state and one micro-batch's "
                                         "activations"), hints=more + (hints if state.total > est.activations else ()),
                       lead="To need less")


def run(cfg, *, progress: str = "auto", save_dir: str = "checkpoints", save_every: int | None = None,
        keep: int | None = 3, resume: str | None = None, async_save: bool = False,
        force: bool = False, replicate_over: Sequence[str] = (), peak_tflops: float | None = None,
        resume_changes: Sequence[str] = ()) -> dict:
    """Train per ``cfg``; returns the summary dict (also printed on rank 0). With
    ``save_every`` a checkpoint goes to ``save_dir/step-<n>`` every that many steps and at
    the end (``async_save``: written in the background, the last one waited for), with a
    record of the run's schedule and global batch (``job.json``); ``resume`` ("latest" or a
    checkpoint's path) continues a run exactly: its state (parameters, optimizer, loss
    scale, keys), its place in the data, and its schedule and global batch: a ``cfg`` that
    would change those is refused unless ``resume_changes`` names them ("schedule",
    "batch"). The metrics file of a resumed run keeps the records up to the resumed step."""
    dist_on = fs.distributed.is_initialized()
    main_rank = fs.distributed.rank() == 0
    for flag, v in (("--save-every", save_every), ("--keep", keep)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{flag}: expected an int >= 1, got {v!r}"
                             + (" (a checkpoint every N steps; leave it out to save none)" if flag == "--save-every"
                                else " (the newest checkpoints kept)"))
    bad = [c for c in resume_changes if c not in _train_resume.RESUME_CHANGES]
    if bad:
        raise ValueError(f"--resume-changes: {bad} are not among {', '.join(_train_resume.RESUME_CHANGES)}")
    check_mesh_axes(cfg.mesh, replicate_over)
    check_paths(cfg)
    # The checkpoint to resume from, and whether these flags keep its run's schedule and
    # batch, before anything is built.
    mgr = fs.checkpoint.Manager(save_dir, keep=keep, every=save_every) if (save_every or resume) else None
    if save_every:
        mgr.lock()  # one run at a time in save_dir: another one's is named
    path = (mgr.latest() if resume == "latest" else resume) if resume else None
    if path is not None and os.path.isdir(path):  # (a missing one: step.load says so)
        saved_at = _train_resume.check_resume(cfg, path, resume_changes)
        if saved_at is not None and saved_at > cfg.steps:
            raise ValueError(f"--steps {cfg.steps}: {path} is at step {saved_at}, past it; give --steps "
                             f"{saved_at + 1} or more to train on from it")
    mesh = fs.Mesh(cfg.mesh)
    tokens = fs.data.load_tokens(cfg.data)
    mcfg = build_model_config(cfg, tokens.vocab_size)
    if "tensor" in mesh.shape and mesh.shape["tensor"] > 1:
        mcfg.check_tensor_parallel(mesh.shape["tensor"])
    if cfg.zero_stage and "data" not in mesh.shape:
        raise ValueError(f"zero_stage={cfg.zero_stage} shards over the 'data' axis, which {mesh!r} lacks")

    experts = mesh.shape.get("expert", 1)
    if "expert" in mesh.shape and mcfg.moe is None:
        raise ValueError(f"{mesh!r} has an 'expert' axis but the model has no experts: add them "
                         f"(--set model.moe.experts=8), or drop the axis")
    if mcfg.moe is not None and mcfg.moe.experts % experts:
        raise ValueError(f"model.moe.experts={mcfg.moe.experts} does not divide over expert={experts}: use a "
                         f"multiple of {experts} experts, or a smaller expert axis")

    def specs_for(params):
        specs = gpt_plans.tensor_parallel_specs(params) if mesh.shape.get("tensor", 1) > 1 else \
            optree.tree_map(lambda _: fs.P(), params)
        if "expert" in mesh.shape:
            specs = gpt_plans.expert_parallel_specs(params, base=specs)
        return fs.parallel.zero(cfg.zero_stage, axis="data", **cfg.offload.zero_kwargs())(specs, params) \
            if cfg.zero_stage else specs

    global_batch = cfg.micro_batch_size * cfg.grad_accum_steps * cfg.data_parallel_size  # rows over data x expert
    seq = _SeqJob(cfg, mesh, mcfg)
    if mcfg.moe is not None:  # routing settings ride with the loss; its metrics are reported
        seq.loss = functools.partial(seq.loss, moe=mcfg.moe, metrics=True)
    if not force:  # before a byte of the model is allocated
        _check_fits(cfg, mcfg, mesh, specs_for, dist_on, seq)
    params = gpt.init(mcfg, cfg.seed)
    specs = specs_for(params)
    if tokens.vocab_size > mcfg.vocab_size:
        raise ValueError(f"data {cfg.data!r} has vocab {tokens.vocab_size} but the model has {mcfg.vocab_size}; "
                         f"set model.vocab_size (--set model.vocab_size={tokens.vocab_size})")
    train_tokens, val_tokens = tokens.split(0.05)
    batches = fs.data.Batches(train_tokens, global_batch, mcfg.seq_len, seed=cfg.seed)
    val = fs.data.Batches(val_tokens, global_batch, mcfg.seq_len, seed=cfg.seed + 1)
    opt = build_optimizer(cfg)
    # Aux-loss-free balancing: the routing biases ride in the state, updated from the loads.
    biased = mcfg.moe is not None and mcfg.moe.bias_update_rate is not None
    # The job never reads a state after stepping it: donate it (the update in place), except
    # under fp16 loss scaling, which keeps the old state to skip an overflowing step.
    piped = pipeline_loss(cfg, mesh, mcfg, params, seq)  # a pipe axis: its micro-batches are the accumulation
    step = fs.train_step(piped or seq.loss, opt, mesh=mesh, param_specs=specs, batch_spec=seq.batch_spec,
                         precision=cfg.policy(), accumulation=1 if piped else cfg.grad_accum_steps,
                         clip=cfg.grad_clip or None, blocks="blocks", check_memory=not force, remat=cfg.remat.policy,
                         donate=not cfg.policy().loss_scaling,
                         update_model_state=gpt.model_state_updater(mcfg.moe) if biased else None)
    state = step.init(params, gpt.init_model_state(params) if biased else None)
    start = 0
    loaded = None
    if resume == "latest":
        # The newest checkpoint that loads: a damaged one is passed over with a warning naming
        # it. One older than the one checked above is checked against these flags too.
        restored, loaded = mgr.restore(step, state)
        if restored is not None and restored != path:
            _train_resume.check_resume(cfg, restored, resume_changes)
        path = restored
    if resume == "latest" and path is None and main_rank:
        # The first start of a job that restarts itself (torchrun --max-restarts): nothing yet.
        print(f"fsharded train: --resume latest: no checkpoint in {save_dir} yet, starting at step 0",
              flush=True)
    if path is not None:
        state = loaded if loaded is not None else step.load(path, state)
        start = int(state.step)
        if start > cfg.steps:
            raise ValueError(f"--steps {cfg.steps}: {path} is at step {start}, past it; give --steps "
                             f"{start + 1} or more to train on from it")
        if main_rank:
            print(f"fsharded train: resumed from {path} at step {start}", flush=True)
    compiling, why = _train_loop.decide(cfg, cfg.steps - start, distributed=dist_on)
    if compiling:
        step.compile()
    n_params = gpt.param_count(params)
    if main_rank:
        print(f"fsharded train: GPT {n_params:,} params ({mcfg.n_layers} layers, d_model {mcfg.d_model}), "
              f"{mesh!r} on the {'distributed' if dist_on else 'virtual'} backend, "
              f"batch {global_batch}x{mcfg.seq_len}, {cfg.steps} steps, {cfg.precision}"
              + (f", ZeRO-{cfg.zero_stage}" if cfg.zero_stage else "")
              + (f", optimizer state offloaded to {cfg.offload.optimizer}" if cfg.offload.active else "")
              + (f", parameters offloaded to {cfg.offload.params}" if cfg.offload.params != "none" else "")
              + (f", zenflow top {cfg.offload.zenflow_topk_ratio:g}" if cfg.offload.zenflow else "")
              + (f", remat {cfg.remat.policy}" if cfg.remat.policy != "none" else "")
              + (", compiled" if compiling else f", eager ({why})" if cfg.compile == "auto" and
                 cfg.steps >= _train_loop.AUTO_MIN_STEPS else "") + seq.describe()
              + (f", pipeline {cfg.pipeline.schedule} with {cfg.grad_accum_steps} micro-batches" if piped else "")
              + (f", {mcfg.moe.experts} experts top-{mcfg.moe.top_k} every {mcfg.moe.every} blocks"
                 + (f" over expert={experts}" if experts > 1 else "") if mcfg.moe is not None else ""), flush=True)
    # Model FLOPs of a step (all devices; MoE blocks: each token through its top-k experts,
    # routed per micro-batch and shard), TFLOP/s per rank (the virtual mesh: in its one
    # process) and MFU, per step in the metrics and over the steady steps in the summary.
    try:
        step_flops = FL.gpt_step_flops(params, batch=global_batch, seq_len=mcfg.seq_len, moe=mcfg.moe,
                                       routing_shards=cfg.grad_accum_steps * cfg.data_parallel_size * seq.n
                                       if mcfg.moe is not None and not seq.megatron else 1)
    except ValueError:  # tokens that do not split evenly into the routing shards (padded sequences)
        step_flops = None
    devices = mesh.size if dist_on else 1
    peak = peak_tflops if peak_tflops is not None else FL.peak_tflops(cfg.precision)
    # Line-buffered: a killed run keeps every record but the one being written.
    metrics_f = _train_resume.open_metrics(cfg.metrics_file, resumed_at=start if resume else None) \
        if (cfg.metrics_file and main_rank) else None

    def saved(directory: str | None) -> None:  # a complete checkpoint gets its run's record
        if directory is not None and main_rank:
            _train_resume.write_job(directory, _train_resume.job_record(cfg, int(directory.rsplit("-", 1)[1]), mcfg))
    bar = _train_loop.Progress(cfg.steps, progress, cfg.log_every, main_rank)
    tok_per_step = global_batch * mcfg.seq_len
    losses: list[float] = []
    compile_s = 0.0  # capturing and compiling the step (compile=True), its first runs included
    t_start = time.perf_counter()
    t_steady = None
    try:
        for i in range(start, cfg.steps):
            t0 = time.perf_counter()
            # (the data position is the step count)
            state, m = _train_loop.call(step, state, seq.prepare(batches.batch_at(i)), auto=cfg.compile == "auto",
                                        main_rank=main_rank, distributed=dist_on)
            dt = time.perf_counter() - t0
            if i == start + 1:
                t_steady = time.perf_counter() - dt  # exclude the first (warm-up) step
            rec = {"step": i + 1, **{k: float(v) for k, v in m.items()}, "step_time_s": dt,
                   "tokens_per_s": tok_per_step / dt}
            if step_flops is not None:
                rec["tflops_per_s"] = step_flops / dt / devices / 1e12
                if peak is not None:
                    rec["mfu"] = FL.mfu(step_flops / devices, dt, peak)
            losses.append(rec["loss"])
            compile_s += rec.get("compile_s", 0.0)
            bar.update(i + 1, rec)
            if metrics_f is not None:  # before the checkpoint: a checkpoint's step has its record
                metrics_f.write(json.dumps(rec) + "\n")
            if mgr is not None and (mgr.due(i + 1) or (save_every and i + 1 == cfg.steps)):
                saved(mgr.wait())  # the save in the background before it, complete
                out = mgr.save_state(step, state, blocking=not async_save)
                if not async_save:
                    saved(out)
        if mgr is not None:
            saved(mgr.wait())  # a save still in the background
    finally:
        bar.close()
        if metrics_f is not None:
            metrics_f.close()
    elapsed = time.perf_counter() - t_start
    steady_steps = cfg.steps - start - 1 if t_steady is not None else cfg.steps - start
    steady_time = (time.perf_counter() - t_steady) if t_steady is not None else elapsed
    state = step.settle(state)  # (ZenFlow: the last host update lands first)
    full = step.params(state)
    # What this process sends per step (on real ranks listed by the first step's schedule
    # check: no dry run of its own).
    manifest = step.own_collectives(state, seq.prepare(batches.batch_at(start)))
    with torch.no_grad():
        ms = step.model_state(state) if biased else None
        val_loss = sum(float(gpt.loss(full, val.batch_at(j), ms, moe=mcfg.moe, train=False)[0] if biased else
                             gpt.loss(full, val.batch_at(j), moe=mcfg.moe, train=False)) for j in range(4)) / 4
    summary = {
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else math.nan,
        "first_loss": losses[0] if losses else math.nan,
        "val_loss": val_loss,
        "steps": cfg.steps,
        "params": n_params,
        "mesh": dict(mesh.shape),
        "backend": "distributed" if dist_on else "virtual",
        "tokens_per_s": tok_per_step * steady_steps / steady_time if steady_time > 0 else math.nan,
        "elapsed_s": elapsed,
        "collective_bytes_per_step": manifest.by_axis(),
        "collectives_per_step": len(manifest),
        "compile_s": compile_s,
    }
    if step_flops is not None and steady_time > 0:
        per_device = step_flops * steady_steps / steady_time / devices
        summary.update(flops_per_step=step_flops, tflops_per_s_per_device=per_device / 1e12,
                       mfu=FL.mfu(per_device, 1.0, peak))
    if main_rank and not losses:  # resumed at its last step (a restart after the end): no loss to show
        print(f"done: nothing to train, the state is at step {start} of {cfg.steps}; val {val_loss:.4f}", flush=True)
    elif main_rank:
        by_axis = ", ".join(f"{a}: {b:,d} B" for a, b in summary["collective_bytes_per_step"].items()) or "none"
        print(
            f"done: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} (mean of last 10), "
            f"val {val_loss:.4f}\n"
            f"      {summary['tokens_per_s']:,.0f} tokens/s, {elapsed:.1f} s, {n_params:,} params, "
            f"mesh {dict(mesh.shape)}\n"
            f"      collectives per step: {summary['collectives_per_step']} ({by_axis} sent per rank)"
            + (f"\n      compiled in {compile_s:.1f} s (the first step)" if compile_s > 0 else "")
            + (f"\n      {summary['flops_per_step'] / 1e9:,.2f} GFLOP per step, "
               f"{summary['tflops_per_s_per_device']:.3f} TFLOP/s "
               f"{'per rank' if dist_on else 'in this process'}"
               + (f", MFU {summary['mfu']:.1%}" if summary.get("mfu") is not None else
                  " (MFU: give --peak-tflops)") if "flops_per_step" in summary else ""),
            flush=True,
        )
    return summary


def main(argv: Sequence[str] | None = None, *, prog: str = "fsharded train") -> int:
    args = build_parser(prog).parse_args(argv)

    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        fs.distributed.initialize(timeout_s=args.timeout)
    try:
        cfg = make_config(args, world_size=fs.distributed.world_size())
    except (ValueError, OSError) as e:
        print(f"fsharded train: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(cfg.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        try:
            run(cfg, progress=args.progress, save_dir=args.save_dir, save_every=args.save_every,
                keep=args.keep, resume=args.resume, async_save=args.async_save, force=args.force,
                replicate_over=[a.strip() for a in args.replicate_over.split(",") if a.strip()],
                peak_tflops=args.peak_tflops, resume_changes=args.resume_changes)
        except (ValueError, OSError, NotImplementedError, FloatingPointError, MemoryError) as e:
            print(f"fsharded train: {e}", file=sys.stderr)
            return 1
    if launched:  # torn down before exit (gloo's threads at interpreter teardown can abort)
        fs.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
