"""The collective schedule of one call on this rank, and a check that every rank agrees.

Ranks that run different collectives hang or, worse, exchange each other's data (the same
op and size issued for different tensors). Before it runs a program for the first time, a
rank can list what it will run (a dry run over meta tensors: op, axis, dtype, shape,
phase, in order, with nothing sent) and the ranks compare a hash of that list: one small
all-gather. A mismatch is an error on every rank naming the first entry that differs.
"""

from __future__ import annotations

import hashlib
from typing import Any

import optree
import torch
import torch.distributed as dist

from fsharded import comm
from fsharded.spmd import _manifest

__all__ = ["dry_run", "agree"]


def _meta(tree: Any) -> Any:
    return optree.tree_map(
        lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x,
        tree)


def dry_run(fn: Any, *args: Any) -> list[tuple]:
    """``fn(*args)`` on meta tensors of the same shapes with the collectives answering
    locally: this rank's schedule, ``(phase, op, axis, dtype, shape)`` per collective."""
    with _manifest.recording(dry=True) as entries:
        fn(*_meta(args))
    return [(e.phase, e.op, e.axis, str(e.dtype).replace("torch.", ""), tuple(e.shape)) for e in entries]


def agree(schedule: list[tuple], what: str) -> None:
    """Raise on every rank unless every rank's ``schedule`` is the same."""
    if not comm.is_initialized() or dist.get_world_size() == 1:
        return
    digest = int.from_bytes(hashlib.sha256(repr(schedule).encode()).digest()[:8], "little", signed=True)
    device = "cuda" if comm.default_device_type() == "cuda" else "cpu"
    mine = torch.tensor([digest, len(schedule)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if all(torch.equal(t, every[0]) for t in every):
        return
    lists: list = [None] * dist.get_world_size()
    dist.all_gather_object(lists, schedule)
    me = dist.get_rank()
    lines = []
    for r, other in enumerate(lists):
        if other == lists[0]:
            continue
        i = next((k for k, (a, b) in enumerate(zip(lists[0], other)) if a != b),
                 min(len(lists[0]), len(other)))
        a = lists[0][i] if i < len(lists[0]) else "(nothing: rank 0 stops here)"
        b = other[i] if i < len(other) else f"(nothing: rank {r} stops here)"
        lines.append(f"  collective #{i}: rank 0 runs {a}, rank {r} runs {b}")
    raise RuntimeError(
        f"{what}: the ranks would run different collectives (rank {me} of "
        f"{dist.get_world_size()}; {len(schedule)} collectives here), which hangs or mixes "
        f"up their data:\n" + "\n".join(lines) + "\nEvery rank must run the same "
        "collectives in the same order with the same shapes: look for control flow on the "
        "rank or on data that differs between ranks (uneven batches, per-rank files)."
    )
