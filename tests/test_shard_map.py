"""shard_map behaviour beyond single collectives: composition with torch.func, pytrees,
size-1 axes, manifests of tuple axes, and the distinction between the two backends."""

from __future__ import annotations

import pytest
import torch

import fsharded as fs
from fsharded import P

TOL = dict(rtol=1e-12, atol=1e-12)


def test_size_one_axes_make_per_shard_code_run_unsharded():
    """Per-shard model code (with collectives) gives the plain result on a 1x1 mesh."""
    mesh = fs.Mesh({"data": 1, "tensor": 1})
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)

    def f(x, w):
        h = fs.pvary(x, "tensor") @ w
        h = fs.all_gather(fs.psum_scatter(h, "data", dim=1), "data", dim=1)
        h = fs.all_to_all(h, "tensor", split_dim=0, concat_dim=1)
        return fs.pmax(fs.psum(h, ("data", "tensor")), "data") + fs.axis_index(("data", "tensor"))

    out = fs.shard_map(f, mesh=mesh, in_specs=(P("data"), P(None, "tensor")), out_specs=P(("data", "tensor")))(x, w)
    torch.testing.assert_close(out, x @ w, **TOL)
    m = fs.shard_map(f, mesh=mesh, in_specs=(P("data"), P(None, "tensor")), out_specs=P(("data", "tensor"))).collectives(x, w)
    # On a one-device mesh nothing is typed (nothing can differ): every call is listed.
    assert len(m) == 6 and m.total_bytes() == 0


def test_vmap_and_jacrev_over_shard_map():
    mesh = fs.Mesh({"i": 2})
    sm = fs.shard_map(lambda x: fs.psum((x**2).sum(0), "i"), mesh=mesh, in_specs=(P("i"),), out_specs=P())
    xs = torch.randn(3, 4, 2, dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(sm)(xs), (xs**2).sum(1), **TOL)
    x = xs[0]
    torch.testing.assert_close(torch.func.jacrev(sm)(x), torch.func.jacrev(lambda x: (x**2).sum(0))(x), **TOL)


def test_nested_outputs_and_non_tensor_arguments():
    mesh = fs.Mesh({"i": 2})

    def f(p, scale):
        return {"sum": fs.psum(p["a"] * scale, "i"), "local": (p["b"] + 1,)}

    p = {"a": torch.arange(4.0), "b": torch.arange(6.0).reshape(3, 2)}
    out = fs.shard_map(f, mesh=mesh, in_specs=({"a": P("i"), "b": P(None, "i")}, P()),
                       out_specs={"sum": P(), "local": (P(None, "i"),)})(p, 3.0)
    torch.testing.assert_close(out["sum"], torch.tensor([6.0, 12.0]))
    torch.testing.assert_close(out["local"][0], p["b"] + 1)


def test_tuple_axis_collective_is_one_manifest_entry():
    mesh = fs.Mesh({"a": 2, "b": 4})
    sm = fs.shard_map(lambda x: fs.all_gather_invariant(x, ("b", "a")), mesh=mesh,
                      in_specs=(P(("b", "a")),), out_specs=P())
    x = torch.arange(16.0)
    torch.testing.assert_close(sm(x), x)
    (e,) = sm.collectives(x)
    assert (e.op, e.axis, e.axis_size, e.shape) == ("all_gather_invariant", "(b,a)", 8, (2,))
    assert e.bytes_sent == 7 * 2 * 4  # (n-1) shards of 2 float32 each


def test_manifest_runs_on_meta_tensors_only():
    mesh = fs.Mesh({"i": 4})
    calls = []

    def f(x):
        calls.append(x.device.type)
        return fs.psum_scatter(x, "i")

    big = torch.empty(4096, 1024)
    m = fs.shard_map(f, mesh=mesh, in_specs=(P(),), out_specs=P("i")).collectives(big)
    assert calls == ["meta"]
    assert m[0].bytes_sent == 3 * 4096 * 1024 * 4 // 4


def test_randomness_is_explicit():
    mesh = fs.Mesh({"i": 2})
    f = lambda x: x + torch.rand(())  # noqa: E731
    with pytest.raises(RuntimeError, match="randomness"):
        fs.shard_map(f, mesh=mesh, in_specs=(P("i"),), out_specs=P("i"))(torch.zeros(2))
    out = fs.shard_map(f, mesh=mesh, in_specs=(P("i"),), out_specs=P("i"), randomness="different")(torch.zeros(2))
    assert out.shape == (2,) and out[0] != out[1]


def test_nested_shard_map_is_not_implemented():
    mesh = fs.Mesh({"i": 2})
    inner = fs.shard_map(lambda x: x, mesh=mesh, in_specs=(P(),), out_specs=P())
    with pytest.raises(NotImplementedError, match="nested shard_map"):
        fs.shard_map(lambda x: inner(x), mesh=mesh, in_specs=(P(),), out_specs=P())(torch.zeros(2))


def test_zero3_style_gather_gives_reduce_scattered_gradient():
    """A parameter stored sharded and all-gathered before use gets its gradient back
    reduce-scattered by the transpose rule (grad inside shard_map, no extra reduction)."""
    mesh = fs.Mesh({"data": 4})
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 3, generator=g, dtype=torch.float64)
    x = torch.randn(16, 8, generator=g, dtype=torch.float64)

    def step(w_shard, x):
        def loss(w_shard):
            w_full = fs.all_gather(w_shard, "data")  # (8, 3)
            return (x @ w_full).tanh().sum()
        return torch.func.grad(loss)(w_shard)

    got = fs.shard_map(step, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"))(w, x)
    ref = torch.func.grad(lambda w: (x @ w).tanh().sum())(w)
    torch.testing.assert_close(got, ref, **TOL)
    m = fs.shard_map(step, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")).collectives(w, x)
    assert [(e.phase, e.op) for e in m] == [("forward", "all_gather"), ("backward", "psum_scatter")]


def test_closure_captured_tensors_are_replicated():
    mesh = fs.Mesh({"i": 2})
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    out = fs.shard_map(lambda x: fs.psum(x * w, "i"), mesh=mesh, in_specs=(P("i"),), out_specs=P())(
        torch.tensor([[1.0, 1.0], [3.0, 3.0]]))
    out.sum().backward()
    torch.testing.assert_close(out, torch.tensor([[4.0, 8.0]]))
    torch.testing.assert_close(w.grad, torch.tensor([4.0, 4.0]))


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["out", "copy", "setitem"])
def test_in_place_writes_through_views_widen_the_buffer_type(how):
    # A buffer typed invariant over x, written (through views of it, or with out=) with
    # values that vary over x, varies over x: a psum over x then sums the shards instead of
    # multiplying one shard's value by their number.
    import vma_cases

    from fsharded.testing import run_on_ranks

    for r in run_on_ranks(vma_cases.writes_through_views, 4, how):
        assert r["types"]["out"] == ("y", "x")
        assert all(t == ("y", "x") for k, t in r["types"].items() if k.startswith("early"))
        torch.testing.assert_close(r["got"], r["want"])
