"""The live-bytes tracker: exact on known allocations, storages (not tensor objects) decide
liveness, categories."""

from __future__ import annotations

import torch

import fsharded as fs


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
