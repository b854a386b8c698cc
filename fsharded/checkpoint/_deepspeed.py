"""DeepSpeed ZeRO checkpoints (stages 1-3, fp32 or bf16, no tensor or pipeline parallelism)
read without DeepSpeed: the full fp32 weights and Adam moments of each parameter, one at a time.

A DeepSpeed checkpoint directory holds a ``latest`` file naming a tag and, under the tag,
per data-parallel rank ``r``:

- stages 1-2: ``mp_rank_00_model_states.pt`` (``param_shapes``: per parameter group, the
  parameters in the order they were flattened) and ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``
  (``single_partition_of_fp32_groups``: rank ``r``'s contiguous slice of each group's flat
  fp32 vector, and the Adam state of that slice);
- stage 3: ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` and ``..._optim_states.pt``
  (``fp32_flat_groups``: for each parameter in order, rank ``r``'s ``ceil(numel / world)``
  elements of it, the last rank's padded).

With ``"bf16": {"enabled": true}`` the optimizer files are named ``bf16_zero_pp_rank_<r>_...``
(the model-states files keep their names) and hold the fp32 master weights all the same:

- stages 1-3 by default (bf16 gradient accumulation): DeepSpeed's ZeRO optimizer, the
  layouts above with bf16 model weights;
- stage 1 with ``"data_types": {"grad_accum_dtype": "fp32"}``: its ``BF16_Optimizer``, whose
  state has no ``zero_stage``: each group's flat vector padded to a multiple of
  ``2 * world`` and cut in equal partitions, ``single_partition_of_fp32_groups`` rank ``r``'s
  (padding included, ``group_paddings`` on the last rank), the Adam state of it beside.

Stage 0 keeps the optimizer (torch's, or in bf16 DeepSpeed's FP16_UnfusedOptimizer wrapper)
inside ``mp_rank_00_model_states.pt``, without ``param_shapes``: not read here.

The files are pickles that name DeepSpeed classes (its loss scaler, an enum, fragment
addresses): they are loaded with those classes stubbed, memory-mapped, so a parameter is
assembled from the ranks' slices without reading the rest.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import warnings
from collections.abc import Iterator
from typing import Any

import optree
import torch

from fsharded import comm
from fsharded.checkpoint._common import CheckpointError, _distributed, _flatten
from fsharded.mesh import _tree
from fsharded.mesh._layout import global_shape, local_slice
from fsharded.mesh._spec import PartitionSpec

__all__ = ["DeepSpeedCheckpoint", "read_deepspeed", "load_deepspeed"]


class _Stub:
    """Stands for a DeepSpeed class in a pickle: keeps whatever state it is given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state"] = state


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "deepspeed" or module.startswith("deepspeed."):
            return type(name, (_Stub,), {"__module__": module})
        return super().find_class(module, name)


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` needs: an Unpickler and ``load``."""

    Unpickler = _Unpickler
    load = pickle.load
    __name__ = "fsharded_deepspeed_pickle"


def _load(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True,
                          pickle_module=_PickleModule)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say which
        raise CheckpointError(f"checkpoint.load_deepspeed: {path} cannot be read as a DeepSpeed "
                              f"checkpoint file ({type(e).__name__}: {e})") from None


class DeepSpeedCheckpoint:
    """One tag of a DeepSpeed ZeRO checkpoint: ``names`` (in DeepSpeed's order),
    ``shapes``, ``stage``, ``world`` (data-parallel ranks), ``bf16`` (saved by a bf16 run:
    ``bf16_zero_pp_rank_*`` files; the tensors are its fp32 masters), ``step`` (optimizer steps
    taken), ``hyper`` (the first parameter group's lr, betas, eps, weight_decay) and
    ``tensor(name, kind)`` for kind ``"param"`` (fp32 master), ``"exp_avg"`` or
    ``"exp_avg_sq"``."""

    KINDS = ("param", "exp_avg", "exp_avg_sq")

    def __init__(self, directory: str, tag: str | None = None) -> None:
        directory = os.fspath(directory)
        if tag is None:
            try:
                with open(os.path.join(directory, "latest")) as f:
                    tag = f.read().strip()
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint.load_deepspeed: {directory} has no 'latest' file; "
                                      f"pass tag= (a subdirectory of it)") from None
        self.directory, self.tag = directory, tag
        root = os.path.join(directory, tag)
        if not os.path.isdir(root):
            raise CheckpointError(f"checkpoint.load_deepspeed: no tag {tag!r} in {directory}")
        files = sorted(os.listdir(root))
        if any(re.search(r"mp_rank_0*[1-9]", n) for n in files):
            raise NotImplementedError("checkpoint.load_deepspeed: the checkpoint has several model-parallel "
                                      "ranks (mp_rank_01, ...); only data-parallel ZeRO checkpoints are supported")
        found = {}  # prefix ("" or "bf16_") -> {rank: file name}
        for n in files:
            m = _OPTIM_FILE.fullmatch(n)
            if m is not None:
                found.setdefault(m.group(1), {})[int(m.group(2))] = n
        if not found and "mp_rank_00_model_states.pt" in files:
            raise NotImplementedError(
                f"checkpoint.load_deepspeed: {root} holds mp_rank_00_model_states.pt and no "
                f"zero_pp_rank_*_optim_states.pt: a checkpoint without ZeRO (zero_optimization.stage 0; "
                f"in bf16 through DeepSpeed's FP16 optimizer wrapper), whose optimizer state lives in the "
                f"model-states file, is not supported yet; save it at ZeRO stage 1-3")
        if not found:
            raise CheckpointError(f"checkpoint.load_deepspeed: no zero_pp_rank_*_optim_states.pt (nor "
                                  f"bf16_zero_pp_rank_*) in {root}: not a DeepSpeed ZeRO checkpoint")
        if len(found) > 1:
            raise CheckpointError(f"checkpoint.load_deepspeed: {root} holds both fp32 (zero_pp_rank_*) and "
                                  f"bf16 (bf16_zero_pp_rank_*) optimizer files: two runs saved the same tag; "
                                  f"save to a fresh tag")
        (prefix, by_rank), = found.items()
        # bf16: DeepSpeed's bf16 runs keep fp32 masters all the same; the prefix names the run.
        self.bf16 = prefix == "bf16_"
        optim = [by_rank[r] for r in sorted(by_rank)]
        self.world = len(optim)
        if sorted(by_rank) != list(range(self.world)):
            raise CheckpointError(f"checkpoint.load_deepspeed: {root} lacks some ranks' optimizer files: "
                                  f"missing {_missing(prefix, by_rank, max(by_rank) + 1)} (found {optim})")
        top = [_load(os.path.join(root, n)) for n in optim]
        self._optim = [t["optimizer_state_dict"] for t in top]
        o0 = self._optim[0]
        count = o0.get("partition_count")
        count = count[0] if isinstance(count, (list, tuple)) and count else count
        if isinstance(count, int) and count != self.world:
            raise CheckpointError(f"checkpoint.load_deepspeed: {root} was saved by {count} ranks but holds "
                                  f"the optimizer files of {self.world} ({', '.join(optim)}): some ranks' "
                                  f"files are missing: {_missing(prefix, by_rank, count)}")
        if "fp32_flat_groups" in o0:
            self.stage = 3
            model = _load(os.path.join(root, "zero_pp_rank_0_mp_rank_00_model_states.pt"))
            flat = [o["fp32_flat_groups"] for o in self._optim]
            adam = [o["optimizer_state_dict"] for o in self._optim]
        elif "single_partition_of_fp32_groups" in o0:
            zero_stage = _stage_of(o0)
            # DeepSpeed's BF16_Optimizer (bf16 with fp32 gradient accumulation) records no
            # zero_stage; its partitions keep their padding, which only the last rank has.
            bf16_optimizer = zero_stage is None and self.bf16
            if bf16_optimizer:
                self.stage = _config_stage(top[0]) or 1
            else:
                self.stage = 1 if zero_stage == 1 else 2
            model = _load(os.path.join(root, "mp_rank_00_model_states.pt"))
            flat = [o["single_partition_of_fp32_groups"] for o in self._optim]
            adam = [o["base_optimizer_state"] for o in self._optim]
            if not isinstance(adam[0], dict) or not isinstance(adam[0].get("state"), dict):
                raise NotImplementedError(
                    "checkpoint.load_deepspeed: this ZeRO-1/2 checkpoint keeps its optimizer state "
                    "per parameter with the padding removed (elastic_checkpoint=True), a layout not "
                    "supported yet; save it with elastic_checkpoint false")
            pads = o0.get("param_alignment_paddings") or []
            if any(any(p) for p in pads):
                raise NotImplementedError("checkpoint.load_deepspeed: parameters padded for alignment inside "
                                          "their group (param_alignment_paddings) are not supported yet")
        else:
            raise CheckpointError(f"checkpoint.load_deepspeed: {optim[0]} holds neither fp32_flat_groups "
                                  f"(ZeRO-3) nor single_partition_of_fp32_groups (ZeRO-1/2, bf16)")
        if not model.get("param_shapes"):
            raise NotImplementedError(
                f"checkpoint.load_deepspeed: {root}'s model states name no param_shapes (a checkpoint of "
                f"DeepSpeed's pipeline engine or without ZeRO); only ZeRO stages 1-3 are supported")
        self.groups = [dict(g) for g in model["param_shapes"]]
        self.shapes = {n: tuple(s) for g in self.groups for n, s in g.items()}
        self.names = list(self.shapes)
        self.step = int(model.get("global_steps", 0))
        first = adam[0]["state"].get(0, {}) if isinstance(adam[0].get("state"), dict) else {}
        group0 = (adam[0].get("param_groups") or [{}])[0]
        skipped = int(model.get("skipped_steps", 0) or 0)
        # Adam's count: per parameter (torch.optim), per group (DeepSpeed's FusedAdam), or
        # the updates that were not skipped (fp16 overflows).
        self.adam_step = int(first["step"]) if "step" in first else \
            int(group0["step"]) if "step" in group0 else self.step - skipped
        self.hyper = {k: group0[k] for k in ("lr", "betas", "eps", "weight_decay") if k in group0}
        # Per rank and group: the flat fp32 slice and its Adam state (same layout).
        self._flat = {"param": flat,
                      "exp_avg": [[adam[r]["state"][g]["exp_avg"] for g in range(len(self.groups))]
                                  for r in range(self.world)],
                      "exp_avg_sq": [[adam[r]["state"][g]["exp_avg_sq"] for g in range(len(self.groups))]
                                     for r in range(self.world)]}
        if self.stage in (1, 2):
            self._check_sizes(root, optim)
        self._where = dict(self._index())

    def _check_sizes(self, root: str, optim: list[str]) -> None:
        """ZeRO-1/2 and BF16_Optimizer: the ranks' partitions of a group, back to back, are
        its flat vector, padded at the end (``group_paddings`` on the last rank) at most."""
        pads = self._optim[-1].get("group_paddings") or [0] * len(self.groups)
        bad = []
        for g, shapes in enumerate(self.groups):
            need = sum(math.prod(s) for s in shapes.values())
            for kind, parts in self._flat.items():
                have = sum(parts[r][g].numel() for r in range(self.world))
                if not need <= have <= need + (pads[g] if g < len(pads) else 0):
                    bad.append(f"  group {g} {kind}: the ranks' partitions hold {have} elements, its "
                               f"{len(shapes)} parameters (param_shapes) need {need}")
        if bad:
            raise CheckpointError(f"checkpoint.load_deepspeed: {root}'s optimizer files ({', '.join(optim)}) "
                                  f"do not fit its model states:\n" + "\n".join(bad))

    def _index(self) -> Iterator[tuple[str, tuple[int, int, int]]]:
        """Each parameter's (group, offset, numel); at stage 3 the offset is into every
        rank's slice vector (each holding ceil(numel / world) of every parameter)."""
        for g, shapes in enumerate(self.groups):
            offset = 0
            for name, shape in shapes.items():
                n = math.prod(shape)
                yield name, (g, offset, n)
                offset += math.ceil(n / self.world) if self.stage == 3 else n

    def tensor(self, name: str, kind: str = "param") -> torch.Tensor:
        """The full fp32 ``kind`` of parameter ``name`` (a new tensor)."""
        if kind not in self.KINDS:
            raise ValueError(f"DeepSpeedCheckpoint.tensor: kind must be one of {self.KINDS}, got {kind!r}")
        g, offset, n = self._where[name]
        parts = [self._flat[kind][r][g] for r in range(self.world)]
        if self.stage == 3:
            k = math.ceil(n / self.world)
            full = torch.cat([p.narrow(0, offset, k) for p in parts])[:n]
        else:  # the ranks' slices back to back are the group's flat vector
            pieces, start = [], 0
            for p in parts:
                lo, hi = max(offset, start), min(offset + n, start + p.numel())
                if lo < hi:
                    pieces.append(p.narrow(0, lo - start, hi - lo))
                start += p.numel()
            full = torch.cat(pieces) if pieces else torch.empty(0)
            if full.numel() != n:
                raise CheckpointError(f"checkpoint.load_deepspeed: {name} needs {n} elements, the ranks' "
                                      f"partitions hold {full.numel()} of them")
        return full.detach().to(torch.float32).reshape(self.shapes[name]).clone()


_OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")


def _missing(prefix: str, by_rank: dict, count: int) -> str:
    return ", ".join(f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                     for r in range(count) if r not in by_rank) or "none by name"


def _config_stage(top: dict) -> int | None:
    """zero_optimization.stage of the ds_config an optimizer file carries."""
    config = top.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    stage = zero.get("stage") if isinstance(zero, dict) else None
    return int(stage) if isinstance(stage, (int, str)) and str(stage).isdigit() else None


def _stage_of(optim: dict) -> int | None:
    z = optim.get("zero_stage")
    state = getattr(z, "state", None)
    for v in (z, state, getattr(z, "args", (None,))[0] if isinstance(z, _Stub) and z.args else None):
        if isinstance(v, int):
            return v
    return None


def read_deepspeed(directory: str | os.PathLike, *, tag: str | None = None) -> DeepSpeedCheckpoint:
    """Open a DeepSpeed ZeRO checkpoint (``engine.save_checkpoint(directory)``) without
    DeepSpeed; see ``DeepSpeedCheckpoint``."""
    return DeepSpeedCheckpoint(os.fspath(directory), tag)


def load_deepspeed(directory: str | os.PathLike, step: Any, params: Any, *, tag: str | None = None,
                   names: Any = None) -> Any:
    """A DeepSpeed ZeRO checkpoint as a state of ``step`` (a ``train_step`` with an Adam or
    AdamW optimizer), laid out for its mesh and placement: fp32 weights into ``params``,
    ``exp_avg`` / ``exp_avg_sq`` into the Adam moments, the step count into the step and
    schedule counters; the dropout key and a loss scale start afresh. ``params``: the
    parameter tree (shapes and structure; ``step.init`` lays it out). ``names``: a function
    or a dict from a parameter path of ``params`` to its DeepSpeed name (the module's
    parameter name; by default the same path, as ``fs.nn.functional`` names them). On real ranks each rank
    assembles the leaves one at a time and keeps its shards. Frozen leaves (the step's
    ``trainable=``) have no moments; one the checkpoint does not hold (DeepSpeed keeps
    parameters that do not train out of its optimizer's groups) keeps its value from
    ``params``, which a frozen weight never leaves."""
    ck = read_deepspeed(directory, tag=tag)
    like = step.init(params)
    specs = _tree.broadcast_prefix(step.state_specs(like), like)
    paths, leaves, tdef = _flatten(like)
    if isinstance(names, dict):
        table = names
        rename = lambda p: table.get(p, p)  # noqa: E731
    else:
        rename = names if names is not None else (lambda p: p)
    mesh = step.mesh
    dist = _distributed(mesh, None)
    ours = {p[len("params."):]: tuple(global_shape(s if isinstance(s, PartitionSpec) else PartitionSpec(),
                                                   tuple(x.shape), mesh) if dist else tuple(x.shape))
            for p, x, s in zip(paths, leaves, specs) if p.startswith("params.")}
    want = {p: rename(p) for p in ours}
    # The step's record of its trained leaves (TrainState.trainable): None when all train.
    trained = [True] * len(ours) if like.trainable is None else [bool(t) for t in like.trainable.tolist()]
    frozen = {p for p, t in zip(_tree.tree_flatten_with_paths(like.params)[0], trained) if not t}
    kept = {p for p in frozen if want[p] not in ck.shapes}  # frozen, and not in DeepSpeed's groups
    problems = [f"  {p}: no {n!r} in the checkpoint" for p, n in want.items() if n not in ck.shapes and p not in kept]
    problems += [f"  {p}: {ours[p]} here, {ck.shapes[n]} in the checkpoint"
                 for p, n in want.items() if n in ck.shapes and ours[p] != tuple(ck.shapes[n])]
    problems += [f"  {n}: in the checkpoint, not in params" for n in sorted(set(ck.names) - set(want.values()))]
    if problems:
        raise CheckpointError(f"checkpoint.load_deepspeed: {ck.directory} (tag {ck.tag}) does not fit "
                              f"these params:\n" + "\n".join(problems)
                              + "\nPass names= to map parameter paths to DeepSpeed's names")
    _check_hyper(step.optimizer, ck)
    coords = mesh.coords(comm.rank()) if dist else None
    moment = re.compile(r"opt_state\.\d+\.(mu|nu)\.(.+)")
    out = []
    for path, x, spec in zip(paths, leaves, specs):
        spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec()
        m = moment.fullmatch(path)
        if path.startswith("params.") and path[len("params."):] in kept:
            out.append(x)  # as step.init laid it out from params
            continue
        if path.startswith("params."):
            full = ck.tensor(want[path[len("params."):]], "param")
        elif m is not None and m.group(2) in want:
            full = ck.tensor(want[m.group(2)], "exp_avg" if m.group(1) == "mu" else "exp_avg_sq")
        elif re.fullmatch(r"opt_state\.\d+\.count", path) and isinstance(x, torch.Tensor):
            first = re.fullmatch(r"opt_state\.(\d+)\.count", path).group(1)
            is_adam = any(p.startswith(f"opt_state.{first}.mu.") for p in paths)
            full = torch.tensor(ck.adam_step if is_adam else ck.step, dtype=x.dtype)
        elif path == "step":
            full = torch.tensor(ck.step, dtype=x.dtype)
        elif path in ("rng", "trainable", "skipped") or path.startswith("loss_scale"):
            # A new key and loss scale (DeepSpeed keeps neither in this form); the step's own
            # choice of what trains; no skipped step counted yet.
            out.append(x)
            continue
        else:
            raise NotImplementedError(
                f"checkpoint.load_deepspeed: the state's {path} has no counterpart in a DeepSpeed "
                f"checkpoint (Adam / AdamW moments, weights and step counts are carried over): use "
                f"fs.optim.adamw or adam")
        full = full.to(x.dtype) if isinstance(x, torch.Tensor) else full
        out.append(local_slice(full, spec, mesh, coords).clone() if dist and full.dim() else full)
    return optree.tree_unflatten(tdef, out)


def _check_hyper(optimizer: Any, ck: DeepSpeedCheckpoint) -> None:
    """Warn when the step's Adam differs from the checkpoint's (betas, eps, decay)."""
    form = getattr(optimizer, "fused", None)
    hyper = getattr(form, "hyper", None)
    if not isinstance(hyper, dict) or "betas" not in ck.hyper:
        return
    theirs = {"b1": ck.hyper["betas"][0], "b2": ck.hyper["betas"][1], "eps": ck.hyper.get("eps"),
              "weight_decay": ck.hyper.get("weight_decay")}
    diff = [f"{k}: {hyper[k]} here, {v} in the checkpoint" for k, v in theirs.items()
            if k in hyper and v is not None and not math.isclose(float(hyper[k]), float(v))]
    if diff:
        warnings.warn("checkpoint.load_deepspeed: the optimizer differs from the checkpoint's: "
                      + "; ".join(diff), stacklevel=3)
