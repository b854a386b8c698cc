"""Case functions for tests/test_dtensor.py, run on real gloo ranks by ``run_on_ranks``.

One function per world size (each spawn costs ~10 s). Every check asserts on the rank
itself (a failing rank makes ``run_on_ranks`` raise with its traceback) and the functions
also return the values the parent process compares against the virtual backend.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import fsharded as fs
from fsharded import P

MESH_2 = {"data": 2}
MESH_4 = {"data": 2, "tensor": 2}
SPECS_2 = [P(), P("data")]
SPECS_4 = [P(), P("data"), P(None, "tensor"), P(("tensor", "data")), P(("data", "tensor"), None)]

# DTensor placements per spec on Mesh(data=2, tensor=2); None: not expressible (not mesh order).
PLACEMENTS_4 = {
    P(): [Replicate(), Replicate()],
    P("data"): [Shard(0), Replicate()],
    P(None, "tensor"): [Replicate(), Shard(1)],
    P(("tensor", "data")): None,
    P(("data", "tensor"), None): [Shard(0), Shard(0)],
}
# What from_dtensor reads back (trailing unsharded dims dropped).
FROM_DTENSOR = {P(("data", "tensor"), None): P(("data", "tensor"))}


def global_x(seed: int = 0) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def expected_block(x: torch.Tensor, spec, mesh: fs.Mesh, coords: dict) -> torch.Tensor:
    """This device's block, written independently of fsharded: chunk each dim over its
    axes major first (so the block index is major-first over the tuple)."""
    for d, e in enumerate(spec):
        for a in () if e is None else (e,) if isinstance(e, str) else e:
            x = x.chunk(mesh.shape[a], d)[coords[a]]
    return x


def _raises(exc, fn, *must_contain: str) -> str:
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for s in must_contain:
        assert s in msg, f"{s!r} not in error message: {msg}"
    return msg


def _roundtrips(mesh: fs.Mesh, specs: list, placements_of: dict | None) -> dict:
    """shard / unshard / to_dtensor / from_dtensor / distribute_tensor on this rank."""
    rank = dist.get_rank()
    coords = mesh.coords(rank)
    dm = mesh.to_torch()
    x = global_x()
    out = {}
    for spec in specs:
        local = fs.shard(x, spec, mesh)
        torch.testing.assert_close(local, expected_block(x, spec, mesh, coords), rtol=0, atol=0)
        # Same numbers as the virtual backend's stacked form at this rank's coordinates.
        stacked = fs.shard(x, spec, mesh, backend="virtual")
        idx = tuple(coords[a] for a in mesh.axis_names if a in spec.axes)
        assert torch.equal(stacked[idx], local)
        # unshard all-gathers back the global tensor on every rank.
        assert torch.equal(fs.unshard(local, spec, mesh), x)
        # tree form, with a non-tensor leaf passing through.
        tree = fs.shard({"x": x, "n": 3}, {"x": spec, "n": P()}, mesh)
        assert tree["n"] == 3 and torch.equal(tree["x"], local)
        back = fs.unshard(tree, {"x": spec, "n": P()}, mesh)
        assert back["n"] == 3 and torch.equal(back["x"], x)

        pl = (
            placements_of[spec]
            if placements_of is not None
            else [Shard(0) if spec.axes else Replicate()]
        )
        if pl is None:
            # DTensor shards a dim over several mesh dims in mesh order only.
            _raises(
                ValueError,
                lambda spec=spec, local=local: fs.to_dtensor(local, spec, mesh),
                "mesh order",
            )
            out[spec] = local
            continue
        dt = fs.to_dtensor(local, spec, mesh)
        assert isinstance(dt, DTensor) and tuple(dt.placements) == tuple(pl)
        assert dt.device_mesh == dm and tuple(dt.shape) == tuple(x.shape)
        assert torch.equal(dt.full_tensor(), x)
        loc2, spec2, mesh2 = fs.from_dtensor(dt)
        assert loc2 is local or torch.equal(loc2, local)
        assert spec2 == FROM_DTENSOR.get(spec, spec) and mesh2 == mesh
        # torch's own distribute_tensor picks the same local block as our shard.
        dt_t = distribute_tensor(x, dm, pl)
        assert torch.equal(dt_t.to_local(), local)
        loc3, spec3, mesh3 = fs.from_dtensor(dt_t)
        assert torch.equal(loc3, local) and spec3 == spec2 and mesh3 == mesh
        out[spec] = local
    return out


def _world_errors(world: int) -> None:
    big = fs.Mesh({"data": 2 * world})
    x = torch.zeros(4 * world)
    want = (f"{2 * world} devices", f"world size is {world}")
    _raises(ValueError, lambda: fs.shard(x, P("data"), big), *want)
    _raises(ValueError, lambda: fs.unshard(x, P("data"), big), *want)
    _raises(ValueError, lambda: big.to_torch(), *want)
    _raises(ValueError, lambda: fs.to_dtensor(x, P("data"), big), *want)
    sm = fs.shard_map(lambda v: v, mesh=big, in_specs=P("data"), out_specs=P("data"))
    _raises(ValueError, lambda: sm(x), *want)


def _mesh_roundtrip(axes: dict) -> None:
    names = tuple(axes)
    dm = init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=names)
    m = fs.Mesh.from_torch(dm)
    assert m == fs.Mesh(axes) and m.axis_names == names and m.device_type == "cpu"
    assert m.to_torch() is dm  # the user's DeviceMesh is reused, no new groups
    assert fs.Mesh(axes).to_torch() is dm
    own = fs.Mesh.from_torch(fs.Mesh(axes).to_torch())
    assert own == fs.Mesh(axes)
    # Without dim names there is nothing to name the axes by.
    unnamed = init_device_mesh("cpu", (dist.get_world_size(),))
    _raises(ValueError, lambda: fs.Mesh.from_torch(unnamed), "mesh_dim_names")


def case_2ranks() -> dict:
    """All checks on 2 ranks, Mesh(data=2)."""
    mesh = fs.Mesh(MESH_2)
    _mesh_roundtrip(MESH_2)
    _world_errors(2)
    out = {"shards": _roundtrips(mesh, SPECS_2, None)}
    # shard_map over DTensor arguments: data parallel x @ w, w replicated.
    dm = mesh.to_torch()
    x = global_x(1)
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    sm = fs.shard_map(
        lambda x, w: torch.tanh(x @ w), mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")
    )
    xd = distribute_tensor(x, dm, [Shard(0)]).requires_grad_()
    wd = DTensor.from_local(w.clone(), dm, [Replicate()]).requires_grad_()
    y = sm(xd, wd)
    assert not isinstance(y, DTensor)
    torch.testing.assert_close(y, sm(x, w), rtol=0, atol=0)
    y.pow(2).sum().backward()
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.tanh(xg @ wg).pow(2).sum().backward()
    assert isinstance(xd.grad, DTensor) and tuple(xd.grad.placements) == (Shard(0),)
    assert isinstance(wd.grad, DTensor) and tuple(wd.grad.placements) == (Replicate(),)
    torch.testing.assert_close(xd.grad.to_local(), fs.shard(xg.grad, P("data"), mesh))
    torch.testing.assert_close(wd.grad.to_local(), wg.grad)  # summed over data
    torch.testing.assert_close(xd.grad.full_tensor(), xg.grad)
    out["y"], out["x_grad"], out["w_grad"] = y, xd.grad.to_local(), wd.grad.to_local()
    return out


def _megatron(w1, w2, x):
    x = fs.pvary(x, "tensor")
    return fs.psum(torch.tanh(x @ w1) @ w2, "tensor")


MEGATRON_SPECS = (P(None, "tensor"), P("tensor", None), P("data", None))


def megatron_inputs():
    g = torch.Generator().manual_seed(3)
    return tuple(
        torch.randn(*s, generator=g, dtype=torch.float64) for s in ((4, 8), (8, 4), (8, 4))
    )


def case_4ranks() -> dict:
    """All checks on 4 ranks, Mesh(data=2, tensor=2)."""
    mesh = fs.Mesh(MESH_4)
    _mesh_roundtrip(MESH_4)
    out = {"shards": _roundtrips(mesh, SPECS_4, PLACEMENTS_4)}
    dm = mesh.to_torch()
    rank = dist.get_rank()

    # -- shard_map over DTensors: a Megatron MLP, DTensor weights + DTensor/global input --
    w1, w2, x = megatron_inputs()
    sm = fs.shard_map(_megatron, mesh=mesh, in_specs=MEGATRON_SPECS, out_specs=P("data", None))
    y_global = sm(w1, w2, x)
    d1 = DTensor.from_local(
        fs.shard(w1, MEGATRON_SPECS[0], mesh).clone(), dm, [Replicate(), Shard(1)]
    ).requires_grad_()
    d2 = distribute_tensor(w2, dm, [Replicate(), Shard(0)]).requires_grad_()
    dx = distribute_tensor(x, dm, [Shard(0), Replicate()]).requires_grad_()
    y = sm(d1, d2, dx)
    torch.testing.assert_close(y, y_global, rtol=0, atol=0)
    y.pow(2).sum().backward()
    # Mixed: DTensor weights, plain global input (gradient flows to both kinds).
    e1 = distribute_tensor(w1, dm, [Replicate(), Shard(1)]).requires_grad_()
    xg = x.clone().requires_grad_()
    sm(e1, d2.detach(), xg).pow(2).sum().backward()

    r1, r2, rx = (t.clone().requires_grad_() for t in (w1, w2, x))
    ref = torch.tanh(rx @ r1) @ r2
    torch.testing.assert_close(y, ref.detach())
    ref.pow(2).sum().backward()
    for dt, r, spec in (
        (d1, r1, MEGATRON_SPECS[0]),
        (d2, r2, MEGATRON_SPECS[1]),
        (dx, rx, MEGATRON_SPECS[2]),
        (e1, r1, MEGATRON_SPECS[0]),
    ):
        assert isinstance(dt.grad, DTensor) and dt.grad.placements == dt.placements
        torch.testing.assert_close(dt.grad.to_local(), fs.shard(r.grad, spec, mesh))
        torch.testing.assert_close(dt.grad.full_tensor(), r.grad)
    torch.testing.assert_close(xg.grad, rx.grad)
    out["y"] = y
    out["grads"] = tuple(t.grad.to_local() for t in (d1, d2, dx))

    # Multi-axis dim as DTensor: P(("data","tensor")) == [Shard(0), Shard(0)].
    z = torch.arange(16.0, dtype=torch.float64).reshape(8, 2)
    zd = distribute_tensor(z, dm, [Shard(0), Shard(0)]).requires_grad_()
    sm2 = fs.shard_map(
        lambda v: v * (1 + fs.axis_index("data") + 10 * fs.axis_index("tensor")),
        mesh=mesh,
        in_specs=P(("data", "tensor")),
        out_specs=P(("data", "tensor")),
    )
    y2 = sm2(zd)
    torch.testing.assert_close(y2, sm2(z), rtol=0, atol=0)
    scale = torch.tensor([1.0, 11.0, 2.0, 12.0], dtype=torch.float64).repeat_interleave(2)
    torch.testing.assert_close(y2, z * scale[:, None], rtol=0, atol=0)
    y2.sum().backward()
    torch.testing.assert_close(zd.grad.full_tensor(), scale[:, None].expand(8, 2))

    # -- errors ---------------------------------------------------------------------------
    bad = distribute_tensor(
        w1, dm, [Shard(0), Replicate()]
    )  # P('data'), specs say P(None,'tensor')
    _raises(ValueError, lambda: sm(bad, w2, x), "args[0]", "in_specs")
    bad2 = distribute_tensor(x, dm, [Shard(0), Shard(1)])
    _raises(ValueError, lambda: sm(w1, w2, bad2), "args[2]")
    part = DTensor.from_local(torch.ones(2, 2), dm, [Partial(), Replicate()])
    _raises(ValueError, lambda: fs.from_dtensor(part), "Partial", "'data'")
    # torch's right-to-left (FSDP2 + TP) order is our P(("tensor","data")); it has no
    # Shard/Replicate form, so from_dtensor refuses it rather than misread it as mesh order.
    xs = global_x()
    strided = distribute_tensor(xs, dm, [_StridedShard(0, split_factor=2), Shard(0)])
    assert torch.equal(strided.to_local(), fs.shard(xs, P(("tensor", "data")), mesh))
    _raises(ValueError, lambda: fs.from_dtensor(strided), "_StridedShard", "'data'")
    uneven = distribute_tensor(torch.ones(3, 4), dm, [Shard(0), Replicate()])
    _raises(ValueError, lambda: fs.from_dtensor(uneven), "not divisible")
    _raises(ValueError, lambda: fs.to_dtensor(torch.ones(2, 2), P("pipe"), mesh), "'pipe'")
    out["rank"] = rank
    return out
