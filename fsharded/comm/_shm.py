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
of fsharded's innermost frames and of the program's line that called it, ``_site``), get
an error on every rank naming each rank's call and line, never each other's data. On
torch.distributed's path the same check costs one small all-gather per collective: on by
default for gloo, for NCCL with ``FSHARDED_CHECK_SITES=1``; ``FSHARDED_CHECK_SITES=0``
turns it off everywhere. A ppermute (torch.distributed's point-to-point calls on every
path) is announced the same way, with its shape and permutation. A rank waiting for one
that has exited or died (its process is watched) raises within ~0.1 s, naming it by its
global rank and its place in the group. After an error, a timeout or Ctrl-C the group's
segment refuses further use (the ranks are out of step). The segment has no name in
``/dev/shm`` once every rank has it mapped; a rank dying before that leaves the others to
remove it.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import sysconfig
import threading
import time
import uuid
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.distributed as dist

from fsharded import _cext
from fsharded.comm import _groups, _peers, _trace

__all__ = ["all_reduce_", "all_gather_into", "reduce_scatter_into", "all_to_all_into", "check_permute", "gather_check",
           "transport_error", "comm_for", "enabled", "in_use",
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
        _BROKEN.clear()
        _MISMATCHES.clear()
        _MODE.clear()


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@functools.cache
def _module() -> tuple[Any, str]:
    """The extension (or None and why), built once per install under a file lock (see
    ``fsharded._cext``): the first process compiles, the others on this host wait
    for the lock, untimed, then load its build."""
    return _cext.build("fsharded_shm_comm", ("shm_comm.cpp",), root=_cext.CSRC, what="the shared-memory transport",
                       took="~15 s", extra_cflags=["-O3"], extra_ldflags=["-lrt"])


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
    me = (socket.gethostname(), _peers.boot_id(), on, mod is not None, why, os.getpid(), _checks())
    infos: list = [None] * g.size
    dist.all_gather_object(infos, me, group=g.group)
    if len({i[6] for i in infos}) > 1:  # one rank would gather before each collective, another not
        raise RuntimeError("fsharded collectives: FSHARDED_CHECK_SITES differs between the ranks ("
                           + ", ".join(f"rank {dist.get_global_rank(g.group, j)}: {i[6]}" for j, i in enumerate(infos))
                           + "); set it alike on every rank")
    # Which process each rank is (also where initialize did not record them): a rank waiting
    # on torch.distributed's path can then tell a peer that exited from one that is late.
    _peers.record([dist.get_global_rank(g.group, i) for i in range(g.size)], [(i[0], i[1], i[5]) for i in infos])
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


_SITE_FRAMES = 8  # innermost frames in a call-site fingerprint (fsharded's path to the transport)
_PROGRAM_FRAMES = 2  # and the program's first frames outside the libraries: its line, and its caller's
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, optree)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # torch, optree, fsharded
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
# id(code) -> (code, whether it is the program's, {line: crc}): the code object is held, so
# its id is not reused while it is here.
_CODES: dict[int, tuple[Any, bool, dict[int, int]]] = {}


_MODE: list[str] = []  # FSHARDED_CHECK_SITES, read once (again after ``forget``: comm.shutdown)


def _checks() -> str:
    """``FSHARDED_CHECK_SITES``: "0" no call-site checks; "auto" (default) on the
    shared-memory transport (free: the fingerprint rides in the round's header) and on
    gloo; "1" on NCCL too (one more small all-gather and a device sync per collective).
    Read at the first collective of a process group (reading the environment costs more
    than the rest of the fingerprint)."""
    if _MODE:
        return _MODE[0]
    v = os.environ.get("FSHARDED_CHECK_SITES", os.environ.get("FSHARDED_SHM_SITES", "auto")).strip().lower()
    _MODE.append("off" if v in ("0", "false", "off", "no") else "all" if v in ("1", "true", "on", "yes", "all")
                 else "auto")
    return _MODE[0]


def _code_entry(code: Any) -> tuple[Any, bool, dict[int, int]]:
    name = code.co_filename
    library = (name.startswith("<frozen") or name.startswith(_LIBRARY_DIRS)
               or (name.startswith(_STDLIB) and "-packages" + os.sep not in name[len(_STDLIB):]))
    if len(_CODES) >= 65536:  # code made on the fly (exec, eval) must not grow it for ever
        _CODES.clear()
    entry = _CODES[id(code)] = (code, not library, {})
    return entry


def _site() -> int:
    """A fingerprint of where the collective was called from, the same on every rank that
    runs the same code at the same place: the innermost frames above this module (file,
    function, line; how fsharded reached the transport), and the program's first frames
    outside torch, optree, fsharded and the standard library (the line of the user's code
    that called fsharded, and its caller), wherever they are on the stack — so two
    collectives of the same shape issued from two lines of the program differ even when
    fsharded's own path to them is the same. zlib's CRC of the file's name, function and
    line, not ``hash`` (that differs between processes), computed once per instruction
    (``f_lasti``, cheaper to read than ``f_lineno``); per collective what remains is a
    walk up the stack, one dict look-up per frame."""
    if (_MODE[0] if _MODE else _checks()) == "off":
        return 0
    f = sys._getframe(2)
    while f is not None and f.f_code is _trace.WRAPPER_CODE:  # the timing wrapper, if any
        f = f.f_back
    get = _CODES.get
    value = inner = program = 0
    while f is not None:
        code = f.f_code
        entry = get(id(code))
        if entry is None or entry[0] is not code:
            entry = _code_entry(code)
        elif inner >= _SITE_FRAMES and not entry[1]:  # a library frame above the innermost: skipped
            f = f.f_back
            continue
        at = f.f_lasti
        h = entry[2].get(at)
        if h is None:
            # The file's name, not its path: the same program may sit elsewhere on another host.
            h = entry[2][at] = zlib.crc32(f"{os.path.basename(code.co_filename)}:{code.co_name}:"
                                          f"{f.f_lineno}".encode())
        if inner < _SITE_FRAMES or entry[1]:
            value = (value * 1000003 + h) & 0x7FFF_FFFF_FFFF_FFFF
            inner += 1
            if entry[1]:
                program += 1
                if program == _PROGRAM_FRAMES:
                    break
        f = f.f_back
    return value


def _caller() -> str:
    """The program's lines that led to this collective (the first two frames outside
    torch, optree, fsharded and the standard library, which the fingerprint covers), as
    file:line (function), the innermost first."""
    f = sys._getframe(1)
    found = []
    while f is not None and len(found) < 2:
        entry = _CODES.get(id(f.f_code))
        if entry is None or entry[0] is not f.f_code:
            entry = _code_entry(f.f_code)
        if entry[1]:
            found.append(f"{f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})")
        f = f.f_back
    return ", called from ".join(found) if found else "a line inside fsharded"


# Operation codes, as csrc/shm_comm.cpp numbers them; dtypes as c10's ScalarType does (the
# transport's round headers carry those), so one description serves both paths.
_OP_CODES = {"all_reduce(sum)": 1, "all_reduce(max)": 2, "all_gather": 3, "reduce_scatter": 4, "all_to_all": 5,
             "barrier": 6, "ppermute": 7}
_DTYPE_CODES = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
                torch.float32: 6, torch.float64: 7, torch.complex64: 9, torch.complex128: 10, torch.bool: 11,
                torch.bfloat16: 15}


def _desc(op: str, x: torch.Tensor) -> int:
    return (_OP_CODES[op] << 56) | (_DTYPE_CODES.get(x.dtype, 255) << 48) | (x.numel() & ((1 << 48) - 1))


_ANNOUNCED = 0x80 << 56  # in a shared-memory round's description: not the op, its announcement


def _describe(desc: int) -> str:
    ops = {v: k for k, v in _OP_CODES.items()}
    dtypes = {v: k for k, v in _DTYPE_CODES.items()}
    return (f"{ops.get((desc >> 56) & 0x7F, 'an unknown collective')} of {desc & ((1 << 48) - 1)} elements "
            f"({dtypes.get((desc >> 48) & 0xFF, 'another dtype')})"
            + (" (through torch.distributed)" if desc & _ANNOUNCED else ""))


# -- naming ranks -------------------------------------------------------------------------------


def _global(g: Any, j: int) -> int:
    """The global rank of group rank ``j`` (group ranks follow the global ones' order)."""
    return sorted(g.ranks)[j]


def _who(g: Any, rank: int) -> str:
    """Global ``rank``, with its index along the group's axes when that differs from it
    (``rank 3 (data index 1 of the group ranks [1, 3])``)."""
    if g.ranks == tuple(range(len(g.ranks))) and dist.get_world_size() == len(g.ranks):
        return f"rank {rank}"  # the group is the world, in order: the index is the rank
    return _peers.label(rank, g.axes, g.ranks)


def _me(g: Any) -> str:
    return _who(g, g.ranks[g.index])


def _others(g: Any) -> list[int]:
    return [r for r in g.ranks if r != g.ranks[g.index]]


# -- the check that every rank of a group does the same ------------------------------------------

_MISMATCHES: dict[str, int] = {}  # group name -> mismatches seen (names the sideband's keys)


def _details(g: Any, mine: str) -> dict[int, str]:
    """After a mismatch every rank of the group has seen (all raise at the same round):
    what each rank was doing, as text, exchanged through the default store (not the
    process group, which may be unusable now), waiting at most a few seconds. Ranks whose
    text did not come are left out."""
    n = _MISMATCHES[g.group_name] = _MISMATCHES.get(g.group_name, 0) + 1
    try:
        import datetime

        store = dist.distributed_c10d._get_default_store()
        key = f"fsharded/mismatch/{g.group_name}/{n}/"
        store.set(key + str(g.ranks[g.index]), mine)
        keys = [key + str(r) for r in g.ranks]
        store.wait(keys, datetime.timedelta(seconds=5))
        return {r: store.get(k).decode() for r, k in zip(g.ranks, keys)}
    except Exception:  # noqa: BLE001 - the details only improve the message
        return {g.ranks[g.index]: mine}


def _doing(op: str, x: torch.Tensor, extra: str = "") -> str:
    return f"{op} of shape {tuple(x.shape)} ({x.dtype}){extra} at {_caller()}"


def _mismatch(g: Any, op: str, x: torch.Tensor, mine: tuple[int, int], theirs: tuple[int, int], j_rank: int,
              extra: str = "") -> RuntimeError:
    """The error every rank of the group raises when group member ``j_rank`` announced
    ``theirs`` (description, site) for the round where this rank announced ``mine``."""
    seen = _details(g, _doing(op, x, extra))
    who, me = _who(g, j_rank), _me(g)
    lines = "".join(f"\n  {_who(g, r)}: {seen[r]}" for r in g.ranks if r in seen)
    if mine[0] != theirs[0]:
        head = (f"fsharded collectives: {me} called {_describe(mine[0])} while {who} called "
                f"{_describe(theirs[0])}; every rank of a group must issue the same collectives in the same order")
    elif mine[1] != theirs[1]:
        head = (f"fsharded collectives: {me} and {who} both called {_describe(mine[0]).split(' (')[0]}, but from "
                f"different places in the program: a rank skipped or added a collective, so the results would be "
                f"another collective's; every rank must issue the same collectives in the same order")
    else:
        head = (f"fsharded collectives: {me} and {who} both called {_describe(mine[0])}, with different "
                f"arguments; every rank must pass the same shapes and permutation")
    return RuntimeError(f"{head}. What each rank called (over {_peers.axes_name(g.axes)}):{lines}\n"
                        "Look for control flow on the rank or on data that differs between ranks "
                        "(FSHARDED_CHECK_SITES=0 turns the call-site check off)")


def _agree(op: str, x: torch.Tensor, g: Any, site: int, extra: tuple[int, ...] = (), shown: str = "") -> None:
    """Before a collective that does not carry its own check (torch.distributed's path, and
    ppermute everywhere): every group rank's (op, dtype, size), call site and ``extra``
    words, gathered (one small all-gather, over shared memory where the group has it),
    must be this rank's; else every rank raises, as the shared-memory transport does,
    instead of pairing this collective with another one of the same shape (or hanging in
    one of another shape). ``shown``: the arguments ``extra`` stands for, for the message."""
    mode = _checks()
    if mode == "off" or g.size == 1 or (mode == "auto" and x.device.type != "cpu"):
        return
    desc = _desc(op, x)
    mine = torch.tensor([desc, site, *extra], dtype=torch.int64, device=x.device)
    k = mine.numel()
    every = torch.empty(k * g.size, dtype=torch.int64, device=x.device)
    c = comm_for(mine, g)
    if c is not None:  # the round's header carries (op, size, site): the shared memory checks those
        try:  # (flagged: a rank running the op itself over shared memory does not match it)
            c.all_gather(mine, every, site, desc | _ANNOUNCED)
        except RuntimeError as e:
            raise _shm_error(c, g, op, x, e, shown) from None
    else:
        t0 = time.monotonic()
        try:
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(every, mine, group=g.group)
        except RuntimeError as e:
            raise transport_error(g, op, e, t0) from None
    rows = every.view(g.size, k).tolist()
    me = rows[g.to_group[g.index]]
    for j, row in enumerate(rows):
        if row != me:
            raise _mismatch(g, op, x, (me[0], me[1]), (row[0], row[1]), _global(g, j), shown)


# -- errors ---------------------------------------------------------------------------------------

_BROKEN: dict[int, str] = {}  # id(ShmComm) -> its first failure's message
_EXITED, _TIMEOUT, _OTHER_OP, _OTHER_SITE = 3, 4, 1, 2  # csrc/shm_comm.cpp's failure kinds


def _shm_error(c: Any, g: Any, op: str, x: torch.Tensor, e: RuntimeError, shown: str = "") -> RuntimeError:
    """The transport's error, with ranks named globally and the program's line."""
    first = _BROKEN.get(id(c))
    if first is not None:  # refused: an earlier collective failed
        return RuntimeError(f"fsharded collectives: {op} at {_caller()} on {_me(g)}: an earlier collective of "
                            f"this group failed ({first.splitlines()[0]}); the ranks are out of step, start them again")
    kind, j, pid, waited, their_desc, their_site, my_desc, my_site, rnd, what = c.failure()
    if kind == 0:
        return e  # not a failure of the ranks (a bad argument)
    peer = _who(g, _global(g, j))
    if kind == _EXITED:
        err = RuntimeError(
            f"fsharded shared-memory collectives: {peer} (pid {pid}) exited or died while {_me(g)} waited for "
            f"it to {what} {op} at {_caller()} (round {rnd}, after {waited:.1f} s); restart the ranks (from the "
            "last checkpoint)")
    elif kind == _TIMEOUT:
        err = RuntimeError(
            f"fsharded shared-memory collectives: {_me(g)} waited {waited:.0f} s (the timeout) for {peer} to "
            f"{what} {op} at {_caller()} (round {rnd}); {peer} is alive but did not arrive: it is stuck, or "
            "running other collectives (initialize(timeout_s=...) or FSHARDED_SHM_TIMEOUT sets the timeout; "
            "FSHARDED_SHM=0 uses gloo's own transport)")
    elif kind in (_OTHER_OP, _OTHER_SITE):
        if not (my_desc ^ their_desc) & _ANNOUNCED:  # both announced: nothing to tell apart
            my_desc, their_desc = my_desc & ~_ANNOUNCED, their_desc & ~_ANNOUNCED
        err = _mismatch(g, op, x, (my_desc, my_site), (their_desc, their_site), _global(g, j), shown)
    else:
        return e
    _BROKEN[id(c)] = str(err)
    return err


def transport_error(g: Any, op: str, e: BaseException, t0: float) -> RuntimeError:
    """torch.distributed's error in ``op`` over group ``g`` (started at ``t0``), with the
    ranks that exited or died named globally (found from their processes, on this host),
    or the timeout said as one."""
    gone = _peers.exited_among(_others(g), settle_s=1.0)
    waited = time.monotonic() - t0
    cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if gone:
        names = ", ".join(f"{_who(g, r)} (pid {pid})" for r, pid in gone)
        return RuntimeError(
            f"fsharded collectives: {names} exited or died while {_me(g)} waited for it in {op} at {_caller()} "
            f"(after {waited:.1f} s; torch.distributed: {cause}); restart the ranks (from the last checkpoint)")
    if "timed out" in cause.lower() or "timeout" in cause.lower():
        others = ", ".join(_who(g, r) for r in _others(g))
        return RuntimeError(
            f"fsharded collectives: {_me(g)} waited {waited:.0f} s (the timeout) in {op} at {_caller()} for "
            f"{others}: alive, but {'it' if len(_others(g)) == 1 else 'one of them'} did not arrive: stuck, or "
            f"running other collectives (initialize(timeout_s=...) sets the timeout; torch.distributed: {cause})")
    return RuntimeError(f"fsharded collectives: {op} at {_caller()} on {_me(g)} failed: {e}")


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
    call on a group is collective over the group (all its ranks decide together).

    ``x`` is a plain tensor: the collectives above hand a torch.func wrapper to their
    ``autograd.Function``, whose forward sees the tensor beneath, and the step's buckets and
    ZeRO-3 gathers come here only from plain autograd on real ranks."""
    if (x.device.type != "cpu" or x.dtype not in _DTYPES or type(x) is not torch.Tensor
            or x.layout != torch.strided):
        return None  # tensor subclasses (fake tensors among them): torch.distributed's path
    # By the group object (held, so its id is not reused by a later group).
    entry = _COMMS.get(id(g.group))
    if entry is None:
        with _SETUP_LOCK:
            entry = _COMMS.get(id(g.group))
            if entry is None:
                entry = _COMMS[id(g.group)] = (g.group, _setup(g))
    return entry[1]


@_trace.traced("all_reduce", 0)
def all_reduce_(y: torch.Tensor, op: str, g: Any, *, divisor: int = 1, site: int | None = None) -> None:
    """In place over the group: ``op`` "sum" or "max" (``y`` contiguous); a sum is then
    divided by ``divisor`` (floating ``y``), rounded as ``psum(y) / divisor`` is."""
    if divisor != 1 and not y.is_floating_point():
        raise ValueError(f"all_reduce_: a divisor needs a floating-point tensor, not {y.dtype}")
    c, site = comm_for(y, g), (_site() if site is None else site)
    name = f"all_reduce({op})"
    if c is not None:
        if _observer is not None:
            _observer("all_reduce", y, g.size)
        try:
            c.all_reduce_(y, op == "max", float(divisor) if op == "sum" else 1.0, site)
        except RuntimeError as e:
            raise _shm_error(c, g, name, y, e) from None
        torch.autograd.graph.increment_version(y)  # written in place, as c10d's op would
        return
    _agree(name, y, g, site)
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    t0 = time.monotonic()
    try:
        # gloo and NCCL have no 16-bit ints: reduced as int32, which wraps alike
        t = y.to(_WIDEN[y.dtype]) if y.dtype in _WIDEN else y
        if t.device.type == "cpu" and dist.get_backend(g.group) == "nccl":
            # A host value on GPU ranks (the norm of gradients streamed to the host for an
            # offloaded update): NCCL reduces device memory, so it goes there and back.
            t = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(t, op=reduce_op, group=g.group)
        if t is not y:
            y.copy_(t)
    except RuntimeError as e:
        raise transport_error(g, name, e, t0) from None
    if op == "sum" and divisor != 1 and y.is_floating_point():
        y.div_(divisor)


@_trace.traced("all_gather", 1)
def all_gather_into(out: torch.Tensor, x: torch.Tensor, g: Any, *, async_op: bool = False, site: int | None = None) -> Any:
    """``out`` (n * numel) <- every group rank's ``x`` in group-rank order (both contiguous);
    a work handle when ``async_op`` (shared memory: already complete)."""
    c, site = comm_for(x, g), (_site() if site is None else site)
    if c is not None:
        if _observer is not None:
            _observer("all_gather_into_tensor", x, g.size)
        try:
            c.all_gather(x, out, site)
        except RuntimeError as e:
            raise _shm_error(c, g, "all_gather", x, e) from None
        return Done() if async_op else None
    _agree("all_gather", x, g, site)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    t0 = time.monotonic()
    try:
        return gather(_bytes(out), _bytes(x), group=g.group, async_op=async_op)
    except RuntimeError as e:
        raise transport_error(g, "all_gather", e, t0) from None


@_trace.traced("reduce_scatter", 1)
def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, g: Any, *, async_op: bool = False, site: int | None = None) -> Any:
    """``out`` <- the sum over the group of block ``group rank`` of ``x`` (n blocks)."""
    c, site = comm_for(x, g), (_site() if site is None else site)
    if c is not None:
        if _observer is not None:
            _observer("reduce_scatter_tensor", x, g.size)
        try:
            c.reduce_scatter(x, out, site)
        except RuntimeError as e:
            raise _shm_error(c, g, "reduce_scatter", x, e) from None
        return Done() if async_op else None
    _agree("reduce_scatter", x, g, site)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    t0 = time.monotonic()
    try:
        if x.dtype in _WIDEN:
            wide = out.new_empty(out.shape, dtype=_WIDEN[x.dtype])
            scatter(wide.view(-1), x.view(-1).to(wide.dtype), group=g.group)
            out.copy_(wide)
            return Done() if async_op else None
        return scatter(out.view(-1), x.view(-1), group=g.group, async_op=async_op)
    except RuntimeError as e:
        raise transport_error(g, "reduce_scatter", e, t0) from None


@_trace.traced("all_to_all", 1)
def all_to_all_into(out: torch.Tensor, x: torch.Tensor, g: Any, *, site: int | None = None) -> None:
    """``out`` block j <- block ``group rank`` of group rank j's ``x`` (n equal blocks)."""
    if x.dim() == 0 or x.shape[0] % g.size:
        raise ValueError(f"all_to_all: dim 0 of shape {tuple(x.shape)} does not split into "
                         f"{g.size} equal blocks")
    c, site = comm_for(x, g), (_site() if site is None else site)
    if c is not None:
        if _observer is not None:
            _observer("all_to_all_single", x, g.size)
        try:
            c.all_to_all(x, out, site)
        except RuntimeError as e:
            raise _shm_error(c, g, "all_to_all", x, e) from None
        return
    _agree("all_to_all", x, g, site)
    t0 = time.monotonic()
    try:
        dist.all_to_all_single(_bytes(out), _bytes(x), group=g.group)
    except RuntimeError as e:
        raise transport_error(g, "all_to_all", e, t0) from None


def gather_check(words: torch.Tensor, g: Any) -> torch.Tensor:
    """Every group rank's ``words`` (a small int64 tensor), in group-rank order, as
    ``all_gather_into`` gathers them (checked the same way) but not recorded: a check of
    the program's own (``train_step``'s agreement), not a collective of the program's, so
    it stays out of timelines and byte counts."""
    every = words.new_empty((g.size, words.numel()))
    c, site = comm_for(words, g), _site()
    if c is not None:
        try:
            c.all_gather(words, every, site)
        except RuntimeError as e:
            raise _shm_error(c, g, "all_gather", words, e) from None
        return every
    _agree("all_gather", words, g, site)
    t0 = time.monotonic()
    try:
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(every.view(-1), words, group=g.group)
    except RuntimeError as e:
        raise transport_error(g, "all_gather", e, t0) from None
    return every


def check_permute(x: torch.Tensor, g: Any, perm: tuple[tuple[int, int], ...]) -> None:
    """Before a ppermute's sends and receives are posted (torch.distributed's point-to-point
    calls, which check nothing: another permutation waits out the timeout, another shape
    aborts the process): every rank of the group must be at the same ppermute — same
    dtype, shape, call site and permutation — or every rank raises, naming them. One
    small all-gather (over shared memory where the group has it)."""
    shape = zlib.crc32(repr(tuple(x.shape)).encode())
    pairs = zlib.crc32(repr(tuple(perm)).encode())
    _agree("ppermute", x, g, _site(), (shape, pairs), f" with perm {[tuple(p) for p in perm]}")


_WIDEN = {torch.int16: torch.int32}  # what torch.distributed's backends cannot reduce


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """Flat, and as bytes for a dtype the backends cannot move (c10d checks dim 0 only,
    and the contract counts elements, so a flat view is the same blocks)."""
    flat = x.view(-1)
    return flat.view(torch.uint8) if x.dtype in _WIDEN else flat
