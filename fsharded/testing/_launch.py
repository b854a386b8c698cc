"""Spawn ``world_size`` processes with a gloo process group and collect their results."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
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

    from fsharded import comm

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


def run_on_ranks(fn: Callable, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be importable by name (a module-level function). Results travel back with
    ``torch.save``. A failure on any rank raises ``RuntimeError`` with that rank's traceback.
    """
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
