"""Checkpoint cases shared by the virtual-mesh tests and gloo ranks: the dropout model of
random_step_cases trained with a warmup schedule, saved and loaded across layouts."""

from __future__ import annotations

import optree
import random_step_cases as R
import torch

import fsharded as fs
from fsharded import P


def loss(params: dict, batch: dict) -> torch.Tensor:
    """The dropout model's loss, its input in the compute dtype (fp16 runs too)."""
    x = batch["x"].to(params["w_in"].dtype)
    return R.loss(params, {"x": x, "y": batch["y"].to(x.dtype)}).float()


def make_step(mesh_axes: dict, stage: int = 0, precision: str = "fp32"):
    mesh = fs.Mesh(mesh_axes)
    params = R.init()
    specs = fs.parallel.zero(stage, min_size=8)(P(), params) if stage else P()
    # A schedule: a resumed run must continue it from the saved step.
    lr = fs.optim.linear(1e-2, 1e-3, 20)
    step = fs.train_step(loss, fs.optim.adamw(lr), mesh=mesh, param_specs=specs, blocks="blocks",
                         clip=1.0, precision=precision)
    return step, params


def batches(start: int, n: int) -> list[dict]:
    return R.batches(start + n)[start:]


def train(step, state, start: int, n: int) -> tuple:
    losses = []
    for b in batches(start, n):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def global_state(step, state) -> dict:
    """Every leaf of the state as a global tensor (gathered on ranks), by dotted path."""
    from fsharded.checkpoint._common import _flatten
    from fsharded.mesh import _tree
    from fsharded.spmd._transfer import gather_global

    specs = _tree.broadcast_prefix(step.state_specs(state), state)
    paths, leaves, _ = _flatten(state)
    dist = fs.distributed.is_initialized()
    out = {}
    for p, x, s in zip(paths, leaves, specs):
        if isinstance(x, torch.Tensor):
            out[p] = gather_global(x.contiguous(), s, step.mesh).clone() if dist else x.clone()
    return out


def save_after(mesh_axes: dict, stage: int, directory: str, n: int = 3, precision: str = "fp32") -> dict:
    step, params = make_step(mesh_axes, stage, precision)
    state, losses = train(step, step.init(params), 0, n)
    step.save(state, directory)
    return {"state": global_state(step, state), "losses": losses}


def load_and_train(mesh_axes: dict, stage: int, directory: str, start: int = 3, n: int = 3,
                   precision: str = "fp32") -> dict:
    step, params = make_step(mesh_axes, stage, precision)
    state = step.load(directory, step.init(params))
    loaded = global_state(step, state)
    state, losses = train(step, state, start, n)
    return {"loaded": loaded, "losses": losses, "final": global_state(step, state)}


def straight(mesh_axes: dict, stage: int, n: int = 6, precision: str = "fp32") -> dict:
    step, params = make_step(mesh_axes, stage, precision)
    state, losses = train(step, step.init(params), 0, n)
    return {"losses": losses, "final": global_state(step, state)}


def leaves_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def close(a: dict, b: dict, tol: float = 1e-5) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.allclose(a[k].double(), b[k].double(), rtol=tol, atol=tol)
        for k in a)


__all__ = ["make_step", "train", "save_after", "load_and_train", "straight", "global_state",
           "leaves_equal", "close", "optree"]


def dcp_cases(directory: str) -> dict:
    """On real ranks: our state through DCP (ZeRO-3 saved, ZeRO-1 loaded; and read back by
    plain dcp.load into DTensors), and an FSDP2 model's DCP checkpoint into fs params."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    out = {}
    step, params = make_step({"data": 2}, 3)
    state, _ = train(step, step.init(params), 0, 2)
    fs.checkpoint.save_dcp(f"{directory}/ours", state, step.state_specs(state), step.mesh)
    out["saved"] = global_state(step, state)
    step1, _ = make_step({"data": 2}, 1)
    like = step1.init(params)
    got = fs.checkpoint.load_dcp(f"{directory}/ours", like, step1.state_specs(like), step1.mesh)
    out["ours_zero1"] = global_state(step1, got)
    # What an FSDP2 / torchtitan user does: dcp.load into their own DTensors by path.
    template = fs.checkpoint.dcp_state_dict(step.init(params), step.state_specs(state), step.mesh)
    dcp.load(template, checkpoint_id=f"{directory}/ours")
    out["plain_dcp"] = {k: v.full_tensor().clone() for k, v in template.items()
                        if hasattr(v, "full_tensor")}
    # Our own format read by dcp.load (fs.checkpoint.DCPReader) into ZeRO-1 DTensors.
    step.save(state, f"{directory}/native")
    like1 = step1.init(params)
    template = fs.checkpoint.dcp_state_dict(like1, step1.state_specs(like1), step1.mesh)
    dcp.load(template, storage_reader=fs.checkpoint.DCPReader(f"{directory}/native"))
    out["dcp_reads_ours"] = {k: v.full_tensor().clone() for k, v in template.items()
                             if hasattr(v, "full_tensor")}
    # An FSDP2 model's checkpoint into an fsharded parameter tree at ZeRO-3.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fully_shard(model, mesh=fs.Mesh({"data": 2}).to_torch())
    dcp.save(model.state_dict(), checkpoint_id=f"{directory}/fsdp2")
    fm = fs.nn.functional(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)))
    mesh = fs.Mesh({"data": 2})
    plan = fs.parallel.zero(3, min_size=8)(P(), fm.params).resolve(mesh).master
    from fsharded.spmd._transfer import local_shards

    local = fs.checkpoint.load_dcp(f"{directory}/fsdp2", local_shards(fm.params, plan, mesh), plan, mesh)
    out["fsdp2"] = fs.unshard(local, plan, mesh)
    out["fsdp2_ref"] = full
    return out


def async_save_while_training(mesh_axes: dict, stage: int, directory: str,
                              max_staged_bytes: int | None = 4096) -> dict:
    """Save in the background after 3 steps, train 2 more (donated: in place) before
    waiting, then load what was saved."""
    step, params = make_step(mesh_axes, stage)
    donated = fs.train_step(loss, fs.optim.adamw(fs.optim.linear(1e-2, 1e-3, 20)), mesh=step.mesh,
                            param_specs=fs.parallel.zero(stage, min_size=8)(P(), params),
                            blocks="blocks", clip=1.0, donate=True)
    state, _ = train(donated, donated.init(params), 0, 3)
    snapshot = global_state(donated, state)
    pending = donated.save_async(state, directory, max_staged_bytes=max_staged_bytes)
    state, _ = train(donated, state, 3, 2)
    pending.wait()
    after = global_state(donated, state)
    loaded = global_state(donated, donated.load(directory, params))
    return {"snapshot": snapshot, "loaded": loaded,
            "trained_on": not leaves_equal(after, snapshot)}


def save_with_bad_specs(directory: str) -> dict:
    """On real ranks: saves whose specs do not fit their leaves (an axis not in the mesh, a
    spec on a JSON value) raise, naming the leaf, and leave no directory behind; then a save
    that fits still works."""
    import os

    mesh = fs.Mesh({"data": torch.distributed.get_world_size()})
    errors = []
    for tree, specs in [({"w": torch.ones(4), "b": torch.ones(2)}, {"w": P("data"), "b": P("model")}),
                        ({"w": torch.ones(4), "n": 3}, {"w": P("data"), "n": P("data")})]:
        try:
            fs.checkpoint.save(directory, tree, specs, mesh)
        except ValueError as e:
            errors.append(str(e))
    listed = sorted(os.listdir(os.path.dirname(directory)))
    fs.checkpoint.save(directory, {"w": torch.full((4,), float(torch.distributed.get_rank()))}, P("data"), mesh)
    return {"errors": errors, "listed": listed,
            "loaded": fs.checkpoint.load(directory, {"w": torch.empty(8)}, P(), mesh)["w"].tolist()}
