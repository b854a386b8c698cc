"""The GPT on the Triton kernels (flash attention, norms, cross-entropy) equals the GPT on
plain torch ops: loss and gradients, on one device and inside shard_map with tensor
parallelism (the kernels' vmap rules). Runs Triton's interpreter on CPU."""

from __future__ import annotations

import os

import optree
import pytest
import torch
import train_cases as T

import fsharded as fs
from fsharded.models import gpt

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)


def _loss_and_grads(params, batch):
    return torch.func.grad_and_value(gpt.loss)(params, batch)


def test_gpt_on_triton_kernels_equals_plain_torch(monkeypatch):
    params = gpt.init(T.CONFIG, 0)
    batch = {"tokens": T.batches(1)[0]["tokens"][:2]}
    monkeypatch.setenv("FSHARDED_KERNELS", "reference")
    g_ref, l_ref = _loss_and_grads(params, batch)
    calls = []
    from fsharded.kernels import attention

    real = attention.flash_attention
    monkeypatch.setattr(attention, "flash_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("FSHARDED_KERNELS", "triton")
    g, l = _loss_and_grads(params, batch)
    assert len(calls) == T.CONFIG.n_layers  # the kernels did run
    # fp32 throughout; the kernels reorder sums (online softmax, chunked vocabulary).
    torch.testing.assert_close(l, l_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(optree.tree_leaves(g), optree.tree_leaves(g_ref)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_gpt_on_triton_kernels_under_tensor_parallel_shard_map(monkeypatch):
    params = gpt.init(T.CONFIG, 0)
    batch = {"tokens": T.batches(1)[0]["tokens"][:2]}
    mesh = fs.Mesh({"tensor": 2})
    specs = gpt.tensor_parallel_specs(params)
    f = fs.shard_map(_loss_and_grads, mesh=mesh, in_specs=(specs, fs.P()), out_specs=(specs, fs.P()))
    monkeypatch.setenv("FSHARDED_KERNELS", "reference")
    g_ref, l_ref = f(params, batch)
    from fsharded.kernels import norm

    calls = []
    real = norm.layer_norm
    monkeypatch.setattr(norm, "layer_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("FSHARDED_KERNELS", "triton")
    g, l = f(params, batch)
    assert calls  # the Triton norm ran inside the vmapped shard_map
    torch.testing.assert_close(l, l_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(optree.tree_leaves(g), optree.tree_leaves(g_ref)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
