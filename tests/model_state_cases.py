"""A model with state it reads but does not differentiate (a running mean of its inputs,
as batch norm keeps), trained by train_step's update_model_state on a mesh (virtual or
real ranks), and the same written as a plain loop on one device
(tests/test_model_state.py)."""

from __future__ import annotations

import optree
import torch

import fsharded as fs
from fsharded import P

STEPS, ROWS, D = 5, 8, 6
MOMENTUM = 0.25


def params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(D, 3, generator=g), "b": torch.zeros(3)}


def batches(n: int = STEPS) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(ROWS, D, generator=g) + 2.0, "y": torch.randn(ROWS, 3, generator=g)}
            for _ in range(n)]


def loss_fn(p, batch, ms):
    x = (batch["x"] - ms["mean"]).to(p["w"].dtype)  # centred by the running mean (read, not differentiated)
    err = x @ p["w"] + p["b"] - batch["y"]
    loss = (err ** 2).mean()
    return loss, {"err_max": err.detach().abs().max()}, {"mean": batch["x"].mean(0)}


def update(ms, stats):
    return {"mean": (1 - MOMENTUM) * ms["mean"] + MOMENTUM * stats["mean"], "seen": ms["seen"] + 1}


def init_state() -> dict:
    return {"mean": torch.zeros(D), "seen": torch.zeros((), dtype=torch.int64)}


def train(mesh_shape: dict, *, accumulation: int = 1, zero_stage: int = 0) -> dict:
    mesh = fs.Mesh(mesh_shape)
    specs = fs.parallel.zero(zero_stage, axis="data", min_size=1)(P(), params()) if zero_stage else P()
    step = fs.train_step(loss_fn, fs.optim.adamw(1e-2, weight_decay=0.0), mesh=mesh, param_specs=specs,
                         accumulation=accumulation, update_model_state=update)
    state = step.init(params(), init_state())
    losses, means = [], []
    for b in batches():
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        means.append(step.model_state(state)["mean"].clone())
    return {"losses": losses, "means": means, "seen": int(step.model_state(state)["seen"]),
            "params": optree.tree_map(lambda x: x.detach().clone(), step.params(state))}


def reference(shards: int = 1, accumulation: int = 1) -> dict:
    """Plain torch: AdamW on the mean loss over the ``shards x accumulation`` row groups,
    each centred by the running mean of the step; the mean moves by the groups' mean."""
    p = {k: v.clone().requires_grad_() for k, v in params().items()}
    opt = torch.optim.AdamW(p.values(), lr=1e-2, weight_decay=0.0)
    ms = init_state()
    out: dict = {"losses": [], "means": []}
    for b in batches():
        groups = shards * accumulation
        loss = 0.0
        for x, y in zip(b["x"].chunk(groups), b["y"].chunk(groups)):
            loss = loss + loss_fn(p, {"x": x, "y": y}, ms)[0] / groups
        opt.zero_grad()
        loss.backward()
        opt.step()
        ms = update(ms, {"mean": b["x"].mean(0)})
        out["losses"].append(float(loss.detach()))
        out["means"].append(ms["mean"].clone())
    out["seen"], out["params"] = int(ms["seen"]), {k: v.detach() for k, v in p.items()}
    return out


def close(got: dict, want: dict, tol: float = 1e-6) -> None:
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert abs(a - b) <= tol * max(1.0, abs(b)), (a, b)
    for a, b in zip(got["means"], want["means"], strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert got["seen"] == want["seen"] == STEPS
    for k in want["params"]:
        torch.testing.assert_close(got["params"][k], want["params"][k], atol=10 * tol, rtol=10 * tol)
