"""Ranks that diverge or fail, on 2 (and a 2x2 mesh of 4) gloo ranks, over the same-host
shared-memory transport and over gloo's own: every rank gets an error naming what differs
(ranks, op, shapes, the program's lines), never another rank's data, and a dead or hung
peer is named by its global rank within the timeout (the functions the ranks run are in
tests/faults_comm_cases.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import faults_comm_cases as C
import pytest

from fsharded.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

TRANSPORTS = {"shm": "1", "gloo": "0"}
CASES = os.path.join(os.path.dirname(__file__), "faults_comm_cases.py")


def _lines(msg: str) -> list[str]:
    """The program lines an error names as each collective's own (the "at file:line" of
    faults_comm_cases.py; the callers named after them are left out)."""
    return re.findall(r" at \S*faults_comm_cases\.py:(\d+)", msg)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", ["swap", "skip"])
def test_same_shape_psums_in_another_order_or_skipped_are_an_error_on_every_rank(case, transport, monkeypatch):
    # Before: "swap" gave rank 0 [[5001, 6002, 7003, 8004], [1005, ...]] (the other rank's
    # b summed into a) where [[6, 8, 10, 12], [6000, ...]] is right; "skip" gave rank 1 the
    # wrong b silently. The fingerprint of fsharded's innermost frames was the same for both.
    monkeypatch.setenv("FSHARDED_SHM", TRANSPORTS[transport])
    monkeypatch.setenv("FSHARDED_SHM_TIMEOUT", "10")
    for out in run_on_ranks(C.psums_in_order, 2, case):
        assert isinstance(out, str), f"no error, numbers: {out}"
        assert "both called all_reduce(sum) of 4 elements, but from different places in the program" in out, out
        # both ranks' lines of the program, not fsharded's
        assert "rank 0: all_reduce(sum) of shape (4,)" in out and "rank 1: all_reduce(sum) of shape (4,)" in out
        assert len(set(_lines(out))) == 2, out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_collectives_through_one_helper_name_the_lines_that_called_it(transport, monkeypatch):
    # The helper's own line is the same on both ranks: the callers' lines tell them apart.
    monkeypatch.setenv("FSHARDED_SHM", TRANSPORTS[transport])
    monkeypatch.setenv("FSHARDED_SHM_TIMEOUT", "10")
    for out in run_on_ranks(C.psums_through_a_helper, 2):
        assert isinstance(out, str), f"no error, numbers: {out}"
        assert "but from different places in the program" in out, out
        callers = re.findall(r"\(_reduce\), called from \S*faults_comm_cases\.py:(\d+) \(body\)", out)
        assert len(callers) == 2 and callers[0] != callers[1], out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_psum_in_another_dtype_names_both_dtypes(transport, monkeypatch):
    # The shared-memory transport's message printed dtypes as codes ("dtype 6").
    monkeypatch.setenv("FSHARDED_SHM", TRANSPORTS[transport])
    monkeypatch.setenv("FSHARDED_SHM_TIMEOUT", "10")
    for out in run_on_ranks(C.psum_in_another_dtype, 2):
        assert isinstance(out, str), f"no error, numbers: {out}"
        assert "torch.float32" in out and "torch.float64" in out, out
        assert not re.search(r"dtype \d", out), out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_on_4_ranks_a_skipped_psum_is_an_error_on_every_rank(transport, monkeypatch):
    monkeypatch.setenv("FSHARDED_SHM", TRANSPORTS[transport])
    monkeypatch.setenv("FSHARDED_SHM_TIMEOUT", "10")
    for out in run_on_ranks(C.psums_in_order, 4, "skip"):
        assert isinstance(out, str), f"no error, numbers: {out}"
        assert "but from different places in the program" in out, out
        assert all(f"rank {r}: all_reduce(sum) of shape (4,)" in out for r in range(4)), out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ranks_running_the_same_steps_train_as_before(transport, monkeypatch):
    monkeypatch.setenv("FSHARDED_SHM", TRANSPORTS[transport])
    a, b = run_on_ranks(C.train_steps, 2, "same")
    assert isinstance(a, list) and a == b and len(a) == 3


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", ["lr", "batch", "skip", "skip_line"])
def test_train_steps_that_differ_between_ranks_are_an_error_on_every_rank(case, transport, monkeypatch):
    # Before: each case trained on, silently: another learning rate on rank 1 (replicas
    # drift apart), another global batch (rows of another batch in the mean), a rank one
    # step behind (each step paired with the other rank's next one).
    monkeypatch.setenv("FSHARDED_SHM", TRANSPORTS[transport])
    monkeypatch.setenv("FSHARDED_SHM_TIMEOUT", "10")
    for out in run_on_ranks(C.train_steps, 2, case):
        assert isinstance(out, str), f"no error, losses: {out}"
        if case == "lr":
            assert "train_step: the ranks are not running the same step" in out, out
            assert "learning rate: rank 0 has 0.01, rank 1 has 0.02" in out, out
        elif case == "batch":
            assert "batch.x: rank 0 has (4, 8) torch.float32, rank 1 has (8, 8) torch.float32" in out, out
        elif case == "skip":
            assert "the global batch's values (same shapes): rank 0 / rank 1 passed different batches" in out, out
        else:  # the step called from two lines: the call-site check names them
            assert "but from different places in the program" in out, out
            assert len(set(_lines(out))) == 2, out


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", ["same", "perm", "shape"])
def test_ppermute_with_another_permutation_or_shape_is_an_error_on_every_rank(case, transport, monkeypatch):
    # Before: another permutation waited out the timeout and ended in gloo's recv timeout;
    # another shape aborted the process (C++ terminate).
    monkeypatch.setenv("FSHARDED_SHM", TRANSPORTS[transport])
    timeout = 5.0
    for rank, (out, waited) in enumerate(run_on_ranks(C.ppermutes, 2, case, timeout)):
        assert waited < timeout, f"rank {rank} waited {waited:.1f} s"
        if case == "same":
            assert out == [4.0, 5.0, 6.0, 7.0, 0.0, 1.0, 2.0, 3.0]
            continue
        assert isinstance(out, str), out
        if case == "perm":
            assert "both called ppermute of 4 elements (torch.float32), with different arguments" in out, out
            assert "rank 0: ppermute of shape (4,) (torch.float32) with perm [(0, 1), (1, 0)]" in out, out
            assert "rank 1: ppermute of shape (4,) (torch.float32) with perm [(0, 1)]" in out, out
        else:
            assert "called ppermute of 4 elements (torch.float32) while" in out or \
                "while rank 0 called ppermute of 4 elements (torch.float32)" in out, out
            assert "rank 1: ppermute of shape (6,)" in out, out


# -- ranks started by hand ---------------------------------------------------------------------


def _ranks(scenario: str, world: int, timeout_s: float, env: dict | None = None,
           wait_for: tuple[int, ...] | None = None) -> dict[int, subprocess.CompletedProcess]:
    """Run faults_comm_cases.py SCENARIO as ``world`` ranks started directly (no torchrun
    to end the survivors: each must end on its own). Ranks not in ``wait_for`` (a hung
    one) are killed once those have ended."""
    from fsharded.testing._launch import free_port

    base = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": "1", "TIMEOUT_S": str(timeout_s), **(env or {})}
    procs = [subprocess.Popen([sys.executable, CASES, scenario], env={**base, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    out = {}
    try:
        for r in (range(world) if wait_for is None else wait_for):
            stdout, stderr = procs[r].communicate(timeout=timeout_s + 90)  # start-up included
            out[r] = subprocess.CompletedProcess(procs[r].args, procs[r].returncode, stdout, stderr)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def _said(res: subprocess.CompletedProcess) -> tuple[str, float]:
    assert res.returncode == 0, res.stderr[-3000:]
    msg, waited = res.stdout.strip().splitlines()[-1].rsplit(" | ", 1)
    return msg, float(waited)


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("how", ["kill", "hang"])
def test_on_a_2x2_mesh_a_dead_or_hung_peer_is_named_by_its_global_rank(how, transport):
    # Before: rank 1, waiting in a psum over data for global rank 3 (index 1 of its data
    # group [1, 3]), was told "rank 1 (pid ...) exited ... while rank 0 waited" (group
    # ranks), or on gloo "Connection closed by peer" / gloo's timeout with no rank at all.
    timeout = 6.0
    res = _ranks(f"mesh2x2_{how}", 4, timeout, {"FSHARDED_SHM": TRANSPORTS[transport]},
                 wait_for=(0, 1, 2) if how == "hang" else None)
    msg, waited = _said(res[1])
    three = "rank 3 (data index 1 of the group ranks [1, 3])"
    me = "rank 1 (data index 0 of the group ranks [1, 3])"
    if how == "kill":
        assert f"{three} (pid" in msg and "exited or died while " + me in msg, msg
        assert waited < 5.0, msg  # from its process, not after the timeout
    else:
        assert me in msg and three in msg and "(the timeout)" in msg and "did not arrive" in msg, msg
        assert waited < timeout + 5.0, msg
    assert "faults_comm_cases.py:" in msg, msg  # the program's line


@pytest.mark.slow
@pytest.mark.parametrize("who,how", [("writer", "kill"), ("writer", "exit"), ("publisher", "kill"),
                                     ("writer", "hang")])
def test_save_async_wait_names_a_peer_that_died_or_hung_within_the_timeout(who, how, tmp_path):
    # Before: wait() polled for 1,800 s whatever initialize(timeout_s=) said and whether
    # the peer was alive, then raised a TimeoutError naming nobody.
    timeout = 6.0
    res = _ranks(f"save_async_{who}_{how}", 2, timeout, {"CKPT_DIR": str(tmp_path / "ckpt")},
                 wait_for=(0,) if who == "writer" else (1,))
    survivor, victim = (0, 1) if who == "writer" else (1, 0)
    msg, waited = _said(res[survivor])
    if how == "hang":
        assert msg.startswith("TimeoutError: checkpoint.save_async: rank 0 waited"), msg
        assert "for rank 1 to write its part" in msg and "(the timeout" in msg, msg
        assert timeout - 1 < waited < timeout + 5.0, msg
    else:
        assert f"rank {victim} (pid" in msg and "exited or died before it could" in msg, msg
        assert "resume from the last complete checkpoint" in msg, msg
        assert waited < 5.0, msg
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "exit", "hang"])
def test_save_async_names_a_peer_gone_before_it_called_it(how, tmp_path):
    # Before: the save's first collective (its token's broadcast) raised gloo's own error
    # ("Connection reset by peer", or its timeout) naming no rank.
    timeout = 6.0
    res = _ranks(f"save_async_absent_{how}", 2, timeout, {"CKPT_DIR": str(tmp_path / "ckpt")}, wait_for=(0,))
    msg, waited = _said(res[0])
    assert msg.startswith("CheckpointError: checkpoint.save:") and "was not saved (rank 0)" in msg, msg
    if how == "hang":
        assert "rank 1 did not reach checkpoint.save's collectives within the timeout" in msg, msg
        assert waited < timeout + 5.0, msg
    else:
        assert "rank 1 (pid" in msg and "exited or died during checkpoint.save" in msg, msg
        assert waited < 5.0, msg
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_save_async_under_torchrun_names_a_peer_that_exited_0(tmp_path):
    # Before: rank 0's wait() polled for 1,800 s (torchrun waits for the survivor).
    env = {**os.environ, "CKPT_DIR": str(tmp_path / "ckpt"), "TIMEOUT_S": "60"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", str(_free_port()), CASES, "save_async_writer_exit"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=150)
    finally:  # torchrun and its workers, also when they hang
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    msg, waited = stdout.strip().splitlines()[-1].rsplit(" | ", 1)
    assert "CheckpointError: checkpoint.save_async: rank 1 (pid" in msg, msg
    assert "exited or died before it could write its part" in msg and float(waited) < 5.0, msg


def _free_port() -> int:
    from fsharded.testing._launch import free_port

    return free_port()


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_peer_failing_during_step_save_is_named_with_the_save(how, transport, tmp_path):
    # Before: a bare gloo error ("Connection closed by peer [127.0.0.1]:...", or gloo's
    # timeout) naming neither the save nor the rank.
    timeout = 6.0
    ckpt = str(tmp_path / "ckpt")
    res = _ranks(f"step_save_{how}", 2, timeout, {"CKPT_DIR": ckpt, "FSHARDED_SHM": TRANSPORTS[transport]},
                 wait_for=(0,))
    msg, waited = _said(res[0])
    assert msg.startswith(f"RuntimeError: train_step.save: saving the state after step 1 to {ckpt} failed on "
                          "rank 0: "), msg
    if how == "exit":
        assert "rank 1 (pid" in msg and "exited or died during train_step.save" in msg, msg
    else:
        assert "within the timeout" in msg, msg
    assert "resume from the last complete checkpoint" in msg, msg
    assert waited < timeout + 5.0, msg
