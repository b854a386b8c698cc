"""What ``train_step`` checks of memory before it allocates: the state ``init`` is about to
make, and (on real ranks) what the first step of a layout allocates beyond it, measured on
the schedule check's dry run (``check_memory``)."""

from __future__ import annotations

import os
from typing import Any

import optree
import torch
import torch.distributed as dist

from fsharded import _tree
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec
from fsharded.parallel.pipeline import Pipelined
from fsharded.parallel.zero import zero
from fsharded.step import _estimate as _memory
from fsharded.step._layout import Moves


def check_init_memory(step: Any, params: Any, pl: Any) -> None:
    """Refuse a state that cannot fit before allocating it (see ``check_memory``)."""
    meta = optree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta")
                           if isinstance(x, torch.Tensor) else x, params)
    on_device = next((x.device.type for x in optree.tree_leaves(params)
                      if isinstance(x, torch.Tensor) and x.device.type != "meta"), "cpu")
    device = "cuda" if on_device == "cuda" else "cpu"

    flags = dict(zip(_tree.tree_flatten_with_paths(params)[0], pl.trainable or ()))

    def trains(path: str, _leaf: Any) -> bool:  # the step's choice (its placement holds it)
        return flags.get(path, True)

    # A pipelined loss: each pipe rank stores its own stages' state (the largest rank's counted).
    pipe = step.loss_fn if isinstance(step.loss_fn, Pipelined) else None

    def need(specs: Any, mesh: Mesh) -> int:
        est = _memory.estimate_memory(meta, specs, step.optimizer, precision=step.policy, mesh=mesh,
                                      activation_bytes=0, blocks=step.blocks, trainable=trains,
                                      loss=pipe if pipe is not None and pipe.axis in mesh.shape else None)
        return est.total + (est.host if device == "cpu" else 0)  # (a CPU device's memory is the host's)

    if step.distributed:
        here = need(pl, step.mesh)
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device == "cpu" else 1
        what = f"the training state at {pl.describe()} on {step.mesh!r}, per rank,"
    else:  # the virtual mesh holds every device's shards in this process: the whole state
        here = need(PartitionSpec(), Mesh({a: 1 for a in step.mesh.axis_names}))
        processes, what = 1, "the training state (the virtual mesh holds all of it in this process)"
    avail, _ = _memory.available_memory(device)
    if here * processes <= avail:
        return
    hints = []
    data = step.mesh.shape.get(pl.axis, 1) if getattr(pl, "axis", None) else step.mesh.shape.get("data", 1)
    if step.distributed and not any(Moves.of(pl).gather_in_loss) and data > 1:  # not sharded for use yet
        z3 = need(zero(3, axis=pl.axis or "data")(PartitionSpec(), meta), step.mesh)
        hints.append(f"ZeRO-3 over {pl.axis or 'data'} ({z3 / 2**30:,.2f} GiB per rank)")
    if not step.distributed:
        hints.append(f"real ranks (torchrun), each holding its shards: at ZeRO-3 about "
                     f"{here / max(data, 1) / 2**30:,.2f} GiB per rank on {max(data, 1)} ranks")
    _memory.check_fits(here, who="train_step.init", what=what, device=device, processes=processes,
                       hints=tuple(hints))

def check_step_memory(step: Any, most: int, state: Any, batch: Any) -> None:
    """Refuse a first step whose forward, backward and update (measured on the schedule
    check's dry run: activations, gradients, buffers, the new state) cannot fit beside
    the state already allocated, before any of it is (see ``check_memory``)."""
    device = next((x.device.type for x in optree.tree_leaves(state.params)
                   if isinstance(x, torch.Tensor)), "cpu")
    device = "cuda" if device == "cuda" else "cpu"
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device == "cpu" else 1
    rows = next((x.shape[0] for x in optree.tree_leaves(batch) if isinstance(x, torch.Tensor) and x.dim()), None)
    hints = [f"a smaller batch (this rank's share is {rows} rows)" if rows else "a smaller batch"]
    if step.remat is None or step.remat.every > 1:
        hints.append("recomputing the model's blocks in backward (train_step(remat=\"blocks\"), "
                     "--set remat.policy=blocks): only block inputs kept")
    data = step.mesh.shape.get("data", 1)
    hints.append(f"the same global batch over more data ranks (now {data})")
    _memory.check_fits(most, who=f"train_step: step {int(state.step) + 1}",
                       what=(f"its forward, backward and update on rank {dist.get_rank()} (measured on "
                             "a dry run, beyond the state already allocated)"),
                       device=device, processes=processes, hints=tuple(hints), lead="To need less")
