"""visualize_sharding on real ranks (tests/test_visualize.py)."""

from __future__ import annotations

import contextlib
import io

import torch

import fsharded as fs
from fsharded import P


def on_rank() -> dict:
    import torch.distributed as dist

    mesh = fs.Mesh({"data": 2})
    x = torch.zeros(4, 6)  # this rank's shard of an (8, 6) tensor
    view = fs.visualize_sharding(x, P("data"), mesh)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        view.show()
    return {"rank": dist.get_rank(), "text": view.text(), "printed": out.getvalue()}
