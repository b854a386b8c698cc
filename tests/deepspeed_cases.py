"""DeepSpeed checkpoint cases shared by the one-process tests and gloo ranks."""

from __future__ import annotations

import os

import torch

import fsharded as fs
from fsharded import P
from fsharded.models import gpt

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepspeed")
FIXTURE = torch.load(os.path.join(DATA, "reference.pt"), weights_only=True)
REF = FIXTURE["reference"]
# bf16 checkpoints (make_fixture.worker_bf16): fixture directory -> its ranks ("world"), DeepSpeed's
# fp32 masters and Adam moments, and the losses of its steps after the checkpoint on
# "batches"[1:] (global batches; "batches"[0] made the checkpoint).
FIXTURE_BF16 = torch.load(os.path.join(DATA, "reference_bf16.pt"), weights_only=True)
REF_BF16 = FIXTURE_BF16["reference"]


def ds_name(path: str) -> str:
    """The bench's nn.Module names (``blocks.0.attn__wq``) for a GPT parameter path."""
    if path.startswith("blocks."):
        _, i, rest = path.split(".", 2)
        return f"blocks.{i}.{rest.replace('.', '__')}"
    return path.replace(".", "__")


def init_params():
    return gpt.init(gpt.GPTConfig(**FIXTURE["config"]), 0)


def step(mesh_axes: dict, stage: int, **kw):
    params = init_params()
    specs = fs.parallel.zero(stage, min_size=8)(P(), params) if stage else P()
    return fs.train_step(gpt.loss, fs.optim.adamw(1e-3, weight_decay=0.01), mesh=fs.Mesh(mesh_axes),
                         param_specs=specs, clip=1.0, blocks="blocks", **kw), params


def by_name(step, state) -> dict:
    paths, leaves, _ = fs._tree.tree_flatten_with_paths(step.params(state))
    return {ds_name(p): x for p, x in zip(paths, leaves)}


def continue_training(step, state, batches) -> tuple:
    """The state after a step on each of ``batches`` (global (B, T + 1) tokens) and the losses."""
    losses = []
    for tokens in batches:
        state, m = step(state, {"tokens": tokens})
        losses.append(float(m["loss"]))
    return state, losses


def on_ranks(stage: int) -> dict:
    st, p = step({"data": 2}, 3)
    state = fs.checkpoint.load_deepspeed(os.path.join(DATA, f"zero{stage}"), st, p, names=ds_name)
    got = by_name(st, state)
    equal = all(torch.equal(got[n], w) for n, w in REF[stage]["fp32"].items())
    state, m = st(state, {"tokens": FIXTURE["batches"][1]})
    return {"equal": equal, "loss": float(m["loss"]), "after": by_name(st, state)}
