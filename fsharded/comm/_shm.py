"""Collectives between CPU ranks on one host through shared memory (``csrc/shm_comm.cpp``).

On a gloo process group whose ranks all run on this host, fsharded's eager all-reduce,
all-gather, reduce-scatter and all-to-all of CPU tensors go through a shared-memory
segment instead of gloo's TCP loopback: each rank copies its part in once and reads the
others' parts directly (for 2 ranks and a few MB, ~1 ms instead of ~8 ms with gloo here). Results are
the same on every rank (every rank reduces in rank order). Everything else (other ops,
tracing under ``make_fx``, NCCL, ranks on several hosts, a C++ compiler missing) stays on
``torch.distributed``.

``FSHARDED_SHM=0`` turns it off (gloo for everything); ``FSHARDED_SHM_SLOT_MB`` sets the
per-rank chunk (default 4 MiB, 8/world MiB from 4 ranks on; the segment is 2 x world x
chunk); ``FSHARDED_SHM_TIMEOUT`` the seconds a rank waits for a live rank that does not
arrive before raising (default: the group's timeout, which is ``initialize(timeout_s=)``'s).
Whether a group uses it is decided once, by all its ranks together, so every rank takes the
same path. A group's collectives run one at a time; ranks that call different collectives
(op, dtype or size), or the same one from different places in the program (a fingerprint
of the innermost calling frames), get an error on every rank, never each other's data. On
torch.distributed's path the same check costs one small all-gather per collective: on by
default for gloo, for NCCL with ``FSHARDED_CHECK_SITES=1``; ``FSHARDED_CHECK_SITES=0``
turns it off everywhere. A rank waiting for one that has exited or
died (its process is watched) raises within ~0.1 s, naming it. After an error, a timeout
or Ctrl-C the group's segment refuses further use (the ranks are out of step). The segment
has no name in ``/dev/shm`` once every rank has it mapped; a rank dying before that leaves
the others to remove it.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
import uuid
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fsharded.comm import _groups, _trace

__all__ = ["all_reduce_", "all_gather_into", "reduce_scatter_into", "all_to_all_into",
           "comm_for", "enabled", "in_use",
           "set_observer", "Done"]

ENV = "FSHARDED_SHM"
_DTYPES = {torch.float32, torch.float64, torch.bfloat16, torch.float16,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}
_COMMS: dict[int, tuple[Any, Any]] = {}  # id(process group) -> (group, ShmComm or None)
_SETUP_LOCK = threading.Lock()
# A forked child must not use its parent's segments (the peers are the parent's peers).
if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_COMMS.clear)
_observer: Callable[[str, torch.Tensor, int], None] | None = None


class Done:
    """A completed ``torch.distributed`` work handle (shared-memory ops finish on return)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def set_observer(fn: Callable[[str, torch.Tensor, int], None] | None) -> None:
    """Call ``fn(op, contributed_tensor, group_size)`` for every shared-memory collective
    (``op`` named as in ``torch.distributed``); for byte accounting in benchmarks."""
    global _observer
    _observer = fn


def forget() -> None:
    """Drop every group's segment (``comm.shutdown``: the groups are being destroyed, and a
    new group could reuse an old one's id)."""
    with _SETUP_LOCK:
        _COMMS.clear()


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@functools.cache
def _module() -> tuple[Any, str]:
    """The extension (or None and why), built once per install under a file lock (see
    ``fsharded.kernels._build``): the first process compiles, the others on this host wait
    for the lock, untimed, then load its build."""
    from fsharded.kernels.cpu_optim import _compile

    return _compile("fsharded_shm_comm", ("shm_comm.cpp",), what="the shared-memory transport",
                    took="~1 min", extra_cflags=["-O3"], extra_ldflags=["-lrt"])


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _timeout(g: Any) -> float:
    """Seconds a rank waits for the others: FSHARDED_SHM_TIMEOUT, else the group's own."""
    if os.environ.get("FSHARDED_SHM_TIMEOUT"):
        return float(os.environ["FSHARDED_SHM_TIMEOUT"])
    try:
        return g.group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - private API; fall back to initialize's timeout
        return _groups.timeout_s()


def _slot_bytes(world: int) -> int:
    """Per-rank chunk: 4 MiB, less on big groups so the segment stays ~16 MiB."""
    default_mb = min(4.0, 8.0 / world)
    text = os.environ.get("FSHARDED_SHM_SLOT_MB", "")
    try:
        mb = float(text) if text else default_mb
    except ValueError:
        warnings.warn(f"fsharded: FSHARDED_SHM_SLOT_MB={text!r} is not a number; using "
                      f"{default_mb:g}", stacklevel=4)
        mb = default_mb
    return max(4096, int(mb * 2**20) // 64 * 64)


def _setup(g: Any) -> Any:
    """Create (group rank 0) or open (the others) the group's segment. Every rank of the
    group takes part and all agree on the outcome (also when FSHARDED_SHM differs between
    them). None: stay on torch.distributed."""
    if g.size == 1 or dist.get_backend(g.group) != "gloo":
        return None
    grank, on = dist.get_rank(g.group), enabled()
    if on:  # every rank builds or loads the extension before the (timed) barrier: on one host
        _module()  # the first compiles while the others wait on its file lock, untimed
    dist.barrier(group=g.group)
    mod, why = _module() if on else (None, "")
    me = (socket.gethostname(), _boot_id(), on, mod is not None, why)
    infos: list = [None] * g.size
    dist.all_gather_object(infos, me, group=g.group)
    if not all(i[2] for i in infos):
        return None  # switched off (FSHARDED_SHM=0) on some rank
    if len({i[:2] for i in infos}) != 1:
        return None  # ranks on several hosts: gloo
    if not all(i[3] for i in infos):
        warnings.warn(f"fsharded: same-host shared-memory collectives unavailable, using gloo "
                      f"({next(i[4] for i in infos if not i[3])})", stacklevel=3)
        return None
    # Group rank 0's name and chunk size for all (the layout must be the same everywhere).
    box = [(f"/fsharded-{os.getpid()}-{uuid.uuid4().hex[:12]}", _slot_bytes(g.size))
           if grank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(g.group, 0), group=g.group)
    name, slot = box[0]
    timeout = _timeout(g)
    comm, err = None, ""
    done = False
    try:
        if grank == 0:
            try:  # pages reserved up front: a full /dev/shm is an error here, not a SIGBUS
                comm = mod.ShmComm(name, grank, g.size, slot, True, timeout)
            except Exception as e:  # noqa: BLE001 - reported below, then gloo
                err = str(e)
        dist.barrier(group=g.group)  # the segment exists (or rank 0 failed)
        if grank != 0:
            try:
                comm = mod.ShmComm(name, grank, g.size, slot, False, timeout)
            except Exception as e:  # noqa: BLE001
                err = str(e)
        errs: list = [None] * g.size
        dist.all_gather_object(errs, err, group=g.group)
        done = True
    finally:
        if comm is not None and grank == 0:
            comm.unlink()  # every rank has it mapped (or gave up): nothing left on exit
        elif not done:  # a rank (perhaps the one that created it) died in the set-up
            _unlink(name)
    if any(errs):
        warnings.warn("fsharded: same-host shared-memory collectives unavailable, using gloo "
                      f"({next(e for e in errs if e)})", stacklevel=3)
        return None
    return comm


_SITE_FRAMES = 8
_SITES: dict[tuple[Any, int], int] = {}


def _checks() -> str:
    """``FSHARDED_CHECK_SITES``: "0" no call-site checks; "auto" (default) on the
    shared-memory transport (free: the fingerprint rides in the round's header) and on
    gloo; "1" on NCCL too (one more small all-gather and a device sync per collective)."""
    v = os.environ.get("FSHARDED_CHECK_SITES", os.environ.get("FSHARDED_SHM_SITES", "auto")).strip().lower()
    return "off" if v in ("0", "false", "off", "no") else "all" if v in ("1", "true", "on", "yes", "all") else "auto"


def _site() -> int:
    """A fingerprint of where the collective was called from: the innermost frames above
    this module (file, function, line), the same on every rank that runs the same code at
    the same place (zlib's CRC, not ``hash``: that differs between processes)."""
    if _checks() == "off":
        return 0
    f = sys._getframe(2)
    while f is not None and f.f_code is _trace.WRAPPER_CODE:  # the timing wrapper, if any
        f = f.f_back
    value = 0
    for _ in range(_SITE_FRAMES):
        if f is None:
            break
        key = (f.f_code, f.f_lineno)
        h = _SITES.get(key)
        if h is None:
            h = _SITES[key] = zlib.crc32(f"{f.f_code.co_filename}:{f.f_code.co_name}:{f.f_lineno}".encode())
        value = (value * 1000003 + h) & 0x7FFF_FFFF_FFFF_FFFF
        f = f.f_back
    return value


_OP_CODES = {"all_reduce(sum)": 1, "all_reduce(max)": 2, "all_gather": 3, "reduce_scatter": 4, "all_to_all": 5}


def _agree(op: str, x: torch.Tensor, g: Any, site: int) -> None:
    """On torch.distributed's path, before the collective: every group rank's (op, dtype,
    size) and call site, gathered (one small all-gather), must be this rank's; else every
    rank raises, as the shared-memory transport does, instead of pairing this collective
    with another one of the same shape (or hanging in one of another shape)."""
    mode = _checks()
    if mode == "off" or g.size == 1 or (mode == "auto" and x.device.type != "cpu"):
        return
    desc = (_OP_CODES[op] << 56) | (_DTYPE_CODES.get(x.dtype, 255) << 48) | x.numel()
    mine = torch.tensor([desc, site], dtype=torch.int64, device=x.device)
    every = torch.empty(2 * g.size, dtype=torch.int64, device=x.device)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(every, mine, group=g.group)
    every = every.view(g.size, 2).tolist()
    me = g.index
    for j, (d, w) in enumerate(every):
        if d != desc:
            raise RuntimeError(
                f"fsharded collectives: rank {g.ranks[me]} called {op} of {x.numel()} elements "
                f"({x.dtype}) while rank {g.ranks[j]} called {_describe(d)}; every rank of a group "
                "must issue the same collectives in the same order")
        if w != site:
            raise RuntimeError(
                f"fsharded collectives: rank {g.ranks[me]} and rank {g.ranks[j]} both called {op} of "
                f"{x.numel()} elements, but from different places in the program (this rank: "
                f"{_caller()}): a rank skipped or added a collective, so the results would be another "
                "collective's; every rank must issue the same collectives in the same order "
                "(FSHARDED_CHECK_SITES=0 turns this check off)")


_DTYPE_CODES = {t: i for i, t in enumerate((torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                            torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                                            torch.bool, torch.complex64, torch.complex128))}


def _describe(desc: int) -> str:
    ops = {v: k for k, v in _OP_CODES.items()}
    dtypes = {v: k for k, v in _DTYPE_CODES.items()}
    return (f"{ops.get(desc >> 56, 'an unknown collective')} of {desc & ((1 << 48) - 1)} elements "
            f"({dtypes.get((desc >> 48) & 0xFF, 'another dtype')})")


def _caller() -> str:
    """The innermost frame outside fsharded's transport, as file:line (function)."""
    f = sys._getframe(1)
    here = os.path.dirname(os.path.abspath(__file__))
    while f is not None and os.path.dirname(os.path.abspath(f.f_code.co_filename)) == here:
        f = f.f_back
    return "unknown" if f is None else f"{f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})"


def _unlink(name: str) -> None:
    """Remove a segment's name (a rank that created it may have died before doing so)."""
    try:
        import _posixshmem

        _posixshmem.shm_unlink(name)
    except (ImportError, OSError):
        pass


def in_use() -> bool:
    """Whether any group of this process runs its collectives over shared memory."""
    return any(c is not None for _, c in _COMMS.values())


def comm_for(x: torch.Tensor, g: Any) -> Any:
    """The group's shared-memory communicator when ``x`` can use it, else None. The first
    call on a group is collective over the group (all its ranks decide together)."""
    if (x.device.type != "cpu" or x.dtype not in _DTYPES or type(x) is not torch.Tensor
            or x.layout != torch.strided or torch._C._functorch.is_functorch_wrapped_tensor(x)):
        return None  # torch.func's wrappers and tensor subclasses: torch.distributed's path
    # By the group object (held, so its id is not reused by a later group).
    entry = _COMMS.get(id(g.group))
    if entry is None:
        with _SETUP_LOCK:
            entry = _COMMS.get(id(g.group))
            if entry is None:
                entry = _COMMS[id(g.group)] = (g.group, _setup(g))
    return entry[1]


@_trace.traced("all_reduce", 0)
def all_reduce_(y: torch.Tensor, op: str, g: Any, *, divisor: int = 1) -> None:
    """In place over the group: ``op`` "sum" or "max" (``y`` contiguous); a sum is then
    divided by ``divisor`` (floating ``y``), rounded as ``psum(y) / divisor`` is."""
    if divisor != 1 and not y.is_floating_point():
        raise ValueError(f"all_reduce_: a divisor needs a floating-point tensor, not {y.dtype}")
    c, site = comm_for(y, g), _site()
    if c is not None:
        if _observer is not None:
            _observer("all_reduce", y, g.size)
        c.all_reduce_(y, op == "max", float(divisor) if op == "sum" else 1.0, site)
        torch.autograd.graph.increment_version(y)  # written in place, as c10d's op would
        return
    _agree(f"all_reduce({op})", y, g, site)
    if y.dtype in _WIDEN:  # gloo and NCCL have no 16-bit ints: reduced as int32, which wraps alike
        wide = y.to(_WIDEN[y.dtype])
        dist.all_reduce(wide, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=g.group)
        y.copy_(wide)
        return
    dist.all_reduce(y, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=g.group)
    if op == "sum" and divisor != 1:
        y.div_(divisor)


@_trace.traced("all_gather", 1)
def all_gather_into(out: torch.Tensor, x: torch.Tensor, g: Any, *, async_op: bool = False) -> Any:
    """``out`` (n * numel) <- every group rank's ``x`` in group-rank order (both contiguous);
    a work handle when ``async_op`` (shared memory: already complete)."""
    c, site = comm_for(x, g), _site()
    if c is not None:
        if _observer is not None:
            _observer("all_gather_into_tensor", x, g.size)
        c.all_gather(x, out, site)
        return Done() if async_op else None
    _agree("all_gather", x, g, site)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(_bytes(out), _bytes(x), group=g.group, async_op=async_op)


@_trace.traced("reduce_scatter", 1)
def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, g: Any, *, async_op: bool = False) -> Any:
    """``out`` <- the sum over the group of block ``group rank`` of ``x`` (n blocks)."""
    c, site = comm_for(x, g), _site()
    if c is not None:
        if _observer is not None:
            _observer("reduce_scatter_tensor", x, g.size)
        c.reduce_scatter(x, out, site)
        return Done() if async_op else None
    _agree("reduce_scatter", x, g, site)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if x.dtype in _WIDEN:
        wide = out.new_empty(out.shape, dtype=_WIDEN[x.dtype])
        scatter(wide.view(-1), x.view(-1).to(wide.dtype), group=g.group)
        out.copy_(wide)
        return Done() if async_op else None
    return scatter(out.view(-1), x.view(-1), group=g.group, async_op=async_op)


@_trace.traced("all_to_all", 1)
def all_to_all_into(out: torch.Tensor, x: torch.Tensor, g: Any) -> None:
    """``out`` block j <- block ``group rank`` of group rank j's ``x`` (n equal blocks)."""
    if x.dim() == 0 or x.shape[0] % g.size:
        raise ValueError(f"all_to_all: dim 0 of shape {tuple(x.shape)} does not split into "
                         f"{g.size} equal blocks")
    c, site = comm_for(x, g), _site()
    if c is not None:
        if _observer is not None:
            _observer("all_to_all_single", x, g.size)
        c.all_to_all(x, out, site)
        return
    _agree("all_to_all", x, g, site)
    dist.all_to_all_single(_bytes(out), _bytes(x), group=g.group)


_WIDEN = {torch.int16: torch.int32}  # what torch.distributed's backends cannot reduce


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """Flat, and as bytes for a dtype the backends cannot move (c10d checks dim 0 only,
    and the contract counts elements, so a flat view is the same blocks)."""
    flat = x.view(-1)
    return flat.view(torch.uint8) if x.dtype in _WIDEN else flat
