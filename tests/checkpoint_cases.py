"""Checkpoint cases shared by the virtual-mesh tests and gloo ranks: the dropout model of
random_step_cases trained with a warmup schedule, saved and loaded across layouts."""

from __future__ import annotations

import optree
import random_step_cases as R
import torch

import fsharded as fs
from fsharded import P


def loss(params: dict, batch: dict) -> torch.Tensor:
    """The dropout model's loss, its input in the compute dtype (fp16 runs too)."""
    x = batch["x"].to(params["w_in"].dtype)
    return R.loss(params, {"x": x, "y": batch["y"].to(x.dtype)}).float()


def make_step(mesh_axes: dict, stage: int = 0, precision: str = "fp32"):
    mesh = fs.Mesh(mesh_axes)
    params = R.init()
    specs = fs.parallel.zero(stage, min_size=8)(P(), params) if stage else P()
    # A schedule: a resumed run must continue it from the saved step.
    lr = fs.optim.linear(1e-2, 1e-3, 20)
    step = fs.train_step(loss, fs.optim.adamw(lr), mesh=mesh, param_specs=specs, blocks="blocks",
                         clip=1.0, precision=precision)
    return step, params


def batches(start: int, n: int) -> list[dict]:
    return R.batches(start + n)[start:]


def train(step, state, start: int, n: int) -> tuple:
    losses = []
    for b in batches(start, n):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def global_state(step, state) -> dict:
    """Every leaf of the state as a global tensor (gathered on ranks), by dotted path."""
    from fsharded import _tree
    from fsharded.checkpoint import _flatten
    from fsharded.spmd._transfer import gather_global

    specs = _tree.broadcast_prefix(step.state_specs(state), state)
    paths, leaves, _ = _flatten(state)
    dist = fs.distributed.is_initialized()
    out = {}
    for p, x, s in zip(paths, leaves, specs):
        if isinstance(x, torch.Tensor):
            out[p] = gather_global(x.contiguous(), s, step.mesh).clone() if dist else x.clone()
    return out


def save_after(mesh_axes: dict, stage: int, directory: str, n: int = 3, precision: str = "fp32") -> dict:
    step, params = make_step(mesh_axes, stage, precision)
    state, losses = train(step, step.init(params), 0, n)
    step.save(state, directory)
    return {"state": global_state(step, state), "losses": losses}


def load_and_train(mesh_axes: dict, stage: int, directory: str, start: int = 3, n: int = 3,
                   precision: str = "fp32") -> dict:
    step, params = make_step(mesh_axes, stage, precision)
    state = step.load(directory, step.init(params))
    loaded = global_state(step, state)
    state, losses = train(step, state, start, n)
    return {"loaded": loaded, "losses": losses, "final": global_state(step, state)}


def straight(mesh_axes: dict, stage: int, n: int = 6, precision: str = "fp32") -> dict:
    step, params = make_step(mesh_axes, stage, precision)
    state, losses = train(step, step.init(params), 0, n)
    return {"losses": losses, "final": global_state(step, state)}


def leaves_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def close(a: dict, b: dict, tol: float = 1e-5) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.allclose(a[k].double(), b[k].double(), rtol=tol, atol=tol)
        for k in a)


__all__ = ["make_step", "train", "save_after", "load_and_train", "straight", "global_state",
           "leaves_equal", "close", "optree"]
