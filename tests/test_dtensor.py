"""torch.distributed interop: Mesh <-> DeviceMesh, shard/unshard, DTensor, shard_map on DTensors.

In-process tests cover the virtual backend; the ``multiprocess`` tests spawn real gloo
ranks once per world size (tests/dtensor_cases.py does every check on the ranks) and
compare what the ranks computed with the virtual backend here.
"""

from __future__ import annotations

import pickle

import dtensor_cases as cases
import pytest
import torch

import fsharded as fs
from fsharded import P
from fsharded.spmd._transfer import placements
from fsharded.testing import run_on_ranks

MESHES = {"data2": cases.MESH_2, "data2_tensor2": cases.MESH_4}
VIRTUAL_CASES = [("data2", s) for s in cases.SPECS_2] + [
    ("data2_tensor2", s) for s in cases.SPECS_4
]


# -- virtual backend (in process) ---------------------------------------------------------


@pytest.mark.parametrize("mesh_name,spec", VIRTUAL_CASES, ids=lambda v: repr(v))
def test_virtual_shard_unshard_roundtrip(mesh_name, spec):
    mesh = fs.Mesh(MESHES[mesh_name])
    x = cases.global_x()
    stacked = fs.shard(x, spec, mesh)
    lead = [a for a in mesh.axis_names if a in spec.axes]  # mesh order, not spec order
    shard_shape = fs.NamedSharding(mesh, spec).shard_shape(x.shape)
    assert tuple(stacked.shape) == tuple(mesh.shape[a] for a in lead) + shard_shape
    for r in range(mesh.size):
        coords = mesh.coords(r)
        block = stacked[tuple(coords[a] for a in lead)]
        assert torch.equal(block, cases.expected_block(x, spec, mesh, coords))
    assert torch.equal(fs.unshard(stacked, spec, mesh), x)


def test_virtual_multi_axis_layout_is_major_first():
    mesh = fs.Mesh(cases.MESH_4)
    x = torch.arange(8.0)
    # P(("tensor","data")): block index t*2 + d; stacked dims are (data, tensor).
    s = fs.shard(x, P(("tensor", "data")), mesh)
    for d in range(2):
        for t in range(2):
            assert torch.equal(s[d, t], x[2 * (2 * t + d) : 2 * (2 * t + d) + 2])
    s2 = fs.shard(x, P(("data", "tensor")), mesh)
    for d in range(2):
        for t in range(2):
            assert torch.equal(s2[d, t], x[2 * (2 * d + t) : 2 * (2 * d + t) + 2])


def test_virtual_unshard_is_differentiable_and_trees_pass_non_tensors():
    mesh = fs.Mesh(cases.MESH_4)
    x = cases.global_x().requires_grad_()
    tree = fs.shard({"x": x, "step": 7}, {"x": P(None, "tensor"), "step": P()}, mesh)
    assert tree["step"] == 7
    back = fs.unshard(tree, {"x": P(None, "tensor"), "step": P()}, mesh)
    assert back["step"] == 7 and torch.equal(back["x"], x.detach())
    (back["x"] * 3).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


def test_virtual_unshard_rejects_wrong_stacked_shape():
    mesh = fs.Mesh(cases.MESH_4)
    with pytest.raises(ValueError, match=r"leading dims \(4,\)"):
        fs.unshard({"w": torch.zeros(4, 2)}, {"w": P("data")}, mesh)
    with pytest.raises(ValueError, match="'pipe' is not in the mesh"):
        fs.unshard(torch.zeros(2, 2), P("pipe"), mesh)


def test_placements_follow_mesh_order_and_refuse_other_orders():
    from torch.distributed.tensor import Replicate, Shard

    mesh = fs.Mesh(cases.MESH_4)
    for spec, pl in cases.PLACEMENTS_4.items():
        if pl is None:
            with pytest.raises(ValueError, match="mesh order"):
                placements(spec, mesh, 2)
        else:
            assert placements(spec, mesh, 2) == pl
    # The same tuple is fine on a mesh whose order it follows.
    flipped = fs.Mesh({"tensor": 2, "data": 2})
    assert placements(P(("tensor", "data")), flipped, 1) == [Shard(0), Shard(0)]
    assert placements(P(None, "data"), flipped, 2) == [Replicate(), Shard(1)]


def test_mesh_pickles_with_device_type():
    m = fs.Mesh({"data": 2}, device_type="cpu")
    m2 = pickle.loads(pickle.dumps(m))
    assert m2 == m and m2.device_type == "cpu"


def test_virtual_backend_refuses_mesh_interop_without_process_group():
    with pytest.raises(RuntimeError, match="initialised process group"):
        fs.Mesh({"data": 2}).to_torch()


# -- real gloo ranks: one spawn per world size ------------------------------------------


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(cases.case_2ranks, 2)


@pytest.fixture(scope="module")
def four_ranks():
    return run_on_ranks(cases.case_4ranks, 4)


def _check_shards_against_virtual(results, axes, specs):
    mesh = fs.Mesh(axes)
    x = cases.global_x()
    for spec in specs:
        stacked = fs.shard(x, spec, mesh)  # virtual, in this process
        for r, res in enumerate(results):
            coords = mesh.coords(r)
            idx = tuple(coords[a] for a in mesh.axis_names if a in spec.axes)
            assert torch.equal(res["shards"][spec], stacked[idx]), (spec, r)
        # and the ranks' shards reassemble into x
        shards = torch.stack([res["shards"][spec] for res in results])
        shards = shards.reshape(*mesh.axis_sizes, *shards.shape[1:])
        for a in reversed(mesh.axis_names):  # drop the axes the spec replicates over
            if a not in spec.axes:
                dim = mesh.axis_names.index(a)
                assert torch.equal(shards.select(dim, 0), shards.select(dim, 1))
                shards = shards.select(dim, 0)
        assert torch.equal(fs.unshard(shards, spec, mesh), x)


@pytest.mark.multiprocess
def test_two_ranks_shards_match_virtual(two_ranks):
    _check_shards_against_virtual(two_ranks, cases.MESH_2, cases.SPECS_2)


@pytest.mark.multiprocess
def test_two_ranks_shard_map_on_dtensors_matches_virtual(two_ranks):
    mesh = fs.Mesh(cases.MESH_2)
    x = cases.global_x(1).requires_grad_()
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    w.requires_grad_()
    sm = fs.shard_map(
        lambda x, w: torch.tanh(x @ w), mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")
    )
    y = sm(x, w)
    y.pow(2).sum().backward()
    for r, res in enumerate(two_ranks):
        torch.testing.assert_close(res["y"], y.detach())
        torch.testing.assert_close(res["x_grad"], x.grad.chunk(2)[r])
        torch.testing.assert_close(res["w_grad"], w.grad)


@pytest.mark.multiprocess
def test_four_ranks_shards_match_virtual(four_ranks):
    _check_shards_against_virtual(four_ranks, cases.MESH_4, cases.SPECS_4)


@pytest.mark.multiprocess
def test_four_ranks_shard_map_on_dtensors_matches_virtual(four_ranks):
    mesh = fs.Mesh(cases.MESH_4)
    w1, w2, x = (t.requires_grad_() for t in cases.megatron_inputs())
    sm = fs.shard_map(
        cases._megatron, mesh=mesh, in_specs=cases.MEGATRON_SPECS, out_specs=P("data", None)
    )
    y = sm(w1, w2, x)
    y.pow(2).sum().backward()
    for r, res in enumerate(four_ranks):
        assert res["rank"] == r
        torch.testing.assert_close(res["y"], y.detach())
        coords = mesh.coords(r)
        for got, ref, spec in zip(res["grads"], (w1.grad, w2.grad, x.grad), cases.MEGATRON_SPECS):
            torch.testing.assert_close(got, cases.expected_block(ref, spec, mesh, coords))
