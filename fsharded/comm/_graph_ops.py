"""The collectives of a captured graph over the same-host shared-memory transport.

Under ``make_fx`` a group's collective becomes either torch's functional op
(``_c10d_functional``, over the process group's own backend) or, where the group runs over
shared memory, the op ``fsharded::shm_collective``: one op for every kind, calling the
transport's eager function when the graph runs. Inductor keeps the functional ops in the
input graph's order; these ops it sees as ordinary kernels, so each takes and returns a
token (a 0-d tensor) that chains them in program order: every rank runs them in the order
its program issued them, as the eager step does, whatever else the compiler moves.

A capture uses one transport for all its collectives: one that reached both is traced
again with the functional ops only (``functional_only``), so no collective of one kind
can overtake one of the other on one rank and not on another. The call site each collective carries for
the transport's checks (``_shm._site``) is taken while tracing, from the program's own
frames, and passed to the op: the generated code's frames would differ between ranks
whose graphs differ.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from fsharded.comm import _shm

__all__ = ["uses_shm", "collective", "functional_only", "reset", "kinds"]

_GROUPS: dict[str, Any] = {}  # group name -> AxisGroup, registered while tracing
_CHAIN: list = [None, None]  # [the trace's proxy mode, its last token]
_KINDS = ("sum", "max", "all_gather", "reduce_scatter", "all_to_all")


_FUNCTIONAL_ONLY = [False]


@contextlib.contextmanager
def functional_only():
    """Within: every collective traced is torch's functional one (a capture whose groups
    are not all on shared memory is traced again so)."""
    _FUNCTIONAL_ONLY[0] = True
    try:
        yield
    finally:
        _FUNCTIONAL_ONLY[0] = False


def reset() -> None:
    """Forget the last trace's token (after a capture)."""
    _CHAIN[0] = _CHAIN[1] = None


def kinds(gm: torch.fx.GraphModule) -> set[str]:
    """Which transports ``gm``'s collectives use: "shm" and/or "functional"."""
    out = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = str(n.target)
        if name.startswith("fsharded.shm_collective"):
            out.add("shm")
        elif name.startswith("_c10d_functional.") and not name.startswith("_c10d_functional.wait_tensor"):
            out.add("functional")
    return out


def uses_shm(g: Any, dtype: torch.dtype) -> bool:
    """Whether a captured graph runs ``g``'s collectives of ``dtype`` over shared memory
    (decided outside the trace: the first call on a group sets the transport up,
    collectively)."""
    if _FUNCTIONAL_ONLY[0] or not _shm.enabled() or dtype not in _shm._DTYPES:
        return False
    with _disable_current_modes():
        return _shm.comm_for(torch.empty(0, dtype=dtype), g) is not None


def _token() -> Tensor:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    if _CHAIN[0] is not mode or _CHAIN[1] is None:
        _CHAIN[0], _CHAIN[1] = mode, torch.zeros((), dtype=torch.int64)
    return _CHAIN[1]


def collective(kind: str, x: Tensor, g: Any) -> Tensor:
    """``kind`` ("sum", "max", "all_gather", "reduce_scatter", "all_to_all"; dim 0, group
    rank order) of ``x`` over ``g``, as one op of the graph being traced."""
    _GROUPS[g.group_name] = g
    site = _shm._site()
    out, _CHAIN[1] = _op(x.contiguous(), _token(), kind, g.group_name, site, g.size)
    return out


@torch.library.custom_op("fsharded::shm_collective", mutates_args=())
def _op(x: Tensor, token: Tensor, kind: str, group: str, site: int, n: int) -> tuple[Tensor, Tensor]:
    g = _GROUPS.get(group)
    if g is None:
        raise RuntimeError(f"fsharded::shm_collective: group {group!r} is not one this process traced")
    if kind in ("sum", "max"):
        out = x.clone()
        _shm.all_reduce_(out, kind, g, site=site)
    elif kind == "all_gather":
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        _shm.all_gather_into(out, x, g, site=site)
    elif kind == "reduce_scatter":
        out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
        _shm.reduce_scatter_into(out, x, g, site=site)
    elif kind == "all_to_all":
        out = torch.empty_like(x)
        _shm.all_to_all_into(out, x, g, site=site)
    else:
        raise ValueError(f"fsharded::shm_collective: kind {kind!r} is not one of {_KINDS}")
    return out, token + 1


@_op.register_fake
def _fake(x: Tensor, token: Tensor, kind: str, group: str, site: int, n: int) -> tuple[Tensor, Tensor]:
    if kind == "all_gather":
        shape = (n * x.shape[0], *x.shape[1:])
    elif kind == "reduce_scatter":
        shape = (x.shape[0] // n, *x.shape[1:])
    else:
        shape = tuple(x.shape)
    return x.new_empty(shape), torch.empty_like(token)
