"""Steps whose gradients or loss are not finite (run on gloo ranks by test_nonfinite)."""

from __future__ import annotations

import torch

import fsharded as fs
from fsharded import P


def sqrt_loss(p, b):
    """sqrt(w * x) has an infinite gradient where w * x = 0: a finite loss, inf gradients."""
    return torch.sqrt(p["w"] * b["x"]).mean() + (p["v"] ** 2).mean() + (p["u"] * b["x"]).mean()


def params() -> dict:
    return {"w": torch.tensor([1.0, 1.0, 2.0, 3.0]), "v": torch.ones(4, 3), "u": torch.full((4,), 0.5)}


def batches() -> tuple[dict, dict]:
    good = {"x": torch.ones(8, 4)}
    bad = {"x": torch.ones(8, 4)}
    bad["x"][6, 1] = 0.0  # one row of the second half: only the last data shard sees it
    return good, bad


def make_step(mesh: dict, *, donate: bool, stage: int = 0, optimizer=None, **kw):
    plan = fs.parallel.zero(stage, min_size=1)(P(), params()) if stage else P()
    return fs.train_step(sqrt_loss, optimizer or fs.optim.adamw(0.1), mesh=fs.Mesh(mesh),
                         param_specs=plan, donate=donate, **kw)


def run_stop(mesh: dict, donate: bool, stage: int = 0, optimizer: str = "adamw") -> dict:
    """A good step, then a bad one: the error, and whether the state is the good one."""
    opt = fs.optim.adamw(0.1) if optimizer == "adamw" else fs.optim.sgd(0.1, momentum=0.9)
    step = make_step(mesh, donate=donate, stage=stage, optimizer=opt)
    good, bad = batches()
    state, _ = step(step.init(params()), good)
    kept = [x.clone() for x in fs._tree.tree_flatten_with_paths((state.params, state.opt_state))[1]
            if isinstance(x, torch.Tensor)]
    try:
        step(state, bad)
        message = None
    except FloatingPointError as e:
        message = str(e)
    now = [x for x in fs._tree.tree_flatten_with_paths((state.params, state.opt_state))[1]
           if isinstance(x, torch.Tensor)]
    unchanged = all(torch.equal(a, b) for a, b in zip(kept, now, strict=True))
    state, m = step(state, good)  # the kept state trains on
    finite = all(bool(torch.isfinite(x).all()) for x in fs._tree.tree_flatten_with_paths(state.params)[1])
    return {"message": message, "unchanged": unchanged, "finite_after": finite,
            "loss": float(m["loss"]), "step": int(state.step)}


def gloo_stop(donate: bool, stage: int) -> dict:
    import torch.distributed as dist

    return run_stop({"data": dist.get_world_size()}, donate, stage)
