"""Every collective against a numpy reference, its gradient through shard_map, and the
adjoint identity <f(x), y> == <x, f^T(y)>, on the virtual mesh and on gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest
import spmd_cases as C
import torch

# float64 throughout: references are exact up to summation order (~1e-15 relative).
TOL = dict(rtol=1e-10, atol=1e-10)

VIRTUAL_MESHES = [
    ({"i": 1}, ["i"]),
    ({"i": 2}, ["i"]),
    ({"i": 4}, ["i"]),
    ({"a": 2, "b": 2}, ["a", "b", ("a", "b"), ("b", "a")]),
    ({"a": 2, "b": 2, "c": 2}, [("c", "a"), "b", ("a", "b", "c")]),
    # an axis of size 1 beside others: each collective over it is the identity
    ({"a": 1, "b": 2}, ["a", "b", ("a", "b")]),
    ({"a": 2, "b": 1, "c": 2}, ["b", ("a", "b"), ("b", "c")]),
]


def _n(mesh_axes, ax):
    names = (ax,) if isinstance(ax, str) else ax
    return int(np.prod([mesh_axes[a] for a in names]))


def check_results(mesh_axes: dict, results: dict) -> int:
    """Compare every case with its numpy reference; returns the number of checks made."""
    checked = 0
    for (ax_s, name), res in results.items():
        ax = next(a for a in _axes_of(mesh_axes) if str(a) == ax_s)
        n = _n(mesh_axes, ax)
        case = {c[0]: c for c in C.collective_specs(n)}[name]
        _, _, shapes, ref, linear, _kinds = case
        k = [c[0] for c in C.collective_specs(n)].index(name)
        X = C.inputs_for(shapes, seed=k)[0]
        expect = ref(X.numpy())
        np.testing.assert_allclose(res["out"].numpy(), expect, **TOL, err_msg=f"{name} over {ax_s}")
        W = C.inputs_for([tuple(res["out"].shape)], seed=100 + k)[0]
        if linear:
            gref = C.reference_grad(ref, X.numpy(), W.numpy())
        else:  # pmax: the max's gradient goes to the arg-max shard
            Xt = X.clone().requires_grad_()
            torch.stack(Xt.chunk(n)).amax(0).mul(W).sum().backward()
            gref = Xt.grad.numpy()
        got = res["grad"].numpy() if res["grad"] is not None else np.zeros_like(gref)
        np.testing.assert_allclose(got, gref, **TOL, err_msg=f"grad of {name} over {ax_s}")
        if "adjoint" in res:
            lhs, rhs = res["adjoint"].tolist()
            assert lhs == pytest.approx(rhs, rel=1e-10, abs=1e-10), f"adjoint of {name} over {ax_s}"
        checked += 1
    return checked


def _axes_of(mesh_axes):
    for m, axes in VIRTUAL_MESHES + [x for v in C.DIST_MESHES.values() for x in v]:
        if m == mesh_axes:
            yield from axes


@pytest.mark.parametrize("mesh_axes,axes", VIRTUAL_MESHES, ids=lambda v: str(v))
def test_virtual(mesh_axes, axes):
    results = C.run_collectives(mesh_axes, axes)
    assert check_results(mesh_axes, results) == len(axes) * len(C.collective_specs(2))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gloo_matches_reference_and_virtual(world, gloo_results):
    per_rank = gloo_results(world)
    for mesh_items, results in per_rank[0]["collectives"].items():
        mesh_axes = dict(mesh_items)
        assert check_results(mesh_axes, results) > 0
        virtual = C.run_collectives(mesh_axes, next(a for m, a in C.DIST_MESHES[world] if m == mesh_axes))
        for r, rank_res in enumerate(per_rank):
            for key, res in rank_res["collectives"][mesh_items].items():
                torch.testing.assert_close(res["out"], virtual[key]["out"], **TOL, msg=f"rank {r} {key}")
                if res["grad"] is not None:
                    torch.testing.assert_close(res["grad"], virtual[key]["grad"], **TOL, msg=f"rank {r} {key}")
