"""JAX's shard_map semantics on both backends: every case against the value JAX gives
(computed here with numpy; checked against JAX 0.10.2 with simulated CPU devices), and the
virtual mesh against 2 and 4 gloo ranks, value for value and dtype for dtype."""

from __future__ import annotations

import jax_cases as J
import numpy as np
import optree
import pytest
import torch

import fsharded as fs
from fsharded import P

# float64 throughout: every expected value is exact in binary floating point.
TOL = dict(rtol=1e-12, atol=1e-12)


def _close(got, want):
    torch.testing.assert_close(got, torch.as_tensor(want, dtype=got.dtype), **TOL)


def check_fan_out(res: dict, n: int) -> None:
    c = (10.0 ** np.arange(n * n))
    x = np.arange(1.0, n + 1)
    csum = c[:n].sum()  # 1111 for n = 4: the sum of every shard's cotangent
    _close(res["psum"]["value"], np.full(n, x.sum()))
    _close(res["psum"]["grad"], np.full(n, csum))
    _close(res["pmean"]["grad"], np.full(n, csum / n))
    _close(res["input_P()"]["value"], np.ones(n))
    _close(res["input_P()"]["grad"], [csum])
    # all_gather: element j sits at j, n + j, 2n + j, ... of the n x n output.
    want = c.reshape(n, n).sum(0)
    for name in ("all_gather", "all_gather_invariant"):
        _close(res[name]["value"], np.tile(x, n))
        _close(res[name]["grad"], want)


def check_dtypes(res: dict, n: int) -> None:
    trues = n - 1 if n > 1 else 1
    assert res["psum_bool"].dtype == torch.int32 and res["psum_bool"].tolist() == [trues]
    assert res["pmean_bool"].dtype == torch.float32
    _close(res["pmean_bool"], [trues / n])
    assert res["pmax_bool"].dtype == torch.bool and res["pmax_bool"].tolist() == [True]
    assert res["pmin_bool"].dtype == torch.bool and res["pmin_bool"].tolist() == [n == 1]
    total = n * (n + 1) // 2
    for name in ("int32", "int16", "uint8", "int64"):
        dt = getattr(torch, name)
        for op, want in (("psum", [total]), ("psum_vary", [total]), ("pmax", [n]),
                         ("psum_scatter", [n * v for v in range(1, n + 1)])):
            got = res[f"{op}_{name}"]
            assert got.dtype == dt and got.tolist() == want, (op, name, got)
        assert res[f"pmean_{name}"].dtype == torch.float32
        _close(res[f"pmean_{name}"], [total / n])


def check_inside(res: dict, n: int) -> None:
    x = np.arange(1.0, n + 1)
    _close(res["invariant"], [x.sum()])  # summed over the shards, as JAX does
    _close(res["varying"], x)  # each shard's own
    _close(res["psum_invariant"], [float(n)])


def check_vma(res: dict, n: int) -> None:
    x = np.arange(1.0, n + 1)
    if n == 1:  # a one-device mesh is not typed: nothing can differ between devices
        assert res["error"] == "" and res["calls"] == 1
        _close(res["vmapped"], [[x.sum()], [2 * x.sum()]])
        return
    err = res["error"]
    assert err.startswith("ValueError: shard_map: out_specs must name every mesh axis")
    assert "output.a: varies over ['i']" in err and "output.c: varies over ['i']" in err
    assert "output.b" not in err and "check_vma=False" in err
    assert res["calls"] == 1  # one run of the body: the check is from types, not values
    _close(res["unchecked"], [2.0])  # shard 0's value
    _close(res["vmapped"], [[x.sum()], [2 * x.sum()]])


def check_transforms(res: dict, n: int) -> None:
    x = np.arange(1.0, n + 1)
    jac = np.tile(np.diag(2 * x), (n, 1))  # d all_gather(x*x) / dx, one block per shard
    _close(res["jacrev"], jac)
    _close(res["jacfwd"], jac)
    _close(res["jvp"], (3 * x**2).sum())
    _close(res["grad_outside"], 3 * x**2)
    _close(res["hessian_diag"], 6 * x)
    _close(res["vmap_outside"], [(x**3).sum(), -(x**3).sum(), 8 * (x**3).sum()])
    rows = np.arange(1.0, 2 * n + 1).reshape(n, 2)  # shard k holds row k
    _close(res["vmap_inside"], rows.sum(0))
    _close(res["jvp_inside"], [2 * x.sum()])


def check_scalars(res: dict, n: int) -> None:
    x = np.arange(1.0, n + 1)
    _close(res["psum_1"], np.full(n, float(n)))
    _close(res["scalar_arg"], [3 * x.sum()])
    assert "tiled=True" in res["gather_0d_tiled"] and res["gather_0d_tiled"].startswith("ValueError")
    _close(res["gather_0d_stacked"], np.tile(x, n))
    a = np.arange(float(n * n)).reshape(n * n, 1)
    # all_to_all(split 0, concat 0), untiled: shard k receives element k of every shard.
    want = np.concatenate([a.reshape(n, n, 1)[:, k] for k in range(n)])
    _close(res["lax_all_to_all"], want)
    _close(res["lax_psum_scatter"], n * np.arange(2.0 * n))
    _close(res["lax_all_gather"], np.tile(x, n).reshape(n * n, 1))  # untiled: a new dim


def check_sharded(res: dict, n: int) -> None:
    total = float(sum(range(2 * n)))
    _close(res["as_global"], [total])  # not split a second time
    assert res["type_after_op"] == "Tensor"  # ops give plain tensors
    _close(res["roundtrip"], np.arange(2.0 * n).reshape(2 * n, 1))
    if isinstance(res["other_layout"], str):  # real ranks: a shard of another layout is refused
        assert "sharded as PartitionSpec()" in res["other_layout"] and "in_specs say" in res["other_layout"]
    else:  # the virtual mesh holds every shard: any layout stands for its global value
        _close(res["other_layout"], [total])


def check_shapes(res: dict, n: int) -> None:
    X = np.arange(2.0 * n * 3 * 4).reshape(2 * n, 3, 4)
    Y = np.arange(2.0 * n * n * 4).reshape(2 * n, n, 4)
    xb, yb = np.split(X, n), np.split(Y, n)

    def per_shard(f):  # out_specs P("i"): shard k's value stacked along dim 0
        return np.concatenate([f(k) for k in range(n)])

    _close(res["gather_-1_tiled"], per_shard(lambda k: np.concatenate(xb, -1)))
    _close(res["gather_-1_untiled"], per_shard(lambda k: np.stack(xb, -1)))  # new dim last
    _close(res["gather_-2_untiled"], per_shard(lambda k: np.stack(xb, -2)))
    _close(res["scatter_-1_tiled"], per_shard(lambda k: np.split(sum(xb), n, -1)[k]))
    _close(res["scatter_-2_untiled"], per_shard(lambda k: sum(yb)[:, k]))
    _close(res["a2a_-1_-2_tiled"], per_shard(lambda k: np.concatenate([np.split(b, n, -1)[k] for b in xb], -2)))
    _close(res["a2a_-2_-1_untiled"], per_shard(lambda k: np.stack([b[:, k] for b in yb], -1)))
    zeros = {"zero_psum": (1, 0, 3), "zero_pmean": (1, 0, 3), "zero_pmax": (1, 0, 3),
             "zero_gather_tiled": (n, 0, 3), "zero_gather_untiled": (n * n, 1, 0, 3),
             "zero_scatter": (n, 0, 2), "zero_ppermute": (n, 0, 3), "zero_a2a": (n, 0, 2),
             "zero_grad": (n, 0, 3)}
    for name, shape in zeros.items():
        assert tuple(res[name].shape) == shape and res[name].dtype == torch.float64, (name, res[name].shape)
    _close(res["zero_global"], np.zeros(3))


def check_ported(res: dict, n: int) -> None:
    x = np.arange(1.0, n + 1)
    _close(res["decorated"], x.sum())
    assert res["decorated_name"] == "total"  # the decorated def keeps its name, as in JAX
    # JAX returns a 0-d array for a Python number: float32 (weak), int32 (without x64),
    # bool. Torch's dtypes for numbers stand in for JAX's: int is int64 here.
    assert res["number_float"] == ("Tensor", "torch.float32", (), 3.0)
    assert res["number_int"] == ("Tensor", "torch.int64", (), 3)
    assert res["number_bool"] == ("Tensor", "torch.bool", (), True)
    assert res["number_out"].shape == () and res["number_out"].item() == 2.0
    assert res["number_psum"].item() == float(n)
    c = 10.0 ** np.arange(n * n)
    # to="invarying": every shard holds the whole gather (out_specs P() is legal); its
    # transpose is a dynamic slice, so shard k's gradient is block k of the cotangent.
    _close(res["gather_invarying"]["value"], x)
    _close(res["gather_invarying"]["grad"], c[:n])
    # to="varying" (JAX's default): its transpose is a psum_scatter of the shards' cotangents.
    _close(res["gather_varying"]["value"], np.tile(x, n))
    _close(res["gather_varying"]["grad"], c.reshape(n, n).sum(0))
    if n > 1:
        assert res["gather_varying_as_P()"].startswith("ValueError: shard_map: out_specs must name")
    _close(res["gather_untiled_invarying"], x.reshape(n, 1))  # lax's default: untiled
    _close(res["native_invarying"], x)
    assert res["gather_reduced"].startswith("NotImplementedError") and "to='invarying'" in res["gather_reduced"]
    assert res["gather_sideways"].startswith("ValueError") and "'reduced'" in res["gather_sideways"]
    assert res["pcast_sideways"].startswith("ValueError") and "'unreduced'" in res["pcast_sideways"]


CHECKS = {"ported": check_ported, "sharded": check_sharded, "fan_out": check_fan_out, "dtypes": check_dtypes, "inside": check_inside,
          "vma": check_vma, "transforms": check_transforms, "scalars": check_scalars,
          "shapes": check_shapes}


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("group", list(CHECKS))
def test_virtual_matches_jax(group, n):
    CHECKS[group](getattr(J, {"sharded": "sharded_values", "fan_out": "fan_out_grads", "dtypes": "bool_and_int_reductions",
                              "inside": "grads_inside", "vma": "vma_errors",
                              "transforms": "transforms", "scalars": "scalars_and_errors",
                              "shapes": "shapes_and_dims", "ported": "ported_surface"}[group])(n), n)


def _same(a, b, where):
    la, ta = optree.tree_flatten(a)
    lb, tb = optree.tree_flatten(b)
    assert ta == tb, where
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype, where
            torch.testing.assert_close(x, y, **TOL, msg=where)
        else:
            assert x == y, where


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_gloo_ranks_match_jax_and_the_virtual_mesh(n):
    from fsharded.testing import run_on_ranks

    virtual = J.all_cases(n)
    for rank, res in enumerate(run_on_ranks(J.all_cases, n, n)):
        for group, check in CHECKS.items():
            check(res[group], n)
            if group != "sharded":  # its refusal message is real-rank only
                _same(res[group], virtual[group], f"rank {rank}: {group}")


def test_lax_refuses_axis_index_groups():
    mesh = fs.Mesh({"i": 2})
    with pytest.raises(NotImplementedError, match="axis_index_groups"):
        fs.shard_map(lambda x: fs.lax.psum(x, "i", axis_index_groups=[[0], [1]]), mesh=mesh,
                     in_specs=P("i"), out_specs=P())(torch.ones(2))


def _exact_jacobian(ref, shape):
    """The Jacobian of an affine numpy reference, column by column."""
    size = int(np.prod(shape))
    base = ref(np.zeros(shape))
    cols = [(ref(np.eye(size)[i].reshape(shape)) - base).reshape(-1) for i in range(size)]
    return np.stack(cols, axis=-1).reshape(*base.shape, *shape)


def check_jacobians(res: dict, n: int) -> None:
    import spmd_cases as C

    for name, _make, shapes, ref, _linear, _kinds in C.collective_specs(n):
        if name not in res:
            continue
        want = _exact_jacobian(ref, shapes[0])
        for how in ("jacrev", "jacfwd"):
            torch.testing.assert_close(res[name][how], torch.as_tensor(want), **TOL,
                                       msg=f"{how} of {name} over {n} shards")
    assert len(res) >= 12


@pytest.mark.parametrize("n", [2, 4])
def test_jacobians_of_every_collective_virtual(n):
    check_jacobians(J.jacobians_of_every_collective(n), n)


@pytest.mark.multiprocess
def test_jacobians_of_every_collective_gloo():
    from fsharded.testing import run_on_ranks

    for res in run_on_ranks(J.jacobians_of_every_collective, 2, 2):
        check_jacobians(res, 2)
