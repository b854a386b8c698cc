"""Training runs shared by the single-process tests and the gloo ranks."""

from __future__ import annotations

import optree
import torch
import torch.nn.functional as F

import fsharded as fs
from fsharded import P
from fsharded.models import gpt

CONFIG = gpt.GPTConfig.tiny(vocab_size=256)
LR, WD, CLIP, STEPS, BATCH = 3e-3, 0.01, 1.0, 20, 8


def batches(n=STEPS, batch=BATCH, seed=0):
    data = fs.data.Batches(fs.data.load_tokens("stdlib:200000"), batch_size=batch, seq_len=CONFIG.seq_len,
                           seed=seed)
    return [data.batch_at(i) for i in range(n)]


def run_train_step(mesh_axes: dict, *, precision="fp32", accumulation=1, steps=STEPS, batch=BATCH) -> dict:
    """``steps`` of ``train_step`` with AdamW + clipping; losses and final full params."""
    mesh = fs.Mesh(mesh_axes)
    params = gpt.init(CONFIG, 0)
    specs = gpt.tensor_parallel_specs(params) if mesh.shape.get("tensor", 1) > 1 else P()
    step = fs.train_step(gpt.loss, fs.optim.adamw(LR, weight_decay=WD), mesh=mesh, param_specs=specs,
                         precision=precision, accumulation=accumulation, clip=CLIP)
    state = step.init(params)
    losses = []
    for b in batches(steps, batch):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return {"losses": losses, "params": step.params(state),
            "manifest": [(e.op, e.axis, e.shape, e.bytes_sent) for e in step.collectives(state, b)]}


def run_plain_torch(module_cls, steps=STEPS, batch=BATCH) -> dict:
    """The same training as a plain nn.Module + torch.optim.AdamW + clip_grad_norm_ loop."""
    params = gpt.init(CONFIG, 0)
    model = module_cls(CONFIG)
    names = model.load_functional(params)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for b in batches(steps, batch):
        x, y = b["tokens"][:, :-1], b["tokens"][:, 1:]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "model": model, "names": names}


def gloo_train(world: int) -> dict:
    return {"dp": run_train_step({"data": world})}


def flat(tree):
    return optree.tree_leaves(tree)
