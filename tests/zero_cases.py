"""ZeRO runs shared by the virtual-mesh tests and the gloo ranks."""

from __future__ import annotations

import train_cases as T

import fsharded as fs
from fsharded import P
from fsharded.models import gpt

STEPS = 20


def run_zero(mesh_axes: dict, stage: int, *, precision="fp32", accumulation=1, axis="data",
             batch_spec=None, steps=STEPS, reshard_after_forward=True) -> dict:
    mesh = fs.Mesh(mesh_axes)
    params = gpt.init(T.CONFIG, 0)
    specs = gpt.tensor_parallel_specs(params) if mesh.shape.get("tensor", 1) > 1 else P()
    plan = fs.parallel.zero(stage, axis=axis, min_size=16,
                            reshard_after_forward=reshard_after_forward)(specs, params)
    step = fs.train_step(gpt.loss, fs.optim.adamw(T.LR, weight_decay=T.WD), mesh=mesh, param_specs=plan,
                         batch_spec=batch_spec, precision=precision, accumulation=accumulation, clip=T.CLIP,
                         blocks="blocks")
    state = step.init(params)
    losses = []
    for b in T.batches(steps):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    man = step.collectives(state, T.batches(1)[0])
    return {"losses": losses, "params": step.params(state),
            "manifest": [(e.op, e.axis, e.shape, e.bytes_sent) for e in man],
            "phases": [(e.op, e.phase) for e in man],
            "local_master_numel": sum(x.numel() for x in T.flat(state.params))}


def measure_memory(mesh_axes: dict, stage: int, donate: bool = False) -> dict:
    """Live bytes of one step on this rank, with the state's own bytes registered."""
    mesh = fs.Mesh(mesh_axes)
    params = gpt.init(T.CONFIG, 0)
    plan = fs.parallel.zero(stage, min_size=16)(P(), params)
    opt = fs.optim.adamw(T.LR)
    step = fs.train_step(gpt.loss, opt, mesh=mesh, param_specs=plan, donate=donate, blocks="blocks")
    state = step.init(params)
    b = T.batches(1)[0]
    state, _ = step(state, b)
    with fs.memory.track() as mem:
        mem.register(state.params, "parameters")
        mem.register(state.opt_state, "optimizer state")
        start = mem.live_bytes()
        new, _ = step(state, b)
        mem.reclassify(new.params, "parameters")
        mem.reclassify(new.opt_state, "optimizer state")
    est = fs.estimate_memory(params, plan, opt, mesh=mesh, loss=gpt.loss, batch=b)
    return {"activations": mem.peak_of(("activations",)), "est_activations": est.activations,
            "total": mem.peak_bytes, "est_total": est.total,"start": start, "peak": mem.peak_bytes, "peak_by": mem.peak_by_category,
            "est_master": est.master, "est_optimizer": est.optimizer,
            "est_model_states": est.model_states, "est_peak": est.peak,
            "model_states": mem.peak_of(("parameters", "gradients", "optimizer state")),
            "with_buffers": mem.peak_of(("parameters", "gradients", "optimizer state", "comm buffers"))}


def gloo_zero(world: int) -> dict:
    out = {stage: run_zero({"data": world}, stage) for stage in (0, 1, 2, 3)}
    out["memory"] = {stage: measure_memory({"data": world}, stage) for stage in (0, 3)}
    out["donated"] = {stage: measure_memory({"data": world}, stage, donate=True) for stage in (0, 1, 2, 3)}
    out["mismatch"] = stage_mismatch({"data": world})
    out["keep"] = run_zero({"data": world}, 3, steps=10, reshard_after_forward=False)
    return out


def stage_mismatch(mesh_axes: dict) -> str:
    """A stage-0 state handed to a ZeRO-3 step: the error message (or '' if none)."""
    mesh = fs.Mesh(mesh_axes)
    params = gpt.init(T.CONFIG, 0)
    s0 = fs.train_step(gpt.loss, fs.optim.adamw(T.LR), mesh=mesh)
    s3 = fs.train_step(gpt.loss, fs.optim.adamw(T.LR), mesh=mesh,
                       param_specs=fs.parallel.zero(3, min_size=16)(P(), params), blocks="blocks")
    s3.init(params)
    try:
        s3(s0.init(params), T.batches(1)[0])
    except ValueError as e:
        return str(e)
    return ""


def gloo_zero4(world: int) -> dict:
    """4 ranks: every stage over data=4, and hybrid (replica=2 x shard=2, ZeRO-3 over shard)."""
    out = {stage: run_zero({"data": world}, stage, steps=10) for stage in (0, 1, 2, 3)}
    out["hybrid"] = run_zero({"replica": 2, "shard": 2}, 3, axis="shard",
                             batch_spec=P(("replica", "shard")), steps=10)
    return out


def zero3_losses(world: int, steps: int = 6) -> dict:
    """ZeRO-3 with per-block gathering and backward prefetch, losses only."""
    return run_zero({"data": world}, 3, steps=steps)
