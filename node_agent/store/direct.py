"""New blob files written past the page cache (O_DIRECT), through a few aligned buffers used again and again.

A blob brought in from a registry is written once and not read back soon
(a lazy restore already has its verified bytes; a restore after a full
pull reads each blob once; what is fetched ahead of a restore is read back
by its page source, from the disk, within a second or two, where writing it
through the page cache instead saved nothing measurable: docs/benchmarks.md). A buffered write copies every byte into new
page-cache pages first, and takes as many pages from the free memory as
the blob is long. Where the memory was given back to a virtual machine's
host (free page reporting, as on the test machines), each such page also
costs a fault in the host when first written: writing 1 GiB into new page
cache took 1.4 to 2.9 CPU seconds there, written direct 0.12. A direct
write hands the buffer to the disk instead; the buffers are this module's
own, allocated once and kept, so their pages are backed already.

`NewFile` writes whole blocks from its buffer and the last, partial one
padded with zeros, then truncates the file to its length. A filesystem
that refuses O_DIRECT (tmpfs, some overlay and network filesystems) gets
the same bytes through ordinary writes; the caller still fsyncs the file
before it counts as durable, as with any other write.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable
from typing import Final

from node_agent.store.files import FILE_MODE, NEW_FILE, write_all

BLOCK: Final = 4096
"""The alignment of a direct write's address, length and offset (the largest logical block size in use)."""
BUFFER: Final = 1 << 20
"""One buffer's size: the most one direct write sends."""
KEEP: Final = 16
"""Buffers kept for the next files once given back; more than that are unmapped."""
O_DIRECT: Final = getattr(os, "O_DIRECT", 0)

_free: list[mmap.mmap] = []
_lock = threading.Lock()


def _take() -> mmap.mmap:
    with _lock:
        if _free:
            return _free.pop()
    return mmap.mmap(-1, BUFFER)


def _give(buf: mmap.mmap) -> None:
    with _lock:
        if len(_free) < KEEP:
            _free.append(buf)
            return
    buf.close()


class NewFile:
    """A new file at ``path`` (0600, must not exist), written past the page cache where its filesystem allows.

    ``write`` the bytes in order, then ``finish`` (the file then holds
    exactly them), and ``close`` in any case. ``direct`` says whether the
    writes go past the page cache.
    """

    def __init__(self, path: str) -> None:
        self.direct = O_DIRECT != 0
        try:
            self.fd = os.open(path, NEW_FILE | O_DIRECT, FILE_MODE)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.direct:
                raise
            self.direct = False
            self.fd = os.open(path, NEW_FILE, FILE_MODE)
        try:
            self._buf: mmap.mmap | None = _take() if self.direct else None
        except BaseException:
            os.close(self.fd)
            raise
        self._fill = 0  # bytes waiting in the buffer
        self._size = 0  # bytes given so far
        self._written = 0  # bytes the buffer sent to the file so far

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._size += len(view)
        if self._buf is None:
            write_all(self.fd, view)
            return
        while view:
            take = min(len(view), BUFFER - self._fill)
            self._buf[self._fill : self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == BUFFER:
                self._flush(BUFFER)

    def receive(self, readinto: Callable[[memoryview], int], most: int, seen: Callable[[memoryview], object]) -> int:
        """Read up to ``most`` bytes with ``readinto`` straight into the buffer (written out once it is full),
        handing them to ``seen`` first; how many came (0: the stream has ended). No copy is made on the way."""
        if self._buf is None:
            piece = memoryview(bytearray(min(most, BUFFER)))
            got = readinto(piece)
            if got:
                seen(piece[:got])
                self.write(piece[:got])
            return got
        if self._fill == BUFFER:
            self._flush(BUFFER)
        free = memoryview(self._buf)[self._fill : self._fill + min(most, BUFFER - self._fill)]
        try:
            got = readinto(free)
            if got:
                seen(free[:got])
        finally:
            free.release()
        self._fill += got
        self._size += got
        return got

    def finish(self) -> None:
        """Write what the buffer holds; the file is then exactly the bytes written."""
        if self._buf is None or not self._fill:
            return
        padded = -(-self._fill // BLOCK) * BLOCK
        self._buf[self._fill : padded] = bytes(padded - self._fill)
        self._flush(padded)
        os.ftruncate(self.fd, self._size)

    def _flush(self, length: int) -> None:
        assert self._buf is not None
        view = memoryview(self._buf)[:length]
        try:
            try:
                _write_at(self.fd, view, self._written)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                # The filesystem opened the file for direct writes but refuses these (its blocks are
                # larger, say): the same bytes, at the same place, through the page cache.
                self._buffered()
                _write_at(self.fd, view, self._written)
        finally:
            view.release()
        self._written += length
        self._fill = 0

    def _buffered(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
        self.direct = False

    def close(self) -> None:
        if self._buf is not None:
            _give(self._buf)
            self._buf = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write_at(fd: int, view: memoryview, offset: int) -> None:
    """Write every byte of ``view`` at ``offset``."""
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done
