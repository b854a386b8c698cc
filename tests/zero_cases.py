"""ZeRO runs shared by the virtual-mesh tests and the gloo ranks."""

from __future__ import annotations

import train_cases as T

import fsharded as fs
from fsharded import P
from fsharded.models import gpt

STEPS = 20


def run_zero(mesh_axes: dict, stage: int, *, precision="fp32", accumulation=1, axis="data",
             batch_spec=None, steps=STEPS) -> dict:
    mesh = fs.Mesh(mesh_axes)
    params = gpt.init(T.CONFIG, 0)
    specs = gpt.tensor_parallel_specs(params) if mesh.shape.get("tensor", 1) > 1 else P()
    plan = fs.parallel.zero(stage, axis=axis, min_size=16)(specs, params)
    step = fs.train_step(gpt.loss, fs.optim.adamw(T.LR, weight_decay=T.WD), mesh=mesh, param_specs=plan,
                         batch_spec=batch_spec, precision=precision, accumulation=accumulation, clip=T.CLIP)
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


def gloo_zero(world: int) -> dict:
    return {stage: run_zero({"data": world}, stage) for stage in (0, 1, 2, 3)}
