"""In-place writes inside shard_map (run on gloo ranks by test_shard_map)."""

from __future__ import annotations

import torch

import fsharded as fs
from fsharded import P
from fsharded.spmd.collectives import psum, varying_axes


def writes_through_views(how: str) -> dict:
    """A buffer made like an input that varies over y, written row by row (through views
    of it, or with ``out=``) with values that vary over x too, then summed over x: the
    buffer's type must gain x, or the psum would take it for n equal copies."""
    types = {}

    def body(h, w):
        out = h.new_empty(2, 2, 2)  # typed as h: varies over y
        for i in range(2):
            if how == "out":
                torch.mm(h[i], w[i], out=out[i])
            elif how == "copy":
                out[i].copy_(h[i] @ w[i])
            else:  # a view taken before the writes, read after them
                early = out[i]
                out[i] = h[i] @ w[i]
                types[f"early{i}"] = varying_axes(early)
        types["out"] = varying_axes(out)
        return psum(out, "x")

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(4, 2, 2, generator=g), torch.randn(4, 2, 4, generator=g)
    sm = fs.shard_map(body, mesh=fs.Mesh({"y": 2, "x": 2}), in_specs=(P("y"), P("y", None, "x")), out_specs=P("y"))
    want = torch.stack([h[i] @ w[i, :, :2] + h[i] @ w[i, :, 2:] for i in range(4)])
    return {"got": sm(h, w), "want": want, "types": types}


# Meshes with an axis of size 1 in each position: a size-1 axis is typed as at any size.
SIZE_ONE_MESHES = {
    2: [{"a": 1, "b": 2}, {"a": 2, "b": 1}, {"a": 1, "b": 2, "c": 1}],
    4: [{"a": 2, "b": 1, "c": 2}, {"a": 1, "b": 4}, {"a": 4, "b": 1}],
}


def _size_one_bodies(axis: str):
    """(name, body(x, w) -> y): x varies over every mesh axis, w over none."""
    return [
        ("psum", lambda x, w: fs.psum(x, axis)),
        ("pmean", lambda x, w: fs.pmean(x.sum() * w, axis)),
        ("pmax", lambda x, w: fs.pmax(x, axis)),
        ("pmin", lambda x, w: fs.pmin(x, axis)),
        ("psum_invariant", lambda x, w: fs.psum(w, axis)),
        ("all_gather", lambda x, w: fs.all_gather(x, axis)),
        ("all_gather_invariant", lambda x, w: fs.all_gather_invariant(x, axis)),
        ("psum_scatter", lambda x, w: fs.psum_scatter(x, axis)),
        ("all_to_all", lambda x, w: fs.all_to_all(x, axis, split_dim=0, concat_dim=0)),
        ("ppermute", lambda x, w: fs.ppermute(
            x, axis, [(i, (i + 1) % fs.axis_size(axis)) for i in range(fs.axis_size(axis))])),
        ("pvary", lambda x, w: fs.pvary(w, axis)),
        ("axis_index", lambda x, w: fs.axis_index(axis)),
    ]


def _reduce_each(x, names):
    for a in names:
        x = fs.pmean(x, a)
    return x


def _whole_mesh_bodies(names: tuple):
    """(name, body): reductions over every axis, all at once and one at a time, whose
    results are invariant over the whole mesh (size-1 axes included)."""
    return [
        ("psum_all", lambda x, w: fs.psum(x, names)),
        ("pmean_each", lambda x, w: _reduce_each(x.sum() * w, names)),
        ("gather_all", lambda x, w: fs.all_gather_invariant(x, names)),
        ("pmax_all", lambda x, w: fs.pmax(x, names)),
    ]


def size_one_types(mesh_axes: dict) -> dict:
    """For every collective over every axis of ``mesh_axes``: the varying axes of its
    result, of a product with a Python number and of a sum with an invariant value (the
    plain ops after it); and the same for reductions over the whole mesh."""
    mesh = fs.Mesh(mesh_axes)
    names = mesh.axis_names
    n = mesh.size
    x = torch.arange(4.0 * n * n).reshape(4 * n, n) + 1.0
    w = torch.tensor(2.0)
    types = {}
    cases = [((axis, name), body) for axis in names for name, body in _size_one_bodies(axis)]
    cases += [(("*", name), body) for name, body in _whole_mesh_bodies(names)]
    for key, body in cases:
        def f(x, w, body=body, key=key):
            y = body(x, w)
            z = 0.1 * y
            u = y + w
            types[key] = (varying_axes(y), varying_axes(z), varying_axes(u))
            return fs.psum(z, varying_axes(z)) if varying_axes(z) else z
        fs.shard_map(f, mesh=mesh, in_specs=(P(names), P()), out_specs=P())(x, w)
    return types


def expected_size_one_types(mesh_axes: dict) -> dict:
    """JAX's rules, written out: reductions and all_gather_invariant remove the axis, pvary
    and axis_index add it, the rest keep the operand's axes."""
    names = tuple(mesh_axes)
    out = {}
    for axis in names:
        rest = tuple(a for a in names if a != axis)
        for name, _ in _size_one_bodies(axis):
            if name in ("psum", "pmean", "pmax", "pmin", "all_gather_invariant"):
                t = rest
            elif name == "psum_invariant":
                t = ()
            elif name in ("pvary", "axis_index"):
                t = (axis,)
            else:
                t = names
            out[(axis, name)] = (t, t, t)
    for name, _ in _whole_mesh_bodies(names):
        out[("*", name)] = ((), (), ())
    return out


def size_one_types_for_world(world: int) -> dict:
    """``size_one_types`` of every mesh of ``world`` devices (one spawn for all)."""
    return {tuple(m.items()): size_one_types(m) for m in SIZE_ONE_MESHES[world]}
