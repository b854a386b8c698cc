"""Training configuration: a typed, frozen ``TrainConfig``; TOML/JSON files; CLI overrides;
and DeepSpeed JSON configs read into the same object.

Every field is validated when the config is built, and every error names the field
path, the value and what was expected — all failing fields at once::

    >>> cfg = TrainConfig(mesh={"data": 2}, micro_batch_size=4, grad_accum_steps=2,
    ...                   optimizer={"name": "adamw", "lr": 3e-4}, precision="bf16")
    >>> cfg.train_batch_size                      # derived: 4 * 2 * mesh['data']
    16
    >>> apply_overrides(cfg, {"optimizer.lr": "1e-3", "mesh.data": "4"}).train_batch_size
    32
    >>> TrainConfig(steps=0)
    Traceback (most recent call last):
    ...
    ValueError: invalid TrainConfig:
      steps: expected an int >= 1, got 0

DeepSpeed configs (``from_deepspeed``) are read with DeepSpeed's own rules: any two of
``train_batch_size`` / ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps``
give the third; ``"Adam"`` means AdamW unless ``adam_w_mode`` is false; ``loss_scale: 0``
means dynamic loss scaling. A feature it does not have yet, turned on (parameter offload,
activation checkpointing...), is an error unless ``allow_ignored=True``; keys fsharded does
not use are named in one ``ConfigWarning``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from fsharded.config._batch import resolve_batch
from fsharded.config._offload import OffloadConfig
from fsharded.config._pipeline import PipelineConfig
from fsharded.config._remat import RematConfig
from fsharded.precision import DynamicLossScale, Policy, StaticLossScale

__all__ = [
    "TrainConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "LossScaleConfig",
    "ConfigWarning",
    "load_config",
    "read_file",
    "apply_overrides",
    "parse_overrides",
    "OPTIMIZERS",
    "SCHEDULERS",
]


class ConfigWarning(UserWarning):
    """Config keys that were read but have no effect in fsharded (filterable; a DeepSpeed
    config's is printed as its message alone)."""


# -- validation machinery -------------------------------------------------------------------
#
# Each config class declares per-field range checks; types come from the annotations, so
# a field's declared type is its contract for TOML, JSON, constructors and CLI overrides.


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) is tuple:
        return f"a pair of {_type_name(args[0])}s"
    return getattr(tp, "__name__", str(tp))


def _coerce(v: Any, tp: Any) -> tuple[bool, Any]:
    """``(ok, value)``: ``v`` checked against annotation ``tp``, with lossless coercions
    (int -> float, integral float -> int, list -> tuple, Mapping -> dict copy)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if args and origin is not tuple and origin is not dict:  # a union
        for a in args:
            ok, cv = _coerce(v, a)
            if ok:
                return True, cv
        return False, v
    if tp is type(None):
        return v is None, v
    if tp is bool:
        return isinstance(v, bool), v
    if tp is int:
        if isinstance(v, float) and v.is_integer():
            return True, int(v)
        return isinstance(v, int) and not isinstance(v, bool), v
    if tp is float:
        ok = isinstance(v, int | float) and not isinstance(v, bool)
        return ok, float(v) if ok else v
    if tp is str:
        return isinstance(v, str), v
    if tp is dict or origin is dict:
        return isinstance(v, Mapping), dict(v) if isinstance(v, Mapping) else v
    if origin is tuple:
        if not isinstance(v, list | tuple) or len(v) != len(args):
            return False, v
        out = [_coerce(x, a) for x, a in zip(v, args)]
        return all(ok for ok, _ in out), tuple(x for _, x in out)
    return isinstance(v, tp), v


_Check = tuple[Callable[[Any], bool], str]


def _validate(obj: Any, prefix: str, checks: Mapping[str, _Check]) -> list[str]:
    """Type- and range-check every field of dataclass ``obj`` (coercing in place)."""
    errors: list[str] = []
    hints = _hints(type(obj))
    for f in fields(obj):
        v, tp, path = getattr(obj, f.name), hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(tp):
            continue  # nested configs validate themselves
        ok, cv = _coerce(v, tp)
        if not ok:
            errors.append(f"  {path}: expected {_type_name(tp)}, got {v!r} ({type(v).__name__})")
            continue
        object.__setattr__(obj, f.name, cv)
        if f.name in checks and cv is not None:
            pred, want = checks[f.name]
            if not pred(cv):
                errors.append(f"  {path}: expected {want}, got {cv!r}")
    return errors


def _raise(cls: type, errors: list[str]) -> None:
    if errors:
        raise ValueError(f"invalid {cls.__name__}:\n" + "\n".join(errors))


def _suggest(key: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _int_ge(n: int) -> _Check:
    return (lambda v: v >= n), f"an int >= {n}"


_NONNEG: _Check = (lambda v: math.isfinite(v) and v >= 0), "a finite number >= 0"
_POS: _Check = (lambda v: math.isfinite(v) and v > 0), "a finite number > 0"


# -- nested sections ------------------------------------------------------------------------

OPTIMIZERS = ("adamw", "adam", "sgd", "lion", "adagrad", "lamb")
_OPTIMIZER_EXTRAS: dict[str, dict[str, type]] = {
    "sgd": {"dampening": float},
    "adagrad": {"lr_decay": float, "initial_accumulator_value": float},
}


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer and its hyperparameters (``None`` = the optimizer's own default).

    ``"adamw"`` decouples weight decay from the gradient (Loshchilov & Hutter);
    ``"adam"`` adds it to the gradient (L2), as ``torch.optim.Adam`` does.
    """

    name: str = "adamw"
    """One of ``adamw adam sgd lion adagrad lamb``."""
    lr: float = 3e-4
    """Peak learning rate (schedules scale it; DeepSpeed's Warmup* set their own)."""
    betas: tuple[float, float] | None = None
    """Adam/Lamb/Lion betas."""
    eps: float | None = None
    """Denominator epsilon (Adam, Lamb, Adagrad)."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for adamw/lion/lamb, L2 for adam/sgd/adagrad)."""
    momentum: float = 0.0
    """SGD momentum."""
    nesterov: bool = False
    """SGD Nesterov momentum."""
    extra: dict = field(default_factory=dict)
    """Optimizer-specific settings: sgd ``dampening``; adagrad ``lr_decay
    initial_accumulator_value``."""

    def __post_init__(self) -> None:
        unit = (lambda v: 0 <= v < 1), "a number in [0, 1)"
        errors = _validate(self, "optimizer.", {
            "name": ((lambda v: v in OPTIMIZERS), f"one of {', '.join(OPTIMIZERS)}"),
            "lr": _NONNEG, "eps": _POS, "weight_decay": _NONNEG,
            "momentum": unit,
            "betas": ((lambda v: all(0 <= b < 1 for b in v)), "two numbers in [0, 1)"),
        })
        if isinstance(self.name, str) and self.name in OPTIMIZERS:
            known = _OPTIMIZER_EXTRAS.get(self.name, {})
            for k, v in self.extra.items():
                if k not in known:
                    errors.append(
                        f"  optimizer.extra.{k}: not a setting of {self.name}{_suggest(k, known)};"
                        f" known: {', '.join(known) or 'none'}"
                    )
                elif not _coerce(v, known[k])[0]:
                    errors.append(f"  optimizer.extra.{k}: expected {known[k].__name__}, got {v!r}")
        _raise(type(self), errors)


_F, _I, _S = float, int, str
_WARMUP = {"warmup_min_lr": _F, "warmup_max_lr": _F, "warmup_num_steps": _I, "warmup_type": _S}
SCHEDULERS: dict[str, dict[str, Any]] = {
    "constant": {},
    "linear": {"final_lr": _F, "total_steps": _I},
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {**_WARMUP, "total_num_steps": _I},
    "WarmupCosineLR": {"total_num_steps": _I, "warmup_min_ratio": _F, "warmup_num_steps": _I,
                       "cos_min_ratio": _F, "warmup_type": _S},
    "OneCycle": {"cycle_min_lr": _F, "cycle_max_lr": _F, "decay_lr_rate": _F,
                 "cycle_first_step_size": _I, "cycle_second_step_size": _I | None,
                 "cycle_first_stair_count": _I, "cycle_second_stair_count": _I | None,
                 "decay_step_size": _I},
}
"""Parameters (and their types) of each schedule: the keyword arguments of the schedules
in ``fsharded.optim`` (DeepSpeed's names for DeepSpeed's schedules)."""
_REQUIRED_PARAMS = {
    "WarmupDecayLR": ("total_num_steps",),
    "WarmupCosineLR": ("total_num_steps",),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
}
_SCHEDULER_BY_LOWER = {k.lower(): k for k in SCHEDULERS}
_SCHEDULER_CHECKS: dict[str, _Check] = {
    # rates and ratios of a rate: a nan, inf or negative one would reach every parameter
    **dict.fromkeys(("warmup_min_lr", "warmup_max_lr", "final_lr", "cycle_min_lr", "cycle_max_lr",
                     "warmup_min_ratio", "cos_min_ratio", "decay_lr_rate"), _NONNEG),
    # numbers of updates (as the schedules themselves check them): a schedule of 0 steps
    # has no length to decay over
    **dict.fromkeys(("total_num_steps", "total_steps", "warmup_num_steps", "cycle_first_step_size"),
                    _int_ge(1)),
    **dict.fromkeys(("cycle_second_step_size", "cycle_first_stair_count",
                     "cycle_second_stair_count", "decay_step_size"), _int_ge(0)),
}
"""The range of each schedule parameter (by name: a name means the same in every schedule)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """The learning-rate schedule: a name and its parameters.

    ``constant`` (``optimizer.lr`` throughout); ``linear`` (from ``optimizer.lr`` to
    ``final_lr``, default 0, over ``total_steps``, default ``TrainConfig.steps``); DeepSpeed's
    ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` (a ratio of ``optimizer.lr``) and
    ``OneCycle``, with DeepSpeed's parameter names and meanings (``fsharded.optim``
    implements them). Names match case-insensitively.
    """

    name: str = "constant"
    """Schedule name (see the class docstring)."""
    params: dict = field(default_factory=dict)
    """Schedule parameters, checked against ``SCHEDULERS[name]``."""

    def __post_init__(self) -> None:
        if isinstance(self.name, str) and self.name.lower() in _SCHEDULER_BY_LOWER:
            object.__setattr__(self, "name", _SCHEDULER_BY_LOWER[self.name.lower()])
        errors = _validate(self, "scheduler.", {
            "name": ((lambda v: v in SCHEDULERS), f"one of {', '.join(SCHEDULERS)}"),
        })
        if not errors:
            known = SCHEDULERS[self.name]
            for k, v in self.params.items():
                if k not in known:
                    errors.append(
                        f"  scheduler.params.{k}: not a parameter of {self.name}"
                        f"{_suggest(k, known)}; known: {', '.join(known) or 'none'}"
                    )
                    continue
                ok, cv = _coerce(v, known[k])
                if not ok:
                    errors.append(
                        f"  scheduler.params.{k}: expected {_type_name(known[k])}, got {v!r}"
                    )
                elif cv is not None and k in _SCHEDULER_CHECKS and not _SCHEDULER_CHECKS[k][0](cv):
                    errors.append(f"  scheduler.params.{k}: expected {_SCHEDULER_CHECKS[k][1]}, got {cv!r}")
                self.params[k] = cv
            for k in _REQUIRED_PARAMS.get(self.name, ()):
                if k not in self.params:
                    errors.append(f"  scheduler.params.{k}: required by {self.name}")
            wt = self.params.get("warmup_type")
            if wt is not None and wt not in ("log", "linear"):
                errors.append(f"  scheduler.params.warmup_type: expected 'log' or 'linear', got {wt!r}")
        _raise(type(self), errors)


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16 loss scaling, with DeepSpeed's names and defaults (used when precision is fp16)."""

    loss_scale: float = 0.0
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at ``2**initial_scale_power``."""
    loss_scale_window: int = 1000
    """Overflow-free steps before the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale halves."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic scale."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis on every overflow-free step (only consecutive overflows count)."""

    def __post_init__(self) -> None:
        _raise(type(self), _validate(self, "loss_scale.", {
            "loss_scale": _NONNEG,
            "initial_scale_power": ((lambda v: -126 <= v <= 127), "an int in [-126, 127]"),
            "loss_scale_window": _int_ge(1), "hysteresis": _int_ge(1), "min_loss_scale": _POS,
        }))

    def build(self) -> DynamicLossScale | StaticLossScale:
        """The ``fsharded.precision`` loss scaler these settings describe."""
        if self.loss_scale > 0:
            return StaticLossScale(self.loss_scale)
        return DynamicLossScale(
            initial_scale_power=self.initial_scale_power,
            loss_scale_window=self.loss_scale_window,
            hysteresis=self.hysteresis,
            min_loss_scale=self.min_loss_scale,
            consecutive_hysteresis=self.consecutive_hysteresis,
        )


# -- TrainConfig ----------------------------------------------------------------------------

_BATCH = ("train_batch_size", "micro_batch_size", "grad_accum_steps")
_SECTIONS = {"optimizer": OptimizerConfig, "scheduler": SchedulerConfig, "loss_scale": LossScaleConfig,
             "pipeline": PipelineConfig, "offload": OffloadConfig, "remat": RematConfig}
_PRECISIONS = ("fp32", "bf16", "fp16")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs, validated at construction.

    Sections (``optimizer``, ``scheduler``, ``loss_scale``) accept their config objects or
    plain dicts. Of the batch triple, give any two (or ``micro_batch_size`` alone): the
    third is derived, and a given triple must satisfy ``train_batch_size ==
    micro_batch_size * grad_accum_steps * mesh['data']``.
    """

    model: dict = field(default_factory=dict)
    """Model settings (for the reference GPT: ``GPTConfig`` fields, or a ``preset`` plus
    overrides); opaque to this module."""
    mesh: dict = field(default_factory=lambda: {"data": 1})
    """Mesh axes in order, name -> size; the batch is split over the ``"data"`` axis."""
    steps: int = 1000
    """Optimizer steps to run."""
    micro_batch_size: int | None = None
    """Sequences per batch shard per micro-step (DeepSpeed's train_micro_batch_size_per_gpu):
    per data shard, or per data x expert shard with an expert axis."""
    grad_accum_steps: int | None = None
    """Micro-steps whose gradients are averaged into one optimizer step (as DeepSpeed,
    which scales each micro-step's loss by ``1 / gradient_accumulation_steps``)."""
    train_batch_size: int | None = None
    """Sequences per optimizer step over all shards = micro * accum * mesh['data']."""
    seq_len: int = 256
    """Tokens per sequence."""
    precision: str = "fp32"
    """``fp32``, ``bf16`` or ``fp16`` (see ``fsharded.precision.Policy``)."""
    reduce_dtype: str | None = None
    """Gradient-reduction dtype (``fp32 bf16 fp16``); ``None`` takes the policy's (fp32)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16 loss scaling (ignored for fp32/bf16)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer name and hyperparameters."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""
    grad_clip: float = 0.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    zero_stage: int = 0
    """ZeRO stage: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters sharded."""
    seed: int = 0
    """Seed for parameter init and data order."""
    data: str = "stdlib"
    """Training text: ``"stdlib"`` (Python's standard library sources) or a file/dir path."""
    metrics_file: str | None = None
    """JSON-lines file of per-step metrics (``fsharded train``: a new run replaces it, a resumed
    one keeps the records up to the resumed step and appends); ``None`` = no file."""
    log_every: int = 10
    """Print metrics every this many steps (DeepSpeed's ``steps_per_print``)."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """With a ``pipe`` mesh axis: schedule, micro-batches (the accumulation), stages per rank."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Where the optimizer state lives: device memory, host memory or NVMe (needs zero_stage 1-3)."""
    remat: RematConfig = field(default_factory=RematConfig)
    """Blocks recomputed in backward (``policy``: ``none``, ``blocks``, ``blocks:K``)."""
    compile: bool | str = "auto"
    """Capture the step as one graph and compile it (``train_step(compile=True)``): true,
    false, or ``"auto"``: where it applies and pays (a job of 200 steps or more, Inductor
    able to generate code here, a layout that captures as one graph)."""

    def __post_init__(self) -> None:
        errors: list[str] = []
        for name, cls in _SECTIONS.items():
            v = getattr(self, name)
            if isinstance(v, Mapping):
                try:
                    object.__setattr__(self, name, _from_mapping(cls, v, name + "."))
                except ValueError as e:
                    errors.extend(str(e).splitlines()[1:])
            elif not isinstance(v, cls):
                errors.append(f"  {name}: expected {cls.__name__} or a dict, got {v!r}")
        errors += _validate(self, "", {
            "mesh": ((lambda m: all(isinstance(k, str) and isinstance(s, int)
                                    and not isinstance(s, bool) and s >= 1 for k, s in m.items())),
                     "a dict of axis name -> int >= 1"),
            "model": ((lambda m: all(isinstance(k, str) for k in m)), "a dict with str keys"),
            "steps": _int_ge(1), "micro_batch_size": _int_ge(1), "grad_accum_steps": _int_ge(1),
            "train_batch_size": _int_ge(1), "seq_len": _int_ge(1),
            "precision": ((lambda v: v in _PRECISIONS), "one of fp32, bf16, fp16"),
            "reduce_dtype": ((lambda v: v in _PRECISIONS), "one of fp32, bf16, fp16 or None"),
            "grad_clip": _NONNEG,
            "zero_stage": ((lambda v: 0 <= v <= 3), "an int in 0..3"),
            "data": ((lambda v: bool(v)), "'stdlib' or a path"),
            "log_every": _int_ge(1),
            "compile": ((lambda v: isinstance(v, bool) or v == "auto"), "true, false or 'auto'"),
        })
        off = self.offload if isinstance(self.offload, OffloadConfig) else OffloadConfig()  # (a dict: reported)
        if off.active and not self.zero_stage:
            errors.append(f"  offload.optimizer={off.optimizer}: needs zero_stage 1, 2 or 3 (as DeepSpeed's "
                          f"offload_optimizer does)")
        if off.params != "none" and not self.zero_stage:
            errors.append(f"  offload.params={off.params}: needs zero_stage 1, 2 or 3 (the master weights' shards)")
        _raise(type(self), errors)
        mb = self.pipeline.microbatches
        if mb is not None and self.grad_accum_steps not in (None, mb):
            _raise(type(self), [f"  pipeline.microbatches {mb} != grad_accum_steps {self.grad_accum_steps}: the "
                                f"pipeline's micro-batches are the accumulation; give one of them"])
        try:
            triple = resolve_batch(
                self.train_batch_size, self.micro_batch_size, self.grad_accum_steps if mb is None else mb,
                self.data_parallel_size, default_micro=1,
                names=(*_BATCH, "data parallel size (mesh['data'] x mesh['expert'])"),
            )
        except ValueError as e:
            _raise(type(self), [f"  {', '.join(_BATCH)}: {e}"])
        for name, v in zip(_BATCH, triple):
            object.__setattr__(self, name, v)

    @property
    def data_parallel_size(self) -> int:
        """The batch shards: the mesh's ``"data"`` axis times its ``"expert"`` axis (expert
        parallelism inside data parallelism, as DeepSpeed's: each expert shard takes its
        own rows); 1 without either."""
        return self.mesh.get("data", 1) * self.mesh.get("expert", 1)

    def policy(self) -> Policy:
        """The mixed-precision ``Policy`` for ``precision`` and ``reduce_dtype``, carrying
        the configured loss scaler for fp16."""
        kw: dict[str, Any] = {}
        if self.reduce_dtype is not None:
            kw["reduce_dtype"] = _DTYPES[self.reduce_dtype]
        if self.precision == "fp16":
            kw["loss_scale"] = self.loss_scale.build()
        return Policy.from_name(self.precision, **kw)

    def loss_scaler(self) -> DynamicLossScale | StaticLossScale | None:
        """The loss scaler for fp16 (dynamic unless ``loss_scale.loss_scale > 0``), else None."""
        return self.loss_scale.build() if self.precision == "fp16" else None

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied and validated.

        Changing one member of the batch triple re-derives another instead of failing on
        the old value: ``train_batch_size`` follows ``micro_batch_size``,
        ``grad_accum_steps`` and ``mesh``; a new ``train_batch_size`` alone re-derives
        ``grad_accum_steps``.
        """
        bad = [k for k in changes if k not in _FIELD_NAMES]
        if bad:
            raise ValueError(
                "unknown TrainConfig field(s): "
                + ", ".join(f"{k!r}{_suggest(k, _FIELD_NAMES)}" for k in bad)
            )
        pipe = changes.get("pipeline")
        mb = (pipe.get("microbatches") if isinstance(pipe, Mapping) else getattr(pipe, "microbatches", None))
        if mb is not None and "grad_accum_steps" not in changes:  # the micro-batches are the accumulation
            changes["grad_accum_steps"] = mb
        given = set(changes) & set(_BATCH)
        if (given and len(given) < 3) or ("mesh" in changes and not given):
            if "train_batch_size" not in given:
                changes.setdefault("train_batch_size", None)
            elif "micro_batch_size" in given:
                changes["grad_accum_steps"] = None
            elif "grad_accum_steps" in given:
                changes["micro_batch_size"] = None
            else:
                changes["grad_accum_steps"] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Nested plain dict (JSON-serialisable); ``TrainConfig.from_dict`` inverts it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainConfig:
        """Build from nested dicts; unknown keys are errors (with suggestions)."""
        return _from_mapping(cls, d, "")

    def __str__(self) -> str:
        return "\n".join(f"{k} = {v!r}" for k, v in _flatten(self.to_dict()))


_FIELD_NAMES = tuple(f.name for f in fields(TrainConfig))


def _flatten(d: Mapping, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


_DEEPSPEED_HINT = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                   "zero_optimization", "fp16", "bf16", "gradient_clipping", "steps_per_print"}


def _from_mapping(cls: type, d: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(d, Mapping):
        raise ValueError(f"invalid {cls.__name__}:\n  {prefix.rstrip('.') or '<root>'}: "
                         f"expected a table/dict, got {d!r}")
    names = [f.name for f in fields(cls)]
    unknown = [k for k in d if k not in names]
    if unknown:
        lines = [f"  {prefix}{k}: unknown key{_suggest(k, names)}" for k in unknown]
        lines.append(f"  valid keys{' of ' + prefix.rstrip('.') if prefix else ''}: {', '.join(names)}")
        if not prefix and _DEEPSPEED_HINT & set(unknown):
            lines.append("  this looks like a DeepSpeed config: use fsharded.config.from_deepspeed")
        raise ValueError(f"invalid {cls.__name__}:\n" + "\n".join(lines))
    return cls(**d)


# -- files and overrides --------------------------------------------------------------------


def _read_toml(path: Path) -> dict:
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ImportError(
                f"reading {path} needs tomllib (Python 3.11+) or the 'tomli' package "
                "(pip install tomli); or write the config as JSON"
            ) from None
    try:
        with open(path, "rb") as f:
            d = tomllib.load(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"config {path}: not UTF-8 text ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config {path} is not valid TOML ({e})") from None
    if not d:
        raise ValueError(f"config {path} is empty: it sets nothing")
    return d


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    d: dict = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r} in JSON config")
        d[k] = v
    return d


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``; every failure names the file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"config {path}: not UTF-8 text ({e}); a config is a JSON or TOML file") from None
    if not text.strip():
        raise ValueError(f"config {path} is empty: a JSON config is an object, {{...}}")
    try:
        d = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise ValueError(f"config {path} is not valid JSON ({e})") from None
    except ValueError as e:  # a duplicate key
        raise ValueError(f"config {path}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"config {path}: expected a JSON object at the top level, got {type(d).__name__}")
    return d


def read_file(path: str | Path) -> dict:
    """The raw mapping a ``.toml`` or ``.json`` config file holds (no validation)."""
    p = Path(path)
    return _read_toml(p) if p.suffix.lower() == ".toml" else _read_json(p)


def load_config(path: str | Path, *, overrides: Mapping[str, Any] | Iterable[str] = ()) -> TrainConfig:
    """Read a ``TrainConfig`` from a ``.toml`` or ``.json`` file of its fields, nested.

    ``overrides`` are applied after (see ``apply_overrides``). Example TOML::

        steps = 200
        precision = "bf16"
        micro_batch_size = 8
        [mesh]
        data = 2
        [optimizer]
        name = "adamw"
        lr = 3e-4
        [scheduler]
        name = "WarmupCosineLR"
        params = { total_num_steps = 200, warmup_num_steps = 20 }
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"config file {path} does not exist")
    if path.suffix == ".toml":
        d = _read_toml(path)
    elif path.suffix == ".json":
        d = _read_json(path)
    else:
        raise ValueError(f"config file {path}: expected a .toml or .json file")
    try:
        cfg = TrainConfig.from_dict(d)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return apply_overrides(cfg, overrides)


def parse_overrides(items: Iterable[str]) -> dict[str, str]:
    """``["optimizer.lr=1e-3", "mesh.data=2"]`` -> ``{"optimizer.lr": "1e-3", ...}``."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r}: expected key=value, e.g. optimizer.lr=1e-3")
        out[key.strip()] = value.strip()
    return out


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _from_string(s: str, tp: Any) -> Any:
    """Parse CLI text ``s`` as annotation ``tp``; raise ValueError if it does not fit."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if args and origin is not tuple and origin is not dict:  # union
        if type(None) in args and s.lower() in ("none", "null"):
            return None
        for a in args:
            if a is not type(None):
                try:
                    return _from_string(s, a)
                except ValueError:
                    pass
        raise ValueError
    if tp is bool:
        if s.lower() in _TRUE | _FALSE:
            return s.lower() in _TRUE
        raise ValueError
    if tp is int:
        return int(s)
    if tp is float:
        return float(s)
    if tp is str:
        return s
    if origin is tuple:
        parts = [p for p in s.strip("[]() ").split(",") if p.strip()]
        if len(parts) != len(args):
            raise ValueError
        return tuple(_from_string(p.strip(), a) for p, a in zip(parts, args))
    return _literal(s)


def _literal(s: str) -> Any:
    """Schema-less values (model settings, dict entries): JSON if it parses, else the text
    (``true``/``false``/``none`` in any case: the bool or None, as for typed fields)."""
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        low = s.lower()
        return {"true": True, "false": False, "none": None}.get(low, s)


def _leaf_paths(cls: type, prefix: str = "") -> list[str]:
    out = []
    for name, tp in _hints(cls).items():
        if dataclasses.is_dataclass(tp):
            out += _leaf_paths(tp, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def apply_overrides(cfg: TrainConfig, overrides: Mapping[str, Any] | Iterable[str]) -> TrainConfig:
    """``cfg`` with dotted-key overrides applied, e.g. from the command line.

    Keys are field paths (``"optimizer.lr"``, ``"loss_scale.hysteresis"``) or entries of
    dict fields (``"mesh.data"``, ``"model.n_layers"``, ``"scheduler.params.warmup_num_steps"``).
    String values are converted to the field's type (``"1e-3"`` -> float, ``"true"`` ->
    bool, ``"0.9,0.95"`` -> betas, ``"none"`` -> None); dict entries parse as JSON when
    they can. Unknown keys and values that do not convert are errors listing every one.
    A list of ``"key=value"`` strings is accepted too.

    >>> apply_overrides(TrainConfig(), ["optimizer.betas=0.9,0.95"]).optimizer.betas
    (0.9, 0.95)
    """
    if not isinstance(overrides, Mapping):
        overrides = parse_overrides(overrides)
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    valid = _leaf_paths(TrainConfig)
    for key, value in overrides.items():
        parts = key.split(".")
        owner_cls, owner = TrainConfig, cfg
        head, rest = parts[0], parts[1:]
        if head in _SECTIONS and rest:
            owner_cls, owner = _SECTIONS[head], getattr(cfg, head)
            head, rest = rest[0], rest[1:]
            target = sections.setdefault(parts[0], {})
        else:
            target = top
        hints = _hints(owner_cls)
        if head not in hints or (rest and hints[head] is not dict):
            errors.append(f"  {key}: unknown key{_suggest(key, valid)}")
            continue
        tp = hints[head]
        if dataclasses.is_dataclass(tp):
            errors.append(f"  {key}: is a section; set {key}.<field> instead")
            continue
        try:
            if rest:  # an entry of a dict field, possibly nested: mesh.data, model.x.y
                d = target.setdefault(head, _deepcopy_dict(getattr(owner, head)))
                for p in rest[:-1]:
                    d = d.setdefault(p, {})
                    if not isinstance(d, dict):
                        raise ValueError
                d[rest[-1]] = _literal(value) if isinstance(value, str) else value
            else:
                target[head] = _from_string(value, tp) if isinstance(value, str) else value
        except ValueError:
            errors.append(f"  {key}: cannot read {value!r} as {_type_name(tp)}")
    if errors:
        raise ValueError("invalid overrides:\n" + "\n".join(errors))
    for name, changes in sections.items():
        top[name] = dataclasses.replace(getattr(cfg, name), **changes)
    return cfg.replace(**top)


def _deepcopy_dict(d: dict) -> dict:
    return {k: _deepcopy_dict(v) if isinstance(v, dict) else v for k, v in d.items()}
