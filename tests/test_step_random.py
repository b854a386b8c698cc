"""Dropout inside train_step: keys are data in the state, so a run is reproducible bit for
bit, each step and batch shard draws its own masks, ZeRO-3's recomputed blocks draw the
same masks as their forward, and the virtual mesh equals real ranks."""

from __future__ import annotations

import pytest
import random_step_cases as C

# The same masks and the same arithmetic up to summation order (sharded sums, vmap vs one
# rank's matmuls): fp32 rounding, ~1e-6 relative.
TOL = 1e-5


def _close(a, b):
    assert len(a) == len(b) and all(abs(x - y) <= TOL * max(1.0, abs(y)) for x, y in zip(a, b)), (a, b)


def test_reproducible_and_seeded():
    a, b = C.run({"data": 2}), C.run({"data": 2})
    assert a == b  # bit for bit
    other = C.run({"data": 2}, seed=1)
    assert all(x != y for x, y in zip(a, other))  # another seed, other masks


def test_zero3_recomputed_blocks_draw_the_forward_masks():
    # The remat of each block in backward runs under the key forked for its forward; with
    # fresh masks the gradients (and the losses from step 2 on) would differ.
    _close(C.run({"data": 2}, stage=3), C.run({"data": 2}, stage=0))


def test_micro_batches_continue_the_stream():
    # Each micro-batch draws its own masks from the step's stream, in every layout.
    _close(C.run({"data": 2}, stage=3, accumulation=2), C.run({"data": 2}, stage=0, accumulation=2))
    assert C.run({"data": 2}, accumulation=2) != C.run({"data": 2})


def test_masks_follow_the_batch_shards_not_the_mesh_size():
    # One device and two shards draw differently (each shard folds in its index), but a
    # data axis of size 1 is the one-device run.
    assert C.run({"data": 1}) != C.run({"data": 2})


@pytest.mark.multiprocess
def test_gloo_ranks_equal_the_virtual_mesh():
    from fsharded.testing import run_on_ranks

    virtual = C.cases(2)
    for res in run_on_ranks(C.cases, 2, 2):
        for stage in (0, 3):
            _close(res[stage], virtual[stage])
