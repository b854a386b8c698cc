import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# fsharded.testing.run_on_ranks keeps its gloo ranks between calls (a new process group
# each time): a hundred spawns of Python + torch + fsharded less. FSHARDED_TEST_POOL=0 to
# spawn every time.
os.environ.setdefault("FSHARDED_TEST_POOL", "1")

# Triton decides at decoration time whether a kernel is compiled or interpreted: without a
# GPU, the kernel tests run Triton's interpreter on CPU tensors (tiny shapes only).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

_CACHE: dict[int, list] = {}


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: tiny models on 2 shared cores only contend
    with more (20 plain steps of a tiny nanoGPT took 11.8 s with 2 threads on a loaded
    machine, 0.18 s with 1)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def gloo_results():
    """``gloo_results(world)``: every rank's results of ``spmd_cases.all_for_world`` (one
    spawn per world size per session; spawning costs ~10 s on 2 cores)."""
    import spmd_cases

    from fsharded.testing import run_on_ranks

    def get(world: int) -> list:
        if world not in _CACHE:
            _CACHE[world] = run_on_ranks(spmd_cases.all_for_world, world, world)
        return _CACHE[world]

    return get
