"""Functions run on gloo ranks by tests/test_faults_comm.py: programs whose ranks diverge
(collectives in another order, a skipped collective or step, another learning rate or
batch, other permutations), and peers that die or hang. Each returns what its rank saw:
the numbers, or the error's message."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import fsharded as fs
from fsharded import P


def _error(fn, *args, **kwargs):
    try:
        out = fn(*args, **kwargs)
    except (RuntimeError, ValueError, TimeoutError) as e:
        return f"{type(e).__name__}: {e}"
    return out


# -- two psums of the same shape from different lines ------------------------------------------


def psums_in_order(case: str):
    """Two psums of the same shape over data-sharded a = 1..4n and b = 1000a: rank 1
    issues them in the other order ("swap") or skips the first ("skip"). Right: the
    blockwise sums of a and of b."""
    world = dist.get_world_size()
    mesh = fs.Mesh({"data": world})
    rank = dist.get_rank()

    def body(a, b):
        if case == "swap" and rank == 1:
            sb = fs.psum(b, "data")
            sa = fs.psum(a, "data")
        elif case == "skip" and rank == 1:
            sa = torch.zeros(a.shape)
            sb = fs.psum(b, "data")
        else:
            sa = fs.psum(a, "data")
            sb = fs.psum(b, "data")
        return torch.stack([sa, sb])

    f = fs.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())
    a = torch.arange(1.0, 4.0 * world + 1)
    b = a * 1000
    return _error(lambda: f(a, b).tolist())


def _reduce(x):
    return fs.psum(x, "data")


def psums_through_a_helper():
    """Both ranks psum through one helper, called from different lines in another order:
    the helper's line is the same, its callers' lines differ."""
    mesh = fs.Mesh({"data": dist.get_world_size()})
    rank = dist.get_rank()

    def body(a, b):
        if rank == 1:
            sb = _reduce(b)
            sa = _reduce(a)
        else:
            sa = _reduce(a)
            sb = _reduce(b)
        return torch.stack([sa, sb])

    f = fs.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())
    a = torch.arange(1.0, 4.0 * dist.get_world_size() + 1)
    return _error(lambda: f(a, a * 1000).tolist())


def psum_in_another_dtype():
    """The same psum from the same line, in float32 on rank 0 and float64 on rank 1."""
    mesh = fs.Mesh({"data": dist.get_world_size()})
    dtype = torch.float32 if dist.get_rank() == 0 else torch.float64
    f = fs.shard_map(lambda a: fs.psum(a, "data"), mesh=mesh, in_specs=(P("data"),), out_specs=P())
    return _error(lambda: f(torch.ones(4 * dist.get_world_size(), dtype=dtype)).tolist())


# -- train steps that differ between ranks -----------------------------------------------------


def _mlp_loss(params, batch):
    return ((batch["x"] @ params["w"]).tanh() - batch["y"]).pow(2).mean()


def _batch_at(i: int, rows: int = 4) -> dict:
    g = torch.Generator().manual_seed(100 + i)
    return {"x": torch.randn(rows, 8, generator=g), "y": torch.randn(rows, 4, generator=g)}


def train_steps(case: str):
    """Three data-parallel steps of a small MLP, with every rank the same ("same"), or rank
    1 using another learning rate ("lr"), another global batch ("batch"), skipping the
    second step of the loop ("skip"), or skipping a step written on a line of its own
    ("skip_line"). Returns the losses, or the error."""
    rank = dist.get_rank()
    lr = 1e-2 * (2 if case == "lr" and rank == 1 else 1)
    step = fs.train_step(_mlp_loss, fs.optim.adamw(lr), mesh=fs.Mesh({"data": dist.get_world_size()}))
    state = step.init({"w": torch.randn(8, 4, generator=torch.Generator().manual_seed(0))})
    losses = []

    def run():
        nonlocal state
        for i in range(3):
            if case == "skip" and rank == 1 and i == 1:
                continue
            rows = 8 if case == "batch" and rank == 1 else 4
            state, m = step(state, _batch_at(i, rows))
            losses.append(float(m["loss"]))
        if case == "skip_line":
            batch = _batch_at(0)
            if rank == 0:
                state, m = step(state, batch)
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        return losses

    return _error(run)


# -- ppermute ---------------------------------------------------------------------------------


def short_timeout(seconds: float) -> None:
    """Collectives of the groups made from now on (the mesh's axis groups, the shared-memory
    segments) wait at most ``seconds`` for the other ranks."""
    from fsharded.comm import _groups

    _groups._TIMEOUT["s"] = float(seconds)
    os.environ["FSHARDED_SHM_TIMEOUT"] = str(seconds)


def ppermutes(case: str, timeout_s: float = 5.0):
    """A ring ppermute over data-sharded x = 0..4n-1; rank 1 passes another permutation
    ("perm": a one-way shift) or a longer x ("shape"); "same" for the right result."""
    short_timeout(timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    ring = [(i, (i + 1) % world) for i in range(world)]
    perm = [(0, 1)] if case == "perm" and rank == 1 else ring
    n = 6 if case == "shape" and rank == 1 else 4
    f = fs.shard_map(lambda x: fs.ppermute(x, "data", perm), mesh=fs.Mesh({"data": world}),
                     in_specs=P("data"), out_specs=P("data"))
    t0 = time.monotonic()
    out = _error(lambda: f(torch.arange(float(world * n))).tolist())
    return out, time.monotonic() - t0


# -- ranks started by hand: a peer that exits, is killed or hangs --------------------------------
#
#   python tests/faults_comm_cases.py SCENARIO   (RANK, WORLD_SIZE, MASTER_* set; TIMEOUT_S)
#
#   mesh2x2_HOW        4 ranks, mesh data=2 x tensor=2: a psum over data, then global rank 3
#                      exits ("exit"), is SIGKILLed ("kill") or sleeps ("hang"); the others
#                      psum over data again (ranks 0 and 2 together, rank 1 waits for 3)
#   save_async_WHO_HOW 2 ranks: save_async; rank 1 does not write its part ("writer") or
#                      never calls save_async ("absent"), or rank 0 does not publish the
#                      checkpoint ("publisher"), by HOW
#   step_save_HOW      2 ranks: a train step, then step.save; rank 1 leaves before saving
#
# Every surviving rank prints "<message> | <seconds waited>" ("ok" when it saw no error).


def _fault(how: str) -> None:
    sys.stdout.flush()
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(0)
    else:  # hang: alive, never arriving
        time.sleep(600)


def _report(fn) -> None:
    t0 = time.monotonic()
    try:
        fn()
        msg = "ok"
    except Exception as e:  # noqa: BLE001 - the survivor reports what it saw
        msg = f"{type(e).__name__}: {e}"
    print(f"{msg} | {time.monotonic() - t0:.2f}".replace("\n", " // "))
    sys.stdout.flush()
    os._exit(0)


def main(scenario: str) -> None:
    from fsharded import checkpoint, distributed
    from fsharded.checkpoint import _api as ckpt_api

    timeout = float(os.environ.get("TIMEOUT_S", "60"))
    os.environ.setdefault("FSHARDED_SHM_TIMEOUT", str(timeout))
    distributed.initialize("gloo", timeout_s=timeout)
    rank = dist.get_rank()
    how = scenario.rsplit("_", 1)[1]
    if scenario.startswith("mesh2x2_"):
        mesh = fs.Mesh({"data": 2, "tensor": 2})
        f = fs.shard_map(lambda x: fs.psum(x, "data"), mesh=mesh, in_specs=P(("data", "tensor")),
                         out_specs=P("tensor"))
        x = torch.arange(8.0)
        f(x)  # every group set up, every rank there once
        dist.barrier()
        if rank == 3:
            _fault(how)
        _report(lambda: f(x))
    if scenario.startswith("save_async_"):
        mesh = fs.Mesh({"data": 2})
        directory = os.environ["CKPT_DIR"]
        victim = 0 if "_publisher_" in scenario else 1
        if rank == victim and "_absent_" in scenario:  # gone before it calls save_async
            _fault(how)
        if rank == victim:
            if victim == 1:
                ckpt_api._write_data = lambda *a, **k: _fault(how)
            else:
                ckpt_api._Job.publish = lambda self: _fault(how)
        tree = {"w": torch.arange(2.0) + 2 * rank}
        _report(lambda: checkpoint.save_async(directory, tree, {"w": P("data")}, mesh).wait())
    if scenario.startswith("step_save_"):
        step = fs.train_step(_mlp_loss, fs.optim.adamw(1e-2), mesh=fs.Mesh({"data": 2}))
        state = step.init({"w": torch.randn(8, 4, generator=torch.Generator().manual_seed(0))})
        state, _ = step(state, _batch_at(0))
        if rank == 1:
            _fault(how)
        _report(lambda: step.save(state, os.environ["CKPT_DIR"]))


if __name__ == "__main__":
    main(sys.argv[1])
