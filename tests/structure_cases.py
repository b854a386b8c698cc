"""Trees of every kind of container saved and loaded back without a template, shared by
the virtual-mesh tests and gloo ranks: flat dicts of dotted names (an nn.Module's
``named_parameters()``), dotted keys in nested dicts, lists, tuples, NamedTuples, and a
train_step over an nn.Module's parameters."""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import checkpoint_cases as C
import optree
import torch

import fsharded as fs
from fsharded import P
from fsharded.spmd._transfer import local_shards, unshard


class Pair(NamedTuple):
    a: Any
    b: Any


def trees() -> dict[str, Any]:
    """One tree of each kind (fixed seed), dicts in an insertion order that is not sorted."""
    g = torch.Generator().manual_seed(0)

    def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "flat": {"0.weight": t(8, 4), "0.bias": t(8), "2.weight": t(4, 8), "2.bias": t(4)},
        "nested": {"encoder": {"layer.1.w": t(8, 4), "layer.0.w": t(8, 4)}, "head.proj": {"w": t(4, 4), "b": t(4)}},
        "list": [t(8), t(4, 2), t(3)],
        "tuple": (t(4, 4), t(2)),
        "namedtuple": Pair(t(8, 2), t(4)),
        "mix": {"z.params": [Pair(t(8, 4), (t(4, dtype=torch.bfloat16), None)), {"b": t(4), "a.c": 3}],
                "opt": (Pair(t(4), "note"), [], {}), "none": None, 2: t(4, dtype=torch.float64),
                "od": collections.OrderedDict([("y", t(4)), ("x", t(8))])},
    }


def specs(tree: Any, stage: int, mesh: fs.Mesh) -> Any:
    """ZeRO-``stage``'s spec tree for ``tree`` on ``mesh``: stage 3 the parameters' (every
    leaf sharded over data where a dim divides), stage 1 the master and optimizer
    state's (the same rule)."""
    pl = fs.parallel.zero(stage, min_size=1)(P(), tree).resolve(mesh)
    return pl.params if stage == 3 else pl.master


def differences(got: Any, want: Any, at: str = "<root>") -> list[str]:
    """Where ``got`` is not ``want``: container types, keys and their order, leaf types,
    and tensors' shapes, dtypes and bits."""
    if type(got) is not type(want):
        return [f"{at}: {type(got).__name__} here, {type(want).__name__} saved"]
    if isinstance(want, torch.Tensor):
        if got.shape != want.shape or got.dtype != want.dtype:
            return [f"{at}: {list(got.shape)} {got.dtype} here, {list(want.shape)} {want.dtype} saved"]
        same = torch.equal(got.detach().cpu().reshape(-1).view(torch.uint8),
                           want.detach().cpu().reshape(-1).view(torch.uint8))
        return [] if same else [f"{at}: other bits"]
    if isinstance(want, dict):
        if list(got) != list(want):
            return [f"{at}: keys {list(got)} here, {list(want)} saved"]
        return [d for k in want for d in differences(got[k], want[k], f"{at}.{k}")]
    if isinstance(want, (list, tuple, collections.deque)):
        if len(got) != len(want):
            return [f"{at}: {len(got)} children here, {len(want)} saved"]
        return [d for i, (x, y) in enumerate(zip(got, want)) for d in differences(x, y, f"{at}.{i}")]
    return [] if got == want else [f"{at}: {got!r} here, {want!r} saved"]


def save_tree_on_ranks(name: str, directory: str, stage: int) -> None:
    """Save ``trees()[name]`` from these ranks (each its shards) at ZeRO-``stage``."""
    mesh = fs.Mesh({"data": fs.distributed.world_size()})
    tree = trees()[name]
    s = specs(tree, stage, mesh)
    fs.checkpoint.save(directory, local_shards(tree, s, mesh), s, mesh)


def load_tree_on_ranks(name: str, directory: str, stage: int) -> Any:
    """Load a checkpoint of ``trees()[name]`` on these ranks without a template, at
    ZeRO-``stage``: the global tree gathered from this rank's shards."""
    mesh = fs.Mesh({"data": fs.distributed.world_size()})
    s = specs(trees()[name], stage, mesh)
    return unshard(fs.checkpoint.load(directory, None, s, mesh), s, mesh)


# -- a train_step over an nn.Module's parameters (a flat dict of dotted names) -----------------------


def module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def module_step(mesh_axes: dict, stage: int) -> tuple:
    """(train_step, its global parameters: ``dict(named_parameters())``, detached)."""
    model = module()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss(p: dict, batch: dict) -> torch.Tensor:
        out = torch.func.functional_call(model, p, (batch["x"],))
        return (out - batch["y"]).pow(2).mean()

    plan = fs.parallel.zero(stage, min_size=1)(P(), params) if stage else P()
    step = fs.train_step(loss, fs.optim.adamw(1e-2), mesh=fs.Mesh(mesh_axes), param_specs=plan)
    return step, params


def module_batches(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 4, generator=g)} for _ in range(n)]


def save_module_step(mesh_axes: dict, stage: int, directory: str, n: int = 2) -> dict:
    """Train ``n`` steps and ``step.save``: the global state by path, the parameters' keys."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ZeRO-3 without blocks=: the whole model gathered at once
        step, params = module_step(mesh_axes, stage)
        state = step.init(params)
        for b in module_batches(n):
            state, _ = step(state, b)
    step.save(state, directory)
    return {"state": C.global_state(step, state), "keys": list(params)}


def load_module_step(mesh_axes: dict, stage: int, directory: str) -> dict:
    """``step.load`` without a template, then one more step: the loaded global state, the
    parameters' container type and keys, and the loss of the step after."""
    step, _ = module_step(mesh_axes, stage)
    state = step.load(directory)
    out = {"state": C.global_state(step, state), "type": type(state.params), "keys": list(state.params),
           "structure_equal": optree.tree_structure(state.params) == optree.tree_structure(dict(module().named_parameters()))}
    _, metrics = step(state, module_batches(3)[-1])
    out["loss"] = float(metrics["loss"])
    return out
