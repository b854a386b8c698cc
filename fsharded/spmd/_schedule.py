"""The collective schedule of one call on this rank, a check that every rank agrees, and
the dry runs behind both (and behind ``collectives()`` and ``estimate_memory``).

Ranks that run different collectives hang or, worse, exchange each other's data (the same
op and size issued for different tensors). Before it runs a program for the first time, a
rank can list what it will run (a dry run: op, axis, dtype, shape, phase, in order, with
nothing sent) and the ranks compare a hash of that list: one small all-gather. A mismatch
is an error on every rank naming the first entry that differs.

A dry run runs the program on stand-ins for its tensors, cheapest first, until one runs:

===========================  ================================================================
stand-ins                    what they cannot do
===========================  ================================================================
meta tensors                 read a value (``.item()``, ``bool(t)``, ``if t.sum() > 0``), or
                             ask for a device type (``torch.autocast(x.device.type)``)
fake tensors                 read a value; tensors the program captured (module buffers,
                             closures) are faked when an op first meets them, never written
fake tensors, tracing        the same, with ``torch.compiler.is_compiling()`` true (process-
guards up                    wide while it runs, as ``torch.export`` sets it), so library code
                             that skips its data checks when traced (Hugging Face's mask
                             checks) skips them
real values on CPU           see what only the other shards' values would show: it runs on
                             copies of one shard's argument values (zeros for meta
                             arguments), the collectives answering as if every shard held
                             this shard's value (``psum``: n·x, ``all_gather``: x tiled)
                             and sending nothing. It costs one forward + backward on CPU
                             and host memory for one shard's arguments (a step's state)
===========================  ================================================================

Real values stay untouched: stand-ins are new tensors (copies, never views), so a program
that updates its state in place (``donate=True``) updates the copies, and tensors the
program captured rather than took as arguments (module buffers, closures, a BatchNorm's
running statistics) are faked or copied where an op first meets them, or, on meta runs,
saved before an op writes them and put back after. An error that does not depend on the
stand-ins (the same on meta and fake tensors, or on meta tensors and real values) is the
program's own and is raised as it is; when no stand-in runs, a ``DryRunError`` names what
each one hit (the op and the line) and what to do.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import logging
import os
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import optree
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fsharded import _memory_tracker as memory
from fsharded import comm
from fsharded.mesh._layout import local_slice
from fsharded.spmd import _env, _manifest, _prims, _vma

__all__ = ["dry_run", "agree", "first_run", "stand_ins", "run_shard", "DryRunError", "Kind",
           "KINDS", "FIX"]

R = TypeVar("R")


class DryRunError(RuntimeError):
    """No stand-in ran the program; the message lists what each one hit and what to do."""


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of stand-in for a dry run's tensors."""

    name: str
    tensors: str  # "meta" | "fake" | "real"
    tracing: bool = False  # torch.compiler.is_compiling() is true while it runs


META = Kind("meta tensors", "meta")
FAKE = Kind("fake tensors", "fake")
TRACED = Kind("fake tensors (tracing guards up)", "fake", tracing=True)
REAL = Kind("real values on CPU", "real")
KINDS = (META, FAKE, TRACED, REAL)  # tried in this order

FIX = ("To dry-run it, make the lines above run without the tensors' data: guard host "
       "reads of values (.item(), bool(t), .tolist(), `if t.sum() > 0:`) with `if not "
       "torch.compiler.is_compiling():` (true in dry runs), or keep the computation on "
       "tensors (torch.where instead of a Python branch).")


# -- stand-ins ------------------------------------------------------------------------------


def _map(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    return optree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)


def _meta(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


def _fake(x: torch.Tensor) -> torch.Tensor:
    # Inside the fake mode: a fake tensor on the argument's device (CPU for a meta argument,
    # so that code asking for the device type gets one autocast knows).
    return torch.empty(x.shape, dtype=x.dtype, device="cpu" if x.device.type == "meta" else x.device)


def _real(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "meta":
        return torch.zeros(x.shape, dtype=x.dtype)
    return x.detach().to("cpu", copy=True)


class _FakeCaptured(TorchDispatchMode):
    """Fakes every real tensor an op meets (tensors the program captured rather than took
    as arguments: module buffers, closures) before fake mode sees it: fake mode would run
    some ops on real inputs for real, writing them."""

    def __init__(self, fake: FakeTensorMode) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat, spec = pytree.tree_flatten((args, kwargs or {}))
        if any(isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) for t in flat):
            flat = [self.fake.from_tensor(t) if isinstance(t, torch.Tensor)
                    and not isinstance(t, FakeTensor) else t for t in flat]
            args, kwargs = pytree.tree_unflatten(flat, spec)
        return func(*args, **(kwargs or {}))


# Ops whose schema does not mark the inputs they write (batch norm's running statistics).
_UNMARKED_WRITES = {
    torch.ops.aten.native_batch_norm.default: (3, 4),
    torch.ops.aten.cudnn_batch_norm.default: (3, 4),
    torch.ops.aten.miopen_batch_norm.default: (3, 4),
}
_WRITES: dict = {}


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    where = _WRITES.get(func)
    if where is None:
        marked = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                  if a.alias_info is not None and a.alias_info.is_write]
        names = [a.name for a in func._schema.arguments]
        marked += [(i, names[i]) for i in _UNMARKED_WRITES.get(func, ())]
        where = _WRITES[func] = tuple(marked)
    out = []
    for i, name in where:
        v = args[i] if i < len(args) else kwargs.get(name)
        out.extend(t for t in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(t, torch.Tensor))
    return out


def _key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, ...)
        return None


class _Shield(TorchDispatchMode):
    """Keeps the real tensors a dry run did not make (the program captured them: module
    buffers, closures, a BatchNorm's running statistics) as they were.

    ``copy=False`` (meta tensors, where every tensor the run makes is meta): a write to a
    real tensor saves its storage first, and ``restore`` puts it back. ``copy=True`` (real
    values on CPU): where an op first meets a tensor the run did not make, a CPU copy
    takes its place, and takes the writes."""

    def __init__(self, *, copy: bool) -> None:
        super().__init__()
        self.copy = copy
        self.ours: set[int] = set()  # storages the run made (copy=True)
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.saved: dict[int, tuple[Any, Any]] = {}

    def own(self, tree: Any) -> Any:
        for t in optree.tree_leaves(tree):
            if isinstance(t, torch.Tensor) and (k := _key(t)) is not None:
                self.ours.add(k)
        return tree

    def _theirs(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or isinstance(t, FakeTensor):
            return False
        return not self.copy or _key(t) not in self.ours

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        hit = self.copies.get(id(t))
        if hit is None:
            hit = self.copies[id(t)] = (t, self.own(t.detach().to("cpu", copy=True)))
        return hit[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.copy:
            flat, spec = pytree.tree_flatten((args, kwargs))
            if any(self._theirs(t) for t in flat):
                flat = [self._copy(t) if self._theirs(t) else t for t in flat]
                args, kwargs = pytree.tree_unflatten(flat, spec)
            return self.own(func(*args, **kwargs))
        for t in _written(func, args, kwargs):
            k = _key(t)
            if self._theirs(t) and k is not None and k not in self.saved:
                s = t.untyped_storage()
                self.saved[k] = (s, s.clone())
        return func(*args, **kwargs)

    def restore(self) -> None:
        for s, c in self.saved.values():
            s.copy_(c)
        self.saved.clear()


@contextlib.contextmanager
def _tracing_guards() -> Iterator[None]:
    # What torch.export's non-strict tracing sets (torch._export.utils), for the same
    # reason: library code that guards its data-dependent checks on it skips them.
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    # Fake mode logs every op it cannot run at ERROR level; here that is an expected miss.
    log = logging.getLogger(name)
    old = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(old)


_STANDS_FOR: contextvars.ContextVar[list | None] = contextvars.ContextVar("fsharded_stands_for", default=None)


def stands_for() -> str:
    """The device type a dry run's meta stand-ins stand for, for code whose choice of
    algorithm depends on the device (its memory differs): the device of the first real
    tensor the dry run converted; for meta arguments (a model built on meta to be
    measured) CUDA where it is available, else CPU, as ``fsharded train`` places a job."""
    box = _STANDS_FOR.get()
    if box is not None and box[0] is not None:
        return box[0]
    return "cuda" if torch.cuda.is_available() else "cpu"


def _noting_device(box: list, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def convert(tree: Any) -> Any:
        if box[0] is None:
            box[0] = next((x.device.type for x in optree.tree_leaves(tree)
                           if isinstance(x, torch.Tensor) and x.device.type != "meta"), None)
        return fn(tree)
    return convert


@contextlib.contextmanager
def stand_ins(kind: Kind) -> Iterator[Callable[[Any], Any]]:
    """Enter what ``kind`` runs under and yield ``convert(tree)``: the tree with every
    tensor replaced by a new stand-in of the same shape and dtype (not requiring grad)."""
    if kind.tensors == "meta":
        shield = _Shield(copy=False)
        box: list = [None]
        token = _STANDS_FOR.set(box)
        try:
            with shield:
                yield _noting_device(box, lambda tree: _map(_meta, tree))
        finally:
            _STANDS_FOR.reset(token)
            shield.restore()
    elif kind.tensors == "real":
        with _Shield(copy=True) as shield:
            yield lambda tree: shield.own(_map(_real, tree))
    else:
        fake = FakeTensorMode()
        with contextlib.ExitStack() as stack:
            stack.enter_context(_quiet("torch._subclasses.fake_tensor"))
            stack.enter_context(fake)
            stack.enter_context(_FakeCaptured(fake))
            if kind.tracing:
                stack.enter_context(_tracing_guards())
            yield lambda tree: _map(_fake, tree)


# -- trying them in turn --------------------------------------------------------------------

# Errors the stand-ins themselves cause (a value read on meta or fake tensors, an op without
# a meta kernel, vmap's data-dependent control flow, fake mode's own checks). Any other
# error raised the same way on meta and on fake tensors is the program's.
_STAND_IN_ERRORS = (RuntimeError, NotImplementedError, AssertionError)


def first_run(attempt: Callable[[Kind], R], *, what: str, fix: str = FIX) -> tuple[Kind, R]:
    """``attempt(kind)`` for each kind in ``KINDS`` until one returns: that kind and its
    result. An error that does not depend on the stand-ins is raised as it is; when every
    kind fails, a ``DryRunError`` says what each hit (``what``: who is asking) and ``fix``."""
    failures: list[tuple[Kind, Exception]] = []
    for kind in KINDS:
        try:
            return kind, attempt(kind)
        except Exception as e:  # noqa: BLE001 - classified below, re-raised or reported
            first = failures[0][1] if failures and failures[0][0] is META else None
            same = first is not None and type(e) is type(first) and str(e) == str(first)
            if same and (kind.tensors == "real" or not isinstance(e, _STAND_IN_ERRORS)):
                e.add_note(f"({what}: raised in a dry run, on {kind.name}, as on meta tensors)")
                raise
            failures.append((kind, e))
    lines = [f"{what}: could not run the program without its data (a dry run). Tried, in turn:"]
    for kind, e in failures:
        lines.append(f"  on {kind.name}: {_describe(e)}")
        lines.append(f"      at {_where(e)}")
    if failures[-1][0] is REAL:
        lines.append("On real values (copies of one device's shards, zeros for meta arguments, "
                     "collectives answering as if every shard held this one's value) it failed as "
                     "last listed: if that is a bug in the program, fix it there; otherwise:")
    lines.append(fix)
    raise DryRunError("\n".join(lines)) from failures[-1][1]


def _describe(e: Exception) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if "_local_scalar_dense" in msg or ".item()" in msg:
        msg += " (a host read of a tensor's value: .item(), bool(t), int(t), .tolist())"
    if len(msg) > 240:
        msg = msg[:240] + " ..."
    return f"{type(e).__name__}: {msg}"


_LIBS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, optree))
_LIBS += (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # fsharded
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def _theirs(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.startswith(_LIBS) or filename.startswith("<"):
        return True
    return path.startswith(_STDLIB) and "-packages" + os.sep not in path


def _where(e: BaseException) -> str:
    """The innermost line of the program (not torch's, fsharded's or the standard
    library's) the error passed through."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "(no traceback)"
    mine = [f for f in frames if not _theirs(f.filename)]
    f = (mine or frames)[-1]
    path = f.filename.split("site-packages" + os.sep)[-1]
    return f"{path}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


# -- one shard, real values -----------------------------------------------------------------


def run_shard(sm: Any, args: tuple, kind: Kind, *, rank: int = 0) -> None:
    """Run the shard_map'ed ``sm`` as device ``rank`` of its mesh alone, without a process
    group, on ``kind`` stand-ins of that device's shards of ``args``: what one real rank
    runs. Call it inside a ``recording(dry=True)``, where the collectives answer locally.
    How ``collectives()`` lists a distributed program, and the virtual mesh's fallback
    for a program vmap cannot run (a host read of a batched value)."""
    mesh = sm.mesh
    coords = mesh.coords(rank)
    leaves, specs, treedef, _ = sm._flat_in(args)
    views = [local_slice(x, s, mesh, coords) if isinstance(x, torch.Tensor) else x
             for x, s in zip(leaves, specs)]
    frame = _env.AxisFrame(mesh, "distributed", coords=coords)
    with stand_ins(kind) as convert:
        shards = convert(views)
        if mesh.size == 1:  # nothing can differ between devices: nothing to type
            with _env.enter(frame):
                sm._flat_out(sm.f(*optree.tree_unflatten(treedef, shards)))
            return
        mode = _vma.VmaMode(mesh.axis_names, _prims.implicit_pvary(frame))
        with _env.enter(dataclasses.replace(frame, vma=mode)), mode:
            _vma.run_body(mode, sm, shards, specs, treedef)


# -- the schedule ---------------------------------------------------------------------------


def _axes(label: str) -> tuple[str, ...]:
    """The axes of a schedule entry's axis label (``"data"`` or ``"(data,tensor)"``)."""
    return tuple(label.strip("()").split(",")) if label.startswith("(") else (label,)


def _group_differences(lists: list[list[tuple]], mesh: Any) -> list[str]:
    """Where two ranks of one group (the ranks that share their coordinates off a set of
    axes) run different collectives over those axes: one line per difference found. (The
    order of collectives over different sets of axes is not compared.)"""
    lines = []
    labels = [dict.fromkeys(e[2] for e in mine) for mine in lists]
    for r in range(len(lists)):
        coords = mesh.coords(r)
        for q in range(r + 1, len(lists)):
            other = mesh.coords(q)
            for label in dict.fromkeys([*labels[r], *labels[q]]):
                axes = set(_axes(label))
                if any(coords[a] != other[a] for a in coords if a not in axes):
                    continue  # not in one group over these axes
                sub = [e for e in lists[r] if e[2] == label]
                theirs = [e for e in lists[q] if e[2] == label]
                if sub != theirs:
                    i = next((k for k, (a, b) in enumerate(zip(sub, theirs)) if a != b), min(len(sub), len(theirs)))
                    a = sub[i] if i < len(sub) else f"(nothing: rank {r} stops here)"
                    b = theirs[i] if i < len(theirs) else f"(nothing: rank {q} stops here)"
                    lines.append(f"  collective #{i}: rank {r} runs {a}, rank {q} runs {b} (of those over {label})")
    return lines[:8]


_CHECK_FIX = FIX + " Or pass check_schedule=False to train_step, which skips the cross-rank check."


def dry_record(fn: Any, *args: Any, what: str = "train_step's schedule check", fix: str = _CHECK_FIX,
               peak: bool = False) -> tuple[list, int]:
    """``fn(*args)`` on stand-ins of the same shapes (see the module doc) with the
    collectives answering locally: the manifest entries of this rank's collectives, and
    with ``peak`` the most bytes the call had allocated at once beyond its arguments (the
    memory tracker, counting meta tensors; else 0)."""
    def attempt(kind: Kind) -> tuple[list, int]:
        with stand_ins(kind) as convert, _manifest.recording(dry=True) as entries:
            stand = convert(args)
            if not peak:
                fn(*stand)
                return entries, 0
            with memory.track(include_meta=True) as mem:
                fn(*stand)
            return entries, mem.peak_bytes

    _, (entries, most) = first_run(attempt, what=what, fix=fix)
    return entries, most


def schedule_of(entries: list) -> list[tuple]:
    """A rank's schedule from its manifest entries: ``(phase, op, axis, dtype, shape)`` per
    collective, what ``agree`` compares."""
    return [(e.phase, e.op, e.axis, str(e.dtype).replace("torch.", ""), tuple(e.shape)) for e in entries]


def dry_run(fn: Any, *args: Any, what: str = "train_step's schedule check", fix: str = _CHECK_FIX,
            peak: bool = False) -> Any:
    """``fn(*args)`` on stand-ins of the same shapes (see ``dry_record``): this rank's
    schedule (``schedule_of``). With ``peak``: ``(schedule, bytes)``, the most bytes the
    call had allocated at once beyond its arguments."""
    entries, most = dry_record(fn, *args, what=what, fix=fix, peak=peak)
    schedule = schedule_of(entries)
    return (schedule, most) if peak else schedule


def agree(schedule: list[tuple], what: str, mesh: Any = None) -> None:
    """Raise on every rank unless every rank's ``schedule`` is the same, or, with a
    ``mesh`` (the ranks laid out on it), unless every group of ranks runs the same
    collectives over its axes: where the ranks' schedules differ (a pipeline's stages,
    each reducing its own leaves over the data axis), the collectives over each set of
    axes must be the same, in order, on every rank of each group they join."""
    if not comm.is_initialized() or dist.get_world_size() == 1:
        return
    digest = int.from_bytes(hashlib.sha256(repr(schedule).encode()).digest()[:8], "little", signed=True)
    device = "cuda" if comm.default_device_type() == "cuda" else "cpu"
    mine = torch.tensor([digest, len(schedule)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if all(torch.equal(t, every[0]) for t in every):
        return
    lists: list = [None] * dist.get_world_size()
    dist.all_gather_object(lists, schedule)
    me = dist.get_rank()
    if mesh is not None and mesh.size == len(lists):
        lines = _group_differences(lists, mesh)
        if not lines:
            return
    else:
        lines = []
        for r, other in enumerate(lists):
            if other == lists[0]:
                continue
            i = next((k for k, (a, b) in enumerate(zip(lists[0], other)) if a != b),
                     min(len(lists[0]), len(other)))
            a = lists[0][i] if i < len(lists[0]) else "(nothing: rank 0 stops here)"
            b = other[i] if i < len(other) else f"(nothing: rank {r} stops here)"
            lines.append(f"  collective #{i}: rank 0 runs {a}, rank {r} runs {b}")
    raise RuntimeError(
        f"{what}: the ranks would run different collectives (rank {me} of "
        f"{dist.get_world_size()}; {len(schedule)} collectives here), which hangs or mixes "
        f"up their data:\n" + "\n".join(lines) + "\nEvery rank must run the same "
        "collectives in the same order with the same shapes: look for control flow on the "
        "rank or on data that differs between ranks (uneven batches, per-rank files)."
    )
