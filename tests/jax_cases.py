"""JAX's shard_map semantics, as cases that run unchanged on the virtual mesh and on gloo ranks.

Each case returns plain values (tensors, dtypes as strings, error messages); the tests
compare them with references computed here from numpy (the values JAX gives: checked
against JAX 0.10.2 with 4 simulated CPU devices) and the two backends with each other.
Mesh ``{"i": n}``, x = [1, ..., n], loss ``(f(x) * c).sum()`` with c = [1, 10, 100, ...].
"""

from __future__ import annotations

import torch

import fsharded as fs
from fsharded import P


def _x(n):
    return torch.arange(1.0, n + 1, dtype=torch.float64)


def _c(n, reps=1):
    return (10.0 ** torch.arange(n * reps, dtype=torch.float64))


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def fan_out_grads(n: int) -> dict:
    """Defect 1: a value invariant over ``i`` returned under out_specs naming ``i``."""
    mesh = fs.Mesh({"i": n})
    out = {}
    cases = {
        "psum": (lambda x: fs.psum(x, "i"), P("i"), _x(n), 1),
        "all_gather": (lambda x: fs.all_gather(x, "i"), P("i"), _x(n), n),
        "input_P()": (lambda w: w, P(), torch.ones(1, dtype=torch.float64), 1),
        "pmean": (lambda x: fs.pmean(x, "i"), P("i"), _x(n), 1),
        "all_gather_invariant": (lambda x: fs.all_gather_invariant(x, "i"), P("i"), _x(n), n),
    }
    for name, (f, ispec, x0, reps) in cases.items():
        x = x0.clone().requires_grad_()
        y = fs.shard_map(f, mesh=mesh, in_specs=ispec, out_specs=P("i"))(x)
        (y * _c(n, reps)[: y.numel()]).sum().backward()
        out[name] = {"value": y.detach(), "grad": x.grad}
    return out


def bool_and_int_reductions(n: int) -> dict:
    """Defects 2 and 5: bool sums as int32, integer dtypes kept, pmean of ints is float32."""
    mesh = fs.Mesh({"i": n})
    b = torch.tensor([i != 1 for i in range(n)])  # [T, F, T, T] for n = 4
    res = {}

    def sm(f, i=P("i"), o=P()):
        return fs.shard_map(f, mesh=mesh, in_specs=i, out_specs=o)

    res["psum_bool"] = sm(lambda v: fs.psum(v, "i"))(b)
    res["pmean_bool"] = sm(lambda v: fs.pmean(v, "i"))(b)
    res["pmax_bool"] = sm(lambda v: fs.pmax(v, "i"))(b)
    res["pmin_bool"] = sm(lambda v: fs.pmin(v, "i"))(b)
    for dt in (torch.int32, torch.int16, torch.uint8, torch.int64):
        name = str(dt).replace("torch.", "")
        x = torch.arange(1, n + 1).to(dt)
        res[f"psum_{name}"] = sm(lambda v: fs.psum(v, "i"))(x)
        res[f"pmean_{name}"] = sm(lambda v: fs.pmean(v, "i"))(x)
        res[f"pmax_{name}"] = sm(lambda v: fs.pmax(v, "i"))(x)
        res[f"psum_scatter_{name}"] = sm(lambda v: fs.psum_scatter(v, "i"), P(), P("i"))(x)
        res[f"psum_vary_{name}"] = sm(lambda v: fs.psum(v * 1, "i"))(x)  # varying operand
    return res


def grads_inside(n: int) -> dict:
    """Defect 3: grad of an invariant parameter inside the body is summed over shards;
    of a varying one it is the shard's own."""
    mesh = fs.Mesh({"i": n})
    x = _x(n)

    def inner(w, x):
        return torch.func.grad(lambda w: (w * x).sum())(w)

    def inner_vary(w, x):
        w = fs.pvary(w, "i")
        return torch.func.grad(lambda w: (w * x).sum())(w)

    w = torch.ones(1, dtype=torch.float64)
    return {
        "invariant": fs.shard_map(inner, mesh=mesh, in_specs=(P(), P("i")), out_specs=P())(w, x),
        "varying": fs.shard_map(inner_vary, mesh=mesh, in_specs=(P(), P("i")), out_specs=P("i"))(w, x),
        # An invariant operand of psum is summed over its n copies, and so is its gradient.
        "psum_invariant": fs.shard_map(lambda w: torch.func.grad(lambda w: fs.psum(w, "i").sum())(w),
                                       mesh=mesh, in_specs=P(), out_specs=P())(w),
    }


def vma_errors(n: int) -> dict:
    """Defect 4: out_specs that leave out a varying axis are an error, statically."""
    mesh = fs.Mesh({"i": n})
    x = _x(n)
    calls = []

    def f(x):
        calls.append(1)
        return {"a": x * 2, "b": fs.psum(x, "i"), "c": fs.all_gather(x, "i")}

    sm = fs.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs={"a": P(), "b": P(), "c": P()})
    err = _error(lambda: sm(x))
    unchecked = fs.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("i"), out_specs=P(),
                             check_vma=False)(x)
    vmapped = torch.func.vmap(fs.shard_map(lambda x: fs.psum(x, "i"), mesh=mesh, in_specs=P("i"),
                                           out_specs=P()))(torch.stack([x, 2 * x]))
    return {"error": err, "calls": len(calls), "unchecked": unchecked, "vmapped": vmapped}


def transforms(n: int) -> dict:
    """Defect 6: jacrev, jacfwd, jvp, vmap over a shard_map'ed function and inside its body."""
    mesh = fs.Mesh({"i": n})
    x = _x(n)
    gather = fs.shard_map(lambda x: fs.all_gather(x * x, "i"), mesh=mesh, in_specs=P("i"),
                          out_specs=P("i"))
    total = fs.shard_map(lambda x: fs.psum((x ** 3).sum(), "i"), mesh=mesh, in_specs=P("i"),
                         out_specs=P())
    out = {
        "jacrev": torch.func.jacrev(gather)(x),
        "jacfwd": torch.func.jacfwd(gather)(x),
        "jvp": torch.func.jvp(total, (x,), (torch.ones_like(x),))[1],
        "vmap_outside": torch.func.vmap(total)(torch.stack([x, -x, 2 * x])),
        "grad_outside": torch.func.grad(total)(x),
        "hessian_diag": torch.func.jacfwd(torch.func.jacrev(total))(x).diagonal(),
    }
    inside = fs.shard_map(lambda x: torch.func.vmap(lambda r: fs.psum(r, "i"))(x.reshape(-1, 1)).reshape(-1),
                          mesh=mesh, in_specs=P("i"), out_specs=P())
    out["vmap_inside"] = inside(torch.arange(1.0, 2 * n + 1, dtype=torch.float64))
    jvp_inside = fs.shard_map(
        lambda x: torch.func.jvp(lambda v: fs.psum(v * v, "i"), (x,), (torch.ones_like(x),))[1],
        mesh=mesh, in_specs=P("i"), out_specs=P())
    out["jvp_inside"] = jvp_inside(x)
    return out


def scalars_and_errors(n: int) -> dict:
    mesh = fs.Mesh({"i": n})
    x = _x(n)
    return {
        "psum_1": fs.shard_map(lambda x: x * 0 + fs.psum(1, "i"), mesh=mesh, in_specs=P("i"),
                               out_specs=P("i"))(x),
        "scalar_arg": fs.shard_map(lambda x, s: fs.psum(x * s, "i"), mesh=mesh,
                                   in_specs=(P("i"), P()), out_specs=P())(x, 3.0),
        "gather_0d_tiled": _error(lambda: fs.shard_map(lambda x: fs.all_gather(x[0], "i"), mesh=mesh,
                                                       in_specs=P("i"), out_specs=P("i"))(x)),
        "gather_0d_stacked": fs.shard_map(lambda x: fs.all_gather(x[0], "i", tiled=False), mesh=mesh,
                                          in_specs=P("i"), out_specs=P("i"))(x),
        "lax_all_to_all": fs.shard_map(lambda x: fs.lax.all_to_all(x, "i", 0, 0), mesh=mesh,
                                       in_specs=P("i"), out_specs=P("i"))(
            torch.arange(float(n * n), dtype=torch.float64).reshape(n * n, 1)),
        "lax_psum_scatter": fs.shard_map(lambda x: fs.lax.psum_scatter(x, "i"), mesh=mesh,
                                         in_specs=P(), out_specs=P("i"))(
            torch.arange(float(2 * n), dtype=torch.float64).reshape(n, 2)),
        "lax_all_gather": fs.shard_map(lambda x: fs.lax.all_gather(x, "i"), mesh=mesh,
                                       in_specs=P("i"), out_specs=P("i"))(x),
    }


def all_cases(n: int) -> dict:
    return {
        "fan_out": fan_out_grads(n),
        "dtypes": bool_and_int_reductions(n),
        "inside": grads_inside(n),
        "vma": vma_errors(n),
        "transforms": transforms(n),
        "scalars": scalars_and_errors(n),
        "sharded": sharded_values(n),
        "shapes": shapes_and_dims(n),
        "ported": ported_surface(n),
    }


def sharded_values(n: int) -> dict:
    """Defect 7: what fs.shard returns stands for the global value in shard_map."""
    mesh = fs.Mesh({"i": n})
    x = torch.arange(float(2 * n), dtype=torch.float64).reshape(2 * n, 1)
    xs = fs.shard(x, P("i"), mesh)
    f = fs.shard_map(lambda v: fs.psum(v.sum(0), "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    other = fs.shard(x, P(), mesh)  # replicated: the whole value, under another layout
    res = {"as_global": f(xs), "type_after_op": type(xs * 2).__name__,
           "roundtrip": fs.unshard(xs, P("i"), mesh)}
    res["other_layout"] = _error(lambda: f(other)) if fs.distributed.is_initialized() else f(other)
    return res


def jacobians_of_every_collective(n: int) -> dict:
    """jacrev and jacfwd through shard_map of every linear collective case of spmd_cases
    (each a small float64 problem), for comparison with the case's exact Jacobian."""
    import spmd_cases as C

    mesh = fs.Mesh({"i": n})
    out = {}
    for k, (name, make, shapes, _ref, linear, _kinds) in enumerate(C.collective_specs(n)):
        if not linear or name == "axis_index":
            continue
        f, ispec, ospec = make("i")
        sm = fs.shard_map(f, mesh=mesh, in_specs=(ispec,), out_specs=ospec)
        (x,) = C.inputs_for(shapes, seed=k)
        out[name] = {"jacrev": torch.func.jacrev(sm)(x), "jacfwd": torch.func.jacfwd(sm)(x)}
    return out


def shapes_and_dims(n: int) -> dict:
    """Negative dims (counted as torch and JAX count them: an untiled gather's new dim
    against the output's rank) and zero-size values through every collective."""
    mesh = fs.Mesh({"i": n})

    def sm(f, i=P("i"), o=P("i")):
        return fs.shard_map(f, mesh=mesh, in_specs=i, out_specs=o)

    X = torch.arange(float(2 * n * 3 * 4), dtype=torch.float64).reshape(2 * n, 3, 4)
    Y = torch.arange(float(2 * n * n * 4), dtype=torch.float64).reshape(2 * n, n, 4)
    Z = torch.zeros(n, 0, 3, dtype=torch.float64)
    Z2 = torch.zeros(n, 0, 2 * n, dtype=torch.float64)
    shift = [(k, (k + 1) % n) for k in range(n)]
    out = {
        "gather_-1_tiled": sm(lambda v: fs.lax.all_gather(v, "i", axis=-1, tiled=True))(X),
        "gather_-1_untiled": sm(lambda v: fs.lax.all_gather(v, "i", axis=-1))(X),
        "gather_-2_untiled": sm(lambda v: fs.lax.all_gather(v, "i", axis=-2))(X),
        "scatter_-1_tiled": sm(lambda v: fs.lax.psum_scatter(v, "i", scatter_dimension=-1, tiled=True))(X),
        "scatter_-2_untiled": sm(lambda v: fs.lax.psum_scatter(v, "i", scatter_dimension=-2))(Y),
        "a2a_-1_-2_tiled": sm(lambda v: fs.lax.all_to_all(v, "i", -1, -2, tiled=True))(X),
        "a2a_-2_-1_untiled": sm(lambda v: fs.lax.all_to_all(v, "i", -2, -1))(Y),
        "zero_psum": sm(lambda v: fs.psum(v, "i"), o=P())(Z),
        "zero_pmean": sm(lambda v: fs.pmean(v, "i"), o=P())(Z),
        "zero_pmax": sm(lambda v: fs.pmax(v, "i"), o=P())(Z),
        "zero_gather_tiled": sm(lambda v: fs.all_gather(v, "i", dim=1))(Z),
        "zero_gather_untiled": sm(lambda v: fs.all_gather(v, "i", tiled=False))(Z),
        "zero_scatter": sm(lambda v: fs.psum_scatter(v, "i", dim=2))(Z2),
        "zero_ppermute": sm(lambda v: fs.ppermute(v, "i", shift))(Z),
        "zero_a2a": sm(lambda v: fs.all_to_all(v, "i", split_dim=2, concat_dim=1))(Z2),
        "zero_global": sm(lambda v: fs.psum(v.sum(0), "i"), o=P())(torch.zeros(0, 3, dtype=torch.float64)),
    }
    z = Z.clone().requires_grad_()
    sm(lambda v: fs.psum(v, "i"), o=P())(z).sum().backward()
    out["zero_grad"] = z.grad
    return out


def _raised(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def ported_surface(n: int) -> dict:
    """What code ported from recent JAX writes: ``shard_map`` as a decorator factory
    (``f`` omitted), Python numbers through the body, ``all_gather(..., to=...)``."""
    mesh = fs.Mesh({"i": n})
    out: dict = {}

    @fs.shard_map(mesh=mesh, in_specs=P("i"), out_specs=P())
    def total(x):
        return fs.psum(x.sum(), "i")

    out["decorated"] = total(_x(n))
    out["decorated_name"] = total.__name__

    def ident(v):
        return fs.shard_map(lambda x: x, mesh=mesh, in_specs=P(), out_specs=P())(v)

    for name, v in (("float", 3.0), ("int", 3), ("bool", True)):
        got = ident(v)
        out[f"number_{name}"] = (type(got).__name__, str(got.dtype), tuple(got.shape), got.item())
    out["number_out"] = fs.shard_map(lambda x: 2.0, mesh=mesh, in_specs=P("i"), out_specs=P())(_x(n))
    out["number_psum"] = fs.shard_map(lambda x: fs.psum(1.0, "i"), mesh=mesh, in_specs=P("i"),
                                      out_specs=P())(_x(n))

    for to, spec in (("invarying", P()), ("varying", P("i"))):
        x = _x(n).requires_grad_()
        y = fs.shard_map(lambda x, to=to: fs.lax.all_gather(x, "i", to=to, tiled=True), mesh=mesh,
                         in_specs=P("i"), out_specs=spec)(x)
        (y * _c(n, n)[: y.numel()]).sum().backward()
        out[f"gather_{to}"] = {"value": y.detach(), "grad": x.grad}
    out["gather_varying_as_P()"] = _raised(lambda: fs.shard_map(
        lambda x: fs.lax.all_gather(x, "i", to="varying"), mesh=mesh, in_specs=P("i"), out_specs=P())(_x(n)))
    out["gather_untiled_invarying"] = fs.shard_map(lambda x: fs.lax.all_gather(x, "i", to="invarying"),
                                                   mesh=mesh, in_specs=P("i"), out_specs=P())(_x(n))
    out["native_invarying"] = fs.shard_map(lambda x: fs.all_gather(x, "i", to="invarying"), mesh=mesh,
                                           in_specs=P("i"), out_specs=P())(_x(n))
    for to in ("reduced", "sideways"):
        out[f"gather_{to}"] = _raised(lambda to=to: fs.shard_map(
            lambda x: fs.lax.all_gather(x, "i", to=to), mesh=mesh, in_specs=P("i"), out_specs=P("i"))(_x(n)))
    out["pcast_sideways"] = _raised(lambda: fs.shard_map(
        lambda x: fs.lax.pcast(x, "i", to="sideways"), mesh=mesh, in_specs=P(), out_specs=P("i"))(_x(n)))
    return out
