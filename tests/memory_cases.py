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


def tracked_step(step, params, b, mesh):
    """The tracker over one donated step of ``step`` after a warm-up step, per device (the
    virtual mesh holds every device's values in this process; on real ranks the mesh
    changes nothing), the state labelled."""
    state = step.init(params)
    state, _ = step(state, b)
    with fs.memory.track(mesh=mesh) as mem:
        mem.register(state.params, "parameters")
        mem.register(state.opt_state, "optimizer state")
        state, _ = step(state, b)
        mem.reclassify(state.params, "parameters")
        mem.reclassify(state.opt_state, "optimizer state")
    return mem


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
        mem = tracked_step(step, params, b, mesh)
        est = fs.estimate_memory(params, plan, opt, mesh=mesh, loss=gpt.loss, batch=b, blocks="blocks")
        out[stage] = {"peak": mem.peak_bytes, "by": mem.peak_by_category,
                      "est_peak": est.peak, "est_model_states": est.model_states,
                      "est_activations": est.activations, "activations": mem.peak_of(("activations",)),
                      "params_peak": mem.peak_of(("parameters",)),
                      "grads_peak": mem.peak_of(("gradients",)), "est_placed_grads": est.placed_grads,
                      "params": gpt.param_count(params)}
        del mem, step
    return out


def loss_and_grad(mesh_axes: dict, sharded: bool) -> dict:
    """One forward + backward of the GPT's loss inside shard_map, tracked per device: the
    same program on the virtual mesh and on each real rank. ``sharded``: the parameters
    come in split over ``data`` and are all-gathered in the body (ZeRO-3's pattern: the
    gathered copies are one per device again); else replicated and pvary'd."""
    import optree

    mesh = fs.Mesh(mesh_axes)
    config = CONFIGS["1M"]
    params = gpt.init(config, 0)
    b = batch(config)
    spec = fs.parallel.zero(3, min_size=16)(P(), params).resolve(mesh).master if sharded else P()

    def body(p, b):
        if sharded:
            p = optree.tree_map(lambda t, s: fs.all_gather(t, "data", dim=_dim(s)) if s.axes
                                else fs.pvary(t, "data"), p, spec, none_is_leaf=False)
        else:
            p = fs.pvary(p, "data")
        out, vjp_fn = torch.func.vjp(lambda q: gpt.loss(q, b), p)
        (g,) = vjp_fn(torch.ones_like(out), create_graph=False)
        return fs.psum(optree.tree_map(lambda t: t.sum(), g), "data")

    sm = fs.shard_map(body, mesh=mesh, in_specs=(spec, P("data")), out_specs=P())
    # Each rank holds its shards only (as a step's state does), not the global values.
    params = fs.shard(params, spec, mesh)
    first = sm(params, b)
    with fs.memory.track(mesh=mesh) as mem:
        mem.register(params, "parameters")
        again = sm(params, b)
    return {"peak": mem.peak_bytes, "by": mem.peak_by_category,
            "sums": [float(x) for x in optree.tree_leaves(again)],
            "same": all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(first), optree.tree_leaves(again)))}


def _dim(spec) -> int:
    return next(i for i, a in enumerate(spec) if a is not None)


def measure_moe(mesh_axes: dict, stage: int) -> dict:
    """The same for a GPT with mixture-of-experts blocks, its experts split over
    ``expert`` (the rows over data and expert): the estimator runs the loss as device 0,
    its all-to-alls answering locally."""
    import functools

    import optree

    mesh = fs.Mesh(mesh_axes)
    config = gpt.GPTConfig.small(d_model=128, n_layers=4, moe=gpt.MoEConfig(experts=4, top_k=2))
    params = gpt.init(config, 0)
    specs = gpt.expert_parallel_specs(params, base=optree.tree_map(lambda _: P(), params))
    plan = fs.parallel.zero(stage, min_size=16)(specs, params) if stage else specs
    rows = ("data", "expert") if "data" in mesh_axes else "expert"
    b = batch(config, rows=8)
    opt = fs.optim.adamw(1e-3)
    loss = functools.partial(gpt.loss, moe=config.moe)
    step = fs.train_step(loss, opt, mesh=mesh, param_specs=plan, batch_spec=P(rows), donate=True, blocks="blocks")
    mem = tracked_step(step, params, b, mesh)
    est = fs.estimate_memory(params, plan, opt, mesh=mesh, loss=loss, batch=b, blocks="blocks",
                             batch_spec=P(rows))
    return {"peak": mem.peak_bytes, "est_peak": est.peak, "est_activations": est.activations,
            "activations": mem.peak_of(("activations",)), "notes": est.notes}
