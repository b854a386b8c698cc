"""``fsharded.checkpoint``'s save, load and ``Manager`` (the package docstring describes the
format); the index, the blocks, the structure record and the interop live beside it."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import optree
import torch

from fsharded import comm
from fsharded.checkpoint import _structure as _ckpt_structure
from fsharded.checkpoint._common import (
    DAMAGED,
    FORMAT,
    CheckpointError,
    CorruptCheckpointError,
    _assemble,
    _distributed,
    _dtype,
    _flat_specs,
    _flatten,
    _Reader,
    refuse_placeholders,
)
from fsharded.checkpoint._deepspeed import DeepSpeedCheckpoint, load_deepspeed, read_deepspeed
from fsharded.checkpoint._dir import DirectoryInUseError, damage, lock_job, restore, settle_all
from fsharded.checkpoint._index import (
    _blocks,
    _complete,
    file_checksum,
    misfit_message,
    read_manifest,
    seal,
)
from fsharded.checkpoint._interop import dcp_state_dict, export_safetensors, load_dcp, save_dcp
from fsharded.checkpoint._layout import _box, _layout
from fsharded.checkpoint._write import Arena, _fsync, _write_data, _write_json
from fsharded.comm import _peers
from fsharded.mesh import Mesh, PartitionSpec
from fsharded.mesh._layout import check_tree, global_shape

__all__ = ["save", "save_async", "PendingSave", "Staging", "load", "tree_like", "Manager", "read_deepspeed", "load_deepspeed",
           "DeepSpeedCheckpoint", "save_dcp", "load_dcp", "dcp_state_dict", "export_safetensors", "FORMAT",
           "CheckpointError", "CorruptCheckpointError", "DirectoryInUseError",
           "read_manifest"]  # and DCPReader (imported when asked for)

# -- save ---------------------------------------------------------------------------------------


def save(directory: str | os.PathLike, tree: Any, specs: Any, mesh: Mesh, *,
         backend: str | None = None, overwrite: bool = False, owners: list | None = None) -> str:
    """Write ``tree`` (laid out by ``specs`` on ``mesh``) to ``directory``; returns its path.

    On real ranks every rank calls it with its own shards (each writes its blocks, in
    parallel; rank 0 the manifest); elsewhere the values are global. ``directory`` must
    not exist unless ``overwrite`` (then it is replaced once the new one is complete).
    ``save_async`` does the same in the background. ``owners``: one entry per leaf
    (flatten order), None or ``(axis, coordinates)``: the leaf is held only by the devices
    at those coordinates along ``axis`` (a pipeline stage's), the first of them writes it
    (on real ranks the others' copies are placeholders, never read)."""
    job = _Job(directory, tree, specs, mesh, backend, overwrite, owners)
    try:
        _write_data(job.tmp, job.rank, job.pieces)
    except BaseException:
        # Disk full, a leaf that cannot be stored, an interrupt: no partial checkpoint is
        # left to mistake for one (the previous ones are untouched).
        if not job.dist:
            shutil.rmtree(job.tmp, ignore_errors=True)
        raise
    if job.dist:
        torch.distributed.barrier()
    if job.rank == 0:
        job.publish()
    if job.dist:
        torch.distributed.barrier()
    return job.directory


class _Job:
    """One save: its temporary directory (made, on real ranks, with every rank agreeing on
    its name), the manifest's leaf entries and the blocks this writer writes."""

    def __init__(self, directory: Any, tree: Any, specs: Any, mesh: Mesh, backend: str | None,
                 overwrite: bool, owners: list | None = None) -> None:
        self.directory = directory = os.fspath(directory)
        paths, leaves, tdef = _flatten(tree)
        flat_specs = _flat_specs(specs, tree, tdef)
        self.mesh, self.dist = mesh, _distributed(mesh, backend)
        self.rank = comm.rank() if self.dist else 0
        self.writers = comm.world_size() if self.dist else 1
        owned = _owned(owners, leaves, mesh)
        if self.dist:
            refuse_placeholders(paths, leaves, owned, "checkpoint.save")
        self.layout, self.entries, self.pieces = _layout(paths, leaves, flat_specs, mesh, self.dist,
                                                         self.rank, tdef, owned)
        self.tdef = tdef  # its structure is described by rank 0 as it publishes (in save_async's thread)
        if os.path.exists(directory) and not overwrite:
            raise FileExistsError(f"checkpoint.save: {directory} exists; pass overwrite=True to replace it")
        token = [secrets.token_hex(4)]
        if self.dist:
            try:
                torch.distributed.broadcast_object_list(token, src=0)
            except Exception as e:
                why = _peers.why_failed(e, "checkpoint.save")
                if why is None:
                    raise
                raise CheckpointError(
                    f"checkpoint.save: {directory} was not saved (rank {self.rank}): {why}. The earlier "
                    "checkpoints are untouched: restart every rank and resume from the last complete one"
                ) from e
        self.token = token[0]
        self.tmp = f"{directory}.tmp-{self.token}"
        os.makedirs(self.tmp, exist_ok=self.dist)  # a fresh name: on real ranks, whoever is first

    def publish(self) -> None:
        """Rank 0, once every writer's blocks are in: the manifest, then the rename."""
        directory, tmp = self.directory, self.tmp
        index = {f"blocks-{w:05d}.json": file_checksum(os.path.join(tmp, f"blocks-{w:05d}.json"))
                 for w in range(self.writers)}  # a few KB each: any edit of the index is refused
        manifest = {"format": FORMAT, "mesh": dict(self.mesh.shape), "leaves": self.entries,
                    "structure": _ckpt_structure.describe(self.tdef), "writers": self.writers,
                    "token": self.token, "index": index}
        _write_json(os.path.join(tmp, "manifest.json"), seal(manifest))
        _fsync(tmp)
        old = None
        if os.path.exists(directory):
            old = f"{directory}.old-{self.token}"
            os.rename(directory, old)
        try:
            os.rename(tmp, directory)
        except BaseException as e:
            # A reader that found <directory> missing between the two renames put this
            # (complete) save in place itself (``checkpoint._index.settle``): a success.
            if not (isinstance(e, FileNotFoundError) and _token_at(directory) == self.token):
                if old is not None:  # the previous checkpoint back in its place
                    os.rename(old, directory)
                raise
        _fsync(os.path.dirname(os.path.abspath(directory)))
        _remove_replaced(directory)


_removing: set[str] = set()
_removing_lock = threading.Lock()


def _remove_replaced(directory: str) -> None:
    """Remove the checkpoints ``directory`` replaced (``<directory>.old-<token>``: renamed
    out of the way, complete and no longer anyone's) in a thread, so that a save returns
    without waiting for the unlinks (a third of a save's time on ext4). The interpreter
    waits for the thread at exit; a leftover of a killed process is removed by the next
    save to ``directory``. Only while a complete checkpoint is at ``directory``: an
    ``.old-`` copy beside a missing one is what ``settle`` restores."""
    parent, base = os.path.split(os.path.abspath(directory))
    if not _complete(directory):
        return
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if name.startswith(base + ".old-"):
                _remove_later(os.path.join(parent, name))


def _remove_later(path: str) -> None:
    with _removing_lock:
        if path in _removing:
            return
        _removing.add(path)

    def run() -> None:
        try:
            shutil.rmtree(path)
        except OSError as e:  # the new checkpoint is complete: a leftover is no failure
            if os.path.exists(path):
                warnings.warn(f"checkpoint: could not remove the replaced {path} ({e})", stacklevel=1)
        finally:
            with _removing_lock:
                _removing.discard(path)

    threading.Thread(target=run, name="fsharded-checkpoint-remove", daemon=False).start()


def _after_fork() -> None:  # a child has none of the parent's threads
    global _removing_lock
    _removing.clear()
    _removing_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def _wait_removals(timeout_s: float = 60.0) -> None:
    """Wait until the replaced checkpoints this process is removing are gone."""
    _poll(lambda: not _removing, timeout_s, "checkpoint: removing replaced checkpoints")


# -- saving in the background -------------------------------------------------------------------


class Staging:
    """Host memory kept from one background save to the next (``save_async(staging=)``; a
    train step keeps one for its ``save_async``). A save copies the blocks this device
    writes into one page-aligned buffer laid out as its data file and writes the file from
    it (``checkpoint._write.Arena``); the next save reuses that buffer instead of allocating and
    faulting in new pages, so the copy that blocks the caller runs at memory speed (about
    5x faster here), as DCP's cached staging does. It holds this device's share of the
    largest state saved so far (``nbytes``) until ``release()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: Arena | None = None

    @property
    def nbytes(self) -> int:
        """The bytes held between saves."""
        free = self._free
        return free.capacity if free is not None else 0

    def release(self) -> None:
        """Free the memory held (a save in flight keeps its buffer until it is written)."""
        with self._lock:
            self._free = None

    def _take(self, nbytes: int) -> Arena:
        with self._lock:
            free = self._free
            if free is not None and free.capacity >= nbytes:
                self._free = None
                free.used = 0
                return free
        return Arena(nbytes)  # none kept, too small, or in use by a save still in flight

    def _give(self, arena: Arena) -> None:
        with self._lock:
            if self._free is None or arena.capacity > self._free.capacity:
                self._free = arena


class PendingSave:
    """A save running in the background (``save_async``); ``wait()`` returns its directory
    once the checkpoint is complete (on every rank: once rank 0 has published it), or
    raises what failed. ``peak_staged_bytes``: the most bytes of staged copies held at
    once."""

    def __init__(self, job: _Job, timeout_s: float, arena: Arena | None = None,
                 staging: Staging | None = None) -> None:
        self._job, self._timeout = job, timeout_s
        self._arena, self._staging = arena, staging  # arena: every block copied into it
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._staged = 0
        self.peak_staged_bytes = 0
        self._queue: queue.Queue = queue.Queue()  # the copies made, in bounded staging
        self._copied: list[tuple] = []  # the blocks in the arena, where there is one
        self._thread = threading.Thread(target=self._run, name="fsharded-checkpoint", daemon=False)

    @property
    def directory(self) -> str:
        return self._job.directory

    def done(self) -> bool:
        """Whether this rank's part has finished (successfully or not)."""
        return not self._thread.is_alive()

    def wait(self) -> str:
        """Block until the checkpoint is complete; its directory. Raises the save's error."""
        self._thread.join()
        self._drain()
        if self._error is not None:
            raise self._error
        job = self._job
        if job.dist and job.rank != 0:  # complete when rank 0 has renamed it into place
            _wait_for_ranks(lambda: _token_at(job.directory) == job.token or bool(_failed_markers(job.tmp)),
                            self._timeout, job, lambda: [0], "publish")
            if _token_at(job.directory) != job.token:
                raise CheckpointError(f"checkpoint.save_async: {job.directory} was not saved: "
                                      f"another rank failed (see {job.tmp})")
        return job.directory

    result = wait

    # -- the foreground: copies of the blocks, as many at a time as the bound allows -------

    def _stage(self, bound: int | None) -> None:
        try:
            pieces = self._job.pieces
            if self._arena is not None:  # every block at once, in the file's layout
                views = self._arena.copy_in(self._job.layout, [p[3] for p in pieces])
                self._copied = [(path, start, size, view) for (path, start, size, _), view in zip(pieces, views)]
                self.peak_staged_bytes = self._arena.used
                pieces = ()
            for path, start, size, piece in pieces:
                n = piece.numel() * piece.element_size()
                with self._cond:
                    while (bound is not None and self._staged and self._staged + n > bound
                           and self._error is None):
                        self._cond.wait()
                    if self._error is not None:
                        break
                    self._staged += n
                    self.peak_staged_bytes = max(self.peak_staged_bytes, self._staged)
                copy = torch.empty(piece.shape, dtype=piece.dtype)  # a snapshot: the state may
                copy.copy_(piece.detach())                          # change once we return
                self._queue.put((path, start, size, copy, n))
        except BaseException as e:
            # The writer must not take the end of a cut-short queue for a complete save.
            self._error = self._error or e
            raise
        finally:
            self._queue.put(None)
            self._job.pieces = []  # the caller's tensors are not held past this call

    def _staged_pieces(self) -> Iterator[tuple]:
        while True:
            item = self._queue.get()
            if item is None:
                if self._error is not None:  # staging stopped short: write no blocks file
                    raise self._error
                return
            path, start, size, copy, n = item
            del item
            yield path, start, size, copy
            del copy  # written: free it and let the stager go on
            if n:
                with self._cond:
                    self._staged -= n
                    self._cond.notify_all()

    # -- the background: write, then (rank 0) publish when every writer is done ------------

    def _run(self) -> None:
        job = self._job
        try:
            try:
                if self._arena is not None and self._error is not None:
                    raise self._error  # the copy failed: no blocks file, the others see the failure
                copied = self._copied if self._arena is not None else self._staged_pieces()
                _write_data(job.tmp, job.rank, copied, self._arena)
            finally:
                self._return_arena()
            if self._error is not None:  # staging failed: what was written is not the state
                raise self._error
            if job.rank == 0:
                if job.dist:
                    names = [os.path.join(job.tmp, f"blocks-{w:05d}.json") for w in range(job.writers)]
                    _wait_for_ranks(lambda: bool(_failed_markers(job.tmp)) or all(os.path.exists(n) for n in names),
                                    self._timeout, job,
                                    lambda: [w for w, n in enumerate(names) if not os.path.exists(n)], "write")
                    if _failed_markers(job.tmp):
                        raise CheckpointError(f"checkpoint.save_async: {job.directory} was not saved: "
                                              f"{', '.join(_failed_markers(job.tmp))} in {job.tmp}")
                job.publish()
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self._error = e
            with self._cond:
                self._cond.notify_all()
            self._drain()
            if job.dist:  # the other ranks stop waiting for this one; the directory stays
                with contextlib.suppress(OSError):  # (an unfinished save, as with save())
                    with open(os.path.join(job.tmp, f"failed-{job.rank:05d}"), "w") as f:
                        f.write(f"{type(e).__name__}: {e}")
            else:
                shutil.rmtree(job.tmp, ignore_errors=True)

    def _return_arena(self) -> None:
        """Hand the arena back for the next save once the file is written (or failed); the
        writer of an arena starts after the caller's copy into it (``save_async``)."""
        arena, self._arena = self._arena, None
        self._copied = []
        if arena is not None:
            self._drain()
            if self._staging is not None:
                self._staging._give(arena)

    def _drain(self) -> None:
        """Drop staged copies nobody will write."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()


def save_async(directory: str | os.PathLike, tree: Any, specs: Any, mesh: Mesh, *,
               backend: str | None = None, overwrite: bool = False,
               max_staged_bytes: int | None = None, staging: Staging | None = None,
               timeout_s: float | None = None, owners: list | None = None) -> PendingSave:
    """``save`` in the background: returns once every block this device writes is copied
    (the caller may then change ``tree`` — a donated step may overwrite it), while a
    thread writes the copies, checksums and publishes the checkpoint as ``save`` does.
    ``.wait()`` on the result blocks until it is complete (call it on every rank).

    Without ``max_staged_bytes`` (or with one that holds them all) every block is copied at
    once (host memory: this device's share of the state), as DCP's async_save stages, into
    one buffer laid out as the data file, which is written from it; ``staging`` (a
    ``Staging``) keeps that buffer for the next save, so that later copies reuse warm
    memory. ``max_staged_bytes``: at most that many bytes of copies held at once (at least
    one block): the call then returns once all but that much is written. Collectives run
    only in this call, none in the thread. ``.wait()`` waits for the other ranks' parts
    (rank 0) or for rank 0's publication (the others) at most ``timeout_s`` (default:
    ``initialize(timeout_s=...)``'s), and names a rank whose process exited or died before
    doing its part as soon as it has (on this host).

    >>> staging = fs.checkpoint.Staging()
    >>> pending = fs.checkpoint.save_async("ckpt/step-200", state, specs, mesh, staging=staging)
    >>> ...                           # train on
    >>> pending.wait()"""
    if max_staged_bytes is not None and (isinstance(max_staged_bytes, bool) or
                                         not isinstance(max_staged_bytes, int) or max_staged_bytes < 1):
        raise ValueError(f"checkpoint.save_async: max_staged_bytes must be a positive int or None, "
                         f"got {max_staged_bytes!r}")
    if staging is not None and not isinstance(staging, Staging):
        raise TypeError(f"checkpoint.save_async: staging must be a checkpoint.Staging or None, "
                        f"got {type(staging).__name__}")
    job = _Job(directory, tree, specs, mesh, backend, overwrite, owners)
    total = job.layout.total
    arena = None
    if max_staged_bytes is None or max_staged_bytes >= total:
        arena = staging._take(total) if staging is not None else Arena(total)
    pending = PendingSave(job, comm.timeout_s() if timeout_s is None else timeout_s, arena, staging)
    if arena is None:  # the writer frees copies as it goes, so that staging can go on
        pending._thread.start()
        pending._stage(max_staged_bytes)
        return pending
    try:  # the writer starts once the copy is made: it would only slow the caller's copy
        pending._stage(max_staged_bytes)
    finally:
        pending._thread.start()  # (also after a failed copy: it cleans up)
    return pending


def _failed_markers(tmp: str) -> list[str]:
    """The ranks' failure markers in a save's temporary directory; none once rank 0 has
    renamed it into place (which may happen between any two calls)."""
    try:
        return sorted(n for n in os.listdir(tmp) if n.startswith("failed-"))
    except FileNotFoundError:
        return []


def _token_at(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, "manifest.json")) as f:
            return json.load(f).get("token")
    except (OSError, ValueError):
        return None


def _wait_for_ranks(ready: Any, timeout_s: float, job: _Job, missing: Any, doing: str) -> None:
    """Wait until ``ready()``; the ranks ``missing()`` are those it waits for (to ``doing``:
    "write" their part, or "publish" the checkpoint). An error naming them as soon as one
    has exited or died without doing it, or after ``timeout_s``."""
    part = ("publish it (rank 0 renames the complete checkpoint into place)" if doing == "publish"
            else "write its part of it")
    after = (f"The checkpoint was not saved (the unfinished one stays in {job.tmp}; the earlier ones are "
             "untouched): restart the ranks and resume from the last complete checkpoint")

    def exited(gone: list, waited: float) -> BaseException:
        who = ", ".join(f"rank {r} (pid {pid})" for r, pid in gone)
        return CheckpointError(f"checkpoint.save_async: {who} exited or died before it could {part}; rank "
                               f"{job.rank} waited {waited:.1f} s for {job.directory}. {after}")

    def late(waited: float) -> BaseException:
        who = ", ".join(f"rank {r}" for r in missing()) or "another rank"
        return TimeoutError(f"checkpoint.save_async: rank {job.rank} waited {waited:.0f} s (the timeout: "
                            f"initialize(timeout_s=...), or save_async(timeout_s=...)) for {who} to {part} "
                            f"({job.directory}); it is alive but did not: stuck, or not saving (every rank must "
                            f"call save_async and wait()). {after}")

    comm._peers.poll(ready, timeout_s=timeout_s, peers=missing, on_exit=exited, on_timeout=late)


def _poll(ready: Any, timeout_s: float, what: str) -> None:
    t0 = time.monotonic()
    delay = 0.001
    while not ready():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)




def tree_like(directory: str | os.PathLike, prefix: str = "") -> Any:
    """The tree saved at ``directory`` (or its subtree at dotted path ``prefix``, e.g.
    ``"params"``) as it was saved: the same containers (dicts, OrderedDicts, lists,
    tuples, NamedTuples, None), keys (keys with dots included) and order, its tensors meta
    tensors of their global shapes and dtypes, its other leaves their values: a template
    for ``load``. A NamedTuple class that cannot be imported here (one of a script's
    ``__main__``) is rebuilt as an equivalent ``collections.namedtuple``, with a warning;
    other node types (registered with optree) need a template: an error says so.
    Checkpoints of an fsharded that did not record the structure: dicts nested from the
    dotted paths, lists where the keys are 0, 1, ...; give them a template
    (``like=``)."""
    directory = os.fspath(directory)
    return _ckpt_structure.tree_like(read_manifest(directory), directory, prefix)


def load(directory: str | os.PathLike, like: Any, specs: Any, mesh: Mesh, *,
         backend: str | None = None, owners: list | None = None, select: str | None = None) -> Any:
    """The checkpoint at ``directory`` as a tree shaped like ``like``, laid out by ``specs``
    on ``mesh`` (on real ranks: this rank's shards, read from only the blocks that hold
    them). ``like`` gives the structure, shapes and dtypes (tensors of any device, meta
    included; on real ranks this rank's shards); the checkpoint must hold exactly its
    leaves. ``like=None``: the tree as it was saved (``tree_like(directory)``).
    ``select``: the subtree at that dotted path only (``"params"`` of a train state: the
    model without its optimizer state); ``like`` and ``specs`` are then the subtree's.
    ``owners`` (as ``save``'s): on real ranks a leaf held elsewhere is not read, and comes
    back as a placeholder (zeros broadcast to its shard's shape)."""
    directory = os.fspath(directory)
    manifest = read_manifest(directory)
    pre = f"{select}." if select else ""
    saved = {e["path"]: e for e in manifest["leaves"] if not select or e["path"] == select
             or e["path"].startswith(pre)}
    rebuilt = like is None
    if rebuilt:
        like = _ckpt_structure.tree_like(manifest, directory, select or "")
    paths, leaves, tdef = _flatten(like)
    if select:  # the subtree's paths -> the checkpoint's
        paths = [select if p == "<root>" else pre + p for p in paths]
    try:
        flat_specs = _flat_specs(specs, like, tdef)
    except ValueError as e:
        if not rebuilt:
            raise
        raise CheckpointError(f"checkpoint.load: {directory}: {e}\n" + _ckpt_structure.template_hint(
            manifest, "fs.checkpoint.load(directory, like, specs, mesh)")) from e
    dist = _distributed(mesh, backend)
    coords = mesh.coords(comm.rank()) if dist else None
    if rebuilt and dist:  # the global shapes saved -> those of this rank's shards
        check_tree(leaves, flat_specs, paths, mesh, "checkpoint.load")
        leaves = [torch.empty(_box(s, tuple(x.shape), mesh, coords)[1], dtype=x.dtype, device="meta")
                  if isinstance(x, torch.Tensor) else x for x, s in zip(leaves, flat_specs)]
    missing, misfit, here = [], [], {}
    for path, x, spec in zip(paths, leaves, flat_specs):
        e = saved.get(path)
        if isinstance(x, torch.Tensor):
            spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec()
            here[path] = shape = list(global_shape(spec, tuple(x.shape), mesh) if dist else x.shape)
        if e is None:
            missing.append(path)
        elif isinstance(x, torch.Tensor):
            if "shape" not in e:
                misfit.append(f"{path}: a tensor {shape} here, the value {e.get('value')!r} there")
            elif shape != e["shape"] or str(x.dtype) != e["dtype"]:
                misfit.append(f"{path}: {shape} {x.dtype} here, {e['shape']} {e['dtype']} in the checkpoint")
    extra = sorted(set(saved) - set(paths))
    if missing or misfit or extra:
        raise CheckpointError(misfit_message(directory, saved, here, missing, extra, misfit))
    blocks = _blocks(directory, manifest)
    reader = _Reader(directory)
    out = []
    held = _owned(owners, leaves, mesh)
    try:
        for path, x, spec, owner in zip(paths, leaves, flat_specs, held):
            e = saved[path]
            if not isinstance(x, torch.Tensor):
                out.append(e.get("value", x))
                continue
            spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec()
            shape = tuple(e["shape"])
            dtype = _dtype(e["dtype"])
            start, size = _box(spec, shape, mesh, coords) if dist else ([0] * len(shape), list(shape))
            if dist and owner is not None and coords[owner[0]] not in owner[1]:  # held elsewhere
                where = torch.device("cpu") if x.device.type == "meta" else x.device
                out.append(torch.zeros((), dtype=dtype, device=where).expand(tuple(size)))
                continue
            try:
                out.append(_assemble(reader, path, blocks.get(path, []), start, size, dtype, x.device))
            except CheckpointError:
                raise
            except (RuntimeError, ValueError, TypeError, KeyError, IndexError, OverflowError) as err:
                # The index is checked before this: a failure here is a checkpoint damaged in
                # a way no check foresaw, still named as one.
                raise CorruptCheckpointError(f"checkpoint: {directory}: reading {path!r} failed "
                                             f"({type(err).__name__}: {err}): {DAMAGED}") from err
    finally:
        reader.close()
    return optree.tree_unflatten(tdef, out)


def _owned(owners: list | None, leaves: list, mesh: Mesh) -> list:
    """``owners`` checked (one entry per leaf: None or ``(axis, coordinates)`` along a mesh
    axis), as a list of None or ``(axis, frozenset)``."""
    if owners is None:
        return [None] * len(leaves)
    owners = list(owners)
    if len(owners) != len(leaves):
        raise ValueError(f"checkpoint: owners has {len(owners)} entries for a tree of {len(leaves)} leaves; "
                         f"give one per leaf, in flatten order")
    out = []
    for o in owners:
        if o is None:
            out.append(None)
            continue
        axis, where = o
        coords = frozenset(int(c) for c in where)
        if axis not in mesh.shape or not coords or not all(0 <= c < mesh.shape[axis] for c in coords):
            raise ValueError(f"checkpoint: owners entry {o!r}: give (axis, coordinates) with an axis of "
                             f"{mesh!r} and coordinates along it")
        out.append((axis, coords))
    return out


# -- a directory of checkpoints -------------------------------------------------------------------


class Manager:
    """Checkpoints of one run under ``root``, as ``root/step-<n>``: ``save`` every ``every``
    steps (``due``), the ``keep`` newest kept, ``restore`` (or ``latest()``) to resume from.

    One run at a time: the first save (or ``lock()``) takes the directory's lock for this
    run (on real ranks: rank 0, for the job), released by ``unlock()``, when the Manager is
    collected, or at exit; another run's Manager then raises ``DirectoryInUseError`` naming
    the holder. A lock left by a killed run is taken over, with a warning.

    >>> mgr = fs.checkpoint.Manager("ckpt", keep=3, every=100)
    >>> path, state = mgr.restore(step, params)          # (None, None) on a first start
    >>> if mgr.due(n): mgr.save_state(step, state)
    """

    def __init__(self, root: str | os.PathLike, *, keep: int | None = 3, every: int | None = None) -> None:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"checkpoint.Manager: keep must be a positive int or None, got {keep!r}")
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"checkpoint.Manager: every must be a positive int or None, got {every!r}")
        self.root, self.keep, self.every = os.fspath(root), keep, every
        self._locked = False
        self._lock = None  # the lock held here (rank 0's on real ranks)

    def lock(self, mesh: Mesh | None = None, *, backend: str | None = None) -> None:
        """Take ``root`` for this run (the first save does): ``DirectoryInUseError`` naming
        the run that has it. On real ranks (``mesh`` on the distributed backend, or without
        a mesh a process group of several ranks) call it on every rank: rank 0 holds the
        lock for the job."""
        if self._locked:
            return
        if mesh is not None:
            dist = _distributed(mesh, backend)
        else:
            dist = torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1
        self._lock = lock_job(self.root, dist)
        self._locked = True

    def unlock(self) -> None:
        """Let ``root`` go (a save in flight is waited for first)."""
        self.wait()
        if self._lock is not None:
            self._lock.release()
        self._lock, self._locked = None, False

    def path(self, n: int) -> str:
        return os.path.join(self.root, f"step-{int(n):08d}")

    def steps(self) -> list[int]:
        """The steps with a complete checkpoint, oldest first (one whose replace was
        interrupted between its two renames put back in place first)."""
        if not os.path.isdir(self.root):
            return []
        return sorted(self._listing())

    def _listing(self) -> dict[int, str]:
        """{step: its checkpoint's directory} (named ``step-<n>``, however padded)."""
        if not os.path.isdir(self.root):
            return {}
        names = os.listdir(self.root)
        if settle_all(self.root, names):
            names = os.listdir(self.root)
        out = {}
        for name in sorted(names):
            if name.startswith("step-") and name[5:].isdigit() and \
                    os.path.isfile(os.path.join(self.root, name, "manifest.json")):
                out.setdefault(int(name[5:]), os.path.join(self.root, name))
        return out

    def incomplete(self) -> list[str]:
        """Leftovers of saves that did not finish (``step-<n>.tmp-*``)."""
        if not os.path.isdir(self.root):
            return []
        return sorted(os.path.join(self.root, n) for n in os.listdir(self.root) if ".tmp-" in n)

    def _warn_incomplete(self) -> None:
        left = self.incomplete()
        if left:
            warnings.warn(f"checkpoint: ignoring {len(left)} unfinished save(s): {', '.join(left)}",
                          stacklevel=3)

    def latest(self) -> str | None:
        """The newest checkpoint whose manifest and index are intact, or None; warns naming
        unfinished saves and damaged checkpoints passed over (and why). A data file's
        damage shows only when it is read: ``restore`` loads, passing over those too."""
        found = self._listing()  # (first: an interrupted replace completed is no unfinished save)
        self._warn_incomplete()
        for n in sorted(found, reverse=True):
            why = damage(found[n])
            if why is None:
                return found[n]
            warnings.warn(f"checkpoint: passing over {found[n]}, which is damaged: {why}", stacklevel=2)
        return None

    def restore(self, step: Any, like: Any = None) -> tuple[str | None, Any]:
        """The newest checkpoint that loads, as ``step.load(path, like)``: (its path, the
        state), or (None, None) where there is none (a job's first start). One found damaged
        (``CorruptCheckpointError``: a checksum that does not match, a truncated or missing
        file, an edited manifest or blocks file) is passed over for the next older, with a
        warning naming it and why; any other error (a checkpoint of another model) is
        raised. On real ranks call it on every rank: they agree, passing over a checkpoint
        that any rank finds damaged. Every checkpoint damaged: ``CorruptCheckpointError``
        naming each."""
        found = self._listing()
        paths = [found[n] for n in sorted(found, reverse=True)]
        self._warn_incomplete()
        return restore(self.root, paths, lambda p: step.load(p, like), _distributed(step.mesh, None))

    def due(self, n: int) -> bool:
        """Whether step ``n`` (1-based: after ``n`` updates) is one to save at."""
        return self.every is not None and int(n) > 0 and int(n) % self.every == 0

    def save(self, n: int, tree: Any, specs: Any, mesh: Mesh, **kw: Any) -> str:
        """``save`` to ``path(n)`` (replacing it), then drop all but the ``keep`` newest."""
        self.lock(mesh, backend=kw.get("backend"))
        out = save(self.path(n), tree, specs, mesh, overwrite=True, **kw)
        self._prune(mesh, kw.get("backend"))
        return out

    def save_state(self, step: Any, state: Any, *, blocking: bool = True,
                   max_staged_bytes: int | None = None) -> str | PendingSave:
        """A train step's state at its own step count (``step.save``), then prune.
        ``blocking=False``: ``step.save_async`` (one save in flight: a previous one is
        waited for first); pruning follows when it is waited for (``wait()``, or the next
        save)."""
        self.wait()
        self.lock(step.mesh)
        path = self.path(int(state.step))
        if blocking:
            out = step.save(state, path, overwrite=True)
            self._prune(step.mesh, None)
            return out
        self._pending = (step.save_async(state, path, overwrite=True, max_staged_bytes=max_staged_bytes),
                         step.mesh)
        return self._pending[0]

    def wait(self) -> str | None:
        """Wait for the save in flight (if any), prune; its directory."""
        pending = getattr(self, "_pending", None)
        if pending is None:
            return None
        self._pending = None
        out = pending[0].wait()
        self._prune(pending[1], None)
        return out

    def _prune(self, mesh: Mesh, backend: str | None) -> None:
        if self.keep is None or (_distributed(mesh, backend) and comm.rank() != 0):
            return
        for n in self.steps()[:-self.keep]:  # out of sight at once, unlinked in a thread
            path = self.path(n)
            pruned = f"{path}.pruned-{secrets.token_hex(4)}"
            with contextlib.suppress(OSError):
                os.rename(path, pruned)
                _remove_later(pruned)
        with contextlib.suppress(OSError):  # a killed process's leftovers
            for name in os.listdir(self.root):
                if ".pruned-" in name or (".old-" in name and  # replaced: only beside a complete checkpoint
                                          _complete(os.path.join(self.root, name[:name.index(".old-")]))):
                    _remove_later(os.path.join(self.root, name))
