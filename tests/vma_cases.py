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
