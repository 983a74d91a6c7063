"""Where an import's archive members land before they go into the store.

Rule: archive names never become filesystem paths. Member content is
written to flat, numbered files (`m<n>`) in a private staging directory
under the store's work area, created with O_EXCL|O_NOFOLLOW relative to that
directory's descriptor. Every write into it is counted first (`Meter`):
against the bounds (`ImportLimits`), and against the filesystem's free
space, which must keep `min_free_bytes`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from dataclasses import dataclass

from node_agent import errors
from node_agent.interop import common as c

COPY = 1 << 20


@dataclass
class Staged:
    kind: str  # tarstream.FILE or tarstream.DIR
    mode: int
    size: int
    name: str | None  # staging file; None for directories and content not kept; "" while looking ahead


class Staging:
    """A private directory of flat, numbered files."""

    def __init__(self, parent: str) -> None:
        os.makedirs(parent, mode=0o700, exist_ok=True)
        self.root = os.path.join(parent, f"import-{secrets.token_hex(8)}")
        os.mkdir(self.root, 0o700)
        self.fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._n = 0

    def create(self) -> tuple[str, int]:
        self._n += 1
        name = f"m{self._n}"
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        return name, fd

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def read(self, name: str, limit: int, what: str) -> bytes:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise errors.ResourceExhausted(f"{what}: {size} bytes is more than the limit of {limit}")
            data = os.read(fd, size + 1)
            while len(data) < size:
                more = os.read(fd, size - len(data))
                if not more:
                    break
                data += more
            return data
        finally:
            os.close(fd)

    def reset(self) -> None:
        """Remove every staged file (the archive is read again from its start)."""
        for name in os.listdir(self.fd):
            os.unlink(name, dir_fd=self.fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        shutil.rmtree(self.root, ignore_errors=True)


def free_bytes(fd: int) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `fd`."""
    st = os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize


class Meter:
    """Every byte bound for staging, counted before it is written: against the bounds and the free space.

    The staging filesystem's free space is read (fstatvfs) at each member's
    header, and again before more than `free_check_bytes` have been written
    since the last look, so `min_free_bytes` stay free even while something
    else fills the disk.
    """

    def __init__(self, fd: int, where: str, limits: c.ImportLimits, bounds: c.StagingBounds) -> None:
        self._fd = fd
        self._where = where
        self._min_free = limits.min_free_bytes
        self._every = limits.free_check_bytes
        self._bounds = bounds
        self.staged = 0  # bytes in staging now
        self._credit = 0  # bytes that may be written before the free space is read again

    def reset(self) -> None:
        self.staged = 0
        self._credit = 0

    def _room(self) -> tuple[int, int]:
        free = free_bytes(self._fd)
        return free, free - self._min_free

    def admit(self, shown: str, size: int) -> None:
        """Before a member's content: all of it must fit."""
        if not size:
            return
        if self.staged + size > self._bounds.total_bytes:
            raise errors.ResourceExhausted(
                f"tar member {shown}: staging its {size} bytes would pass the limit of "
                f"{self._bounds.total_bytes} ({self._bounds.total_name()})"
            )
        free, room = self._room()
        if room < size:
            raise errors.ResourceExhausted(
                f"tar member {shown}: staging its {size} bytes would leave less than "
                f"min_free_bytes={self._min_free} free under {self._where} ({free} bytes free)"
            )
        self._credit = min(room, self._every)

    def charge(self, shown: str, n: int, done: int, size: int) -> None:
        """Before `n` more bytes of a member of `size` bytes, `done` of them already staged."""
        if self.staged + n > self._bounds.total_bytes:
            raise errors.ResourceExhausted(
                f"tar member {shown}: staging more than {done} of its {size} bytes would pass the limit of "
                f"{self._bounds.total_bytes} ({self._bounds.total_name()})"
            )
        if n > self._credit:
            free, room = self._room()
            if room < n:
                raise errors.ResourceExhausted(
                    f"tar member {shown}: staging more than {done} of its {size} bytes would leave less than "
                    f"min_free_bytes={self._min_free} free under {self._where} ({free} bytes free)"
                )
            self._credit = min(room, max(self._every, n))
        self._credit -= n
        self.staged += n
