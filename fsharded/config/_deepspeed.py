"""Reading DeepSpeed JSON configs into a ``TrainConfig`` (``fsharded.config.from_deepspeed``).

DeepSpeed's own rules apply: any two of ``train_batch_size`` /
``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps`` give the third;
``"Adam"`` means AdamW unless ``adam_w_mode`` is false; ``loss_scale: 0`` means dynamic loss
scaling. A feature fsharded does not have yet, turned on (``offload_param.device:
"cpu"``, ``flops_profiler.enabled: true``: ``_deepspeed_unsupported.FEATURES``), is an error
unless ``allow_ignored=True``; keys fsharded does not use are named in one ``ConfigWarning``,
printed as its message alone.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fsharded.config._batch import resolve_batch
from fsharded.config._deepspeed_unsupported import CHECKS, FEATURES, HOW_TO_RUN
from fsharded.config._train import (
    _DTYPES,
    _NONNEG,
    _OPTIMIZER_EXTRAS,
    _POS,
    _REQUIRED_PARAMS,
    _SCHEDULER_BY_LOWER,
    _SCHEDULER_CHECKS,
    OPTIMIZERS,
    SCHEDULERS,
    ConfigWarning,
    LossScaleConfig,
    OptimizerConfig,
    TrainConfig,
    _Check,
    _coerce,
    _int_ge,
    _no_duplicates,
    _read_json,
    _type_name,
)

__all__ = ["from_deepspeed"]

_DS_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_DS_QUIET = {
    "wall_clock_breakdown", "memory_breakdown", "dump_state", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "fp16.auto_cast", "bf16.immediate_grad_update",
    "optimizer.params.torch_adam",
    *(f"zero_optimization.{k}" for k in (
        "allgather_partitions", "allgather_bucket_size", "reduce_scatter", "reduce_bucket_size",
        "overlap_comm", "contiguous_gradients", "round_robin_gradients", "sub_group_size",
        "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "elastic_checkpoint",
        "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
        "ignore_unused_parameters", "load_from_fp32_weights")),
}
"""Performance knobs and timing switches with no numerical effect: read without a warning
(fsharded schedules its own communication)."""

# Defaults of the optimizers DeepSpeed builds for each type (FusedAdam, FusedLamb, FusedLion,
# torch.optim.Adagrad / SGD), so an omitted key means what it meant under DeepSpeed.
_DS_OPT_DEFAULTS: dict[str, dict[str, Any]] = {
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8},
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8},
    "lamb": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8},
    "lion": {"lr": 1e-3, "betas": (0.9, 0.999)},
    "adagrad": {"lr": 1e-2, "eps": 1e-10},
    "sgd": {"lr": 1e-3, "momentum": 0.0, "nesterov": False},
}


class _Reader:
    """Reads dotted paths from a DeepSpeed dict, recording which keys were used, type
    errors (with the path) and ``"auto"`` placeholders."""

    def __init__(self, d: dict) -> None:
        self.d, self.used, self.asked = d, set(), set()
        self.errors: list[str] = []
        self.auto: list[str] = []
        self.notes: list[str] = []
        self.unsupported: list[tuple[str, str]] = []  # (path = value, what it asks for)
        for path in _DS_QUIET:
            if self.has(path):
                self.used.add(path)

    def _node(self, path: str) -> tuple[Any, str]:
        *head, last = path.split(".")
        node: Any = self.d
        for p in head:
            node = node.get(p) if isinstance(node, Mapping) else None
        return node, last

    def has(self, path: str) -> bool:
        self.asked.add(path)
        node, last = self._node(path)
        return isinstance(node, Mapping) and last in node

    def get(self, path: str, tp: Any, default: Any = None, check: _Check | None = None) -> Any:
        if not self.has(path):
            return default
        node, last = self._node(path)
        v = node[last]
        self.used.add(path)
        if isinstance(v, str) and v == "auto":
            self.auto.append(path)
            return default
        ok, cv = _coerce(v, tp)
        if not ok:
            self.errors.append(f"  {path}: expected {_type_name(tp)}, got {v!r} ({type(v).__name__})")
            return default
        if check is not None and cv is not None and not check[0](cv):  # (None: an optional key left unset)
            self.errors.append(f"  {path}: expected {check[1]}, got {cv!r}")
            return default
        return cv

    def default_only(self, path: str, default: Any) -> None:
        """A setting fsharded only has at its default: not supported at another value."""
        v = self.get(path, type(default), default)
        if v != default:
            self.unsupported.append((f"{path} = {v!r}", f"fsharded has it only at DeepSpeed's default, "
                                                        f"{default!r}"))

    def use_block(self, path: str) -> None:
        """Every key under ``path`` read (quietly)."""
        node, last = self._node(path)
        if not isinstance(node, Mapping) or last not in node:
            return
        todo = [(path, node[last])]
        while todo:
            prefix, v = todo.pop()
            self.used.add(prefix)
            if isinstance(v, Mapping):
                todo += [(f"{prefix}.{k}", x) for k, x in v.items()]

    def misspelt(self) -> list[str]:
        """Unread keys inside blocks fsharded reads that look like a key it reads there
        (``zero_optimization.stgae``): the setting meant would be dropped silently."""
        import difflib

        out = []

        def walk(node: Mapping, prefix: str) -> None:
            for k, v in node.items():
                path = f"{prefix}{k}"
                if isinstance(v, Mapping):
                    walk(v, path + ".")
                elif path not in self.used and path not in self.asked:  # (asked: read, value ignored)
                    known = sorted({a[len(prefix):] for a in self.asked
                                    if a.startswith(prefix) and "." not in a[len(prefix):]})
                    near = difflib.get_close_matches(str(k), known, n=1, cutoff=0.75)
                    if near:
                        out.append(f"  {path}: not a key fsharded reads; did you mean {prefix}{near[0]}?")

        walk(self.d, "")
        return out

    def unused(self) -> list[str]:
        def walk(node: Mapping, prefix: str) -> tuple[list[str], bool]:
            out, any_used = [], False
            for k, v in node.items():
                path = f"{prefix}{k}"
                if isinstance(v, Mapping):
                    if not v:
                        continue  # an empty block sets nothing
                    sub, sub_used = walk(v, path + ".")
                    any_used |= sub_used
                    # a block nothing was read from is named once, not leaf by leaf
                    out += sub if sub_used else [path]
                elif path in self.used:
                    any_used = True
                else:
                    out.append(f"{path} = {v!r}")
            return out, any_used

        return walk(self.d, "")[0]


def _ds_pipeline(r: _Reader, kw: dict, mesh: dict) -> None:
    """DeepSpeed's ``pipeline`` block: ``stages`` is the mesh's ``pipe`` axis, run as
    DeepSpeed's engine runs it (1F1B, ``gradient_accumulation_steps`` micro-batches per
    step, blocks balanced by parameter count: ``partition`` "parameters")."""
    if not r.has("pipeline"):
        return
    stages = r.get("pipeline.stages", int, None, _int_ge(1))
    if stages is not None:
        if mesh.get("pipe", stages) != stages:
            r.errors.append(f"  pipeline.stages: {stages}, but the mesh's 'pipe' axis is {mesh['pipe']}")
        if stages > 1:  # the outer axis, as DeepSpeed's topology places it
            kw["mesh"] = {"pipe": stages, **{k: v for k, v in kw["mesh"].items() if k != "pipe"}}
    if "pipe" in kw["mesh"]:
        kw["pipeline"] = {"schedule": "1f1b"}
    partition = r.get("pipeline.partition", str, "parameters")
    if partition.lower() != "parameters":
        r.unsupported.append((f"pipeline.partition = {partition!r}", "fsharded cuts the blocks by parameter count "
                              "(\"parameters\") or at boundaries given in code (pipeline_stages(boundaries=))"))
    if r.get("pipeline.activation_checkpoint_interval", int, 0, _int_ge(0)):
        r.unsupported.append(("pipeline.activation_checkpoint_interval", "activation checkpointing of pipeline "
                              "stages is not supported yet"))
    for key in ("seed_layers", "pipe_partitioned", "grad_partitioned"):  # how DeepSpeed builds and sends: no effect here
        r.get(f"pipeline.{key}", bool, None)


_AC = "activation_checkpointing"


def _ds_activation_checkpointing(r: _Reader, kw: dict) -> None:
    """``activation_checkpointing``: DeepSpeed's settings for the layers a model checkpoints
    (``deepspeed.checkpointing.checkpoint`` around each one). ``fsharded train`` checkpoints
    the model's blocks: the block given (even at its defaults) is ``remat.policy: blocks``,
    and ``cpu_checkpointing: true`` keeps their inputs in host memory (``blocks,offload``).
    ``partition_activations`` splits the kept inputs over the tensor-parallel ranks
    (``blocks,partition``: each keeps its part, gathered whole in backward; with no tensor
    axis there is nothing to split, and DeepSpeed's does nothing either). ``contiguous_memory_optimization``, ``number_checkpoints``
    (the buffers it preallocates), ``synchronize_checkpoint_boundary`` and ``profile``
    change no number and are read quietly."""
    node, last = r._node(_AC)
    if not isinstance(node, Mapping) or last not in node or node[last] is None:
        if isinstance(node, Mapping) and last in node:  # "activation_checkpointing": null
            r.used.add(_AC)
        return
    if not isinstance(node[last], Mapping):
        r.errors.append(f"  {_AC}: expected dict, got {node[last]!r} ({type(node[last]).__name__})")
        return
    r.used.add(_AC)
    partition = r.get(_AC + ".partition_activations", bool, False)
    cpu = r.get(_AC + ".cpu_checkpointing", bool, False)
    for knob in ("contiguous_memory_optimization", "synchronize_checkpoint_boundary", "profile"):
        r.get(f"{_AC}.{knob}", bool, None)
    r.get(_AC + ".number_checkpoints", int | None, None)
    split = partition and kw["mesh"].get("tensor", 1) > 1
    kw["remat"] = {"policy": "blocks" + (",partition" if split else "") + (",offload" if cpu else "")}


_OFFLOAD = "zero_optimization.offload_optimizer"


def _offload_device(r: _Reader, block: str) -> str | None:
    """An offload block's ``device`` (None: not given; a ``null`` block is read as off)."""
    node, last = r._node(block)
    if isinstance(node, Mapping) and last in node and node[last] is None:  # "offload_optimizer": null
        r.used.add(block)
    return r.get(block + ".device", str, None,
                 ((lambda v: v.lower() in ("none", "cpu", "nvme")), "one of \"none\", \"cpu\", \"nvme\""))


def _ds_offload(r: _Reader, kw: dict) -> None:
    """``zero_optimization.offload_optimizer`` (and DeepSpeed's older ``cpu_offload``): the
    optimizer state in host memory or on NVMe (``TrainConfig.offload``). Its performance
    knobs (``fast_init``, ``pipeline_read``/``pipeline_write``: fsharded always reads the
    next bucket while updating this one) change no number; ``ratio`` below 1 (a part of the
    state left on the device) is not supported."""
    device = _offload_device(r, _OFFLOAD)
    old = r.get("zero_optimization.cpu_offload", bool, False)
    pin = r.get(_OFFLOAD + ".pin_memory", bool, None)
    old_pin = r.get("zero_optimization.cpu_offload_use_pin_memory", bool, None)
    nvme = r.get(_OFFLOAD + ".nvme_path", str, None)
    buffers = r.get(_OFFLOAD + ".buffer_count", int, None, _int_ge(1))
    ratio = r.get(_OFFLOAD + ".ratio", float, 1.0)
    for knob in ("fast_init", "pipeline_read", "pipeline_write", "pipeline"):
        r.get(f"{_OFFLOAD}.{knob}", bool, None)
    tier = device.lower() if device is not None else ("cpu" if old else "none")
    if tier == "none":
        _ds_offload_param(r, kw)
        if r.has(_ZENFLOW) and r._node(_ZENFLOW)[0][_ZENFLOW.rsplit(".", 1)[1]] is not None:
            r.use_block(_ZENFLOW)
            r.unsupported.append((f"{_ZENFLOW} without offload_optimizer", "ZenFlow overlaps the host-memory "
                                  "optimizer update: set offload_optimizer.device to \"cpu\" (as DeepSpeed requires)"))
        return
    off: dict = {"optimizer": tier}
    if nvme is not None:
        off["nvme_path"] = nvme
    if pin is not None or old_pin is not None:
        off["pin_memory"] = bool(pin if pin is not None else old_pin)
    if buffers is not None:
        off["buffer_count"] = buffers
    if ratio < 1.0:
        r.unsupported.append((f"{_OFFLOAD}.ratio = {ratio!r}", "a part of the optimizer state left on the device: "
                              "fsharded offloads all of it"))
    kw["offload"] = off
    _ds_offload_param(r, kw)
    _ds_zenflow(r, off)


_ZENFLOW = "zero_optimization.zenflow"


def _ds_zenflow(r: _Reader, off: dict) -> None:
    """``zero_optimization.zenflow``, over a host-memory or NVMe ``offload_optimizer``
    (``OffloadConfig.zenflow``): ``topk_ratio``, ``full_warm_up_rounds`` (warm-up steps)
    and ``select_interval`` in steps (``select_strategy: step``; ``auto`` and ``epoch``,
    which DeepSpeed counts in epochs, take fsharded's default of 100 steps, noted).
    ``overlap_step: true`` is fsharded's mode, the host update one step late beside the
    next step, on the cold gradients summed over ``update_interval`` steps (``auto``,
    which DeepSpeed adapts as it runs, takes 1, noted); ``false`` with ``update_interval``
    1 is the exact update, and above 1 (a host update in line every k steps) is not
    supported. ``offload``, ``auto_ratio``, ``pt_reserved_cores_perc`` and
    ``steps_per_epoch`` change no number here: read quietly."""
    if not r.has(_ZENFLOW):
        return
    node, last = r._node(_ZENFLOW)
    if node[last] is None:
        r.used.add(_ZENFLOW)
        return
    ratio = r.get(_ZENFLOW + ".topk_ratio", float, 0.1, ((lambda v: 0 < v <= 1), "a fraction in (0, 1]"))
    strategy = r.get(_ZENFLOW + ".select_strategy", str, "auto",
                     ((lambda v: v in ("auto", "step", "epoch")), "one of \"auto\", \"step\", \"epoch\""))
    interval = r.get(_ZENFLOW + ".select_interval", int, None, _int_ge(1))
    update = r.get(_ZENFLOW + ".update_interval", int, None, _int_ge(1))
    overlap = r.get(_ZENFLOW + ".overlap_step", bool, False)
    warmup = r.get(_ZENFLOW + ".full_warm_up_rounds", int, 0, _int_ge(0))
    for knob, tp in (("offload", bool), ("auto_ratio", float), ("pt_reserved_cores_perc", float),
                     ("steps_per_epoch", int)):
        r.get(f"{_ZENFLOW}.{knob}", tp, None)
    if off.get("optimizer") not in ("cpu", "nvme") or off.get("params", "none") != "none":
        r.unsupported.append((f"{_ZENFLOW} with offload_optimizer.device = {off.get('optimizer')!r}"
                              + (f" and offload_param.device = {off['params']!r}" if off.get("params") else ""),
                              "ZenFlow with offloaded parameters: fsharded updates the hot rows where the "
                              "parameters are, in device memory"))
        return
    if not overlap and update is not None and update > 1:
        r.unsupported.append((f"{_ZENFLOW}.overlap_step = false with update_interval = {update}", "the cold rows' "
                              "update run in line every few steps: fsharded runs it beside the next step "
                              "(overlap_step: true)"))
        return
    if not overlap:
        r.notes.append(f"{_ZENFLOW}: overlap_step false with update_interval 1 is the exact update (every row "
                       f"updated each step): run as offload_optimizer alone")
        return
    if strategy != "step" or interval is None:
        r.notes.append(f"{_ZENFLOW}: select_strategy {strategy!r} reselects once per epoch in DeepSpeed; fsharded "
                       f"reselects every {interval or 100} steps (offload.zenflow_select_interval)")
    if update is None:
        r.notes.append(f"{_ZENFLOW}: update_interval auto adapts as DeepSpeed runs; fsharded sums the cold rows' "
                       f"gradients over 1 step (offload.zenflow_update_interval)")
    off.update(zenflow=True, zenflow_topk_ratio=ratio, zenflow_select_interval=interval or 100,
               zenflow_warmup_steps=warmup, zenflow_update_interval=update or 1)


_PARAM = "zero_optimization.offload_param"


def _ds_offload_param(r: _Reader, kw: dict) -> None:
    """``zero_optimization.offload_param`` (and the older ``cpu_offload_params``): ZeRO-3's
    parameter shards in host memory or on NVMe (``OffloadConfig.params``), with the
    optimizer state offloaded too (``offload_optimizer``: the update streams both).
    ``buffer_count``, ``buffer_size`` and ``max_in_cpu`` size DeepSpeed's own buffers and
    change no number: read quietly."""
    device = _offload_device(r, _PARAM)
    old = r.get("zero_optimization.cpu_offload_params", bool, False)
    nvme = r.get(_PARAM + ".nvme_path", str | None, None)
    pin = r.get(_PARAM + ".pin_memory", bool, None)
    for knob, tp in (("buffer_count", int), ("buffer_size", int | float), ("max_in_cpu", int | float)):
        r.get(f"{_PARAM}.{knob}", tp, None)
    tier = device.lower() if device is not None else ("cpu" if old else "none")
    if tier == "none":
        return
    off = kw.get("offload")
    if off is None:
        asked = f"{_PARAM}.device = {tier!r}" if device is not None else "zero_optimization.cpu_offload_params = True"
        r.unsupported.append((f"{asked} without offload_optimizer",
                              "parameters offloaded with the optimizer state in device memory: fsharded streams the "
                              "parameters through the offloaded update (set offload_optimizer.device too)"))
        return
    stage = r.get("zero_optimization.stage", int, 0)
    if stage != 3:  # DeepSpeed reads it at ZeRO-3 only
        r.notes.append(f"{_PARAM}: DeepSpeed offloads parameters at stage 3 only, so at stage {stage} it is not "
                       f"applied here either (fsharded's offload.params would keep the master shards in the tier "
                       f"at stages 1-2 too)")
        return
    if nvme is not None and off.get("nvme_path", nvme) != nvme:
        r.unsupported.append((f"{_PARAM}.nvme_path = {nvme!r}", "parameters on another disk than the optimizer "
                              "state: fsharded keeps both under one nvme_path"))
        return
    if nvme is not None:
        off["nvme_path"] = nvme
    if pin is not None and "pin_memory" not in off:
        off["pin_memory"] = bool(pin)
    off["params"] = tier


def _load_deepspeed(ds_config: Mapping | str | Path) -> dict:
    if isinstance(ds_config, Mapping):
        return dict(ds_config)
    if isinstance(ds_config, str) and ds_config.lstrip().startswith("{"):
        return json.loads(ds_config, object_pairs_hook=_no_duplicates)
    if isinstance(ds_config, str | Path):
        path = Path(ds_config)
        if not path.exists():
            raise FileNotFoundError(f"DeepSpeed config {path} does not exist")
        try:
            return _read_json(path)
        except ValueError as e:
            hint = ("; DeepSpeed also reads hjson (comments, trailing commas), fsharded reads strict "
                    "JSON") if "not valid JSON" in str(e) else ""
            raise ValueError(f"DeepSpeed {e}{hint}") from None
    raise TypeError(f"ds_config: expected a dict, a JSON string or a path, got {ds_config!r}")


def from_deepspeed(
    ds_config: Mapping | str | Path, *, data_parallel_size: int | None = None,
    allow_ignored: bool = False, **overrides: Any
) -> TrainConfig:
    """A ``TrainConfig`` from a DeepSpeed config (dict, JSON text or path to a JSON file).

    Read: the batch triple, ``fp16`` (``enabled``, ``loss_scale`` with 0 = dynamic,
    ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``, ``min_loss_scale``,
    ``consecutive_hysteresis``), ``bf16``, ``communication_data_type``, ``optimizer``
    (``Adam`` is AdamW unless ``params.adam_w_mode`` is false, as in DeepSpeed; omitted
    hyperparameters take the defaults of the optimizer DeepSpeed would build),
    ``scheduler``, ``gradient_clipping``, ``zero_optimization.stage`` and
    ``offload_optimizer``, ``activation_checkpointing`` (the model's blocks recomputed:
    ``remat``), ``steps_per_print`` (``log_every``) and ``seed``. Keys with the wrong type are a ``ValueError`` listing
    each path; ``"auto"`` (Hugging Face Trainer placeholders) counts as unset, with a
    warning (batch sizes all "auto" or absent: a micro batch of 1, as ``TrainConfig``'s
    default, which ``micro_batch_size=`` / ``fsharded train --batch`` set, as HF Trainer
    fills them from its arguments).

    A feature fsharded does not have yet, turned on — ``zero_optimization.offload_param``
    with a ``device`` other than ``"none"``, ``partition_activations`` with tensor
    parallelism, ``flops_profiler.enabled``, Apex ``amp``, ZeRO++ quantization, elasticity,
    curriculum learning and the rest of ``_deepspeed_unsupported.FEATURES``, or a setting
    fsharded has only at DeepSpeed's default (``optimizer.params.amsgrad: true``) — is a
    ``ValueError`` naming each key, unless ``allow_ignored=True`` (``fsharded train
    --allow-ignored``): then the config is read without them and a ``ConfigWarning``
    names them. At their off values these keys are read without a word. Other keys
    fsharded does not use are named in a ``ConfigWarning`` (printed as its message alone).

    The data-parallel size is ``data_parallel_size``, else ``mesh['data']`` from
    ``overrides``, else — when all three batch sizes are given — the one they imply,
    else 1. ``overrides`` are ``TrainConfig`` fields (``steps``, ``seq_len``, ``model``,
    ``mesh``...) applied last.

    >>> cfg = from_deepspeed({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
    ...                       "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
    ...                       "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}},
    ...                      data_parallel_size=2)
    >>> cfg.grad_accum_steps, cfg.precision, cfg.zero_stage, cfg.mesh, cfg.optimizer.name
    (4, 'fp16', 2, {'data': 2}, 'adamw')
    """
    ds = _load_deepspeed(ds_config)
    r = _Reader(ds)
    kw: dict[str, Any] = {}
    train, micro, accum = (r.get(k, int, None, _int_ge(1)) for k in _DS_BATCH)
    mesh = dict(overrides.pop("mesh", None) or {})
    dp = _ds_data_parallel(r, train, micro, accum, data_parallel_size, mesh)
    kw["mesh"] = {"data": dp, **{k: v for k, v in mesh.items() if k != "data"}}
    sp = r.get("sequence_parallel_size", int, 1, _int_ge(1))  # DeepSpeed-Ulysses' degree
    if sp > 1:
        if mesh.get("seq", sp) != sp:
            r.errors.append(f"  sequence_parallel_size: {sp}, but the mesh's 'seq' axis is {mesh['seq']}")
        kw["mesh"]["seq"] = sp
        kw["model"] = {**overrides.pop("model", {}), "seq_parallel": "ulysses"}
    _ds_pipeline(r, kw, mesh)
    _ds_precision(r, kw)
    _ds_optimizer(r, kw)
    _ds_scheduler(r, kw)
    kw["grad_clip"] = r.get("gradient_clipping", float, 0.0, _NONNEG)
    zero = r.get("zero_optimization", dict | bool, {})
    if isinstance(zero, bool):  # DeepSpeed's deprecated form: true means stage 1
        kw["zero_stage"] = int(zero)
    else:
        kw["zero_stage"] = r.get("zero_optimization.stage", int, 0,
                                 ((lambda v: 0 <= v <= 3), "an int in 0..3"))
    _ds_offload(r, kw)
    _ds_activation_checkpointing(r, kw)
    kw["log_every"] = r.get("steps_per_print", int, 10, _int_ge(1))
    if r.has("seed"):
        kw["seed"] = r.get("seed", int, 0)
    _ds_unsupported(r)

    if not r.errors:
        # Batch sizes left to HF Trainer ("auto") are TrainConfig's default micro batch (1),
        # as HF fills them from its arguments: micro_batch_size= (fsharded train --batch) sets them.
        auto_batch = any(k in r.auto for k in _DS_BATCH[:2])
        try:
            kw["train_batch_size"], kw["micro_batch_size"], kw["grad_accum_steps"] = resolve_batch(
                train, micro, accum, dp, names=(*_DS_BATCH, "data parallel size"),
                default_micro=1 if auto_batch else None)
        except ValueError as e:
            r.errors.append(f"  {', '.join(_DS_BATCH)}: {e}")
    r.errors += r.misspelt()
    if r.errors and r.auto:
        r.errors.append(f"  (\"auto\" in {', '.join(r.auto)}: a Hugging Face Trainer placeholder, read "
                        f"as unset; give a number instead)")
    refused = [] if allow_ignored else _unsupported_lines(r)
    if r.errors or refused:
        head = ["invalid DeepSpeed config:", *r.errors] if r.errors else []
        if refused:
            head += [("" if r.errors else "DeepSpeed config: ") + "settings fsharded does not support yet:",
                     *(f"  {line}" for line in refused), HOW_TO_RUN]
        raise ValueError("\n".join(head))
    if r.unsupported:
        r.notes.append("settings fsharded does not support yet, ignored (allow_ignored):\n    "
                       + "\n    ".join(_unsupported_lines(r)))
    if r.auto:
        r.notes.append("\"auto\" values (Hugging Face Trainer placeholders) treated as unset: "
                       + ", ".join(r.auto))
    unused = r.unused()
    if unused:
        r.notes.append("keys fsharded does not use (ignored):\n    " + "\n    ".join(unused))
    if r.notes:
        _warn("DeepSpeed config:\n  " + "\n  ".join(r.notes), stacklevel=2)
    cfg = TrainConfig(**kw)
    return cfg.replace(**overrides) if overrides else cfg


def _message_only(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  line: str | None = None) -> str:
    return f"{message}\n"


def _warn(message: str, *, stacklevel: int) -> None:
    """``warnings.warn(message, ConfigWarning)``, printed as the message alone: the file and
    line Python would print are fsharded's own (``fsharded train``'s call), which tell a
    user nothing. Only how this one warning prints changes, for the duration of the call:
    filters, ``-W error`` and ``pytest.warns`` (which record warnings, not print them) see
    an ordinary ``ConfigWarning``."""
    shown = warnings.formatwarning
    warnings.formatwarning = _message_only
    try:
        warnings.warn(message, ConfigWarning, stacklevel=stacklevel + 1)
    finally:
        warnings.formatwarning = shown


def _ds_unsupported(r: _Reader) -> None:
    """Record each feature of ``FEATURES`` the config turns on; read its block's other keys."""
    for f in FEATURES:
        block = f.key.rpartition(".")[0]
        node, last = r._node(block)
        if isinstance(node, Mapping) and last in node and node[last] is None:  # "offload_param": null
            r.used.add(block)
        v = r.get(f.key, f.tp, None, CHECKS.get(f.key))
        for k in f.with_it:
            if k == "*":
                r.use_block(block)
            elif r.has(f"{block}.{k}"):
                r.used.add(f"{block}.{k}")
        if v is not None and not f.off(v):
            r.unsupported.append((f"{f.key} = {v!r}", f.what))


def _unsupported_lines(r: _Reader) -> list[str]:
    """One line per reason: the settings asking for it, then what it is."""
    by_what: dict[str, list[str]] = {}
    for setting, what in r.unsupported:
        by_what.setdefault(what, []).append(setting)
    return [f"{', '.join(settings)}: {what}" for what, settings in by_what.items()]


def sequence_parallel_size(ds_config: Mapping | str | Path) -> int:
    """A DeepSpeed config's ``sequence_parallel_size`` (1 when absent): the ranks of a
    job are data x sequence parallel, as DeepSpeed counts them."""
    v = _load_deepspeed(ds_config).get("sequence_parallel_size", 1)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else 1


_DS_KEY_OF = {"log_every": "steps_per_print", "seed": "seed", "remat": _AC}


def given(ds_config: Mapping | str | Path, fields: tuple[str, ...] = tuple(_DS_KEY_OF)) -> tuple[str, ...]:
    """Which of the ``TrainConfig`` fields ``log_every`` (``steps_per_print``), ``seed`` and
    ``remat`` (``activation_checkpointing``) a DeepSpeed config gives (``"auto"`` gives
    nothing): ``fsharded train`` takes these from the config only when it gives them, and
    keeps its own otherwise."""
    ds = _load_deepspeed(ds_config)
    return tuple(f for f in fields if ds.get(_DS_KEY_OF[f], "auto") != "auto")


def _ds_data_parallel(r: _Reader, train: int | None, micro: int | None, accum: int | None,
                      data_parallel_size: int | None, mesh: dict) -> int:
    if data_parallel_size is not None:
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) \
                or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size: expected an int >= 1, got {data_parallel_size!r}")
        if mesh.get("data", data_parallel_size) != data_parallel_size:
            raise ValueError(
                f"data_parallel_size {data_parallel_size} != mesh['data'] {mesh['data']}"
            )
        return data_parallel_size
    if "data" in mesh:
        return mesh["data"]
    if None not in (train, micro, accum):
        if train % (micro * accum):
            r.errors.append(
                f"  {', '.join(_DS_BATCH)}: train_batch_size {train} is not a multiple of "
                f"train_micro_batch_size_per_gpu {micro} * gradient_accumulation_steps {accum} "
                f"= {micro * accum}, so no data parallel size fits"
            )
        return max(1, train // (micro * accum))
    return 1


def _ds_precision(r: _Reader, kw: dict) -> None:
    ds = r.d
    bf16 = "bf16" if "bf16" in ds or "bfloat16" not in ds else "bfloat16"
    r.get("fp16", dict)
    r.get(bf16, dict)
    fp16_on = r.get("fp16.enabled", bool, False)
    bf16_on = r.get(f"{bf16}.enabled", bool, False)
    if fp16_on and bf16_on:
        r.errors.append(f"  fp16.enabled, {bf16}.enabled: fp16 and bf16 cannot both be enabled")
    kw["precision"] = "fp16" if fp16_on else "bf16" if bf16_on else "fp32"
    ls = LossScaleConfig()
    kw["loss_scale"] = LossScaleConfig(
        loss_scale=r.get("fp16.loss_scale", float, ls.loss_scale, _NONNEG),
        initial_scale_power=r.get("fp16.initial_scale_power", int, ls.initial_scale_power,
                                  ((lambda v: -126 <= v <= 127), "an int in [-126, 127]")),
        loss_scale_window=r.get("fp16.loss_scale_window", int, ls.loss_scale_window, _int_ge(1)),
        hysteresis=r.get("fp16.hysteresis", int, ls.hysteresis, _int_ge(1)),
        min_loss_scale=r.get("fp16.min_loss_scale", float, ls.min_loss_scale, _POS),
        consecutive_hysteresis=r.get("fp16.consecutive_hysteresis", bool, False),
    )
    r.default_only("fp16.fp16_master_weights_and_grads", False)
    for k in ("check_grad_overflow", "bf16_master_weights_and_grads", "bf16_optimizer_states"):
        r.default_only(f"{bf16}.{k}", False)
    comm = r.get("communication_data_type", str, None,
                 ((lambda v: v.lower() in _DTYPES), "one of fp32, bf16, fp16"))
    kw["reduce_dtype"] = comm.lower() if comm else None


def _ds_optimizer(r: _Reader, kw: dict) -> None:
    if r.has("optimizer") and r.get("optimizer", dict) is not None:
        typ = r.get("optimizer.type", str)
        name = typ.lower() if typ else None
        if typ is None and not r.auto:
            r.errors.append("  optimizer.type: required (e.g. \"AdamW\")")
        elif name == "adam":
            name = "adamw" if r.get("optimizer.params.adam_w_mode", bool, True) else "adam"
        elif name == "adamw":
            r.get("optimizer.params.adam_w_mode", bool, True)  # AdamW stays AdamW either way
        elif name is not None and name not in OPTIMIZERS:
            r.errors.append(
                f"  optimizer.type: {typ!r} is not supported; expected one of Adam, AdamW, SGD, "
                "Lion, Adagrad, Lamb"
            )
        if r.has("optimizer.params.max_grad_norm"):
            r.errors.append(
                "  optimizer.params.max_grad_norm: not an optimizer parameter (DeepSpeed rejects "
                "it too); use the top-level \"gradient_clipping\""
            )
        if name in _DS_OPT_DEFAULTS:
            dflt, p = _DS_OPT_DEFAULTS[name], "optimizer.params."
            opt: dict[str, Any] = {"name": name, "lr": r.get(p + "lr", float, dflt["lr"], _NONNEG),
                                   "weight_decay": r.get(p + "weight_decay", float, 0.0, _NONNEG)}
            if "betas" in dflt:
                opt["betas"] = r.get(p + "betas", tuple[float, float], dflt["betas"])
            if "eps" in dflt:
                opt["eps"] = r.get(p + "eps", float, dflt["eps"], _POS)
            if name == "sgd":
                opt["momentum"] = r.get(p + "momentum", float, 0.0, _NONNEG)
                opt["nesterov"] = r.get(p + "nesterov", bool, False)
            opt["extra"] = {k: r.get(p + k, tp) for k, tp in _OPTIMIZER_EXTRAS.get(name, {}).items()
                            if r.has(p + k)}
            # Settings fsharded's optimizers only have at DeepSpeed's defaults.
            for k, v in (("bias_correction", True), ("amsgrad", False), ("max_coeff", 10.0),
                         ("min_coeff", 0.01)):
                r.default_only(p + k, v)
            kw["optimizer"] = opt
    else:
        r.notes.append(
            "no \"optimizer\" block (DeepSpeed would use the optimizer passed in code): using "
            f"{OptimizerConfig()!r}"
        )


def _ds_scheduler(r: _Reader, kw: dict) -> None:
    if r.has("scheduler") and r.get("scheduler", dict) is not None:
        typ = r.get("scheduler.type", str)
        name = _SCHEDULER_BY_LOWER.get(typ.lower()) if typ else None
        if name in (None, "constant", "linear"):
            ds_names = [k for k in SCHEDULERS if k not in ("constant", "linear")]
            r.errors.append(f"  scheduler.type: expected one of {', '.join(ds_names)}, got {typ!r}")
        else:
            r.get("scheduler.params", dict)
            params = {}
            for k, tp in SCHEDULERS[name].items():
                path = f"scheduler.params.{k}"
                if r.has(path):
                    v = r.get(path, tp, None, _SCHEDULER_CHECKS.get(k))
                    if path not in r.auto:  # "auto" is unset: DeepSpeed's default (WarmupLR's: below)
                        params[k] = v
            for k in _REQUIRED_PARAMS.get(name, ()):
                if k not in params:
                    r.errors.append(f"  scheduler.params.{k}: required by {name}")
            if name == "WarmupLR" and "warmup_max_lr" not in params:
                # DeepSpeed 0.19's WarmupLR warms up to the optimizer's lr by default
                params["warmup_max_lr"] = kw.get("optimizer", {}).get("lr", OptimizerConfig.lr)
            r.default_only("scheduler.params.last_batch_iteration", -1)
            opt_name = kw.get("optimizer", {}).get("name", OptimizerConfig.name)
            if name == "OneCycle" and opt_name != "sgd" and opt_name != "adagrad" \
                    and r.get("scheduler.params.cycle_momentum", bool, True):
                r.notes.append(
                    "OneCycle: DeepSpeed also cycles beta1 between cycle_min_mom and "
                    "cycle_max_mom (cycle_momentum defaults to true); fsharded schedules only "
                    "the learning rate"
                )
            kw["scheduler"] = {"name": name, "params": params}
