"""The mixture-of-experts GPT trained on a mesh (virtual or real ranks) and its
single-device reference, in which each batch shard routes its own tokens
(tests/test_moe_gpt.py)."""

from __future__ import annotations

import functools

import optree
import torch

import fsharded as fs
from fsharded import P
from fsharded.models import gpt

STEPS = 6


def config(**moe) -> gpt.GPTConfig:
    return gpt.GPTConfig.small(d_model=32, n_layers=2, n_heads=4, seq_len=16, bias=True,
                               moe={"experts": 4, "top_k": 2, "capacity_factor": 1.0, "every": 1, **moe})


def batches(cfg: gpt.GPTConfig, n: int = STEPS, rows: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"tokens": torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=g)} for _ in range(n)]


def _reference_loss(cfg, params, batch, *extra, shards: int):
    """The mean over ``shards`` row groups of each group's loss (its own routing and
    capacity), with the groups' metrics averaged: one device seeing what the shards see.
    With the routing biases (``extra``: the model state), the groups' loads averaged too."""
    parts = [gpt.loss(params, {"tokens": t}, attention="einsum", moe=cfg.moe, metrics=True,
                      model_state=extra[0] if extra else None)
             for t in batch["tokens"].chunk(shards)]
    metrics = {k: sum(p[1][k] for p in parts) / shards for k in parts[0][1]}
    loss = sum(p[0] for p in parts) / shards
    if not extra:
        return loss, metrics
    loads = [sum(p[2]["moe_load"][i] for p in parts) / shards for i in range(len(parts[0][2]["moe_load"]))]
    return loss, metrics, {"moe_load": loads}


def train(mesh_shape: dict | None, *, shards: int = 1, zero_stage: int = 0, tensor: bool = False,
          remat: bool = False, skew: bool | float = False, steps: int = STEPS, **moe) -> dict:
    """STEPS adamw steps: on ``mesh_shape`` with the experts split over 'expert' (the batch
    over ('data', 'expert')), or None: the reference on one device, the rows in ``shards``
    groups each routed alone (as many as the mesh has batch shards)."""
    cfg = config(**moe)
    params = gpt.init(cfg, 0)
    if skew is True:  # every token's choices are experts 0 and 1: the other experts idle, half drop
        for b in params["blocks"]:
            b["norm2"]["b"] = torch.ones_like(b["norm2"]["b"])  # the router's input ~ 1 + normalised x
            b["mlp"]["router"] = torch.zeros_like(b["mlp"]["router"])
            b["mlp"]["router"][:, 0] = 1.0
    elif skew:  # the router leans toward expert 0 by about skew * d_model in its logits
        for b in params["blocks"]:
            b["norm2"]["b"] = torch.ones_like(b["norm2"]["b"])
            b["mlp"]["router"][:, 0] += skew
    opt = fs.optim.adamw(1e-3)
    biased = cfg.moe.bias_update_rate is not None
    kw = {"update_model_state": gpt.model_state_updater(cfg.moe)} if biased else {}
    if mesh_shape is None:
        loss = functools.partial(_reference_loss, cfg, shards=shards)
        step = fs.train_step(loss, opt, mesh=fs.Mesh({"data": 1}), clip=1.0, **kw)
    else:
        mesh = fs.Mesh(mesh_shape)
        block_fn = _remat if remat else None
        loss = functools.partial(gpt.loss, attention="einsum", moe=cfg.moe, metrics=True, block_fn=block_fn)
        base = gpt.tensor_parallel_specs(params) if tensor else optree.tree_map(lambda _: P(), params)
        specs = gpt.expert_parallel_specs(params, base=base) if "expert" in mesh_shape else base
        if zero_stage:
            specs = fs.parallel.zero(zero_stage, axis="data", min_size=8)(specs, params)
        axes = tuple(a for a in ("data", "expert") if a in mesh_shape)
        step = fs.train_step(loss, opt, mesh=mesh, param_specs=specs, batch_spec=P(axes) if axes else P(),
                             blocks="blocks", clip=1.0, **kw)
    state = step.init(params, gpt.init_model_state(params) if biased else None)
    out: dict = {"losses": [], "drops": [], "aux": [], "bias": []}
    for b in batches(cfg, steps):
        state, m = step(state, b)
        out["losses"].append(float(m["loss"]))
        out["drops"].append(float(m["moe_drop_fraction"]))
        out["aux"].append(float(m["moe_aux_loss"]))
        out.setdefault("imbalance", []).append(float(m["moe_load_imbalance"]))
        if biased:
            out["bias"].append([x.tolist() for x in state.model_state["moe_bias"]])
    out["params"] = optree.tree_map(lambda x: x.detach().clone(), step.params(state))
    if mesh_shape is not None:
        out["collectives"] = [(e.op, e.axis, e.phase, e.shape, e.bytes_sent)
                              for e in step.collectives(state, batches(cfg, 1)[0])]
    return out


def _remat(block, p, x, **kw):
    leaves, tdef = optree.tree_flatten(p)
    run = lambda x, *ps: block(optree.tree_unflatten(tdef, list(ps)), x, **kw)  # noqa: E731
    return fs.parallel.remat.checkpoint(run)(x, *leaves)


def close(got: dict, want: dict, tol: float = 1e-5) -> None:
    """Losses and auxiliary losses within ``tol``, drop fractions equal, parameters within
    ``2 * tol`` (Adam turns reduction-order rounding on near-zero gradients into steps)."""
    for key in ("losses", "aux"):
        for i, (a, b) in enumerate(zip(got[key], want[key], strict=True)):
            assert abs(a - b) <= tol * max(1.0, abs(b)), (key, i, a, b)
    assert got["drops"] == want["drops"]
    assert got["bias"] == want["bias"]  # sign steps of the loads: equal, not close
    for a, b in zip(optree.tree_leaves(got["params"]), optree.tree_leaves(want["params"]), strict=True):
        torch.testing.assert_close(a, b, atol=2 * tol, rtol=tol)
