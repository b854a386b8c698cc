"""Functions run on ranks by tests/test_launch.py."""

from __future__ import annotations

import os

import torch


def who() -> dict:
    import torch.distributed as dist

    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return {"pid": os.getpid(), "rank": dist.get_rank(), "world": dist.get_world_size(), "sum": float(t),
            "env": os.environ.get("FSHARDED_LAUNCH_TEST"), "draw": torch.rand(3)}


def fail_on_rank_1() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 says no")
    dist.barrier()  # rank 0 waits for a rank that has failed
    return 0
