"""Which process each rank runs in, so that a rank waiting for another can tell whether it
exited or died, and errors can name ranks globally, with their place in an axis group.

``initialize`` records every rank's (host, boot id, pid) once (one small all-gather); the
shared-memory transport's set-up records its group's too (process groups made without
``initialize``). A rank on another host, or not recorded, is never called dead: only its
timeout speaks for it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

__all__ = ["me", "gather", "record", "forget", "pid_of", "exited", "exited_among", "label", "axes_name",
           "poll"]

# global rank -> (host, boot id, pid), for this process's default process group
_PROCS: dict[int, tuple[str, str, int]] = {}


def boot_id() -> str:
    """This boot of this host (ranks on one host share its memory)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def me() -> tuple[str, str, int]:
    """This process: (host name, boot id, pid)."""
    return socket.gethostname(), boot_id(), os.getpid()


def gather() -> None:
    """Every rank's process, recorded on every rank (collective over the default group)."""
    procs: list = [None] * dist.get_world_size()
    dist.all_gather_object(procs, me())
    record(range(len(procs)), procs)


def record(ranks: Iterable[int], procs: Iterable[Any]) -> None:
    for r, p in zip(ranks, procs):
        if p is not None:
            _PROCS[int(r)] = (str(p[0]), str(p[1]), int(p[2]))


def forget() -> None:
    _PROCS.clear()


def pid_of(rank: int) -> int | None:
    """The pid of global ``rank`` when it runs on this host (None: unknown or elsewhere)."""
    p = _PROCS.get(rank)
    if p is None:
        return None
    host, boot, _ = me()
    return p[2] if (p[0], p[1]) == (host, boot) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True  # no procfs: kill() said it exists
    state = stat[stat.rfind(")") + 2:stat.rfind(")") + 3]
    return state not in ("Z", "X")  # a zombie has exited (its parent has not reaped it yet)


def exited(rank: int) -> int | None:
    """The pid of global ``rank`` if its process has exited or died, else None."""
    pid = pid_of(rank)
    return pid if pid is not None and pid != os.getpid() and not _alive(pid) else None


def exited_among(ranks: Iterable[int], *, settle_s: float = 0.0) -> list[tuple[int, int]]:
    """``(rank, pid)`` of those of ``ranks`` whose process has exited or died. ``settle_s``:
    look again for that long if none has (a peer's sockets close while it exits, a moment
    before its process is gone)."""
    ranks = list(ranks)
    t0 = time.monotonic()
    while True:
        gone = [(r, pid) for r in ranks if (pid := exited(r)) is not None]
        if gone or time.monotonic() - t0 >= settle_s:
            return gone
        time.sleep(0.02)


def label(rank: int, axes: tuple[str, ...] = (), ranks: tuple[int, ...] = ()) -> str:
    """``rank 3 (data index 1 of the group ranks [1, 3])``: a global rank, with its place
    along ``axes`` in the group of ``ranks`` (axis order) when given."""
    if not axes or rank not in ranks:
        return f"rank {rank}"
    return f"rank {rank} ({axes_name(axes)} index {ranks.index(rank)} of the group ranks {list(ranks)})"


def axes_name(axes: tuple[str, ...]) -> str:
    """``data``, or ``(data, tensor)`` for a group over several axes (major first)."""
    return axes[0] if len(axes) == 1 else f"({', '.join(axes)})"


def poll(ready: Callable[[], bool], *, timeout_s: float, peers: Callable[[], Iterable[int]],
         on_exit: Callable[[list[tuple[int, int]], float], BaseException],
         on_timeout: Callable[[float], BaseException]) -> None:
    """Wait until ``ready()``: raise ``on_exit(gone, waited)`` as soon as one of ``peers()``
    (the ranks it waits for) has exited or died without making it ready, and
    ``on_timeout(waited)`` after ``timeout_s``. Sleeps ever longer, up to 50 ms."""
    t0 = time.monotonic()
    delay, next_look = 0.001, 0.0
    while not ready():
        waited = time.monotonic() - t0
        if waited >= next_look:
            next_look = waited + 0.1
            gone = exited_among(peers())
            if gone and not ready():  # what it left behind is final: look once more
                raise on_exit(gone, waited)
        if waited > timeout_s:
            raise on_timeout(waited)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def why_failed(e: BaseException, what: str) -> str | None:
    """Why a torch.distributed call of ``what`` failed on this rank, naming the ranks whose
    processes exited (found from their pids) or that did not arrive in time; None for an
    error that is not the process group's (the caller raises it as it is)."""
    text = str(e)
    if not (isinstance(e, getattr(dist, "DistError", ())) or "gloo" in text or "NCCL" in text
            or "c10d" in text or "timed out" in text.lower()):
        return None
    me = dist.get_rank()
    others = [r for r in range(dist.get_world_size()) if r != me]
    gone = exited_among(others, settle_s=1.0)
    cause = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    if gone:
        why = ", ".join(f"rank {r} (pid {pid})" for r, pid in gone) + f" exited or died during {what}"
    elif "timed out" in cause.lower() or "timeout" in cause.lower():
        who = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {', '.join(map(str, others))}"
        why = (f"{who} did not reach {what}'s collectives within the timeout (initialize(timeout_s=...)): "
               f"stuck, or not calling it (every rank must call {what})")
    else:
        why = "a collective failed"
    return f"{why} (torch.distributed: {cause})"
