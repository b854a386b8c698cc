"""Process groups per mesh axis over torch.distributed, launched by ``torchrun``.

>>> # torchrun --nproc_per_node 4 train.py
>>> fsharded.distributed.initialize()          # reads RANK, WORLD_SIZE, MASTER_ADDR, ...
>>> mesh = fsharded.Mesh({"data": 2, "tensor": 2})
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsharded.comm import _peers
from fsharded.mesh._mesh import Mesh

__all__ = ["initialize", "is_initialized", "rank", "world_size", "device_mesh", "from_device_mesh", "axis_group",
           "AxisGroup", "check_world", "remember_device_mesh", "default_device_type", "timeout_s", "forget"]


# How long a collective waits for the other ranks: initialize's timeout_s, per process
# (like the default process group it belongs to).
_TIMEOUT = {"s": 300.0}


def timeout_s() -> float:
    """Seconds a collective waits for the other ranks (``initialize(timeout_s=...)``)."""
    return _TIMEOUT["s"]


def is_initialized() -> bool:
    """Whether this process is in a torch.distributed process group (real ranks)."""
    return dist.is_available() and dist.is_initialized()


def initialize(backend: str | None = None, *, timeout_s: float = 300.0) -> None:
    """Initialise the default process group from torchrun's environment variables.

    ``backend`` defaults to NCCL when CUDA is available and gloo otherwise. Safe to call
    twice. Sets the CUDA device to ``LOCAL_RANK`` on GPU machines. ``timeout_s``: how long
    any collective waits for the other ranks — the default group's, every mesh axis's
    group's, and the same-host shared-memory transport's (unless ``FSHARDED_SHM_TIMEOUT``
    says otherwise); on that transport a rank that has exited or died is an error on the
    ranks waiting for it within a fraction of a second, whatever the timeout.
    """
    if is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"fsharded.distributed.initialize(): environment variables {missing} are not set; "
            f"launch with `torchrun --nproc_per_node N script.py`, or use the virtual mesh "
            f"(no initialize) in a single process"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Restarted by torchrun (--max-restarts): its agent keeps one store for every attempt
        # (static rendezvous), where the dead attempt's addresses still are; this attempt's
        # keys go under their own prefix, or the new ranks would dial the old ones.
        store = dist.PrefixStore(f"fsharded/attempt-{restart}", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
            is_master=False, timeout=timeout))
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    _TIMEOUT["s"] = float(timeout_s)
    # Every rank's process (host, pid), so that a rank waiting for another (a collective,
    # a checkpoint's publication) can say that it exited instead of waiting out the timeout.
    _peers.gather()
    # A process that ends with the group alive can abort in gloo's teardown ("terminate
    # called without an active exception") after its work is done: take it down first.
    atexit.unregister(_destroy_at_exit)
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    if is_initialized():
        dist.destroy_process_group()


def forget() -> None:
    """Drop every axis group and device mesh made so far (``comm.shutdown``)."""
    _GROUPS.clear()
    _DEVICE_MESHES.clear()
    _peers.forget()


def rank() -> int:
    """This process's global rank, 0 without a process group."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """The number of ranks, 1 without a process group."""
    return dist.get_world_size() if is_initialized() else 1


def default_device_type() -> str:
    """The device type of the mesh's shards: "cuda" on NCCL ranks, "cpu" otherwise."""
    if is_initialized() and dist.get_backend() == "nccl":
        return "cuda"
    return "cpu"


def check_world(mesh: Mesh) -> None:
    """Refuse a mesh whose size is not the world size, naming both."""
    if not is_initialized():
        raise RuntimeError("the distributed backend needs an initialised process group")
    ws = dist.get_world_size()
    if mesh.size != ws:
        raise ValueError(
            f"{mesh!r} has {mesh.size} devices but the world size is {ws}; "
            f"launch {mesh.size} ranks or change the mesh so its axis sizes multiply to {ws}"
        )


# Process groups are process-wide resources created collectively; they are memoised per
# (mesh, axes) so every shard_map call on the same mesh reuses them.
_GROUPS: dict[tuple[Mesh, tuple[str, ...]], AxisGroup] = {}
_DEVICE_MESHES: dict[tuple[Mesh, str], Any] = {}


@dataclass(frozen=True)
class AxisGroup:
    """The process group of the ranks that differ from this one only along ``axes``."""

    axes: tuple[str, ...]
    group: Any
    group_name: str
    size: int
    index: int  # this rank's position along ``axes`` (major axis first)
    ranks: tuple[int, ...]  # global ranks in axis order
    to_group: tuple[int, ...]  # axis-order position -> group rank
    identity_order: bool


def device_mesh(mesh: Mesh, *, device_type: str | None = None) -> Any:
    """The ``DeviceMesh`` with ``mesh``'s axes (created once per process)."""
    check_world(mesh)
    device_type = device_type or mesh.device_type or default_device_type()
    key = (mesh, device_type)
    if key not in _DEVICE_MESHES:
        _DEVICE_MESHES[key] = init_device_mesh(
            device_type, mesh.axis_sizes, mesh_dim_names=mesh.axis_names
        )
    return _DEVICE_MESHES[key]


def from_device_mesh(dm: Any) -> Mesh:
    """The ``Mesh`` of a ``torch.distributed.device_mesh.DeviceMesh`` (named dims required),
    its device type kept. Under an initialised process group ``dm`` is remembered, so
    ``device_mesh(from_device_mesh(dm))`` is ``dm`` (no new process groups).

    The DeviceMesh must lay the global ranks ``0 .. n-1`` out row-major, as
    ``init_device_mesh`` does, because a ``Mesh`` places rank ``r`` at ``coords(r)``.
    """
    names = dm.mesh_dim_names
    if names is None:
        raise ValueError(
            f"fs.comm.from_device_mesh: {dm!r} has no mesh_dim_names; build it with "
            f"init_device_mesh(..., mesh_dim_names=(...)) so axes can be named"
        )
    ranks = dm.mesh.flatten().tolist()
    if ranks != list(range(len(ranks))):
        raise ValueError(
            f"fs.comm.from_device_mesh: {dm!r} holds ranks {ranks}, but a Mesh lays out "
            f"ranks 0..{len(ranks) - 1} row-major; pass the whole-world mesh from "
            f"init_device_mesh (not a sub-mesh such as dm[{names[-1]!r}])"
        )
    mesh = Mesh(dict(zip(names, (int(s) for s in dm.mesh.shape))), device_type=dm.device_type)
    remember_device_mesh(mesh, dm)
    return mesh


def remember_device_mesh(mesh: Mesh, dm: Any) -> None:
    """Reuse a user's ``DeviceMesh`` for ``mesh`` (``from_device_mesh`` does).

    Only when a process group is initialised and ``dm`` spans the whole world; otherwise
    nothing is recorded and ``device_mesh`` builds its own on demand.
    """
    if is_initialized() and mesh.size == dist.get_world_size():
        _DEVICE_MESHES.setdefault((mesh, dm.device_type), dm)


def axis_group(mesh: Mesh, axes: tuple[str, ...]) -> AxisGroup:
    """The group for ``axes`` (one name or several, major first); collective on first use."""
    key = (mesh, tuple(axes))
    if key not in _GROUPS:
        _GROUPS[key] = _groups_along(mesh, tuple(axes), list(itertools.product(*(range(mesh.shape[a]) for a in axes))))
    return _GROUPS[key]


def axis_subgroup(mesh: Mesh, axis: str, members: tuple[int, ...]) -> AxisGroup | None:
    """The group of the ranks at coordinates ``members`` along ``axis`` that differ from
    this one only along it (positions in ``members`` order), or None on a rank whose
    coordinate is not among them; collective on first use (every rank makes every such
    group, in the same order, whether it belongs to one or not)."""
    key = (mesh, (axis,), tuple(members))
    if key not in _GROUPS:
        _GROUPS[key] = _groups_along(mesh, (axis,), [(c,) for c in members])
    return _GROUPS[key]


def _groups_along(mesh: Mesh, axes: tuple[str, ...], along: list[tuple[int, ...]]) -> AxisGroup | None:
    """Every group of the ranks at the coordinates ``along`` of ``axes``, one per position
    on the other axes, made by every rank in the same order; this rank's, or None."""
    check_world(mesh)
    me = mesh.coords(dist.get_rank())
    others = [a for a in mesh.axis_names if a not in axes]
    mine = None
    # Every rank must create every subgroup, in the same order.
    for fixed in itertools.product(*(range(mesh.shape[a]) for a in others)):
        base = dict(zip(others, fixed))
        ranks = [mesh.rank_of({**base, **dict(zip(axes, at))}) for at in along]
        # The group waits as long as initialize(timeout_s=) says (new_group's own default
        # is 30 minutes, whatever the default group's timeout).
        group = dist.new_group(ranks=sorted(ranks), timeout=datetime.timedelta(seconds=timeout_s()))
        if all(base[a] == me[a] for a in others) and dist.get_rank() in ranks:
            sorted_ranks = sorted(ranks)
            to_group = tuple(sorted_ranks.index(r) for r in ranks)
            mine = AxisGroup(
                axes=tuple(axes),
                group=group,
                group_name=group.group_name,
                size=len(ranks),
                index=ranks.index(dist.get_rank()),
                ranks=tuple(ranks),
                to_group=to_group,
                identity_order=to_group == tuple(range(len(ranks))),
            )
    return mine
