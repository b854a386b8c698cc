"""The live-bytes tracker: exact on known allocations, storages (not tensor objects) decide
liveness, categories."""

from __future__ import annotations

import pytest
import torch

import fsharded as fs
from fsharded import P


def test_peak_is_exact_and_follows_storages():
    with fs.memory.track() as mem:
        a = torch.ones(1000)  # 4000 B
        b = torch.ones(1000)  # 8000 live
        v = a[10:]  # a view: no new storage
        del a  # the storage lives on through v
        c = b * 2  # 12000 live: the peak
        del b, c, v  # all freed
        d = torch.ones(250)  # 1000 live
    assert mem.peak_bytes == 12000
    assert mem.peak_by_category["activations"] == 12000
    assert mem.live_bytes()["activations"] == 1000
    del d
    assert sum(mem.live_bytes().values()) == 0


def test_registered_and_reclassified_categories():
    w = torch.ones(500)  # exists before tracking: 2000 B
    with fs.memory.track() as mem:
        mem.register(w, "parameters")
        w2 = w * 2
        mem.reclassify(w2, "parameters")  # re-labels the peak too
    assert mem.peak_by_category["parameters"] == 4000
    assert mem.peak_by_category["activations"] == 0
    del w2


def test_gradients_category_and_saved_tensors():
    x = torch.ones(1000, requires_grad=True)
    with fs.memory.track() as mem:
        y = x.exp()  # saved for backward: alive until backward even if y is dropped
        s = y.sum()
        del y
        assert mem.live_bytes()["activations"] >= 4000
        s.backward()
        assert mem.live_bytes()["gradients"] == 4000  # x.grad, created in backward
    assert x.grad is not None and mem.peak_bytes >= 8000


def test_per_device_on_the_virtual_mesh():
    """``track(mesh=)``: a sharded input counts its shard, a replicated one its whole; an op
    on a sharded value makes a shard per device; a psum or an all-gather is one copy per
    device again. Known sizes, data=2."""
    mesh = fs.Mesh({"data": 2})
    x = torch.ones(1000)  # 4000 B global: 2000 B per device as P("data")
    w = torch.ones(500)  # 2000 B, replicated: 2000 B per device

    def body(x, w):
        y = x * 2  # 500 elements per device: 2000 B
        s = fs.psum(y, "data")  # invariant: 2000 B per device (one copy, unbatched)
        g = fs.all_gather_invariant(y, "data")  # 1000 elements on every device: 4000 B
        return s.sum() + g.sum() + w.sum()

    f = fs.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())
    with fs.memory.track(mesh=mesh) as mem:
        mem.register(x, "parameters")
        mem.register(w, "parameters")
        f(x, w)
    assert mem.peak_by_category["parameters"] == 2000 + 2000
    # y, s and g alive at once (plus the scalar sums): 2000 + 2000 + 4000.
    assert 8000 <= mem.peak_by_category["activations"] + mem.peak_by_category["comm buffers"] < 8100
    with fs.memory.track() as whole:  # the whole mesh, as one process holds it
        whole.register(x, "parameters")
        f(x, w)
    assert whole.peak_by_category["parameters"] == 4000


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "gathered"])
def test_virtual_per_device_equals_a_real_rank(sharded):
    """The GPT's forward + backward inside shard_map: the per-device peak on the virtual
    mesh equals the peak one gloo rank measures for the same program (and the values)."""
    import memory_cases as M

    from fsharded.testing import run_on_ranks

    v = M.loss_and_grad({"data": 2}, sharded)
    r = run_on_ranks(M.loss_and_grad, 2, {"data": 2}, sharded)
    assert v["same"] and all(x["same"] for x in r)
    for x in r:
        assert abs(x["peak"] - v["peak"]) <= 0.01 * x["peak"], (v["peak"], x["peak"])
        for c in ("parameters", "gradients"):
            assert abs(x["by"][c] - v["by"][c]) <= 0.01 * max(x["by"][c], 1), (c, v["by"], x["by"])
    for a, b in zip(v["sums"], r[0]["sums"]):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a))


def test_the_temporaries_of_a_kernels_reference_count():
    # Off the GPU fsharded's kernels run their pure-torch references inside a custom op;
    # the tracker counts what those allocate inside (here the (T, T) scores per head),
    # not only the op's outputs.
    from fsharded.kernels.attention import flash_attention_with_lse

    q, k, v = (torch.randn(1, 2, 64, 8, requires_grad=True) for _ in range(3))
    with fs.memory.track() as mem:
        out, lse = flash_attention_with_lse(q, k, v, causal=True, impl="reference")
    scores = 2 * 64 * 64 * 4
    outputs = out.numel() * 4 + lse.numel() * 4
    assert mem.peak_bytes >= outputs + scores


def test_views_of_tensors_allocated_before_tracking_are_not_counted():
    # A weight allocated before (not registered): its rows taken inside the tracked region
    # are views of it, not allocations; only the product is new.
    w = torch.randn(256, 256)
    with fs.memory.track() as mem:
        rows = [w[i] for i in range(4)] + [w.t(), w.view(-1)]
        y = rows[0] @ w
        w.mul_(1.0)  # in place: nothing new either
    assert mem.peak_bytes == y.numel() * 4 == 1024
    # A view of what the region allocates is that allocation, counted once.
    with fs.memory.track() as mem:
        z = torch.ones(64, 64)
        parts = [z[i] for i in range(64)]
    assert mem.peak_bytes == z.numel() * 4 and len(parts) == 64


def test_a_storage_an_op_grows_counts_its_new_size():
    # out= resizes its target: a reallocation, the new bytes allocated by the program,
    # whether the target was made before tracking or inside it.
    x = torch.randn(100, 100)
    before = torch.empty(0)
    with fs.memory.track() as mem:
        torch.mm(x, x, out=before)
    assert mem.peak_bytes == 100 * 100 * 4
    with fs.memory.track() as mem:
        inside = torch.empty(0)
        torch.mm(x, x, out=inside)
        del inside
    assert mem.peak_bytes >= 100 * 100 * 4
    assert mem.live_bytes()["activations"] == 0
