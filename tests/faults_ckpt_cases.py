"""Checkpoint fault cases run on gloo ranks (importable by name for run_on_ranks): the
save directory's lock held by one rank for the job, and resuming past a checkpoint that
only one rank finds damaged."""

from __future__ import annotations

import os

import checkpoint_cases as C
import torch

import fsharded as fs
from fsharded import P


def save_under_lock(root: str) -> dict:
    """Every rank saves step 1 through its own Manager of ``root``: rank 0 takes the
    directory's lock for the job, the others learn whether it got it. Returns the error
    (if any), what the lock file said while held, and this rank's pid."""
    rank = torch.distributed.get_rank()
    mesh = fs.Mesh({"data": torch.distributed.get_world_size()})
    mgr = fs.checkpoint.Manager(root, keep=2)
    out = {"rank": rank, "pid": os.getpid(), "error": None, "lock": None}
    try:
        mgr.save(1, {"w": torch.full((2,), float(rank))}, P("data"), mesh)
    except OSError as e:
        out["error"] = str(e)
    else:
        with open(os.path.join(root, ".fsharded-lock")) as f:
            out["lock"] = f.read()
    torch.distributed.barrier()  # every rank has read the lock before rank 0 lets it go
    mgr.unlock()
    return out


def save_steps(root: str) -> dict:
    """ZeRO-3 on data=2: checkpoints at steps 2 and 4; the global state at each."""
    step, params = C.make_step({"data": 2}, 3)
    mgr = fs.checkpoint.Manager(root, keep=3)
    state = step.init(params)
    out = {}
    for i in range(4):
        state, _ = C.train(step, state, i, 1)
        if (i + 1) % 2 == 0:
            mgr.save_state(step, state)
            out[i + 1] = C.global_state(step, state)
    mgr.unlock()
    return out


def restore(root: str) -> dict:
    """Manager.restore on every rank: the path each rank resumed from and its state."""
    import warnings

    step, params = C.make_step({"data": 2}, 3)
    mgr = fs.checkpoint.Manager(root, keep=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, state = mgr.restore(step, step.init(params))
    return {"path": path, "state": C.global_state(step, state),
            "warnings": [str(w.message) for w in caught]}
