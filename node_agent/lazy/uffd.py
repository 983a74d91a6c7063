"""The kernel's userfaultfd, the part a fault handler uses (``linux/userfaultfd.h``).

CRIU's restore opens one userfaultfd per restored process (non-blocking,
with the FORK, REMAP, REMOVE and UNMAP events), registers the process's
lazy memory with it in "missing" mode and hands it to the lazy-pages
handler. The handler then reads messages from it (a page fault, or an
event that changes the process's memory map) and fills pages:

* ``UFFDIO_COPY`` copies whole pages into the process and wakes the
  threads waiting on them. It stops at a page that is already there
  (EEXIST), fails with EAGAIN while the process's map is changing (an event
  not yet read), with ENOENT where no registered mapping is, and with
  ESRCH once the process's memory is gone (it exited or ran execve).
* ``UFFDIO_ZEROPAGE`` maps the zero page (memory the checkpoint holds no
  bytes for).
* ``UFFDIO_UNREGISTER`` stops faults in a range (after ``madvise`` removed
  it, its pages are the process's own business again).

Every call goes through ctypes, which lets go of the interpreter lock for
the call's length, so copies in several threads run side by side.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass
from typing import Final

PAGEFAULT: Final = 0x12
FORK: Final = 0x13
REMAP: Final = 0x14
REMOVE: Final = 0x15
UNMAP: Final = 0x16

MSG: Final = struct.Struct("<B3x4x24s")  # struct uffd_msg: event, padding, the 24-byte union
_FAULT: Final = struct.Struct("<QQ8x")
_FORK: Final = struct.Struct("<I20x")
_REMAP: Final = struct.Struct("<QQQ")
_RANGE: Final = struct.Struct("<QQ8x")

# Gone: the process's memory no longer exists (ESRCH; ENOSPC on older kernels).
GONE: Final = frozenset({errno.ESRCH, errno.ENOSPC})


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0xAA << 8) | nr


class _Copy(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_uint64), ("src", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("mode", ctypes.c_uint64), ("copy", ctypes.c_int64)]


class _Range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Zero(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("zeropage", ctypes.c_int64)]


# _IOWR is _IOC_READ | _IOC_WRITE (3), _IOR is _IOC_READ (2).
UFFDIO_COPY: Final = _ioc(3, 0x03, ctypes.sizeof(_Copy))
UFFDIO_ZEROPAGE: Final = _ioc(3, 0x04, ctypes.sizeof(_Zero))
UFFDIO_UNREGISTER: Final = _ioc(2, 0x01, ctypes.sizeof(_Range))

_libc = ctypes.CDLL(None, use_errno=True)
_ioctl = _libc.ioctl
_ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
_ioctl.restype = ctypes.c_int


@dataclass(frozen=True)
class Message:
    """One message read from a userfaultfd."""

    event: int
    address: int = 0  # PAGEFAULT: the faulting address
    fd: int = -1  # FORK: the child's userfaultfd, now open in this process
    start: int = 0  # REMAP: from; REMOVE/UNMAP: start
    end: int = 0  # REMAP: from + len; REMOVE/UNMAP: end
    to: int = 0  # REMAP: the new start


def read(fd: int) -> Message | None:
    """The next message, or None when none is queued."""
    try:
        data = os.read(fd, MSG.size)
    except BlockingIOError:
        return None
    if len(data) != MSG.size:
        raise OSError(errno.EIO, f"short userfaultfd message ({len(data)} bytes)")
    event, arg = MSG.unpack(data)
    if event == PAGEFAULT:
        _flags, address = _FAULT.unpack(arg)
        return Message(event, address=address)
    if event == FORK:
        return Message(event, fd=_FORK.unpack(arg)[0])
    if event == REMAP:
        start, to, length = _REMAP.unpack(arg)
        return Message(event, start=start, end=start + length, to=to)
    if event in (REMOVE, UNMAP):
        start, end = _RANGE.unpack(arg)
        return Message(event, start=start, end=end)
    return Message(event)


def copy(fd: int, dst: int, src: int, length: int) -> tuple[int, int]:
    """(bytes copied, errno): ``length`` bytes from address ``src`` of this process to ``dst`` of the faulting one.

    errno is 0 when all of it was copied; otherwise the copy stopped after
    the bytes it reports (EEXIST: at a page already there).
    """
    arg = _Copy(dst, src, length, 0, 0)
    if _ioctl(fd, UFFDIO_COPY, ctypes.byref(arg)) == 0:
        return length, 0
    err = ctypes.get_errno()
    return max(0, int(arg.copy)), err


def zeropage(fd: int, start: int, length: int) -> int:
    """Map zero pages at ``start``; the errno (0 when done)."""
    arg = _Zero(start, length, 0, 0)
    if _ioctl(fd, UFFDIO_ZEROPAGE, ctypes.byref(arg)) == 0:
        return 0
    return ctypes.get_errno()


def unregister(fd: int, start: int, length: int) -> int:
    """Stop handling faults in a range; the errno (0 when done)."""
    arg = _Range(start, length)
    if _ioctl(fd, UFFDIO_UNREGISTER, ctypes.byref(arg)) == 0:
        return 0
    return ctypes.get_errno()


def address_of(data: bytes) -> int:
    """The address of the bytes of ``data`` (kept alive by the caller while it is used)."""
    addr = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert addr is not None
    return addr
