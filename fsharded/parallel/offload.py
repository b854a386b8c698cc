"""Memory tiers for the optimizer state: host memory and NVMe files (ZeRO-Offload,
ZeRO-Infinity), as part of a placement.

``zero(stage, offload_optimizer="cpu" | "nvme", nvme_path=...)`` puts the optimizer's
moments in a tier instead of device memory; the parameters stay where the placement puts
them. The step then updates the state in streamed buckets (``stream_update``): each bucket
of parameters and gradients is copied to host staging buffers, its moments are read from
their tier (for NVMe, the next bucket's while this one is updated), the fused kernel (the
C++ CPU optimizer) runs on the host, the moments go back to their tier and the parameters
back to the device. The numbers are those of the in-memory fused step, bit for bit: the
kernel is elementwise, and a bucket is a split of the same elements.

The tiers:

- ``"cpu"``: the moments are host tensors (pinned where a GPU is the device, so the copies
  are asynchronous). On a CPU-only machine the "device" is host memory as well: the step
  still copies each bucket to staging buffers and back, so the same ordering runs here as
  on a GPU.
- ``"nvme"``: each moment leaf is a file under ``nvme_path`` (one directory per tier,
  removed at exit), reserved when the state is made (a disk too small is an error then).
  The state's leaves stay tensors (memory-mapped views of their files: a checkpoint reads
  them like any leaf); the step reads and writes the files with ``fsharded.kernels.aio``
  (a C++ thread pool, ``O_DIRECT`` where the filesystem allows it, so the state does not
  come back into RAM as page cache). Every piece written is checksummed and checked when
  read back: a file changed behind the step's back is an error naming it.

What changes, numerically: nothing. What changes otherwise: the optimizer state in a tier
is updated in place, as DeepSpeed's is, so a state passed to a step is consumed whatever
``donate`` says (the parameters follow ``donate`` as before). The NVMe tier needs an
optimizer with a fused form (``adamw``, ``adam``, ``lion``); the host tier runs any
optimizer (those without a fused form on the host copies of the parameters, whole).

>>> rule = zero(2, offload_optimizer="nvme", nvme_path="/local_nvme")
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from fsharded.kernels import aio
from fsharded.spmd._wrappers import is_wrapped

__all__ = ["Offload", "ZenFlow", "TIERS", "place", "place_params", "in_tier", "fetch", "Reading", "read", "store",
           "verify", "stream_update", "nvme_files", "to_host", "mark_host", "on_host"]

TIERS = ("cpu", "nvme")


@dataclass(frozen=True)
class ZenFlow:
    """ZenFlow's overlapped update (DeepSpeed's ``zero_optimization.zenflow``) over the host
    tier: the most important rows of each parameter's gradient are updated on the device
    at once, and the rest on the host while the next step's forward and backward run.

    Each step, per parameter shard (a row is a slice along dim 0; a leaf of fewer than 2
    dims is all important):

    - the ``topk_ratio`` of its rows with the largest gradient L1 norm, chosen at the first
      step and again every ``select_interval`` steps, are *hot*: the optimizer updates them
      on the device with this step's gradient, their moments held on the device;
    - the other rows are *cold*: their gradients are summed on the host over
      ``update_interval`` steps; then the host tier's update of them with the mean starts
      once the step ends and runs beside the next step; its result lands when that next
      step updates. So with ``update_interval=1`` a cold row's update from step t's
      gradient first reaches the forward of step t+2, one step late; a hot row's reaches
      step t+1, as without ZenFlow.

    What it changes, numerically: the cold rows train one step stale (the gradient of step
    t is taken at parameters that lack step t-1's cold update), and with
    ``update_interval`` k > 1 on the mean gradient of k steps, one optimizer step per k
    steps (its counter and learning rate those of the step it starts at, as DeepSpeed
    does); the hot rows are exact. With ``topk_ratio=1`` every row is hot and the numbers
    are those of the exact update. A selection falls at the first step of an interval
    (``select_interval`` is rounded up to whole intervals), so no row changes sides
    within one.
    ``warmup_steps`` (DeepSpeed's ``full_warm_up_rounds``) first steps run the exact
    update. A reselection lands the update in flight first. A checkpoint (``step.save``)
    and ``step.settle(state)`` land it too, and apply the gradients summed so far as an
    interval of their own (the running job and a job resumed from that checkpoint then
    continue alike); the selection starts afresh after one."""

    topk_ratio: float = 0.1
    select_interval: int = 100
    warmup_steps: int = 0
    update_interval: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.topk_ratio, bool) or not isinstance(self.topk_ratio, (int, float)) \
                or not 0 < self.topk_ratio <= 1:
            raise ValueError(f"zenflow: topk_ratio must be a fraction in (0, 1], got {self.topk_ratio!r}")
        for name in ("select_interval", "warmup_steps", "update_interval"):
            v, least = getattr(self, name), (0 if name == "warmup_steps" else 1)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"zenflow: {name} must be an int >= {least}, got {v!r}")

    def rows(self, n: int) -> int:
        """Hot rows of a shard of ``n`` rows: the ratio rounded up (none of none)."""
        return min(n, math.ceil(self.topk_ratio * n))


@dataclass(frozen=True)
class Offload:
    """Where a placement keeps the optimizer state (``optimizer``: None for device memory,
    ``"cpu"`` or ``"nvme"``) and how it streams it: ``nvme_path`` (a directory on the
    NVMe disk; required for ``"nvme"``), ``pin_memory`` (page-locked host buffers where a
    GPU is the device), ``bucket_elems`` (elements per streamed bucket), ``buffer_count``
    (buckets in flight: 2 overlaps the next bucket's read with this one's update),
    ``direct`` (``O_DIRECT`` where the filesystem allows it)."""

    optimizer: str | None = None
    params: str | None = None
    """Where the master parameters' shards live: None for device memory, ``"cpu"`` or
    ``"nvme"`` (ZeRO-Infinity's ``offload_param``; ZeRO 1-3). Needs ``optimizer`` set."""
    # Where this host keeps its files: ranks may name different disks, so the path is not
    # part of the layout the ranks agree on (nor of the repr that shows it).
    nvme_path: str | None = field(default=None, compare=False, repr=False)
    pin_memory: bool = True
    bucket_elems: int = 1 << 22
    buffer_count: int = 2
    direct: bool = True
    zenflow: ZenFlow | None = None
    """ZenFlow's overlapped update of the host tier (``ZenFlow``): None for the exact one."""

    def __post_init__(self) -> None:
        if self.optimizer not in (None, *TIERS):
            raise ValueError(f"offload_optimizer must be None, 'cpu' or 'nvme', got {self.optimizer!r}")
        if self.params not in (None, *TIERS):
            raise ValueError(f"offload_params must be None, 'cpu' or 'nvme', got {self.params!r}")
        if self.params is not None and self.optimizer is None:
            raise ValueError(f"offload_params={self.params!r} needs offload_optimizer= as well: the update "
                             f"streams the parameters through the host with the optimizer state")
        if "nvme" in (self.optimizer, self.params) and not self.nvme_path:
            raise ValueError("offload to 'nvme' needs nvme_path=, a directory on the disk to keep the "
                             "state in")
        if self.nvme_path is not None and not os.path.isdir(self.nvme_path):
            raise ValueError(f"nvme_path={self.nvme_path!r} is not a directory: create it, on the disk the "
                             f"optimizer state should live on")
        if not isinstance(self.bucket_elems, int) or self.bucket_elems < 1024:
            raise ValueError(f"offload: bucket_elems must be an int >= 1024, got {self.bucket_elems!r}")
        if not isinstance(self.buffer_count, int) or self.buffer_count < 1:
            raise ValueError(f"offload: buffer_count must be a positive int, got {self.buffer_count!r}")
        if self.zenflow is not None:
            if not isinstance(self.zenflow, ZenFlow):
                raise ValueError(f"zenflow must be a fsharded.parallel.offload.ZenFlow, got {self.zenflow!r}")
            if self.optimizer not in TIERS or self.params is not None:
                raise ValueError(f"zenflow needs offload_optimizer='cpu' or 'nvme' and the parameters in device "
                                 f"memory (its hot rows are updated there at once, the host update overlaps the "
                                 f"device's compute), got offload_optimizer={self.optimizer!r}, "
                                 f"offload_params={self.params!r}")

    @property
    def active(self) -> bool:
        return self.optimizer is not None

    def describe(self) -> str:
        where = {"nvme": f"on NVMe under {self.nvme_path}", "cpu": "in host memory", None: "in device memory"}
        if self.params is not None and self.params == self.optimizer:
            return f"parameters and optimizer state {where[self.params]}"
        out = f"optimizer state {where[self.optimizer]}"
        out += f", parameters {where[self.params]}" if self.params is not None else ""
        return out + (f", zenflow (top {self.zenflow.topk_ratio:g} of rows on the device, the rest one step "
                      f"stale)" if self.zenflow is not None else "")


# -- the NVMe tier's files --------------------------------------------------------------------

_PIECE = 1 << 20  # the most elements per checksummed piece of a file


def piece_elems(offload: Offload) -> int:
    """Elements per piece (the unit of streaming and of checksums): ``bucket_elems``,
    rounded down to a multiple of 1024 (whole ``O_DIRECT`` blocks of fp32), at most
    ``_PIECE``."""
    return max(1024, min(_PIECE, offload.bucket_elems // 1024 * 1024))


class _Leaf:
    """One NVMe-tier tensor's file: its ``aio.File``, element size, its pieces' size, and
    the CRC-32C of each piece as last written by the tier (None: not yet written)."""

    def __init__(self, file: Any, numel: int, itemsize: int, piece: int) -> None:
        self.file, self.numel, self.itemsize, self.piece = file, numel, itemsize, piece
        self.crcs: list[int | None] = [None] * max(1, math.ceil(numel / piece))


class _Directory:
    """A directory of tier files under ``nvme_path``, removed at exit (or by ``close``)."""

    def __init__(self, root: str, direct: bool, piece: int) -> None:
        self.path = tempfile.mkdtemp(prefix="fsharded-nvme-", dir=root)
        self.direct, self.piece, self.n = direct, piece, 0
        self.leaves: dict[str, _Leaf] = {}

    def new(self, like: torch.Tensor) -> torch.Tensor:
        """A file-backed tensor shaped and typed like ``like``, holding its values."""
        self.n += 1
        path = os.path.join(self.path, f"{self.n:05d}.bin")
        nbytes = like.numel() * like.element_size()
        leaf = _Leaf(aio.File.create(path, nbytes, direct=self.direct), like.numel(), like.element_size(), self.piece)
        self.leaves[path] = leaf
        out = torch.from_file(path, shared=True, size=like.numel(), dtype=like.dtype).view(like.shape)
        src = like.detach().reshape(-1)
        if bool(src.any()):  # (a new file reads zeros: what optimizer.init made, mostly)
            _write_all(leaf, src)
        else:
            for k in range(len(leaf.crcs)):
                n = min(leaf.piece, leaf.numel - k * leaf.piece)
                leaf.crcs[k] = _zero_crc(n * leaf.itemsize)
        return out

    def close(self) -> None:
        for leaf in self.leaves.values():
            leaf.file.close()
        self.leaves.clear()
        shutil.rmtree(self.path, ignore_errors=True)


_DIRS: list[_Directory] = []
_LOCK = threading.Lock()
_ZERO_CRC: dict[int, int] = {}


def _zero_crc(nbytes: int) -> int:
    if nbytes not in _ZERO_CRC:
        _ZERO_CRC[nbytes] = aio.checksum(torch.zeros(nbytes, dtype=torch.uint8))
    return _ZERO_CRC[nbytes]


def _write_all(leaf: _Leaf, src: torch.Tensor) -> None:
    buf = aio.aligned_empty(min(leaf.numel, leaf.piece) * leaf.itemsize)
    for k in range(len(leaf.crcs)):
        lo, hi = k * leaf.piece, min(leaf.numel, (k + 1) * leaf.piece)
        view = buf[: (hi - lo) * leaf.itemsize].view(src.dtype)
        view.copy_(src[lo:hi])
        leaf.crcs[k] = leaf.file.write(lo * leaf.itemsize, buf, (hi - lo) * leaf.itemsize).wait()


@atexit.register
def _remove_all() -> None:
    with _LOCK:
        for d in _DIRS:
            d.close()
        _DIRS.clear()


def _directory(offload: Offload) -> _Directory:
    """This process's tier directory under ``offload.nvme_path`` (one per path)."""
    piece = piece_elems(offload)
    with _LOCK:
        for d in _DIRS:
            if os.path.dirname(d.path) == os.path.abspath(offload.nvme_path) and (d.direct, d.piece) == \
                    (offload.direct, piece):
                return d
        d = _Directory(os.path.abspath(offload.nvme_path), offload.direct, piece)
        _DIRS.append(d)
        return d


def _leaf_of(t: torch.Tensor) -> _Leaf | None:
    """The tier file ``t`` is a whole view of (None: not an NVMe-tier tensor)."""
    try:
        name = t.untyped_storage().filename
    except (AttributeError, RuntimeError):
        return None
    if not name:
        return None
    with _LOCK:
        for d in _DIRS:
            leaf = d.leaves.get(name)
            if leaf is not None:
                return leaf if t.storage_offset() == 0 and t.is_contiguous() and t.numel() == leaf.numel else None
    return None


def nvme_files(tree: Any) -> list[str]:
    """The tier files of a state's NVMe-tier leaves (tests, tools)."""
    return [t.untyped_storage().filename for t in optree.tree_leaves(tree)
            if isinstance(t, torch.Tensor) and _leaf_of(t) is not None]


# -- placing a state ------------------------------------------------------------------------------


def _pinned(t: torch.Tensor, offload: Offload) -> torch.Tensor:
    host = t.detach().to("cpu")
    if offload.pin_memory and torch.cuda.is_available():
        host = host.pin_memory()
    return host


def place(moments: list[torch.Tensor], offload: Offload, *, tier: str | None = None) -> list[torch.Tensor]:
    """``moments`` (tensors shaped like parameters) in ``offload``'s optimizer tier (or
    ``tier``: ``offload.params`` for the parameters): host tensors, or file-backed tensors
    under ``nvme_path``. Leaves already there are kept."""
    tier = offload.optimizer if tier is None else tier
    if tier is None or any(t.device.type == "meta" for t in moments):  # (a template: shapes only)
        return moments
    if tier == "cpu":
        return [t if in_tier(t, offload, tier=tier) else _pinned(t, offload) for t in moments]
    d = _directory(offload)
    return [t if in_tier(t, offload, tier=tier) else d.new(t.detach().to("cpu")) for t in moments]


def place_params(params: list[torch.Tensor], offload: Offload | None) -> list[torch.Tensor]:
    """The master parameters in ``offload.params``'s tier (unchanged without one). Only
    fp32 leaves move (what the step trains; a frozen leaf kept in a 16-bit dtype stays
    where it is)."""
    if offload is None or offload.params is None:
        return params
    movable = [isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() > 0 for t in params]
    placed = iter(place([t for t, m in zip(params, movable) if m], offload, tier=offload.params))
    return [next(placed) if m else t for t, m in zip(params, movable)]


def in_tier(t: torch.Tensor, offload: Offload, *, tier: str | None = None) -> bool:
    tier = offload.optimizer if tier is None else tier
    if tier == "nvme":
        return _leaf_of(t) is not None
    return t.device.type == "cpu"


class Reading:
    """Reads of the NVMe-tier tensors among ``tensors`` posted now (``aio``'s threads do
    them while the caller computes), finished by ``wait()``: every tensor's values in
    memory, checked against the checksums the tier wrote; a tensor of no NVMe tier as it
    is. Wait for every ``Reading`` once (its buffers are written until then)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.posted: list[tuple[torch.Tensor, _Leaf, list] | None] = []
        if not _DIRS:  # no NVMe tier in this process: nothing to read
            self.posted = [None] * len(self.tensors)
            return
        for t in self.tensors:
            leaf = _leaf_of(t) if isinstance(t, torch.Tensor) and t.device.type == "cpu" else None
            if leaf is None:
                self.posted.append(None)
                continue
            buf = aio.aligned_empty(aio.padded(leaf.numel * leaf.itemsize))
            reads = []
            for k in range(len(leaf.crcs)):
                lo, hi = k * leaf.piece, min(leaf.numel, (k + 1) * leaf.piece)
                reads.append(leaf.file.read(lo * leaf.itemsize, buf[lo * leaf.itemsize:], (hi - lo) * leaf.itemsize))
            self.posted.append((buf, leaf, reads))

    def wait(self) -> list[torch.Tensor]:
        out = []
        for t, p in zip(self.tensors, self.posted):
            if p is None:
                out.append(t)
                continue
            buf, leaf, reads = p
            crcs = [r.wait() for r in reads]  # every request waited for, before any error
            for k, crc in enumerate(crcs):
                _verify(leaf, k, crc)
            out.append(buf[: leaf.numel * leaf.itemsize].view(t.dtype).view(t.shape))
        self.posted = [None] * len(self.tensors)
        return out

    def __del__(self) -> None:  # never let a read land in a freed buffer
        for p in getattr(self, "posted", ()):
            if p is not None:
                for r in p[2]:
                    try:
                        r.wait()
                    except Exception:  # noqa: BLE001 (an error of a read nobody took)
                        pass


def fetch(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` in memory: for a tensor of an NVMe tier, a new tensor read from
    its file through ``aio`` (not through its memory map, so the file's pages do not come
    into this process's memory) and checked against the checksums the tier wrote; any
    other tensor as it is."""
    return Reading([t]).wait()[0]


class _Read(torch.autograd.Function):
    """The values of NVMe-tier tensors read through ``aio`` (``Reading``), differentiable:
    the gradient of each read passes to its tensor."""

    @staticmethod
    def forward(ctx, *ts: torch.Tensor) -> tuple:
        return tuple(Reading(list(ts)).wait())

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        return grads


def read(tensors: list) -> list:
    """``tensors`` with every one of an NVMe tier replaced by its values read through
    ``aio`` and checked (``fetch``), differentiably (the gradient goes to the file-backed
    tensor); the others as they are. For code that would read the files through their
    memory maps: unchecked, and into this process's page cache."""
    if not _DIRS:
        return list(tensors)
    with torch._C.DisableTorchFunction():
        at = [i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.device.type == "cpu"
              and _leaf_of(t) is not None]
    if not at:
        return list(tensors)
    out = list(tensors)
    for i, v in zip(at, _Read.apply(*(tensors[i] for i in at))):
        out[i] = v
    return out


def store(t: torch.Tensor, values: torch.Tensor) -> None:
    """``values`` into ``t``: for a tensor of an NVMe tier, written to its file through
    ``aio`` (not through its memory map) with fresh checksums; any other tensor copied
    into. What a caller changed in a ``fetch`` of ``t`` goes back this way."""
    leaf = _leaf_of(t)
    if leaf is None:
        t.copy_(values)
        return
    _write_all(leaf, values.detach().reshape(-1))


def verify(tree: Any) -> None:
    """Read every NVMe-tier tensor of ``tree`` through ``aio`` and check it against the
    checksums the tier wrote (an error naming a file changed behind the step's back). For
    the virtual mesh, whose forward reads the parameters through their memory maps."""
    for t in optree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and _leaf_of(t) is not None:
            fetch(t)


def _verify(leaf: _Leaf, k: int, crc: int) -> None:
    if leaf.crcs[k] is not None and crc != leaf.crcs[k]:
        raise RuntimeError(f"offload: {leaf.file.path} (piece {k}) does not hold what the step wrote "
                           f"there: checksum {crc:#010x}, written {leaf.crcs[k]:#010x}. The state on disk "
                           f"was changed or corrupted; resume from the last checkpoint")


# -- gradients on the host ------------------------------------------------------------------------

_HOST: dict[int, weakref.ref] = {}  # storage address -> the host buffer (while it lives)


def to_host(t: torch.Tensor, *, pin: bool = True) -> tuple[torch.Tensor, Any]:
    """A copy of ``t`` in a host buffer of its own, known to the streamed update as already
    on the host (``on_host``: the update reads it where it is instead of copying it into
    its staging buffers). Where ``t`` is on a GPU: into pinned memory (``pin``), on a copy
    stream of its own that waits for what the compute stream has queued so far (so the
    copy overlaps the rest of backward), with the event the host waits on before it reads
    the copy; the caller keeps ``t`` alive until then. Elsewhere a plain copy and no event."""
    cuda = t.device.type == "cuda"
    with torch._C.DisableTorchFunction(), torch.no_grad():
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and cuda)
        event = None
        if cuda:
            side = _copy_stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                h.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
        else:
            h.copy_(t)
    mark_host(h)
    return h, event


_COPY_STREAMS: dict = {}


def _copy_stream(device: torch.device) -> Any:
    """The side stream of ``device`` that copies gradients to the host."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device=device)
    return _COPY_STREAMS[device]


def mark_host(h: torch.Tensor) -> None:
    """Note ``h`` (a CPU tensor) as a host buffer the streamed update reads where it is:
    what ``to_host`` made, or what the host made from it (ZeRO-1's slice of a gradient
    streamed whole)."""
    key = h.untyped_storage().data_ptr()
    _HOST[key] = weakref.ref(h, lambda _, key=key: _HOST.pop(key, None))


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` is (a view of) a buffer ``to_host`` or ``mark_host`` noted, still alive
    (False for a value beneath the virtual mesh's vmap levels, which has no storage)."""
    if not _HOST or is_wrapped(t):
        return False
    with torch._C.DisableTorchFunction():
        if t.device.type != "cpu":
            return False
        ref = _HOST.get(t.untyped_storage().data_ptr())
    return ref is not None and ref() is not None


# -- the streamed update --------------------------------------------------------------------------


class _Staging:
    """One bucket's host buffers: parameters (``width`` elements) and gradients (``gwidth``:
    none where every gradient is on the host already), and one
    per tensor list read from files (``files``: the NVMe tier's moments, and the parameters
    where they are there too; ``mwidth`` elements each, pieces at aligned offsets for
    ``O_DIRECT``)."""

    def __init__(self, width: int, mwidth: int, files: int, dtype: torch.dtype, offload: Offload, *,
                 gwidth: int) -> None:
        pin = offload.pin_memory and torch.cuda.is_available()
        self.p = torch.empty(width, dtype=dtype, pin_memory=pin)
        self.g = torch.empty(gwidth, dtype=dtype, pin_memory=pin)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.m = [aio.aligned_empty(mwidth * itemsize).view(dtype) for _ in range(files)]
        self.reads: list = []  # (pending, leaf, piece) of the files being read in
        self.writes: list = []  # (pending, leaf, piece) of the files being written out
        self.event: Any = None  # (CUDA) the copy back to the device that reads p

    def settle(self) -> None:
        """Wait until this staging set can be reused: its writes are done (their checksums
        recorded), and its parameters have been copied back to the device."""
        for w, leaf, k in self.writes:
            leaf.crcs[k] = w.wait()
        self.writes = []
        if self.event is not None:
            self.event.synchronize()
            self.event = None


class _Piece:
    """Elements ``[lo, hi)`` of leaf ``i``: at ``at`` in a bucket's parameter and gradient
    staging, at ``mat`` (aligned) in its file staging; ``k``: its checksummed piece."""

    __slots__ = ("i", "lo", "hi", "at", "mat", "k")

    def __init__(self, i: int, lo: int, hi: int, at: int, mat: int, k: int) -> None:
        self.i, self.lo, self.hi, self.at, self.mat, self.k = i, lo, hi, at, mat, k


def _buckets(sizes: list[int], cap: int, piece: int, align: int) -> list[list[_Piece]]:
    """The leaves cut into whole pieces of ``piece`` elements, grouped into buckets of at
    most ``max(cap, piece)`` elements (a piece is never split); each piece's file staging
    starts at a multiple of ``align`` elements."""
    cap = max(cap, piece)
    out: list[list[_Piece]] = [[]]
    at = mat = 0
    for i, n in enumerate(sizes):
        for lo in range(0, n, piece):
            hi = min(n, lo + piece)
            if at + hi - lo > cap and out[-1]:
                out.append([])
                at = mat = 0
            out[-1].append(_Piece(i, lo, hi, at, mat, lo // piece))
            at += hi - lo
            mat += -(-(hi - lo) // align) * align
    return [b for b in out if b]


def _file_leaves(tensors: list[torch.Tensor], offload: Offload, what: str) -> list[_Leaf]:
    got = [_leaf_of(t) for t in tensors]
    if any(f is None for f in got):
        raise RuntimeError(f"offload: the {what} is not in this step's NVMe tier (a state made by another step, or "
                           f"moved since): make it with step.init(params) or step.load(...)")
    if any(f.piece != piece_elems(offload) for f in got):  # type: ignore[union-attr]
        raise RuntimeError(f"offload: the {what}'s files were cut into pieces of another size (made with another "
                           f"bucket_elems): make the state with this step's init or load")
    return got  # type: ignore[return-value]


def stream_update(step: Any, params: list[torch.Tensor], grads: list[torch.Tensor],
                  moments: list[list[torch.Tensor]], decay: list[bool] | None, offload: Offload) -> torch.Tensor:
    """One fused step (``optim.FusedStep`` ``step``) of ``params`` (flat contiguous device
    tensors, or the NVMe tier's parameter files; updated in place) with ``grads`` (flat,
    contiguous, the same sizes) and ``moments`` (one list per moment, in ``offload``'s
    tier), bucket by bucket through host staging buffers (see the module doc). What lives
    in files is read with ``aio`` (the next bucket's while this one is updated) and written
    back the same way, never through its memory map. Gradients streamed to the host during
    backward (``to_host``) are read where they are, not copied into the staging buffers
    again. Returns found_inf (false unless the
    step checks: non-finite steps are refused before the update)."""
    nvme = offload.optimizer == "nvme"
    p_files = offload.params == "nvme"
    dtype = params[0].dtype if params else torch.float32
    itemsize = torch.empty((), dtype=dtype).element_size()
    buckets = _buckets([p.numel() for p in params], offload.bucket_elems, piece_elems(offload),
                       max(1, aio.ALIGN // itemsize))
    found = torch.zeros((), dtype=torch.bool)
    if not buckets:
        return found
    files: list[list[_Leaf]] = [_file_leaves(ms, offload, "optimizer state") for ms in moments] if nvme else []
    if p_files:  # the parameters go through the file staging as one more list (the last)
        files.append(_file_leaves(params, offload, "parameters"))
    width = max(b[-1].at + b[-1].hi - b[-1].lo for b in buckets)
    mwidth = max(b[-1].mat + b[-1].hi - b[-1].lo + aio.ALIGN for b in buckets) if files else 0
    host = [on_host(g) for g in grads]
    sets = [_Staging(width, mwidth, len(files), dtype, offload, gwidth=0 if all(host) else width)
            for _ in range(min(offload.buffer_count, len(buckets)))]
    cuda = params[0].device.type == "cuda"

    def fetch_bucket(b: int) -> None:  # post the reads of bucket b's files into its staging set
        st = sets[b % len(sets)]
        st.settle()
        for pc in buckets[b]:
            for j, ls in enumerate(files):
                leaf = ls[pc.i]
                st.reads.append((leaf.file.read(pc.lo * itemsize, st.m[j][pc.mat:].view(torch.uint8),
                                                (pc.hi - pc.lo) * itemsize), leaf, pc.k))

    if files:
        fetch_bucket(0)
    for b, pieces in enumerate(buckets):
        st = sets[b % len(sets)]
        if not files:
            st.settle()
        elif b + 1 < len(buckets) and len(sets) > 1:
            fetch_bucket(b + 1)  # the next bucket's state arrives while this one is updated
        ps, gs, ms, flags = [], [], [[] for _ in moments], []
        for pc in pieces:
            n = pc.hi - pc.lo
            if p_files:
                ps.append(st.m[-1][pc.mat: pc.mat + n])
            else:
                ps.append(st.p[pc.at: pc.at + n])
                ps[-1].copy_(params[pc.i][pc.lo:pc.hi], non_blocking=cuda)
            if host[pc.i]:  # streamed to the host in backward already: read where it is
                gs.append(grads[pc.i][pc.lo:pc.hi])
            else:
                gs.append(st.g[pc.at: pc.at + n])
                gs[-1].copy_(grads[pc.i][pc.lo:pc.hi], non_blocking=cuda)
            for j in range(len(moments)):
                ms[j].append(st.m[j][pc.mat: pc.mat + n] if nvme else moments[j][pc.i].view(-1)[pc.lo:pc.hi])
            flags.append(True if decay is None else decay[pc.i])
        if cuda:
            torch.cuda.current_stream().synchronize()  # the host reads what the device copied
        for pend, leaf, k in st.reads:
            _verify(leaf, k, pend.wait())
        st.reads = []
        found = found | step.run(ps, gs, ms, None if decay is None else flags)
        for pc in pieces:
            for j, ls in enumerate(files):
                leaf = ls[pc.i]
                st.writes.append((leaf.file.write(pc.lo * itemsize, st.m[j][pc.mat:].view(torch.uint8),
                                                  (pc.hi - pc.lo) * itemsize), leaf, pc.k))
        if not p_files:
            for pc, p in zip(pieces, ps):
                params[pc.i].view(-1)[pc.lo:pc.hi].copy_(p, non_blocking=cuda)
        if cuda:
            st.event = torch.cuda.Event()
            st.event.record()
        if files and len(sets) == 1 and b + 1 < len(buckets):
            fetch_bucket(b + 1)
    for st in sets:
        st.settle()
    return found
