"""SPMD test cases that run unchanged on the virtual mesh and on gloo ranks.

Every case function computes with the default backend: virtual in the pytest process,
distributed inside ``fsharded.testing.run_on_ranks``. Tests compare both to references.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import fsharded as fs
from fsharded import P

DT = torch.float64


def _names(ax):
    return (ax,) if isinstance(ax, str) else tuple(ax)


def _chunks(X, n, dim=0):
    return np.split(X, n, axis=dim)


def collective_specs(n: int):
    """(name, build(ax) -> (f, in_specs, out_specs), input shapes, numpy reference)."""
    cases = []

    def add(name, make, shapes, ref, linear=True, kinds=("vary", "vary")):
        # kinds: whether the input / output vary along the axis or are replicated (for the
        # adjoint's inner products). all_gather's output counts as varying, as in JAX.
        cases.append((name, make, shapes, ref, linear, kinds))

    add("psum", lambda ax: (lambda x: fs.psum(x, ax), P(ax), P()), [(2 * n, 3, 4)],
        lambda X: sum(_chunks(X, n)), kinds=("vary", "rep"))
    add("pmean", lambda ax: (lambda x: fs.pmean(x, ax), P(ax), P()), [(2 * n, 3, 4)],
        lambda X: sum(_chunks(X, n)) / n, kinds=("vary", "rep"))
    add("pmax", lambda ax: (lambda x: fs.pmax(x, ax), P(ax), P()), [(2 * n, 3, 4)],
        lambda X: np.max(np.stack(_chunks(X, n)), axis=0), linear=False)
    # all_gather's result still varies over the axis (JAX's rule): under an out_spec that
    # names the axis every shard's copy of the whole value is returned; all_gather_invariant
    # gives a value typed invariant, returned once under P().
    add("all_gather0", lambda ax: (lambda x: fs.all_gather(x, ax), P(ax), P(ax)), [(2 * n, 3, 4)],
        lambda X: np.concatenate([X] * n, axis=0))
    add("all_gather1", lambda ax: (lambda x: fs.all_gather(x, ax, dim=1), P(ax), P(ax)),
        [(2 * n, 3, 4)], lambda X: np.concatenate([np.concatenate(_chunks(X, n), axis=1)] * n, axis=0))
    add("all_gather_invariant0", lambda ax: (lambda x: fs.all_gather_invariant(x, ax), P(ax), P()),
        [(2 * n, 3, 4)], lambda X: X, kinds=("vary", "rep"))
    add("all_gather_invariant1", lambda ax: (lambda x: fs.all_gather_invariant(x, ax, dim=1), P(ax), P()),
        [(2 * n, 3, 4)], lambda X: np.concatenate(_chunks(X, n), axis=1), kinds=("vary", "rep"))
    add("all_gather_stack",
        lambda ax: (lambda x: fs.all_gather_invariant(x, ax, dim=2, tiled=False), P(ax), P()),
        [(2 * n, 3, 4)], lambda X: np.stack(_chunks(X, n), axis=2), kinds=("vary", "rep"))
    add("psum_scatter1", lambda ax: (lambda y: fs.psum_scatter(y, ax, dim=1), P(ax), P(None, ax)),
        [(2 * n, 2 * n, 4)], lambda Y: sum(_chunks(Y, n)))
    add("psum_scatter0", lambda ax: (lambda y: fs.psum_scatter(y, ax), P(None, ax), P(ax)),
        [(2 * n, 2 * n)], lambda Y: sum(_chunks(Y, n, 1)))
    add("all_to_all00", lambda ax: (lambda x: fs.all_to_all(x, ax, split_dim=0, concat_dim=0), P(ax), P(ax)),
        [(2 * n * n, 3)],
        lambda X: np.concatenate(
            [np.concatenate([_chunks(xj, n, 0)[i] for xj in _chunks(X, n)], 0) for i in range(n)], 0))
    add("psum_scatter_untiled",
        lambda ax: (lambda y: fs.psum_scatter(y, ax, dim=1, tiled=False), P(ax), P(ax)),
        [(2 * n, n, 4)],
        lambda Y: np.concatenate([sum(_chunks(Y, n))[:, i] for i in range(n)], axis=0))
    add("all_to_all", lambda ax: (lambda x: fs.all_to_all(x, ax, split_dim=1, concat_dim=0), P(ax), P(ax)),
        [(2 * n, 2 * n, 4)],
        lambda X: np.concatenate(
            [np.concatenate([_chunks(xj, n, 1)[i] for xj in _chunks(X, n)], 0) for i in range(n)], 0))
    add("all_to_all_same_dim",
        lambda ax: (lambda x: fs.all_to_all(x, ax, split_dim=2, concat_dim=2), P(ax), P(ax)),
        [(2 * n, 3, 2 * n)],
        lambda X: np.concatenate(
            [np.concatenate([_chunks(xj, n, 2)[i] for xj in _chunks(X, n)], 2) for i in range(n)], 0))
    shift = [(i, (i + 1) % n) for i in range(n)]
    add("ppermute_cycle", lambda ax: (lambda x: fs.ppermute(x, ax, shift), P(ax), P(ax)),
        [(2 * n, 3)],
        lambda X: np.concatenate([_chunks(X, n)[(i - 1) % n] for i in range(n)], 0))
    partial = [(0, n - 1)]
    add("ppermute_partial", lambda ax: (lambda x: fs.ppermute(x, ax, partial), P(ax), P(ax)),
        [(2 * n, 3)],
        lambda X: np.concatenate(
            [_chunks(X, n)[0] if i == n - 1 else np.zeros_like(_chunks(X, n)[0]) for i in range(n)], 0))
    # The overlapped form: posted, then awaited around other work (the same value).
    add("ppermute_start_partial",
        lambda ax: (lambda x: (lambda h: x * 2.0 + h.wait())(fs.ppermute_start(x, ax, partial)), P(ax), P(ax)),
        [(2 * n, 3)],
        lambda X: 2.0 * X + np.concatenate(
            [_chunks(X, n)[0] if i == n - 1 else np.zeros_like(_chunks(X, n)[0]) for i in range(n)], 0))
    add("pvary_psum", lambda ax: (lambda x: fs.psum(fs.pvary(x, ax) * 2.0, ax), P(), P()), [(3, 4)],
        lambda X: 2.0 * n * X, kinds=("rep", "rep"))
    add("axis_index",
        lambda ax: (lambda x: x * 0 + fs.axis_index(ax).to(x.dtype) + fs.axis_size(ax) * 100, P(ax), P(ax)),
        [(n, 1)], lambda X: np.arange(n, dtype=np.float64).reshape(n, 1) + 100 * n)
    return cases


def inputs_for(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=DT) for s in shapes]


def run_collectives(mesh_axes: dict, axes_list: list) -> dict:
    """Forward, gradient through shard_map, and the adjoint identity for every collective."""
    mesh = fs.Mesh(mesh_axes)
    results = {}
    for ax in axes_list:
        n = mesh.axis_size(_names(ax))
        for k, (name, make, shapes, _ref, linear, kinds) in enumerate(collective_specs(n)):
            f, ispec, ospec = make(ax)
            xs = inputs_for(shapes, seed=k)
            sm = fs.shard_map(f, mesh=mesh, in_specs=(ispec,), out_specs=ospec, check_rep=True)
            out = sm(*xs)
            # Gradient of <f(X), W> taken outside shard_map.
            xg = [x.clone().requires_grad_() for x in xs]
            W = inputs_for([tuple(out.shape)], seed=100 + k)[0]
            (g,) = torch.autograd.grad((sm(*xg) * W).sum(), xg, allow_unused=True)
            res = {"out": out.detach(), "grad": None if g is None else g.detach()}
            if linear and name != "axis_index":
                res["adjoint"] = _adjoint(mesh, ax, f, ispec, shapes, k, kinds)
            results[(str(ax), name)] = res
    return results


def _adjoint(mesh, ax, f, ispec, shapes, k, kinds):
    """``<f(x), y>`` and ``<x, f^T(y)>``, f^T from ``torch.func.vjp`` *inside* shard_map.

    Inner products sum over shards for values that vary along ``ax`` and count replicated
    values once.
    """
    (x,) = inputs_for(shapes, seed=k)
    in_rep, out_rep = kinds[0] == "rep", kinds[1] == "rep"

    def body(x, y):
        out, vjp = torch.func.vjp(f, x)
        (xt,) = vjp(y)
        lhs = (out * y).sum()
        rhs = (x * xt).sum()
        lhs = lhs if out_rep else fs.psum(lhs, ax)
        rhs = rhs if in_rep else fs.psum(rhs, ax)
        return torch.stack([lhs, rhs])

    shape = _local_out_shape(mesh, f, ispec, x)
    n = mesh.axis_size(_names(ax))
    if out_rep:
        y, yspec = inputs_for([shape], seed=200 + k)[0], P()
    else:
        y, yspec = inputs_for([(shape[0] * n, *shape[1:])], seed=200 + k)[0], P(ax)
    return fs.shard_map(body, mesh=mesh, in_specs=(ispec, yspec), out_specs=P())(x, y)


def _local_out_shape(mesh, f, ispec, x):
    """Per-shard output shape, from a shapes-only (meta) run."""
    shapes = []

    def g(x):
        y = f(x)
        shapes.append(tuple(y.shape))
        return y

    fs.shard_map(g, mesh=mesh, in_specs=(ispec,), out_specs=P(), check_vma=False).collectives(x)
    return shapes[0]


def reference_grad(ref, X, W):
    """Gradient of <ref(X), W> for an affine ref: its exact Jacobian-transpose, by columns."""
    flat = X.reshape(-1)
    g = np.zeros_like(flat)
    base = ref(np.zeros_like(X))
    for i in range(flat.size):
        e = np.zeros_like(flat)
        e[i] = 1.0
        g[i] = float(((ref(e.reshape(X.shape)) - base) * W).sum())
    return g.reshape(X.shape)


# ---------------------------------------------------------------------------------------
# Models: a 2x2 Megatron MLP and Ulysses-style sequence-sharded attention.
# ---------------------------------------------------------------------------------------


def mlp_params(seed=0, B=8, D=4, H=8):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=DT)  # noqa: E731
    return {"w1": r(D, H), "b1": r(H), "w2": r(H, D), "b2": r(D)}, r(B, D)


def mlp_ref(p, x):
    return torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def mlp_local(p, x):
    """Per-shard Megatron MLP: column-parallel w1, row-parallel w2 over ``tensor``."""
    x = fs.pvary(x, "tensor")  # f: identity forward, all-reduce backward
    h = torch.tanh(x @ p["w1"] + p["b1"])  # (B/dp, H/tp)
    return fs.psum(h @ p["w2"], "tensor") + p["b2"]  # g: all-reduce forward


MLP_SPECS = {"w1": P(None, "tensor"), "b1": P("tensor"), "w2": P("tensor", None), "b2": P()}


def run_megatron() -> dict:
    mesh = fs.Mesh({"data": 2, "tensor": 2})
    p, x = mlp_params()
    sm = fs.shard_map(mlp_local, mesh=mesh, in_specs=(MLP_SPECS, P("data")), out_specs=P("data"),
                      check_rep=True)
    out = sm(p, x)
    # grad outside shard_map (global loss)
    loss = lambda p, x: sm(p, x).pow(2).mean()  # noqa: E731
    g_out = torch.func.grad(loss, argnums=(0, 1))(p, x)
    pg = {k: v.clone().requires_grad_() for k, v in p.items()}
    xg = x.clone().requires_grad_()
    loss(pg, xg).backward()
    g_bwd = ({k: v.grad for k, v in pg.items()}, xg.grad)

    # grad inside shard_map (JAX's rule): the parameters are invariant over data, so their
    # gradients of the per-shard mean come back summed over data by the implicit pvary's
    # transpose; the global mean divides by the data size. x's grad is per data shard and
    # already summed over tensor by the explicit pvary.
    def step(p, x):
        g = torch.func.grad(lambda p, x: mlp_local(p, x).pow(2).mean(), argnums=(0, 1))(p, x)
        n = fs.axis_size("data")
        return {k: v / n for k, v in g[0].items()}, g[1] / n

    sm_in = fs.shard_map(step, mesh=mesh, in_specs=(MLP_SPECS, P("data")),
                         out_specs=(MLP_SPECS, P("data")), check_rep=True)
    g_in = sm_in(p, x)
    return {"out": out, "grad_outside": g_out, "grad_backward": g_bwd, "grad_inside": g_in,
            "manifest": [(e.op, e.axis, e.phase, e.shape, e.bytes_sent) for e in sm_in.collectives(p, x)]}


def attn_inputs(seed=0, B=2, T=8, H=4, Dh=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, H, Dh, generator=g, dtype=DT) for _ in range(3)]


def attention(q, k, v):
    """Causal softmax attention, (B, T, H, Dh) layout."""
    T = q.shape[1]
    s = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1), v)


def ulysses_local(q, k, v):
    """Sequence-sharded input (B, T/sp, H, Dh): all_to_all to head-sharded (B, T, H/sp, Dh),
    full-sequence attention on local heads, all_to_all back."""
    q, k, v = (fs.all_to_all(t, "seq", split_dim=2, concat_dim=1) for t in (q, k, v))
    o = attention(q, k, v)  # (B, T, H/sp, Dh)
    return fs.all_to_all(o, "seq", split_dim=1, concat_dim=2)  # (B, T/sp, H, Dh)


def run_ulysses(sp: int) -> dict:
    mesh = fs.Mesh({"seq": sp})
    q, k, v = attn_inputs()
    spec = P(None, "seq")
    sm = fs.shard_map(ulysses_local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    out = sm(q, k, v)
    w = attn_inputs(seed=1)[0]
    g_out = torch.func.grad(lambda q, k, v: (sm(q, k, v) * w).sum(), argnums=(0, 1, 2))(q, k, v)

    def inner(q, k, v, w):
        return torch.func.grad(lambda q, k, v: (ulysses_local(q, k, v) * w).sum(), argnums=(0, 1, 2))(q, k, v)

    g_in = fs.shard_map(inner, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3)(q, k, v, w)
    return {"out": out, "grad_outside": g_out, "grad_inside": g_in}


# ---------------------------------------------------------------------------------------
# Entry points for run_on_ranks: everything one world size checks, in one spawn.
# ---------------------------------------------------------------------------------------

DIST_MESHES = {
    1: [({"i": 1}, ["i"])],
    2: [({"i": 2}, ["i"]), ({"a": 1, "b": 2}, ["a", ("a", "b")])],
    4: [({"i": 4}, ["i"]), ({"a": 2, "b": 2}, ["a", "b", ("a", "b"), ("b", "a")]),
        ({"a": 2, "b": 1, "c": 2}, ["b", ("b", "c")])],
}


def all_for_world(world: int) -> dict:
    out = {"collectives": {}}
    for axes, axes_list in DIST_MESHES[world]:
        out["collectives"][tuple(axes.items())] = run_collectives(axes, axes_list)
    if world == 4:
        out["megatron"] = run_megatron()
    if world in (2, 4):
        out["ulysses"] = run_ulysses(world)
    return out
