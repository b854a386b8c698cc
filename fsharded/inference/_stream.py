"""ZeRO-Inference: the blocks' weights kept in host memory or in files on a disk and
brought to the device one block at a time, the next block's read running while this one
computes, so a model larger than device memory (or RAM, for files) generates at the speed
the transfer allows.

``stream_weights(params, tier="nvme", path=DIR)`` returns the GPT's tree with
``params["blocks"]`` a ``StreamedBlocks``: each block's tensors written once, back to back,
to one file under ``DIR`` (read with ``fsharded.kernels.aio``: ``O_DIRECT`` where the
filesystem allows, so the weights do not come back as page cache, and a CRC-32C checked
on every read: a file changed behind the model's back is an error naming it); or with
``tier="cpu"`` kept in host memory (pinned where the device is a GPU) and copied to the
device per block. The embedding, the final norm and the head stay where they are (on the
device). Iterating the blocks (what ``forward`` does, layer by layer) yields each block as
views into one of ``prefetch + 1`` device buffers while the following blocks are read into
the others: the device holds ``prefetch + 1`` blocks at a time, never the whole stack.

The numbers are the in-memory model's, bit for bit: the same bytes, the same operations.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import optree
import torch

from fsharded.inference._int8 import Int8Weight
from fsharded.kernels import aio

__all__ = ["StreamedBlocks", "stream_weights", "block_meta"]


@dataclass(frozen=True)
class _Layout:
    """Where each tensor of a block lies in the block's bytes, and how the block's leaves
    are made of them (``int8[i]``: leaf ``i`` an ``Int8Weight`` of two tensors, its ``q``
    and ``scales``, with its ``(shape, inputs)``; None: one tensor)."""

    treedef: Any
    int8: tuple[tuple[tuple[int, ...], int] | None, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    nbytes: int


def _tensors(block: dict) -> tuple[list[torch.Tensor], Any, tuple]:
    """A block's tensors in order (an int8 weight's ``q`` then ``scales``), its tree, and
    which leaves are int8 weights (``_Layout.int8``)."""
    leaves, treedef = optree.tree_flatten(block)
    tensors, int8 = [], []
    for x in leaves:
        if isinstance(x, Int8Weight):
            tensors += [x.q, x.scales]
            int8.append((x.shape, x.inputs))
        elif isinstance(x, torch.Tensor):
            tensors.append(x)
            int8.append(None)
        else:
            raise ValueError(f"stream_weights: a block holds a {type(x).__name__}; only tensors and int8 weights "
                             f"(fs.inference.quantize) can be streamed")
    return tensors, treedef, tuple(int8)


def _leaves(tensors: list, int8: tuple) -> list:
    """The block's leaves from its tensors (``_tensors`` undone)."""
    out, i = [], 0
    for recipe in int8:
        if recipe is None:
            out.append(tensors[i])
            i += 1
        else:
            out.append(Int8Weight(tensors[i], tensors[i + 1], *recipe))
            i += 2
    return out


def _layout(block: dict) -> _Layout:
    tensors, treedef, int8 = _tensors(block)
    offsets, at = [], 0
    for x in tensors:
        at = -(-at // 64) * 64  # each tensor 64-byte aligned in the block's bytes
        offsets.append(at)
        at += x.numel() * x.element_size()
    return _Layout(treedef, int8, tuple(tuple(x.shape) for x in tensors), tuple(x.dtype for x in tensors),
                   tuple(offsets), aio.padded(at))


def _views(buf: torch.Tensor, layout: _Layout) -> dict:
    tensors = [buf[o:o + torch.Size(s).numel() * torch.empty((), dtype=d).element_size()].view(d).view(s)
               for o, s, d in zip(layout.offsets, layout.shapes, layout.dtypes)]
    return optree.tree_unflatten(layout.treedef, _leaves(tensors, layout.int8))


def _meta(layout: _Layout) -> dict:
    """The block as meta tensors (and int8 weights of meta tensors): shapes, no data."""
    tensors = [torch.empty(s, dtype=d, device="meta") for s, d in zip(layout.shapes, layout.dtypes)]
    return optree.tree_unflatten(layout.treedef, _leaves(tensors, layout.int8))


_DIRS: list[str] = []


@atexit.register
def _remove_dirs() -> None:
    for d in _DIRS:
        shutil.rmtree(d, ignore_errors=True)
    _DIRS.clear()


class StreamedBlocks:
    """The GPT's blocks in a tier, read per block with prefetch (see the module docstring).
    ``meta[i]``: block ``i`` as meta tensors (shapes and dtypes, no data); ``reads``: the
    blocks read so far; ``nbytes``: the bytes one pass over the blocks moves."""

    def __init__(self, blocks: list[dict], tier: str, path: str | None, prefetch: int, device: torch.device) -> None:
        if tier not in ("nvme", "cpu"):
            raise ValueError(f"stream_weights: tier must be 'nvme' or 'cpu', got {tier!r}")
        if prefetch < 1:
            raise ValueError(f"stream_weights: prefetch must be >= 1 (the next block read while one computes), "
                             f"got {prefetch}")
        if tier == "nvme" and path is None:
            raise ValueError("stream_weights: tier='nvme' needs path=, a directory on the disk to hold the weights")
        self.tier, self.prefetch, self.device = tier, int(prefetch), device
        self.layouts = [_layout(b) for b in blocks]
        self.meta = [_meta(lay) for lay in self.layouts]
        self.nbytes = sum(lay.nbytes for lay in self.layouts)
        size = max(lay.nbytes for lay in self.layouts)
        self._buffers = [aio.aligned_empty(size) for _ in range(self.prefetch + 1)]
        if device.type == "cuda":
            self._device_buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in self._buffers]
        self.reads = 0
        self._files: list[aio.File] = []
        self._crcs: list[int] = []
        self._host: list[torch.Tensor] = []
        if tier == "nvme":
            self.path = tempfile.mkdtemp(prefix="fsharded-weights-", dir=os.path.abspath(path))
            _DIRS.append(self.path)
            for i, (b, lay) in enumerate(zip(blocks, self.layouts)):
                buf = self._buffers[0]
                buf.zero_()
                self._pack(b, lay, buf)
                f = aio.File.create(os.path.join(self.path, f"block-{i:04d}.bin"), lay.nbytes)
                self._crcs.append(f.write(0, buf, lay.nbytes).wait())
                f.sync()
                self._files.append(f)
        else:
            for b, lay in zip(blocks, self.layouts):
                h = torch.empty(lay.nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
                self._pack(b, lay, h)
                self._host.append(h)
        self._lock = threading.Lock()

    @staticmethod
    def _pack(block: dict, layout: _Layout, buf: torch.Tensor) -> None:
        for x, o in zip(_tensors(block)[0], layout.offsets):
            n = x.numel() * x.element_size()
            buf[o:o + n].copy_(x.detach().contiguous().cpu().reshape(-1).view(torch.uint8))

    def __len__(self) -> int:
        return len(self.layouts)

    def _start(self, i: int, slot: int) -> Any:
        """Begin moving block ``i`` into buffer ``slot``; a handle to ``_finish``."""
        lay = self.layouts[i]
        if self.tier == "nvme":
            return self._files[i].read(0, self._buffers[slot], lay.nbytes)
        return None

    def _finish(self, i: int, slot: int, handle: Any) -> dict:
        lay = self.layouts[i]
        if self.tier == "nvme":
            crc = handle.wait()
            if crc != self._crcs[i]:
                raise RuntimeError(f"stream_weights: {self._files[i].path} does not hold the bytes written to it "
                                   f"(CRC-32C {crc:#010x}, written {self._crcs[i]:#010x}): the weights file was "
                                   f"changed or damaged; rebuild the streamed model from its weights")
            src = self._buffers[slot]
        else:
            src = self._host[i]
        if self.device.type == "cuda":
            dst = self._device_buffers[slot]
            dst[:lay.nbytes].copy_(src[:lay.nbytes])  # (done before the staging buffer is read into again)
            src = dst
        elif self.tier == "cpu":  # (the host is the device: the copy a GPU would make, into a staging buffer)
            self._buffers[slot][:lay.nbytes].copy_(src[:lay.nbytes])
            src = self._buffers[slot]
        self.reads += 1
        return _views(src, lay)

    def __iter__(self) -> Iterator[dict]:
        if not self._lock.acquire(blocking=False):  # (one pass at a time: the passes share the buffers)
            raise RuntimeError("StreamedBlocks: a pass over the blocks is already running (another thread, or a "
                               "pass left unfinished); streamed weights run one forward at a time")
        n, k = len(self), self.prefetch + 1
        pending = {i: self._start(i, i % k) for i in range(min(self.prefetch, n))}
        try:
            for i in range(n):
                block = self._finish(i, i % k, pending.pop(i))
                if i + self.prefetch < n:  # into the buffer of block i - 1, which the caller is done with
                    j = i + self.prefetch
                    pending[j] = self._start(j, j % k)
                yield block
        finally:  # (a pass left early: its reads still finish before their buffers are reused)
            for handle in pending.values():
                if handle is not None:
                    handle.wait()
            self._lock.release()

    def __getitem__(self, i: int) -> dict:
        """Block ``i``, read now into the last buffer (random access: no prefetch)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"StreamedBlocks: block {i} of {len(self)}")
        i %= len(self)
        slot = self.prefetch  # (iteration reuses it; a block read here is good until the next read)
        return self._finish(i, slot, self._start(i, slot))

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []
        if self.tier == "nvme":
            shutil.rmtree(self.path, ignore_errors=True)

    def __repr__(self) -> str:
        return (f"StreamedBlocks({len(self)} blocks, {self.nbytes / 1e6:.1f} MB in {self.tier}, "
                f"{self.prefetch + 1} on the device at a time)")


def stream_weights(params: dict, tier: str = "nvme", path: str | None = None, *, prefetch: int = 1) -> dict:
    """``params`` (a GPT's tree) with its blocks in ``tier`` (``"nvme"``: files under
    ``path``; ``"cpu"``: host memory), streamed per block during generation."""
    blocks = params["blocks"]
    if not blocks:
        raise ValueError("stream_weights: the model has no blocks to stream")
    device = params["emb"].device
    return {**params, "blocks": StreamedBlocks(list(blocks), tier, path, prefetch, device)}


def block_meta(params: dict) -> Any:
    """The blocks to read shapes from without reading weights: a ``StreamedBlocks``'s
    ``meta``, or the blocks themselves."""
    blocks = params["blocks"]
    return blocks.meta if isinstance(blocks, StreamedBlocks) else blocks
