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


def _zero_losses() -> dict:
    """Four ZeRO-1/2/3 steps of a small GPT on 2 ranks, and int16 reductions (which gloo
    cannot reduce itself): on whichever transport the environment picked."""
    import torch.distributed as dist

    import fsharded as fs
    from fsharded import distributed
    from fsharded.comm import _shm
    from fsharded.models import gpt

    mesh = fs.Mesh({"data": 2})
    config = gpt.GPTConfig.small(d_model=32, n_layers=2)
    params = gpt.init(config, 0)
    batch = {"tokens": torch.randint(0, config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))}
    out: dict = {"shm": _shm.in_use() or _shm.comm_for(torch.zeros(1), distributed.axis_group(mesh, ("data",)))
                 is not None}
    for stage in (1, 2, 3):
        step = fs.train_step(gpt.loss, fs.optim.adamw(1e-3), mesh=mesh,
                             param_specs=fs.parallel.zero(stage, min_size=8)(fs.P(), params))
        state, losses = step.init(params), []
        for _ in range(4):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        out[stage] = losses
    g = distributed.axis_group(mesh, ("data",))
    x = torch.tensor([30000, -7, 5], dtype=torch.int16) * (dist.get_rank() + 1)
    y = x.clone()
    _shm.all_reduce_(y, "sum", g)  # 30000 + 60000 wraps as int16 arithmetic does
    rs = torch.empty(1, dtype=torch.int16)
    _shm.reduce_scatter_into(rs, torch.arange(2, dtype=torch.int16) + 100 * dist.get_rank(), g)
    ga = torch.empty(6, dtype=torch.int16)
    _shm.all_gather_into(ga, x, g)
    out["int16"] = (y.tolist(), rs.tolist(), ga.tolist())
    return out


def test_training_on_gloo_alone_equals_shared_memory(monkeypatch):
    runs = {}
    for shm in ("1", "0"):
        monkeypatch.setenv("FSHARDED_SHM", shm)
        runs[shm] = run_on_ranks(_zero_losses, 2)
    assert [r["shm"] for r in runs["1"]] == [True, True] and [r["shm"] for r in runs["0"]] == [False, False]
    want = torch.tensor([30000, -7, 5], dtype=torch.int16) * 3
    for r0, r1 in zip(runs["1"], runs["0"]):
        for stage in (1, 2, 3):
            assert r0[stage] == r1[stage], stage  # 2 ranks: a + b either way, bit for bit
        assert r0["int16"] == r1["int16"]
    y, rs0, ga = runs["0"][0]["int16"]
    assert y == want.tolist() and rs0 == [100] and ga == [30000, -7, 5, -5536, -14, 10]
    assert runs["0"][1]["int16"][1] == [102]


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
    out = [_shm.comm_for(a, g) is not None]
    try:
        if dist.get_rank() == 0:  # rank 1 skips this one: it would get rank 0's a instead of b
            _shm.all_reduce_(a, "sum", g)
        _shm.all_reduce_(b, "sum", g)
        out.append(f"no error: {b.tolist()}")
    except RuntimeError as e:
        out.append(str(e))
    return out


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_skipped_collective_of_the_same_shape_is_an_error_on_every_rank(transport, monkeypatch):
    monkeypatch.setenv("FSHARDED_SHM", "1" if transport == "shm" else "0")
    for used, msg in run_on_ranks(_skipped_collective, 2):
        assert used == (transport == "shm")
        assert "both called all_reduce(sum) of 4 elements, but from different places" in msg, msg
        assert "skipped or added a collective" in msg


@pytest.mark.parametrize("check", ["0", "auto"])
def test_the_call_site_check_on_gloo_can_be_turned_off(check, monkeypatch):
    # Each rank reduces a different variable at a different place; with the check off the
    # two pair up silently (1 + 10 on both ranks), which is what the check exists to stop.
    monkeypatch.setenv("FSHARDED_SHM", "0")
    monkeypatch.setenv("FSHARDED_CHECK_SITES", check)
    results = run_on_ranks(_two_places, 2)
    if check == "0":
        assert results == [[11.0] * 4, [11.0] * 4]
    else:
        assert all("from different places in the program" in r for r in results), results


def _two_places() -> list[float] | str:
    import torch.distributed as dist

    import fsharded as fs
    from fsharded import distributed
    from fsharded.comm import _shm

    g = distributed.axis_group(fs.Mesh({"data": 2}), ("data",))
    try:
        if dist.get_rank() == 0:
            a = torch.full((4,), 1.0)
            _shm.all_reduce_(a, "sum", g)
            return a.tolist()
        b = torch.full((4,), 10.0)
        _shm.all_reduce_(b, "sum", g)
        return b.tolist()
    except RuntimeError as e:
        return str(e)


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


def _different_collectives_gloo() -> str:
    import torch.distributed as dist

    import fsharded as fs
    from fsharded import distributed
    from fsharded.comm import _shm

    g = distributed.axis_group(fs.Mesh({"data": 2}), ("data",))
    x = torch.ones(8)
    try:
        if dist.get_rank() == 0:
            _shm.all_reduce_(x, "sum", g)
        else:
            _shm.all_gather_into(torch.empty(16), x, g)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_on_gloo_ranks_calling_different_collectives_get_an_error(monkeypatch):
    monkeypatch.setenv("FSHARDED_SHM", "0")
    m0, m1 = run_on_ranks(_different_collectives_gloo, 2)
    assert "rank 0 called all_reduce(sum) of 8 elements (torch.float32) while rank 1 called all_gather" in m0, m0
    assert "rank 1 called all_gather of 8 elements (torch.float32) while rank 0 called all_reduce(sum)" in m1, m1
