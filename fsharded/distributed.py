"""Real ranks under ``torchrun``: initialise the process group, look up per-axis groups.

>>> # torchrun --nproc_per_node 4 train.py
>>> fsharded.distributed.initialize()          # reads RANK, WORLD_SIZE, MASTER_ADDR, ...
>>> mesh = fsharded.Mesh({"data": 2, "tensor": 2})
>>> ...
>>> fsharded.distributed.shutdown()            # before exit: the process group torn down cleanly

(The transport itself lives in ``fsharded.comm``.)
"""

from fsharded.comm import (
    axis_group,
    check_world,
    default_device_type,
    device_mesh,
    initialize,
    is_initialized,
    rank,
    shutdown,
    timeout_s,
    world_size,
)

__all__ = ["initialize", "shutdown", "is_initialized", "rank", "world_size", "device_mesh", "axis_group",
           "check_world", "default_device_type", "timeout_s"]
