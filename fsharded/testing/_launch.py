"""Spawn ``world_size`` processes with a gloo process group and collect their results."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from fsharded import comm


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, port: int, outdir: str, args: tuple, kwargs: dict) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    path = os.path.join(outdir, f"rank{rank}.pt")
    try:
        comm.initialize("gloo", timeout_s=120)
        result = fn(*args, **kwargs)
        torch.save({"ok": True, "result": result}, path)
    except BaseException as e:  # report every rank's failure to the parent
        torch.save({"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The result is saved: leave without running C++ static destructors, where a thread
    # still owned by a library (gloo, OpenMP) occasionally aborts the process at teardown
    # ("terminate called without an active exception") on a loaded machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_new_ranks(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """``run_on_ranks`` in ``world_size`` new processes, spawned for this call and gone
    after it."""
    with tempfile.TemporaryDirectory() as outdir:
        port = free_port()
        err = None
        try:
            mp.start_processes(
                _worker,
                args=(fn, world_size, port, outdir, args, kwargs),
                nprocs=world_size,
                join=True,
                start_method="spawn",
            )
        except Exception as e:  # noqa: BLE001 - re-raised below with the rank's traceback
            err = e
        results = []
        for r in range(world_size):
            path = os.path.join(outdir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} produced no result ({err})")
            rec = torch.load(path, weights_only=False)
            if not rec["ok"]:
                raise RuntimeError(f"rank {r} failed: {rec['error']}\n{rec['tb']}")
            results.append(rec["result"])
        if err is not None:
            raise RuntimeError(f"distributed run failed: {err}")
        return results


# -- a pool of ranks kept between calls ---------------------------------------------------
#
# Starting a rank costs a Python interpreter, torch's import and fsharded's (~2 s on a
# small machine, 4 ranks at once more); a test suite calls run_on_ranks a hundred times.
# The pool keeps one set of processes per world size and gives each call a new default
# process group (a new rendezvous), the caller's sys.path and environment variables, a
# new random seed for torch and fresh warning filters; fsharded's groups and segments are
# forgotten after the call (comm.shutdown). A rank that fails or dies ends the whole set
# (the others may be waiting in a collective), as does a call that imported a library
# with process-group state of its own (DeepSpeed); the next call starts a new one.


_NOT_REUSED_AFTER = {"deepspeed"}


def _pool_worker(rank: int, world_size: int, conn: Any) -> None:
    import io
    import warnings

    torch.set_num_threads(1)

    while True:
        try:
            where = conn.recv()  # the caller's sys.path, environment and rendezvous port
            task = conn.recv_bytes()
        except EOFError:
            break
        path, env, port = where
        sys.path[:] = path  # the function's module may sit where the caller added a path
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        torch.seed()  # a new random seed, as a new process has
        buf = io.BytesIO()
        ok = True
        before = set(sys.modules)
        try:
            fn, args, kwargs = torch.load(io.BytesIO(task), weights_only=False)
            with warnings.catch_warnings():
                comm.initialize("gloo", timeout_s=120)
                result = fn(*args, **kwargs)
            torch.save({"ok": True, "result": result}, buf)
        except BaseException as e:  # report it, then leave: the peers see a dead rank
            ok = False
            buf = io.BytesIO()
            torch.save({"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}, buf)
        if ok:
            try:
                comm.shutdown()
            except BaseException as e:  # noqa: BLE001 - a rank that cannot reset is not reused
                ok = False
                buf = io.BytesIO()
                torch.save({"ok": False, "error": f"shutdown: {type(e).__name__}: {e}",
                            "tb": traceback.format_exc()}, buf)
        # A library with process-group state of its own (DeepSpeed keeps its groups in
        # module globals) would hand the next call the destroyed groups: not reused then.
        retire = not ok or any(m.split(".")[0] in _NOT_REUSED_AFTER for m in set(sys.modules) - before)
        conn.send((retire, buf.getvalue()))
        if retire:
            break
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.retired = False  # a rank will not take another call
        self.conns, self.procs = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_pool_worker, args=(r, world_size, child), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for c in self.conns:
            c.close()
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> list[Any]:
        import io
        from multiprocessing.connection import wait

        buf = io.BytesIO()
        torch.save((fn, args, kwargs), buf)
        task = buf.getvalue()
        where = (list(sys.path), dict(os.environ), free_port())
        for c in self.conns:
            c.send(where)
            c.send_bytes(task)
        recs: dict[int, dict] = {}
        dead: dict[int, str] = {}
        waiting = {c: r for r, c in enumerate(self.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while waiting:
            ready = wait(list(waiting) + [s for s, r in sentinels.items() if r not in dead])
            for obj in ready:
                if obj in waiting:
                    r = waiting.pop(obj)
                    try:
                        retire, payload = obj.recv()
                        self.retired |= retire
                        recs[r] = torch.load(io.BytesIO(payload), weights_only=False)
                    except EOFError:
                        dead[r] = f"rank {r} exited (code {self.procs[r].exitcode})"
                elif sentinels.get(obj) is not None:
                    r = sentinels[obj]
                    if r in recs:
                        continue
                    # Its result may still be in the pipe.
                    c = self.conns[r]
                    if c in waiting and c.poll():
                        continue
                    waiting.pop(c, None)
                    self.procs[r].join()
                    dead[r] = f"process {r} terminated with exit code {self.procs[r].exitcode}"
            if dead or any(not rec["ok"] for rec in recs.values()):
                break  # the others may wait forever in a collective with the failed rank
        if dead or any(not rec["ok"] for rec in recs.values()):
            raise _PoolFailure(recs, dead)
        return [recs[r]["result"] for r in range(self.world_size)]


class _PoolFailure(Exception):
    def __init__(self, recs: dict, dead: dict) -> None:
        self.recs, self.dead = recs, dead


_POOLS: dict[int, _Pool] = {}
_BUSY: dict[int, threading.Lock] = {}
_BUSY_LOCK = threading.Lock()


def _pool_enabled() -> bool:
    return os.environ.get("FSHARDED_TEST_POOL", "0").strip().lower() in ("1", "true", "on", "yes")


def run_on_ranks(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be importable by name (a module-level function); arguments and results
    travel with ``torch.save``. A failure on any rank raises ``RuntimeError`` with that
    rank's traceback. New processes are spawned for the call; with ``FSHARDED_TEST_POOL=1``
    (fsharded's own test suite) the ranks are processes kept between calls instead, each
    call with a new process group, the caller's environment variables, a new random
    seed for torch (as a new process has) and fresh warning filters
    (``run_on_new_ranks`` always spawns).
    """
    if not _pool_enabled():
        return run_on_new_ranks(fn, world_size, *args, **kwargs)
    with _BUSY_LOCK:
        busy = _BUSY.setdefault(world_size, threading.Lock())
    if not busy.acquire(blocking=False):  # another thread runs on this pool: new ranks for this call
        return run_on_new_ranks(fn, world_size, *args, **kwargs)
    try:
        return _run_pooled(fn, world_size, args, kwargs)
    finally:
        busy.release()


def _run_pooled(fn: Callable, world_size: int, args: tuple, kwargs: dict) -> list[Any]:
    pool = _POOLS.get(world_size)
    if pool is not None and not pool.alive():
        pool.close()
        pool = None
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        out = pool.run(fn, args, kwargs)
        if pool.retired:
            _POOLS.pop(world_size, None)
            pool.close()
        return out
    except _PoolFailure as f:
        _POOLS.pop(world_size, None)
        _terminate(pool)
        for r in range(world_size):
            rec = f.recs.get(r)
            if rec is not None and not rec["ok"]:
                raise RuntimeError(f"rank {r} failed: {rec['error']}\n{rec['tb']}") from None
        r = min(f.dead)
        raise RuntimeError(f"rank {r} produced no result ({f.dead[r]})") from None
    except BaseException:
        _POOLS.pop(world_size, None)
        _terminate(pool)
        raise


def _terminate(pool: _Pool) -> None:
    for p in pool.procs:
        if p.is_alive():
            p.kill()
    for p in pool.procs:
        p.join()
    for c in pool.conns:
        c.close()


def _close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


import atexit  # noqa: E402

atexit.register(_close_pools)
