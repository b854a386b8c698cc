"""The transport under fsharded's collectives on real ranks.

Process groups per mesh axis (``initialize``, ``axis_group``), a ``Mesh``'s ``DeviceMesh``
both ways (``device_mesh``, ``from_device_mesh``), the eager
and traceable c10d calls (``_c10d``) and the same-host shared-memory transport for gloo
CPU ranks (``_shm``). Nothing here knows about shard_map, specs or varying axes.
"""

from fsharded.comm import _c10d, _groups, _peers, _shm  # noqa: F401 - the transport modules, by name
from fsharded.comm._c10d import (
    all_gather_dim,
    all_reduce,
    all_to_all_dims,
    reduce_scatter_dim,
    send_recv,
    send_recv_start,
    tracing,
)
from fsharded.comm._groups import (
    AxisGroup,
    axis_group,
    axis_subgroup,
    check_world,
    default_device_type,
    device_mesh,
    from_device_mesh,
    initialize,
    is_initialized,
    rank,
    remember_device_mesh,
    timeout_s,
    world_size,
)

__all__ = [
    "initialize",
    "shutdown",
    "is_initialized",
    "rank",
    "world_size",
    "device_mesh",
    "from_device_mesh",
    "axis_group",
    "axis_subgroup",
    "AxisGroup",
    "check_world",
    "remember_device_mesh",
    "default_device_type",
    "timeout_s",
    "tracing",
    "all_reduce",
    "all_gather_dim",
    "reduce_scatter_dim",
    "all_to_all_dims",
    "send_recv",
    "send_recv_start",
]


def shutdown() -> None:
    """Destroy the default process group and forget every axis group and shared-memory
    segment made over it, so ``initialize`` can start afresh in this process (a notebook
    that re-launches, a pool of test ranks)."""
    import torch.distributed as dist

    _groups.forget()
    _shm.forget()
    if is_initialized():
        dist.destroy_process_group()
