"""Steps with a learning rate or a loss that must not be applied (run on the virtual mesh and
on gloo ranks by test_faults_step)."""

from __future__ import annotations

import math

import nonfinite_cases as N
import torch

import fsharded as fs
from fsharded import P


def bad_at(k: int, value: float):
    """A schedule given as a plain callable: 0.1 / (update + 1), except ``value`` at update
    ``k`` (from 0), i.e. on step ``k + 1``."""

    def schedule(step):
        s = torch.as_tensor(step).to(torch.float64)
        return torch.where(s == k, torch.full_like(s, value), 0.1 / (s + 1.0))

    return schedule


def _leaves(state) -> list[torch.Tensor]:
    return [x.clone() for x in fs._tree.tree_flatten_with_paths((state.params, state.opt_state))[1]
            if isinstance(x, torch.Tensor)]


def run_bad_lr(mesh: dict, donate: bool, stage: int = 0, optimizer: str = "adamw",
               value: float = math.nan) -> dict:
    """Two good steps, then a step whose schedule gives ``value``: the error, whether the
    state passed in is the one after step 2, and whether that state trains on."""
    sched = bad_at(2, value)
    opt = fs.optim.adamw(sched) if optimizer == "adamw" else fs.optim.sgd(sched, momentum=0.9)
    step = N.make_step(mesh, donate=donate, stage=stage, optimizer=opt)
    good, _ = N.batches()
    state = step.init(N.params())
    lrs = []
    for _ in range(2):
        state, m = step(state, good)
        lrs.append(float(m["lr"]))
    kept = _leaves(state)
    try:
        step(state, good)
        message = None
    except FloatingPointError as e:
        message = str(e)
    now = _leaves(state)
    unchanged = all(torch.equal(a, b) for a, b in zip(kept, now, strict=True))
    finite = all(bool(torch.isfinite(x).all()) for x in now if x.is_floating_point())
    # The same state goes on with a schedule that is finite at that update.
    fixed = N.make_step(mesh, donate=donate, stage=stage,
                        optimizer=fs.optim.adamw(bad_at(99, 0.0)) if optimizer == "adamw"
                        else fs.optim.sgd(bad_at(99, 0.0), momentum=0.9))
    state, m = fixed(state, good)
    return {"message": message, "unchanged": unchanged, "finite": finite, "lrs": lrs,
            "step": int(state.step), "lr_after": float(m["lr"]), "loss_after": float(m["loss"])}


def gloo_bad_lr(donate: bool, stage: int) -> dict:
    import torch.distributed as dist

    return run_bad_lr({"data": dist.get_world_size()}, donate, stage)


def nan_bias_loss(p, b):
    """A nan that does not reach the gradients: a finite gradient, a nan loss."""
    return (p["w"] ** 2).sum() + b["bias"]


def run_fp16_nan_loss(mesh: dict, on_nonfinite: str) -> dict:
    """fp16 (a scale small enough that the gradients do not overflow): one good step, then
    one whose loss is nan and whose gradients are finite."""
    from fsharded.precision import DynamicLossScale, Policy

    policy = Policy.fp16(loss_scale=DynamicLossScale(initial_scale_power=8))
    step = fs.train_step(nan_bias_loss, fs.optim.adamw(0.1), mesh=fs.Mesh(mesh), param_specs=P(),
                         batch_spec=P(), precision=policy, on_nonfinite=on_nonfinite)
    state, _ = step(step.init({"w": torch.ones(4)}), {"bias": torch.tensor(0.0)})
    kept = _leaves(state)
    scale = [x.clone() for x in state.loss_scale]
    out: dict = {"message": None}
    try:
        new, m = step(state, {"bias": torch.tensor(math.nan)})
        out.update(skipped=int(m["skipped"]), step=int(new.step), grad_norm=float(m["grad_norm"]),
                   new_params=[x.clone() for x in new.params.values()],
                   new_scale_same=all(torch.equal(a, b) for a, b in zip(scale, new.loss_scale)))
    except FloatingPointError as e:
        out["message"] = str(e)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(kept, _leaves(state), strict=True)) and \
        all(torch.equal(a, b) for a, b in zip(scale, state.loss_scale))
    out["kept_params"] = [x.clone() for x in state.params.values()]
    return out


def gloo_fp16_nan_loss(on_nonfinite: str) -> dict:
    import torch.distributed as dist

    return run_fp16_nan_loss({"data": dist.get_world_size()}, on_nonfinite)
