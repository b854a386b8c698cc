"""Writing a checkpoint's files: a writer's data file (its blocks back to back, each
checksummed as it passes, ``O_DIRECT`` where the file system takes it), its blocks file, and
JSON written and fsynced whole. ``Arena``: host memory laid out as a data file, which a
background save copies the state into and writes from without a second copy."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import sys
from collections.abc import Iterable
from typing import Any

import torch

from fsharded.checkpoint._common import CHUNK, _bytes, checksummer


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(obj))  # one string from the C encoder (json.dump streams in Python)
        f.flush()
        os.fsync(f.fileno())



def _write_data(tmp: str, rank: int, pieces: Iterable[tuple], arena: Arena | None = None) -> None:
    """This writer's data file and, once it is on disk, its blocks file (renamed into place
    complete, so that a reader that sees it sees all of it). Written a chunk at a time, each
    checksummed as it passes (``_DataFile``). With ``arena``, the pieces' values are its
    slices, back to back from its start (``Arena.copy_in``): they are checksummed as they come,
    then the file is written from the arena's memory in one pass."""
    kind, crc = checksummer()
    blocks = []
    data_name = f"data-{rank:05d}.bin"
    out = _DataFile(os.path.join(tmp, data_name))
    offset = 0
    try:
        for path, start, size, piece in pieces:
            buf = piece if arena is not None else _bytes(piece)
            value, part = 0, None
            for i in range(0, buf.nbytes, CHUNK):
                part = buf[i:i + CHUNK]
                value = crc(part, value)
                if arena is None:
                    out.write(part)
            blocks.append({"path": path, "start": start, "shape": size, "file": data_name,
                           "offset": offset, "nbytes": buf.nbytes, kind: value})
            offset += buf.nbytes
            del buf, part, piece  # a staged copy is freed before the next one is asked for
        if arena is not None:
            out.write_from(arena.view, arena.used)
        out.finish()
    finally:
        out.close()
    name = os.path.join(tmp, f"blocks-{rank:05d}.json")
    _write_json(name + ".part", blocks)
    os.replace(name + ".part", name)


_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length multiples of this


class _DataFile:
    """Bytes written back to back into a new file, then fsynced.

    Where the OS and the file system take ``O_DIRECT`` (Linux, most disk file systems;
    ``FSHARDED_CKPT_DIRECT=0`` turns it off) the bytes go from an aligned chunk buffer
    straight to the disk: no page-cache copy and no kernel write-back threads competing
    with training for the CPU (on a 2-core VM it writes 300 MB in about a fifth of the
    buffered time), as DeepSpeed's FastPersist does. The last chunk is padded to the
    alignment and the file truncated to its length. Elsewhere (tmpfs, macOS) the writes
    are buffered, each chunk's write-back to the disk started at once (Linux's
    sync_file_range) so that the closing fsync waits only for the last chunks."""

    def __init__(self, path: str) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0) if os.environ.get("FSHARDED_CKPT_DIRECT", "1") != "0" else 0
        self.fd, self.direct = -1, False
        if direct:
            try:
                self.fd, self.direct = os.open(path, flags | direct, 0o644), True
            except OSError:  # EINVAL: the file system does not take O_DIRECT
                with contextlib.suppress(OSError):
                    os.unlink(path)
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o644)
        self.offset = 0  # bytes written (in the buffer included)
        self._synced = 0  # buffered: bytes whose write-back has been started
        if self.direct:
            self._buf = mmap.mmap(-1, CHUNK)  # page-aligned
            self._view = memoryview(self._buf)
            self._fill, self._fell_back = 0, False

    def write(self, part: memoryview) -> None:
        self.offset += part.nbytes
        if not self.direct:
            while part.nbytes:
                part = part[os.write(self.fd, part):]
            if self.offset - self._synced >= CHUNK:
                _start_writeback(self.fd, self._synced, self.offset - self._synced)
                self._synced = self.offset
            return
        while part.nbytes:
            n = min(part.nbytes, CHUNK - self._fill)
            self._view[self._fill:self._fill + n] = part[:n]
            self._fill += n
            part = part[n:]
            if self._fill == CHUNK:
                self._flush(CHUNK)

    def _flush(self, n: int) -> None:
        """Write the buffer's first ``n`` bytes (a multiple of the alignment)."""
        done = 0
        while done < n:
            try:
                done += os.write(self.fd, self._view[done:n])
            except OSError as e:
                if e.errno != errno.EINVAL or self._fell_back:
                    raise
                self._buffered()  # a device with a larger alignment: the rest buffered
        self._fill = 0

    def _buffered(self) -> None:
        import fcntl

        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self._fell_back = True

    def write_from(self, view: memoryview, nbytes: int) -> None:
        """The first ``nbytes`` of ``view`` as the whole file, written straight from it:
        ``view`` starts at a page boundary and holds ``nbytes`` rounded up to the alignment
        (the padding written with O_DIRECT is cut)."""
        if self.offset:
            raise ValueError("_DataFile.write_from: the file must be empty")
        if not self.direct:
            for i in range(0, nbytes, CHUNK):
                self.write(view[i:min(i + CHUNK, nbytes)])
            return
        padded = -(-nbytes // _ALIGN) * _ALIGN
        done = 0
        while done < padded:
            try:
                done += os.write(self.fd, view[done:min(done + CHUNK, padded)])
            except OSError as e:
                if e.errno != errno.EINVAL or self._fell_back:
                    raise
                self._buffered()
        self.offset = nbytes
        if padded != nbytes:
            os.ftruncate(self.fd, nbytes)

    def finish(self) -> None:
        """Write what is buffered, cut the padding, fsync."""
        if self.direct and self._fill:
            n = -(-self._fill // _ALIGN) * _ALIGN
            self._view[self._fill:n] = bytes(n - self._fill)
            self._flush(n)
            os.ftruncate(self.fd, self.offset)
        os.fsync(self.fd)

    def close(self) -> None:
        if self.direct:
            self._view.release()
            self._buf.close()
            self.direct = False
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_sync_file_range: Any = None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a range of ``fd``'s page cache to the disk without waiting (Linux's
    sync_file_range; elsewhere nothing: fsync then writes it all)."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                _sync_file_range = fn
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; errors: fsync reports them


class Arena:
    """Page-aligned host memory that a background save copies a writer's blocks into, back
    to back as they lie in its data file, so that the file is written from it with no
    further copy (``O_DIRECT`` takes the pages as they are). ``checkpoint.Staging`` keeps
    one between saves: the next copy then runs at memory speed instead of faulting in new
    pages (measured here: 2.4 ms instead of 13 ms for 29 MB)."""

    def __init__(self, nbytes: int) -> None:
        self.capacity = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        self._mm = mmap.mmap(-1, self.capacity)
        self.view = memoryview(self._mm)
        self.used = 0
        self._layout: Any = None  # the layout the views below were made for
        self._dsts: list = []
        self._views: list[memoryview] = []

    def copy_in(self, layout: Any, tensors: list[torch.Tensor]) -> list[memoryview]:
        """Copy each of ``tensors`` (any device, any strides) to its block of ``layout``
        (``checkpoint._layout._Layout``: the blocks' offsets and bytes, back to back from the
        start, as C-order bytes); those bytes here, one memoryview per block. The tensors
        over the blocks are kept for the next copy of the same layout (a step saves the
        same state again)."""
        if layout.total > self.capacity:
            raise ValueError(f"Arena.copy_in: {layout.total} bytes do not fit in {self.capacity}")
        if self._layout is not layout:
            self._layout, self._dsts = None, []
            for x, offset, n in zip(tensors, layout.offsets, layout.nbytes):
                self._dsts.append(torch.frombuffer(self._mm, dtype=x.dtype, count=x.numel(), offset=offset)
                                  .view(x.shape) if n else None)
            self._views = [self.view[o:o + n] for o, n in zip(layout.offsets, layout.nbytes)]
            self._layout = layout
        with torch.no_grad():
            for dst, x in zip(self._dsts, tensors):
                if dst is not None:
                    dst.copy_(x.detach())
        self.used = layout.total
        return self._views
