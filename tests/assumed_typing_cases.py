"""Steps whose loss runs with the varying-axes typing assumed (``VmaMode.assuming``) or
typed op by op, shared by the virtual-mesh tests and the gloo ranks. Each case returns
the losses and the final parameters of a few steps, and how many ops the typing saw."""

from __future__ import annotations

import contextlib

import optree
import torch
import torch.nn.functional as F
from random_step_cases import batches, init  # the same small model and data

import fsharded as fs
from fsharded import P
from fsharded.spmd import _vma
from fsharded.step import _assume

DROPOUT = {"p": 0.2}  # set to 0 where one device is compared with two (other masks)


def _block(p: dict, h: torch.Tensor) -> torch.Tensor:
    return h + F.dropout(torch.tanh(h @ p["w"] + p["b"]), DROPOUT["p"])


def _centred(p: dict, h: torch.Tensor) -> torch.Tensor:
    # A differentiated value reduced over the batch axis: the typing must insert the
    # implicit pvary where the mean meets the shard's own values again.
    h = _block(p, h)
    return h - fs.pmean(h.mean(0), "data")


def _swallowed(p: dict, h: torch.Tensor) -> torch.Tensor:
    h = _block(p, h)
    try:
        h = h - fs.pmean(h.mean(0), "data")
    except Exception:  # a loss that hides errors must not hide the typing's request
        pass
    return h


def _asks(p: dict, h: torch.Tensor) -> torch.Tensor:
    h = _block(p, h)
    scale = torch.ones(()) * 2  # not differentiated: the assumption does not type it
    return h * (0.5 if "data" in fs.varying_axes(scale) else 1.0)


BLOCKS = {"plain": _block, "centred": _centred, "swallowed": _swallowed, "asks": _asks}


def loss_for(kind: str):
    block = BLOCKS[kind]

    def loss(params: dict, batch: dict) -> torch.Tensor:
        h = F.dropout(batch["x"] @ params["w_in"], DROPOUT["p"] / 2)
        for p in params["blocks"]:
            h = fs.parallel.run_block(block, p, h)
        return ((h @ params["w_out"]).squeeze(-1) - batch["y"]).pow(2).mean()

    return loss


@contextlib.contextmanager
def _counting():
    """Count the ops the typing mode sees (its ``__torch_function__`` calls)."""
    box = [0]
    orig = _vma.VmaMode.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        box[0] += 1
        return orig(self, func, types, args, kwargs)

    _vma.VmaMode.__torch_function__ = counted
    try:
        yield box
    finally:
        _vma.VmaMode.__torch_function__ = orig


@contextlib.contextmanager
def _typed_only():
    orig = _assume.assumable
    _assume.assumable = lambda *a, **k: None
    try:
        yield
    finally:
        _assume.assumable = orig


def run(kind: str, mesh_axes: dict, *, stage: int = 0, assume: bool = True, steps: int = 3,
        accumulation: int = 1) -> dict:
    mesh = fs.Mesh(mesh_axes)
    params = init()
    specs = fs.parallel.zero(stage, min_size=8)(P(), params) if stage else P()
    with contextlib.nullcontext() if assume else _typed_only(), _counting() as ops:
        step = fs.train_step(loss_for(kind), fs.optim.adamw(1e-2), mesh=mesh, param_specs=specs,
                             blocks="blocks", clip=1.0, accumulation=accumulation)
        state = step.init(params)
        losses, per_step = [], []
        for b in batches(steps):
            before = ops[0]
            state, m = step(state, b)
            losses.append(float(m["loss"]))
            per_step.append(ops[0] - before)
    return {"losses": losses, "params": [x.clone() for x in optree.tree_leaves(step.params(state))],
            "ops": per_step}


def cases(world: int) -> dict:
    out = {}
    for kind in BLOCKS:
        for stage in (0, 1, 3):
            for assume in (True, False):
                r = run(kind, {"data": world}, stage=stage, assume=assume)
                out[kind, stage, assume] = {"losses": r["losses"], "ops": r["ops"],
                                            "params": [x.tolist() for x in r["params"]]}
    return out
