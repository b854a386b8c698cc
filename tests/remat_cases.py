"""Remat policies (``train_step(remat=...)``) shared by the virtual-mesh tests and gloo ranks."""

from __future__ import annotations

import optree
import torch
import torch.nn.functional as F

import fsharded as fs
from fsharded import P
from fsharded.models import gpt

CONFIG = gpt.GPTConfig.tiny(vocab_size=256, n_layers=4)


def batches(n: int = 3, rows: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"tokens": torch.randint(0, 256, (rows, CONFIG.seq_len + 1), generator=g)} for _ in range(n)]


def _specs(mesh: dict, stage: int, params):
    """ZeRO ``stage`` over ``data``; with a ``tensor`` axis, over the GPT's tensor-parallel specs."""
    base = gpt.tensor_parallel_specs(params) if mesh.get("tensor", 1) > 1 else P()
    return fs.parallel.zero(stage, min_size=16)(base, params)


def run_gpt(mesh: dict, stage: int, remat, steps: int = 3) -> dict:
    params = gpt.init(CONFIG, 0)
    step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3, weight_decay=0.01), mesh=fs.Mesh(mesh), clip=1.0,
                         param_specs=_specs(mesh, stage, params), blocks="blocks", remat=remat)
    state = step.init(params)
    losses = []
    for b in batches(steps):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return {"losses": losses, "params": optree.tree_leaves(step.params(state))}


def activations(mesh: dict, stage: int, remat, categories=("activations",), per_device: bool = False) -> int:
    """The peak bytes of activations in one step (the memory tracker), the state registered;
    ``per_device``: one device's (the virtual mesh's storages divided by their copies)."""
    params = gpt.init(CONFIG, 0)
    step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=fs.Mesh(mesh), blocks="blocks", remat=remat,
                         param_specs=_specs(mesh, stage, params), donate=True)
    b = batches(1, rows=16)[0]
    state, _ = step(step.init(params), b)
    with fs.memory.track(mesh=step.mesh if per_device else None) as mem:
        mem.register(state.params, "parameters")
        mem.register(state.opt_state, "optimizer state")
        step(state, b)
    return mem.peak_of(categories)


def replays(mesh: dict, stage: int, remat) -> dict:
    """Over one step, how many outputs a selective remat kept in forward, and how many of
    them its recomputations took (hits) or ran again (misses)."""
    from fsharded.parallel import remat as RM

    made: list = []
    kept_init = RM._Kept.__init__

    def init(self, ops):
        kept_init(self, ops)
        made.append(self)

    params = gpt.init(CONFIG, 0)
    step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=fs.Mesh(mesh), blocks="blocks", remat=remat,
                         param_specs=fs.parallel.zero(stage, min_size=16)(P(), params))
    state = step.init(params)
    RM._Kept.__init__ = init
    try:
        step(state, batches(1)[0])
    finally:
        RM._Kept.__init__ = kept_init
    return {k: sum(getattr(m, k) for m in made) for k in ("recorded", "hits", "misses")}


def run_hf_gpt2(mesh: dict, stage: int, remat, steps: int = 3) -> dict:
    """A Hugging Face GPT-2 built from a config (dropout 0.1 in train mode) through
    fs.nn.functional: the recomputed blocks draw the forward's dropout masks."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=3, n_head=2, use_cache=False,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(0)
    fm = fs.nn.functional(transformers.GPT2LMHeadModel(cfg).train())

    def loss(p, b):
        return F.cross_entropy(fm.apply(p, input_ids=b["x"]).logits.flatten(0, 1), b["y"].flatten())

    step = fs.train_step(loss, fs.optim.adamw(1e-3), mesh=fs.Mesh(mesh), blocks=fm.blocks, remat=remat,
                         param_specs=fs.parallel.zero(stage, min_size=16)(P(), fm.params))
    state = step.init(fm.params)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        t = torch.randint(0, 256, (8, 17), generator=g)
        state, met = step(state, {"x": t[:, :-1], "y": t[:, 1:]})
        losses.append(float(met["loss"]))
    return {"losses": losses, "params": optree.tree_leaves(step.params(state))}


def gloo_remat(world: int) -> dict:
    """On real ranks (ZeRO-3's prefetch and saved-tensor hooks around the recomputed
    blocks): every policy against none."""
    out = {(stage, remat): run_gpt({"data": world}, stage, remat) for stage in (0, 3)
           for remat in (None, "blocks", "blocks:2", "blocks:2,offload", "blocks,dots")}
    for remat in (None, "blocks,partition", "blocks,partition,offload"):  # tensor parallel: inputs split
        out[("tensor", remat)] = run_gpt({"data": 1, "tensor": world}, 0, remat)
    return out
