"""Memory of one ZeRO step on this rank (or the virtual mesh), beside the estimator's."""

from __future__ import annotations

import torch

import fsharded as fs
from fsharded import P
from fsharded.models import gpt

CONFIGS = {"1M": gpt.GPTConfig.small(), "6M": gpt.GPTConfig.small(d_model=256, n_layers=8)}


def batch(config, rows: int = 4, seq: int = 64) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"tokens": torch.randint(0, config.vocab_size, (rows, seq + 1), generator=g)}


def measure(mesh_axes: dict, size: str, stages=(1, 2, 3)) -> dict:
    """Per stage: the tracked peak of one donated step (after a warm-up step) by category,
    and the estimator's view of the same step, in bytes."""
    mesh = fs.Mesh(mesh_axes)
    config = CONFIGS[size]
    params = gpt.init(config, 0)
    b = batch(config)
    opt = fs.optim.adamw(1e-3)
    out = {}
    for stage in stages:
        plan = fs.parallel.zero(stage, min_size=16)(P(), params)
        step = fs.train_step(gpt.loss, opt, mesh=mesh, param_specs=plan, donate=True, blocks="blocks")
        state = step.init(params)
        state, _ = step(state, b)
        with fs.memory.track() as mem:
            mem.register(state.params, "parameters")
            mem.register(state.opt_state, "optimizer state")
            state, _ = step(state, b)
            mem.reclassify(state.params, "parameters")
            mem.reclassify(state.opt_state, "optimizer state")
        est = fs.estimate_memory(params, plan, opt, mesh=mesh, loss=gpt.loss, batch=b, blocks="blocks")
        out[stage] = {"peak": mem.peak_bytes, "by": mem.peak_by_category,
                      "est_peak": est.peak, "est_model_states": est.model_states,
                      "est_activations": est.activations, "activations": mem.peak_of(("activations",)),
                      "params": gpt.param_count(params)}
        del state, step
    return out
