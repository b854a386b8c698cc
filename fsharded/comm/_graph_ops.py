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
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from fsharded.comm import _shm

__all__ = ["uses_shm", "collective", "functional_only", "reset", "kinds", "tracing", "send", "recv", "finish",
           "end"]

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
    """Which transports ``gm``'s collectives use: "shm", "functional" and/or "p2p" (the
    pipeline's sends and receives)."""
    out = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = str(n.target)
        if name.startswith("fsharded.shm_collective"):
            out.add("shm")
        elif name.startswith("fsharded.p2p_"):
            out.add("p2p")
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


def tracing() -> bool:
    """Whether ops are being traced into a graph (``make_fx``) now."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None


def end() -> Tensor | None:
    """The current trace's last token (None if it chained no op): a capture returns it
    with its outputs, so no op of the chain is dead code, a send's included."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return _CHAIN[1] if _CHAIN[0] is get_proxy_mode() else None


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


# -- point-to-point (the pipeline's values between stages) ---------------------------------
#
# A send copies its value and posts it (``isend``): the graph may reuse the value's buffer
# once the op returns, and the copy is held until the send is known done: at the receive
# named as its follower (the gradient coming back for an activation sent means the
# activation arrived), or at ``finish``. A receive blocks until its value is there. Each
# takes the chain's token, so every rank posts and waits in its program's order, which
# the eager transport runs without deadlock; a graph sends and receives what its eager
# step does, shapes included (learnt while tracing, from the headers the eager transport
# sends).

_P2P: dict[str, Any] = {}  # group name -> process group, registered while tracing
_INFLIGHT: dict[tuple, tuple] = {}  # (group, peer, tag) -> (work, the copy it sends)


def _name(group: Any) -> str:
    name = group.group_name
    _P2P[name] = group
    return name


def send(x: Tensor, group: Any, peer: int, tag: int) -> None:
    """Send ``x`` to global rank ``peer`` of ``group`` under ``tag``, as an op of the
    graph being traced."""
    _CHAIN[1] = _send(x.contiguous(), _token(), _name(group), peer, tag)


def recv(shape: tuple, dtype: torch.dtype, group: Any, peer: int, tag: int, after: int = -1) -> Tensor:
    """The value global rank ``peer`` sends under ``tag`` (of ``shape`` and ``dtype``), as
    an op of the graph being traced; ``after``: the tag of a send of ours to ``peer`` this
    value follows (its copy is released here), -1 for none."""
    out, _CHAIN[1] = _recv(_token(), list(shape), dtype, _name(group), peer, tag, after)
    return out


def finish(group: Any) -> None:
    """Wait for every send of the graph over ``group`` still unfinished."""
    _CHAIN[1] = _finish(_token(), _name(group))


def _group(name: str) -> Any:
    g = _P2P.get(name)
    if g is None:
        raise RuntimeError(f"fsharded::p2p: group {name!r} is not one this process traced")
    return g


@torch.library.custom_op("fsharded::p2p_send", mutates_args=())
def _send(x: Tensor, token: Tensor, group: str, peer: int, tag: int) -> Tensor:
    buf = x.clone(memory_format=torch.contiguous_format)
    _INFLIGHT[(group, peer, tag)] = (dist.isend(buf, peer, group=_group(group), tag=tag), buf)
    return token + 1


@_send.register_fake
def _send_fake(x: Tensor, token: Tensor, group: str, peer: int, tag: int) -> Tensor:
    return torch.empty_like(token)


@torch.library.custom_op("fsharded::p2p_recv", mutates_args=())
def _recv(token: Tensor, shape: list[int], dtype: torch.dtype, group: str, peer: int, tag: int,
          after: int) -> tuple[Tensor, Tensor]:
    sent = _INFLIGHT.pop((group, peer, after), None) if after >= 0 else None
    if sent is not None:
        sent[0].wait()
    out = torch.empty(shape, dtype=dtype)
    dist.recv(out, peer, group=_group(group), tag=tag)
    return out, token + 1


@_recv.register_fake
def _recv_fake(token: Tensor, shape: list[int], dtype: torch.dtype, group: str, peer: int, tag: int,
               after: int) -> tuple[Tensor, Tensor]:
    return torch.empty(shape, dtype=dtype), torch.empty_like(token)


@torch.library.custom_op("fsharded::p2p_finish", mutates_args=())
def _finish(token: Tensor, group: str) -> Tensor:
    for k in [k for k in _INFLIGHT if k[0] == group]:
        _INFLIGHT.pop(k)[0].wait()
    return token + 1


@_finish.register_fake
def _finish_fake(token: Tensor, group: str) -> Tensor:
    return torch.empty_like(token)
