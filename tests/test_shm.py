"""Same-host shared-memory collectives (csrc/shm_comm.cpp) against gloo's own transport and
an exact reference, on real ranks: several dtypes, odd world sizes, tensors much larger
than a slot (many rounds), results identical on every rank, and the clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from fsharded.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64)


def _inputs(rank: int, world: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * world + rank)
    x = torch.randn(world * n, generator=g, dtype=torch.float64) * 10
    return x.to(dtype) if dtype.is_floating_point else x.round().to(dtype)


def _collectives(n: int) -> dict:
    import torch.distributed as dist

    import fsharded as fs
    from fsharded import distributed
    from fsharded.comm import _shm

    world, rank = dist.get_world_size(), dist.get_rank()
    # 10 kB slots: every op takes many rounds. Group rank 0's size holds for all (the
    # others' settings differ on purpose).
    os.environ["FSHARDED_SHM_SLOT_MB"] = "0.01" if rank == 0 else "0.05"
    g = distributed.axis_group(fs.Mesh({"data": world}), ("data",))
    out: dict = {"used": _shm.comm_for(torch.zeros(1), g) is not None}
    dist.barrier()  # group rank 0 has removed the segment's name once every rank mapped it
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    out["left"] = [f for f in os.listdir("/dev/shm") if f.startswith(f"fsharded-{pids[0]}-")]
    empty = torch.zeros(0)
    _shm.all_reduce_(empty, "sum", g)  # no rounds on any rank: the ranks stay in step
    for dtype in DTYPES:
        x = _inputs(rank, world, dtype, n)
        s = x.clone()
        _shm.all_reduce_(s, "sum", g)
        m = x.clone()
        _shm.all_reduce_(m, "max", g)
        mean = x.clone()
        if dtype.is_floating_point:  # the mean, division folded in
            _shm.all_reduce_(mean, "sum", g, divisor=world)
        ga = x.new_empty(world * x.numel())
        _shm.all_gather_into(ga, x, g)
        rs = x.new_empty(n)
        _shm.reduce_scatter_into(rs, x, g)
        a2a = torch.empty_like(x)
        _shm.all_to_all_into(a2a, x, g)
        gloo_sum = x.clone()
        dist.all_reduce(gloo_sum, group=g.group)
        out[str(dtype)] = {"sum": s, "max": m, "gather": ga, "scatter": rs, "a2a": a2a, "gloo_sum": gloo_sum,
                          "mean": mean if dtype.is_floating_point else None}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_collectives_match_the_reference(world):
    n = 6001  # elements per rank block: not a multiple of the chunk
    per_rank = run_on_ranks(_collectives, world, n)
    assert all(r["used"] for r in per_rank)  # the shared-memory path ran, not gloo
    assert all(r["left"] == [] for r in per_rank)
    for dtype in DTYPES:
        xs = [_inputs(r, world, dtype, n) for r in range(world)]
        wide = torch.stack([x.double() for x in xs])
        exact_sum, exact_max = wide.sum(0), wide.max(0).values
        for rank, res in enumerate(per_rank):
            got = res[str(dtype)]
            # every rank holds bit-identical results (replicas stay in sync)
            torch.testing.assert_close(got["sum"], per_rank[0][str(dtype)]["sum"], rtol=0, atol=0)
            tol = {"rtol": 1e-2, "atol": 1e-1} if dtype in (torch.bfloat16, torch.float16) \
                else {"rtol": 1e-6, "atol": 1e-6}
            torch.testing.assert_close(got["sum"].double(), exact_sum, **tol)
            torch.testing.assert_close(got["max"].double(), exact_max, rtol=0, atol=0)
            torch.testing.assert_close(got["gather"], torch.cat(xs), rtol=0, atol=0)
            block = exact_sum[rank * n:(rank + 1) * n]
            torch.testing.assert_close(got["scatter"].double(), block, **tol)
            # all-to-all: block j of ours is block `rank` of rank j's input
            mine = torch.cat([x[rank * n:(rank + 1) * n] for x in xs])
            torch.testing.assert_close(got["a2a"], mine, rtol=0, atol=0)
            if dtype.is_floating_point:  # rounded as psum(x) / n: the sum, then the quotient
                torch.testing.assert_close(got["mean"], got["sum"] / world, rtol=0, atol=0)
            if dtype == torch.int64 or world == 2:
                # two addends (or integers): the same as gloo's sum, bit for bit
                torch.testing.assert_close(got["sum"], got["gloo_sum"], rtol=0, atol=0)


def _switched_off() -> bool:
    import torch.distributed as dist

    import fsharded as fs
    from fsharded import distributed
    from fsharded.comm import _shm

    g = distributed.axis_group(fs.Mesh({"data": dist.get_world_size()}), ("data",))
    return _shm.comm_for(torch.zeros(1), g) is None


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("FSHARDED_SHM", "0")
    assert run_on_ranks(_switched_off, 2) == [True, True]


def _one_rank_missing() -> str:
    import torch.distributed as dist

    import fsharded as fs
    from fsharded import distributed
    from fsharded.comm import _shm

    os.environ["FSHARDED_SHM_TIMEOUT"] = "2"
    g = distributed.axis_group(fs.Mesh({"data": 2}), ("data",))
    assert _shm.comm_for(torch.zeros(1), g) is not None
    if dist.get_rank() == 1:
        time.sleep(5)  # alive, but never joins the all-reduce
        return "skipped"
    try:
        _shm.all_reduce_(torch.ones(4), "sum", g)
    except RuntimeError as e:
        first = str(e)
    else:
        return "no error"
    try:  # the ranks are out of step now: the segment refuses further use
        _shm.all_reduce_(torch.ones(4), "sum", g)
    except RuntimeError as e:
        return first + " | " + str(e)
    return first + " | no error"


def test_a_rank_that_never_arrives_is_a_clear_error():
    msg, other = run_on_ranks(_one_rank_missing, 2)
    assert other == "skipped"
    first, again = msg.split(" | ")
    assert "rank 0 waited 2 s (the timeout) for rank 1 to reach all_reduce(sum)" in first
    assert "alive but did not arrive" in first and "FSHARDED_SHM=0" in first
    assert "earlier collective" in again and "out of step" in again


FAULTS = os.path.join(os.path.dirname(__file__), "shm_faults.py")


def _two_ranks(scenario: str, timeout_s: float = 60.0) -> list[subprocess.CompletedProcess]:
    """Run tests/shm_faults.py SCENARIO as 2 ranks started directly (no torchrun to kill
    the survivors): every rank must end on its own."""
    from fsharded.testing._launch import free_port

    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, FAULTS, scenario], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout_s)  # a hang fails the test here
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("fsharded-")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_rank_that_exits_or_dies_is_named_by_the_survivor_within_seconds(how):
    before = _segments()
    t0 = time.monotonic()
    r0, r1 = _two_ranks(how)
    assert time.monotonic() - t0 < 30  # start-up included; the wait itself is below
    assert r1.returncode == (0 if how == "exit" else -9)
    assert r0.returncode == 0, r0.stderr[-3000:]
    msg, waited = r0.stdout.strip().rsplit(" | ", 1)
    assert "rank 1 (pid" in msg and "exited or died while rank 0 waited for it to reach all_reduce(sum)" in msg
    assert float(waited) < 5.0  # detected from its process, not after the 60 s timeout
    assert _segments() <= before, "a segment was left in /dev/shm"


def test_a_training_run_whose_peer_left_stops_naming_the_step_and_the_rank():
    r0, r1 = _two_ranks("train_exit", timeout_s=120)
    assert r0.returncode == 0 and r1.returncode == 0, r0.stderr[-3000:]
    msg, waited = r0.stdout.strip().rsplit(" | ", 1)
    assert msg.startswith("train_step: step 2 on rank 0: "), msg
    assert "rank 1" in msg and float(waited) < 10.0


@pytest.mark.parametrize("who", [0, 1])
def test_a_rank_killed_while_the_segment_is_set_up_leaves_nothing_in_dev_shm(who):
    before = _segments()
    results = _two_ranks(f"kill_in_setup_{who}")
    assert results[who].returncode == -9
    survivor = results[1 - who]
    assert survivor.returncode == 0 and survivor.stdout.strip().startswith("error:"), survivor.stderr[-3000:]
    assert _segments() <= before, "a segment was left in /dev/shm"


def _skipped_collective() -> list[str]:
    import torch.distributed as dist

    import fsharded as fs
    from fsharded import distributed
    from fsharded.comm import _shm

    g = distributed.axis_group(fs.Mesh({"data": 2}), ("data",))
    a, b = torch.full((4,), 1.0), torch.full((4,), 10.0)
    out = []
    try:
        if dist.get_rank() == 0:  # rank 1 skips this one: it would get rank 0's a instead of b
            _shm.all_reduce_(a, "sum", g)
        _shm.all_reduce_(b, "sum", g)
        out.append(f"no error: {b.tolist()}")
    except RuntimeError as e:
        out.append(str(e))
    return out


def test_a_skipped_collective_of_the_same_shape_is_an_error_on_every_rank():
    for (msg,) in run_on_ranks(_skipped_collective, 2):
        assert "both called all_reduce(sum) of 4 elements, but from different places" in msg, msg
        assert "skipped or added a collective" in msg


def _different_collectives() -> list[str]:
    import torch.distributed as dist

    import fsharded as fs
    from fsharded import distributed
    from fsharded.comm import _shm

    g = distributed.axis_group(fs.Mesh({"data": 2}), ("data",))
    # rank 0 reduces 2000 elements, rank 1 1000: a program bug, caught on both ranks
    x = torch.ones(2000 if dist.get_rank() == 0 else 1000)
    errors = []
    for _ in range(2):  # and the segment refuses further use afterwards
        try:
            _shm.all_reduce_(x, "sum", g)
            errors.append("no error")
        except RuntimeError as e:
            errors.append(str(e))
    return errors


def test_ranks_calling_different_collectives_get_an_error_not_data():
    for first, again in run_on_ranks(_different_collectives, 2):
        assert "called all_reduce(sum) of" in first and "same collectives" in first
        assert "out of step" in again
