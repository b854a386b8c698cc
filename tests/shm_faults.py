"""One rank of a fault scenario for the shared-memory transport (run by tests/test_shm.py
as 2 processes started directly, RANK / WORLD_SIZE / MASTER_* in the environment).

    exit             rank 1 leaves (exit 0) after one all-reduce; rank 0 starts another
    kill             the same, rank 1 killed by SIGKILL instead
    kill_in_setup_R  rank R is killed while the segment is being set up (after rank 0 has
                     created it, before its name is removed)
    train_exit       a data=2 train_step: one step together, then rank 1 leaves; rank 0
                     takes the next step

Rank 0 (or the survivor) prints what it saw: "<error message> | <seconds waited>", or
"error: ..." for the set-up scenarios.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import fsharded as fs
from fsharded import distributed
from fsharded.comm import _shm


def main(scenario: str) -> None:
    os.environ.setdefault("FSHARDED_SHM_TIMEOUT", "60")
    distributed.initialize("gloo", timeout_s=60)
    rank = dist.get_rank()
    g = distributed.axis_group(fs.Mesh({"data": 2}), ("data",))
    if scenario.startswith("kill_in_setup_"):
        victim = int(scenario.rsplit("_", 1)[1])
        if rank == victim:
            real = dist.all_gather_object

            def die(*args, **kwargs):  # the gather after every rank opened the segment
                if rank == 0 or die.calls:  # rank 0: right after creating it
                    os.kill(os.getpid(), signal.SIGKILL)
                die.calls += 1
                return real(*args, **kwargs)

            die.calls = 0
            if rank == 0:
                real_barrier = dist.barrier
                seen = []

                def barrier(*args, **kwargs):  # the second barrier: the segment exists
                    seen.append(1)
                    if len(seen) == 2:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real_barrier(*args, **kwargs)

                _shm.dist.barrier = barrier
            else:
                _shm.dist.all_gather_object = die
        try:
            _shm.comm_for(torch.zeros(1), g)
            print("no error")
        except Exception as e:  # noqa: BLE001 - the survivor reports what it saw
            print(f"error: {type(e).__name__}: {e}")
        sys.stdout.flush()
        os._exit(0)
    if scenario == "train_exit":
        from fsharded.models import gpt

        config = gpt.GPTConfig.small(d_model=32, n_layers=2)
        step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=fs.Mesh({"data": 2}))
        state = step.init(gpt.init(config, 0))
        batch = {"tokens": torch.randint(0, config.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))}
        state, _ = step(state, batch)
        if rank == 1:
            os._exit(0)
        t0 = time.monotonic()
        try:
            step(state, batch)
            print(f"no error | {time.monotonic() - t0:.2f}")
        except RuntimeError as e:
            print(f"{e} | {time.monotonic() - t0:.2f}")
        sys.stdout.flush()
        os._exit(0)
    assert _shm.comm_for(torch.zeros(1), g) is not None
    _shm.all_reduce_(torch.ones(4), "sum", g)
    if rank == 1:
        if scenario == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)
    t0 = time.monotonic()
    try:
        _shm.all_reduce_(torch.ones(4), "sum", g)
        print(f"no error | {time.monotonic() - t0:.2f}")
    except RuntimeError as e:
        print(f"{e} | {time.monotonic() - t0:.2f}")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
