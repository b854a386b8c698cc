"""A directory of checkpoints (``checkpoint.Manager``'s): one run at a time in it, its
checkpoints listed with interrupted replaces settled, and resuming from the newest one that
loads.

One run at a time: ``DirLock`` holds an exclusive ``flock`` on ``<root>/.fsharded-lock``,
which records its holder (pid, host, command, start time) so that a second run is refused
naming the first; on real ranks rank 0 holds it for the job and the others learn whether it
got it (``lock_job``). The kernel drops the lock when its holder dies however it dies, so a
lock left by a killed run is free: the next run takes it over, warning with what the file
says of the dead holder. A clean release removes the file (while still holding the lock:
whoever opened it meanwhile sees it gone and opens anew)."""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from fsharded.checkpoint._common import CheckpointError, CorruptCheckpointError
from fsharded.checkpoint._index import _blocks, _read_manifest_file, settle

NAME = ".fsharded-lock"


class DirectoryInUseError(OSError):
    """A directory of checkpoints another run (or another ``Manager`` here) is saving to."""


def _command() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            parts = [p.decode(errors="replace") for p in f.read().split(b"\0")[:-1]]
    except OSError:
        parts = []
    parts = [(p if len(p) <= 100 else p[:100] + "...").replace("\n", "\\n") for p in parts or [sys.executable, *sys.argv]]
    cmd = shlex.join(parts)  # (a `python -c` script cut short)
    return cmd if len(cmd) <= 400 else cmd[:400] + " ..."


def _read(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 1 << 16, 0)
    except OSError:
        return None
    if not raw.strip():
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        return {"raw": raw[:200].decode(errors="replace")}
    return info if isinstance(info, dict) else {"raw": repr(info)[:200]}


def describe(info: dict | None) -> str:
    """A holder as the lock file records it."""
    if not info:
        return "a process that has not recorded itself yet"
    if "pid" not in info:
        return f"a process that recorded {info.get('raw')!r}"
    me = " (this process)" if info.get("pid") == os.getpid() and info.get("host") == socket.gethostname() else ""
    return (f"pid {info.get('pid')}{me} on {info.get('host')}, started {info.get('started')}, running "
            f"`{info.get('command')}`")


def _release(fd: int, path: str, pid: int) -> None:
    if os.getpid() != pid:  # a forked child exiting: the lock is its parent's
        return
    try:
        if os.path.samestat(os.fstat(fd), os.stat(path)):
            os.unlink(path)  # held while unlinked: a waiting opener finds the file gone
    except OSError:
        pass
    finally:
        os.close(fd)  # drops the lock


class DirLock:
    """An exclusive lock on the directory ``root`` (made if missing) for this process,
    released by ``release()``, when this object is collected, or at exit."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, NAME)
        self._finalizer: weakref.finalize | None = None

    @property
    def held(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def acquire(self) -> None:
        """Take the lock or raise ``DirectoryInUseError`` naming its holder. Where the file
        system cannot lock, warn and go on unlocked."""
        if self.held:
            return
        try:
            import fcntl
        except ImportError:  # not a POSIX system
            warnings.warn(f"checkpoint: cannot lock {self.root} here (no fcntl): nothing keeps another run "
                          f"from saving there too", stacklevel=3)
            return
        os.makedirs(self.root, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                info = _read(fd)
                for _ in range(20):  # the holder writes its record just after taking the lock
                    if info:
                        break
                    time.sleep(0.025)
                    info = _read(fd)
                os.close(fd)
                raise DirectoryInUseError(
                    f"checkpoint: {self.root} is in use by another run: {describe(info)} holds its lock "
                    f"({self.path}). Two runs saving to one directory overwrite each other's checkpoints: give "
                    f"this run another directory (fsharded train --save-dir), or stop the other run first") from None
            except OSError as e:  # a file system without locks
                os.close(fd)
                warnings.warn(f"checkpoint: cannot lock {self.root} ({e}): nothing keeps another run from saving "
                              f"there too", stacklevel=3)
                return
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its holder released and removed it meanwhile: lock the new one
        left = _read(fd)
        if left:
            warnings.warn(f"checkpoint: took over the lock of {self.root} from {describe(left)}, which is no "
                          f"longer running (killed?)", stacklevel=3)
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": _command(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self._finalizer = weakref.finalize(self, _release, fd, self.path, os.getpid())

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None


def lock_job(root: str, dist: bool) -> DirLock | None:
    """The lock of ``root`` for this job: taken by this process, or on real ranks (``dist``,
    called on every rank) by rank 0, which tells the others whether it got it; every rank
    raises what rank 0 met. The lock held here, or None (another rank holds it)."""
    lock, err = None, None
    if not dist or torch.distributed.get_rank() == 0:
        lock = DirLock(root)
        try:
            lock.acquire()
        except Exception as e:  # noqa: BLE001 - every rank raises it, below
            lock, err = None, e
    if dist:
        box = [err]
        torch.distributed.broadcast_object_list(box, src=0)
        err = box[0]
    if err is not None:
        raise err
    return lock


# -- listing, and resuming from the newest checkpoint that loads ------------------------------------


def settle_all(root: str, names: list[str]) -> bool:
    """``settle`` every checkpoint of ``root`` (``names``: its listing) whose replace was
    interrupted between its two renames; whether one was."""
    bases = set()
    for n in names:
        for mark in (".tmp-", ".old-"):
            if mark in n:
                bases.add(n[:n.index(mark)])
    done = False
    for base in sorted(bases - set(names)):
        done |= settle(os.path.join(root, base))
    return done


def damage(path: str) -> str | None:
    """What is wrong with the checkpoint at ``path``'s manifest or index (their checksums,
    their entries, the blocks tiling every leaf within their data files), or None. Reads no
    data: a flipped byte in a data file is found by the load."""
    try:
        _blocks(path, _read_manifest_file(path))
    except (CorruptCheckpointError, FileNotFoundError) as e:
        return str(e)
    return None


def restore(root: str, paths: list[str], load: Callable[[str], Any], dist: bool) -> tuple[str | None, Any]:
    """``load`` the first of ``paths`` (newest first) that loads: (its path, what ``load``
    returned), or (None, None) where there are none. One found damaged (on any rank: on
    real ranks every rank calls this and they agree) is passed over with a warning naming
    it and why; any other error is raised (on every rank). Every one damaged: an error
    naming each."""
    damaged = []
    rank = torch.distributed.get_rank() if dist else 0
    if dist:  # the candidates as rank 0 lists them: every rank tries the same ones, in step
        box = [paths]
        torch.distributed.broadcast_object_list(box, src=0)
        paths = box[0]
    for path in paths:
        state, err, why = None, None, None
        try:
            state = load(path)
        except (CorruptCheckpointError, FileNotFoundError) as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            err = e
        if dist:
            every = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every, (why, None if err is None else f"{type(err).__name__}: {err}"))
            if err is None:
                other = next((f"rank {r}: {e}" for r, (_, e) in enumerate(every) if e is not None), None)
                if other is not None:
                    raise CheckpointError(f"checkpoint: {path} could not be loaded on {other}")
            why = next((f"(rank {r}) {w}" if w != why else w for r, (w, _) in enumerate(every) if w is not None), None)
        if err is not None:
            raise err
        if why is None:
            return path, state
        del state
        damaged.append((path, why))
        if rank == 0:
            warnings.warn(f"checkpoint: {path} is damaged, resuming from an older checkpoint instead: {why}",
                          stacklevel=3)
    if damaged:
        raise CorruptCheckpointError(
            f"checkpoint: every checkpoint in {root} is damaged:\n"
            + "\n".join(f"  {p}: {w}" for p, w in damaged)
            + f"\nRestore one from a copy, or move them out of {root} to start afresh")
    return None, None
