"""A small model with dropout inside its blocks, trained with train_step: shared by the
virtual-mesh tests and the gloo ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fsharded as fs
from fsharded import P

D, LAYERS, ROWS = 16, 3, 16


def init(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w_in": torch.randn(8, D, generator=g) * 0.3,
        "blocks": [{"w": torch.randn(D, D, generator=g) * 0.3, "b": torch.zeros(D)} for _ in range(LAYERS)],
        "w_out": torch.randn(D, 1, generator=g) * 0.3,
    }


def block(p: dict, h: torch.Tensor) -> torch.Tensor:
    return h + F.dropout(torch.tanh(h @ p["w"] + p["b"]), 0.3)


def loss(params: dict, batch: dict) -> torch.Tensor:
    h = F.dropout(batch["x"] @ params["w_in"], 0.1)
    for p in params["blocks"]:
        h = fs.parallel.run_block(block, p, h)
    return ((h @ params["w_out"]).squeeze(-1) - batch["y"]).pow(2).mean()


def batches(n: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(ROWS, 8, generator=g), "y": torch.randn(ROWS, generator=g)} for _ in range(n)]


def run(mesh_axes: dict, stage: int = 0, seed: int = 0, steps: int = 4, accumulation: int = 1) -> list[float]:
    mesh = fs.Mesh(mesh_axes)
    params = init()
    specs = fs.parallel.zero(stage, min_size=8)(P(), params) if stage else P()
    step = fs.train_step(loss, fs.optim.adamw(1e-2), mesh=mesh, param_specs=specs, blocks="blocks",
                         seed=seed, clip=1.0, accumulation=accumulation)
    state = step.init(params)
    out = []
    for b in batches(steps):
        state, m = step(state, b)
        out.append(float(m["loss"]))
    return out


def cases(world: int) -> dict:
    return {stage: run({"data": world}, stage) for stage in (0, 3)}
