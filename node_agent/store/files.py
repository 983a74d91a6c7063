"""Filesystem helpers of the store: errors, private directories, durable and bounded file I/O.

Rule: every file the store makes is private (0600 in 0700 directories), is
created without following a symlink and never replaces another by surprise;
what must survive a crash is fsynced, with its directory. Reads are bounded
and never follow a final symlink. This module knows paths and bytes only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from typing import Final

from node_agent.errors import AgentError, FailedPrecondition, Internal, NotFound, ResourceExhausted

DIR_MODE: Final = 0o700
FILE_MODE: Final = 0o600
_DIGEST_SCAN_RE: Final = re.compile(rb"sha256:([0-9a-f]{64})")
_SCAN_BLOCK: Final = 1 << 20
O_CLOEXEC: Final = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY: Final = getattr(os, "O_DIRECTORY", 0)
NEW_FILE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC
"""Open flags of a file the store makes: new, never through a final symlink."""


def os_error(exc: OSError, what: str) -> AgentError:
    """Translate an OSError into the agent's hierarchy."""
    detail = f"{what}: {exc.strerror or exc}"
    if exc.errno == errno.ENOENT:
        return NotFound(detail)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return FailedPrecondition(detail)
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST):
        return FailedPrecondition(f"{detail} (an unexpected file or symlink is in the way)")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE):
        return ResourceExhausted(detail)
    return Internal(detail)


def ensure_dir(path: str) -> None:
    """Create ``path`` (mode 0700) if missing and tighten it to 0700."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise Internal(f"store path {path!r} exists and is not a directory")
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries to disk."""
    fd = os.open(path, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write every byte of ``data`` to ``fd``."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def write_new_file(path: str, data: bytes | bytearray | memoryview, *, sync: bool = False) -> None:
    """Create ``path`` (0600, must not exist), write ``data``, fsync when ``sync``.

    A failed write removes the partial file.
    """
    fd = os.open(path, NEW_FILE, FILE_MODE)
    try:
        write_all(fd, data)
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)


def replace_file(path: str, data: bytes, *, scratch_dir: str) -> None:
    """Atomically replace ``path`` with ``data``.

    The new bytes are written and fsynced in ``scratch_dir`` (on the same
    filesystem), renamed over ``path``, and ``path``'s directory is fsynced.
    """
    temp = os.path.join(scratch_dir, f".{os.path.basename(path)}-{secrets.token_hex(8)}")
    write_new_file(temp, data, sync=True)
    try:
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_dir(os.path.dirname(path))


def read_bounded(path: str, limit: int) -> bytes:
    """Read a regular file without following a final symlink; at most ``limit`` bytes.

    Raises OSError for I/O problems and ValueError when the file is larger
    than ``limit`` or not a regular file.
    """
    fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes exceeds the {limit}-byte limit")
        data = read_upto(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"more than {limit} bytes")
    return data


def read_upto(fd: int, limit: int) -> bytes:
    """Read from ``fd`` until end of file or ``limit`` bytes."""
    parts: list[bytes] = []
    remaining = limit
    while remaining > 0:
        part = os.read(fd, min(remaining, 8 << 20))
        if not part:
            break
        parts.append(part)
        remaining -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def scan_digests(path: str) -> set[str]:
    """Every ``sha256:<hex>`` string found in a file, as digests.

    Used by garbage collection: a superset of the references is always safe,
    and the scan works even on files that fail validation.
    """
    found: set[str] = set()
    with contextlib.suppress(FileNotFoundError):
        fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
        try:
            tail = b""
            while True:
                block = os.read(fd, _SCAN_BLOCK)
                if not block:
                    break
                window = tail + block
                found.update("sha256:" + m.decode() for m in _DIGEST_SCAN_RE.findall(window))
                tail = window[-80:]
        finally:
            os.close(fd)
    return found
