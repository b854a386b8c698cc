"""fsharded.testing.run_on_ranks: a pool of gloo ranks kept between calls (the test suite's
default), each call with a new process group, the caller's environment, a new seed."""

from __future__ import annotations

import launch_cases as L
import pytest
import torch

from fsharded.testing import run_on_new_ranks, run_on_ranks


@pytest.mark.multiprocess
def test_pooled_ranks_are_reused_with_a_new_group_and_the_callers_environment(monkeypatch):
    monkeypatch.setenv("FSHARDED_TEST_POOL", "1")
    monkeypatch.setenv("FSHARDED_LAUNCH_TEST", "first")
    a = run_on_ranks(L.who, 2)
    monkeypatch.setenv("FSHARDED_LAUNCH_TEST", "second")
    b = run_on_ranks(L.who, 2)
    assert [r["pid"] for r in a] == [r["pid"] for r in b]  # the same processes
    for r, rank in zip(b, (0, 1)):
        assert (r["rank"], r["world"], r["sum"], r["env"]) == (rank, 2, 3.0, "second")
    assert not torch.equal(a[0]["draw"], b[0]["draw"])  # a new random seed, as a new process has
    fresh = run_on_new_ranks(L.who, 2)
    assert {r["pid"] for r in fresh}.isdisjoint(r["pid"] for r in b)


@pytest.mark.multiprocess
def test_a_failed_rank_is_named_and_the_next_call_gets_new_ranks(monkeypatch):
    monkeypatch.setenv("FSHARDED_TEST_POOL", "1")
    before = run_on_ranks(L.who, 2)
    with pytest.raises(RuntimeError, match="rank 1 failed: ValueError: rank 1 says no"):
        run_on_ranks(L.fail_on_rank_1, 2)
    after = run_on_ranks(L.who, 2)
    assert [r["sum"] for r in after] == [3.0, 3.0]
    assert {r["pid"] for r in after}.isdisjoint(r["pid"] for r in before)


@pytest.mark.multiprocess
def test_without_the_pool_every_call_spawns(monkeypatch):
    monkeypatch.setenv("FSHARDED_TEST_POOL", "0")
    a, b = run_on_ranks(L.who, 2), run_on_ranks(L.who, 2)
    assert {r["pid"] for r in a}.isdisjoint(r["pid"] for r in b)
