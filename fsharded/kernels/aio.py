"""Asynchronous file I/O for the NVMe memory tier (``csrc/aio.cpp``): a C++ thread pool
running ``pread``/``pwrite``, with ``O_DIRECT`` where the filesystem allows it and a
CRC-32C of every range read or written.

>>> f = File.create("/nvme/state.bin", nbytes=1 << 20)
>>> buf = aligned_empty(1 << 20)
>>> crc = f.write(0, buf).wait()          # the checksum of what was written
>>> assert f.read(0, buf).wait() == crc   # and of what was read back

Built once per install (a C++ compiler, no system library: neither ``libaio`` nor
``liburing`` is needed). Errors are raised by ``wait``, naming the file, the offset and
the sizes: a short read (a truncated file), a full disk, any other errno.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from fsharded import _cext

__all__ = ["File", "Pending", "aligned_empty", "checksum", "load", "set_threads", "ALIGN"]

ALIGN = 4096  # O_DIRECT's alignment of addresses, offsets and sizes (csrc/aio.cpp's kAlign)


@functools.cache
def _build() -> tuple[ModuleType | None, str]:
    return _cext.build("fsharded_aio", ("aio.cpp",), root=_cext.CSRC, what="the NVMe tier's file I/O",
                       took="~15 s", extra_cflags=["-O3"], extra_ldflags=["-lpthread"])


def load(required: bool = True) -> ModuleType | None:
    """The compiled extension (built on first use); ``None`` where it cannot be built,
    or with ``required`` a ``RuntimeError`` saying why."""
    mod, why = _build()
    if mod is None and required:
        raise RuntimeError(f"the NVMe tier needs its C++ file I/O, which cannot be built here: {why}. "
                           f"Install a C++ compiler (g++) and ninja, or keep the state in memory or on the host "
                           f"(offload_optimizer='cpu')")
    return mod


def set_threads(n: int) -> None:
    """Run the I/O on ``n`` threads (default 4); call with no request outstanding."""
    load().set_threads(int(n))


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A ``uint8`` CPU tensor of at least ``nbytes`` (a multiple of ``ALIGN``), its address
    aligned for ``O_DIRECT``."""
    return load().aligned_empty(int(nbytes))


def checksum(t: torch.Tensor) -> int:
    """The CRC-32C of a contiguous CPU tensor's bytes (what ``Pending.wait`` returns)."""
    return int(load().checksum(t))


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGN``."""
    return -(-int(nbytes) // ALIGN) * ALIGN


class Pending:
    """A queued read or write: ``wait()`` blocks until it is done and returns the CRC-32C
    of its data, or raises the error it met. Wait for every request once."""

    __slots__ = ("_ticket", "_done", "_crc")

    def __init__(self, ticket: int) -> None:
        self._ticket, self._done, self._crc = ticket, False, 0

    def wait(self) -> int:
        if not self._done:
            self._done = True
            self._crc = int(load().wait(self._ticket))
        return self._crc


class File:
    """One file of the tier, open for reading and writing (``O_DIRECT`` where possible:
    ``direct``). ``create`` makes it with its bytes reserved (a full disk is an error
    here); ``open`` opens an existing one and checks its size."""

    def __init__(self, path: str, fd: int, direct: bool, nbytes: int) -> None:
        self.path, self.fd, self.direct, self.nbytes = path, fd, direct, nbytes

    @classmethod
    def create(cls, path: str | os.PathLike, nbytes: int, *, direct: bool = True) -> File:
        fd, on = load().open_file(os.fspath(path), int(nbytes), True, bool(direct))
        return cls(os.fspath(path), fd, on, int(nbytes))

    @classmethod
    def open(cls, path: str | os.PathLike, nbytes: int, *, direct: bool = True) -> File:
        fd, on = load().open_file(os.fspath(path), int(nbytes), False, bool(direct))
        return cls(os.fspath(path), fd, on, int(nbytes))

    def _io(self, offset: int, buf: torch.Tensor, nbytes: int | None, write: bool, check: bool) -> Pending:
        logical = buf.numel() * buf.element_size() if nbytes is None else int(nbytes)
        io = logical
        if self.direct:  # whole aligned blocks from an aligned offset into an aligned buffer
            if offset % ALIGN or buf.data_ptr() % ALIGN:
                raise ValueError(f"aio: {self.path} is opened with O_DIRECT: offset {offset} and the buffer's "
                                 f"address must be multiples of {ALIGN} (use aligned_empty)")
            io = padded(logical)
        return Pending(load().submit(self.fd, int(offset), buf, io, logical, write, check))

    def read(self, offset: int, buf: torch.Tensor, nbytes: int | None = None, *, check: bool = True) -> Pending:
        """Read ``nbytes`` (default: the buffer's size) at ``offset`` into ``buf``."""
        return self._io(offset, buf, nbytes, False, check)

    def write(self, offset: int, buf: torch.Tensor, nbytes: int | None = None, *, check: bool = True) -> Pending:
        """Write ``nbytes`` (default: the buffer's size) of ``buf`` at ``offset``."""
        return self._io(offset, buf, nbytes, True, check)

    def sync(self, drop: bool = True) -> None:
        """Flush the file to the device and drop its pages from the page cache."""
        load().sync_file(self.fd, bool(drop))

    def close(self) -> None:
        if self.fd >= 0:
            load().close_file(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        return f"File({self.path!r}, {self.nbytes} bytes, {'O_DIRECT' if self.direct else 'buffered'})"
