"""A 2x2 (data, tensor) Megatron MLP and Ulysses sequence-sharded attention: forward and
gradients equal the unsharded computation, with grad taken outside and inside shard_map,
on the virtual mesh and on gloo ranks."""

from __future__ import annotations

import pytest
import spmd_cases as C
import torch

# float64: sharded and unsharded differ only by summation order.
TOL = dict(rtol=1e-10, atol=1e-12)


def _reference_mlp():
    p, x = C.mlp_params()
    loss = lambda p, x: C.mlp_ref(p, x).pow(2).mean()  # noqa: E731
    return C.mlp_ref(p, x), torch.func.grad(loss, argnums=(0, 1))(p, x)


def check_megatron(res):
    out, (gp, gx) = _reference_mlp()
    torch.testing.assert_close(res["out"], out, **TOL)
    for key in ("grad_outside", "grad_backward", "grad_inside"):
        got_p, got_x = res[key]
        for k in gp:
            torch.testing.assert_close(got_p[k], gp[k], **TOL, msg=f"{key}: d/d{k}")
        torch.testing.assert_close(got_x, gx, **TOL, msg=f"{key}: d/dx")


def test_megatron_virtual():
    check_megatron(C.run_megatron())


@pytest.mark.multiprocess
def test_megatron_gloo_4_ranks(gloo_results):
    per_rank = gloo_results(4)
    virtual = C.run_megatron()
    for res in per_rank:
        check_megatron(res["megatron"])
        assert res["megatron"]["manifest"] == virtual["manifest"]


def check_ulysses(res):
    q, k, v = C.attn_inputs()
    w = C.attn_inputs(seed=1)[0]
    out = C.attention(q, k, v)
    g = torch.func.grad(lambda q, k, v: (C.attention(q, k, v) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    torch.testing.assert_close(res["out"], out, **TOL)
    for key in ("grad_outside", "grad_inside"):
        for got, ref, name in zip(res[key], g, "qkv"):
            torch.testing.assert_close(got, ref, **TOL, msg=f"{key}: d/d{name}")


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_ulysses_virtual(sp):
    check_ulysses(C.run_ulysses(sp))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_gloo(world, gloo_results):
    for res in gloo_results(world):
        check_ulysses(res["ulysses"])


def test_megatron_manifest():
    """grad inside shard_map (JAX's rule): forward pvary (free) + psum over tensor; in
    backward one psum over data per parameter, the transpose of the implicit pvary where
    the data-invariant parameter meets data-varying activations (last used, first
    reduced), and the psum over tensor that is the explicit pvary's transpose for x."""
    import fsharded as fs
    from fsharded import P

    mesh = fs.Mesh({"data": 2, "tensor": 2})
    p, x = C.mlp_params()  # B=8, D=4, H=8: local x (4, 4), w1/w2 shards (4, 4)

    def step(p, x):
        return torch.func.grad(lambda p, x: C.mlp_local(p, x).pow(2).mean(), argnums=(0, 1))(p, x)

    sm = fs.shard_map(step, mesh=mesh, in_specs=(C.MLP_SPECS, P("data")),
                      out_specs=(C.MLP_SPECS, P("data")))
    m = sm.collectives(p, x)
    f8 = 8  # float64 bytes
    ring = lambda numel, n=2: 2 * (n - 1) * numel * f8 // n  # noqa: E731 - all-reduce bytes
    expected = [
        ("forward", "pvary", "tensor", (4, 4), 0),
        ("forward", "psum", "tensor", (4, 4), ring(16)),
        ("backward", "psum", "data", (4,), ring(4)),  # b2
        ("backward", "psum", "data", (4, 4), ring(16)),  # w2 shard (H/tp, D)
        ("backward", "psum", "data", (4,), ring(4)),  # b1 shard
        ("backward", "psum", "data", (4, 4), ring(16)),  # w1 shard (D, H/tp)
        ("backward", "psum", "tensor", (4, 4), ring(16)),  # x: pvary's transpose
    ]
    assert [(e.phase, e.op, e.axis, e.shape, e.bytes_sent) for e in m] == expected
    assert m.by_axis() == {"tensor": 2 * ring(16), "data": 2 * ring(16) + 2 * ring(4)}
    assert all(e.dtype == torch.float64 for e in m)
    text = str(m)
    assert "psum" in text and "total over data" in text
