"""Content-addressed blobs, the ingest area and the store's locks.

Rule: a blob is verified before it becomes visible, and verified again when it
is read. Blobs live at ``blobs/sha256/<hex>`` and never change once renamed
there. New data is written to a writer's own ``ingest/<random>/`` directory,
which holds a lease (an exclusive flock) and an append-only ``refs`` file
naming every digest the writer uses; garbage collection keeps every digest
named by a live lease. This module knows bytes and digests, not checkpoints.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Collection, Iterable, Iterator
from typing import Final

from node_agent.errors import DataLoss, Internal
from node_agent.store.manifest import digest_hex, is_hex_digest

log = logging.getLogger(__name__)

DIR_MODE: Final = 0o700
FILE_MODE: Final = 0o600
LEASE_NAME: Final = "lease"
REFS_NAME: Final = "refs"
_CHUNK_PREFIX: Final = "chunk-"
_DIGEST_SCAN_RE: Final = re.compile(rb"sha256:([0-9a-f]{64})")
_SCAN_BLOCK: Final = 1 << 20
_O_CLOEXEC: Final = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY: Final = getattr(os, "O_DIRECTORY", 0)


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
    fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_synced(path: str, data: bytes) -> None:
    """Create ``path`` (0600, must not exist), write ``data`` and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(path: str, data: bytes | memoryview) -> None:
    """Create ``path`` (0600, must not exist) and write ``data``, without fsync.

    A failed write removes the partial file.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)


def read_bounded(path: str, limit: int) -> bytes:
    """Read a regular file without following a final symlink; at most ``limit`` bytes.

    Raises OSError for I/O problems and ValueError when the file is larger
    than ``limit`` or not a regular file.
    """
    fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes exceeds the {limit}-byte limit")
        return _read_exact(fd, limit + 1)
    finally:
        os.close(fd)


def _read_exact(fd: int, limit: int) -> bytes:
    parts: list[bytes] = []
    remaining = limit
    while remaining > 0:
        part = os.read(fd, min(remaining, 8 << 20))
        if not part:
            break
        parts.append(part)
        remaining -= len(part)
    return b"".join(parts)


def scan_digests(path: str) -> set[str]:
    """Every ``sha256:<hex>`` string found in a file, as digests.

    Used by garbage collection: a superset of the references is always safe,
    and the scan works even on files that fail validation.
    """
    found: set[str] = set()
    with contextlib.suppress(FileNotFoundError):
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
        try:
            tail = b""
            while True:
                block = os.read(fd, _SCAN_BLOCK)
                if not block:
                    break
                window = tail + block
                found.update("sha256:" + m.decode() for m in _DIGEST_SCAN_RE.findall(window))
                tail = window[-80:]
            found.update("sha256:" + m.decode() for m in _DIGEST_SCAN_RE.findall(tail))
        finally:
            os.close(fd)
    return found


@contextlib.contextmanager
def store_lock(lock_path: str, *, exclusive: bool) -> Iterator[None]:
    """Hold the store-wide flock (shared for writers, exclusive for publish/GC).

    Each acquisition opens its own file description, so threads of one
    process exclude each other exactly as separate processes do.
    """
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


class BlobStore:
    """The ``blobs/sha256`` directory: paths, verified reads, sizes, deletion."""

    def __init__(self, root: str) -> None:
        self.parent = os.path.join(root, "blobs")
        self.dir = os.path.join(self.parent, "sha256")

    def setup(self) -> None:
        """Create or tighten the blob directories."""
        ensure_dir(self.parent)
        ensure_dir(self.dir)

    def path(self, digest: str) -> str:
        """Filesystem path of a blob (validated digest, no existence check)."""
        return os.path.join(self.dir, digest_hex(digest))

    def size_of(self, digest: str) -> int | None:
        """Size of a stored blob, or None if it is missing or not a regular file."""
        try:
            st = os.lstat(self.path(digest))
        except FileNotFoundError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def read(self, digest: str, size: int) -> bytes:
        """Read a whole blob and verify its size and digest; DataLoss otherwise."""
        problem, data = self._load(digest, size)
        if problem is not None:
            raise DataLoss(f"blob {digest}: {problem}")
        return data

    def check(self, digest: str, size: int) -> str | None:
        """Verify a stored blob; return the reason it is bad, or None."""
        return self._load(digest, size)[0]

    def _load(self, digest: str, size: int) -> tuple[str | None, bytes]:
        path = self.path(digest)
        try:
            fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
        except FileNotFoundError:
            return "missing", b""
        except OSError as exc:
            return f"unreadable ({exc.strerror})", b""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return "not a regular file", b""
            data = _read_exact(fd, size + 1)
        except OSError as exc:
            return f"unreadable ({exc.strerror})", b""
        finally:
            os.close(fd)
        if len(data) != size:
            return f"size mismatch (expected {size} bytes, found {len(data) if len(data) <= size else 'more'})", b""
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if actual != digest:
            return f"digest mismatch (content hashes to {actual})", b""
        return None, data

    def digests(self) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """Every well-named entry of the blob directory."""
        with os.scandir(self.dir) as it:
            for entry in it:
                if is_hex_digest(entry.name):
                    yield "sha256:" + entry.name, entry

    def delete(self, digests: Iterable[str]) -> tuple[list[str], int]:
        """Unlink blobs; return the digests removed and the bytes freed."""
        removed: list[str] = []
        freed = 0
        for digest in sorted(digests):
            path = self.path(digest)
            try:
                size = os.lstat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                continue
            removed.append(digest)
            freed += size
        if removed:
            fsync_dir(self.dir)
        return removed, freed


class Ingest:
    """One writer's scratch directory under ``ingest/``, held by a lease.

    The writer appends each digest it uses to ``refs`` before relying on it,
    under the shared store lock, so an exclusive-lock holder (publish, GC)
    sees a consistent set. New chunks are written as ``chunk-<hex>`` files
    and renamed into the blob directory only after fsync and verification.
    """

    def __init__(self, ingest_root: str, lock_path: str, blobs: BlobStore) -> None:
        self._blobs = blobs
        self._lock_path = lock_path
        self.dir = os.path.join(ingest_root, secrets.token_hex(16))
        self._lease_fd = -1
        self._refs_fd = -1
        self._known: set[str] = set()
        self.pending: dict[str, int] = {}
        with store_lock(lock_path, exclusive=False):
            os.mkdir(self.dir, DIR_MODE)
            try:
                self._lease_fd = os.open(
                    os.path.join(self.dir, LEASE_NAME),
                    os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                    FILE_MODE,
                )
                fcntl.flock(self._lease_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.write(self._lease_fd, f"pid={os.getpid()}\n".encode())
                self._refs_fd = os.open(
                    os.path.join(self.dir, REFS_NAME),
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | _O_NOFOLLOW | _O_CLOEXEC,
                    FILE_MODE,
                )
            except BaseException:
                self.release()
                raise

    def put(self, digest: str, data: bytes | memoryview) -> bool:
        """Make ``data`` (whose digest is ``digest``) available to this writer.

        Returns True when the bytes were written (a new blob), False when an
        existing blob or an earlier chunk of this writer already holds them.
        """
        if digest in self._known:
            return False
        hexpart = digest_hex(digest)
        with store_lock(self._lock_path, exclusive=False):
            os.write(self._refs_fd, f"{digest}\n".encode())
            existing = self._blobs.size_of(digest)
        if existing != len(data):
            write_new_file(os.path.join(self.dir, _CHUNK_PREFIX + hexpart), data)
            self.pending[digest] = len(data)
        self._known.add(digest)
        return existing != len(data)

    def commit_blobs(self, used: Collection[str]) -> None:
        """Fsync and verify the new chunks in ``used``, rename them into place, fsync the dirs.

        Pending chunks that nothing uses (left by a failed add) stay in the
        ingest directory and vanish with it.
        """
        checked: list[tuple[str, str]] = []
        for digest, size in self.pending.items():
            if digest not in used:
                continue
            temp = os.path.join(self.dir, _CHUNK_PREFIX + digest_hex(digest))
            fd = os.open(temp, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
            try:
                os.fsync(fd)
                data = _read_exact(fd, size + 1)
            finally:
                os.close(fd)
            actual = "sha256:" + hashlib.sha256(data).hexdigest()
            if len(data) != size or actual != digest:
                raise DataLoss(
                    f"blob {digest}: ingest copy failed verification "
                    f"({len(data)} bytes hashing to {actual}, expected {size} bytes)"
                )
            checked.append((digest, temp))
        for digest, temp in checked:
            final = self._blobs.path(digest)
            try:
                os.link(temp, final)
            except FileExistsError:
                if self._blobs.size_of(digest) != self.pending[digest]:
                    os.replace(temp, final)
                    log.warning("replaced damaged blob %s", digest, extra={"digest": digest})
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        if checked:
            fsync_dir(self._blobs.dir)
            fsync_dir(self._blobs.parent)
        self.pending.clear()

    def release(self) -> None:
        """Delete the ingest directory, then drop the lease. Idempotent."""
        if self._refs_fd >= 0:
            os.close(self._refs_fd)
            self._refs_fd = -1
        if os.path.isdir(self.dir):
            shutil.rmtree(self.dir, ignore_errors=True)
        if self._lease_fd >= 0:
            os.close(self._lease_fd)
            self._lease_fd = -1


def lease_is_live(ingest_dir: str) -> bool:
    """Whether some writer still holds the lease of ``ingest_dir``.

    Call with the exclusive store lock held: a writer creates its directory
    and takes its lease under the shared lock, so no half-made lease is seen.
    """
    try:
        fd = os.open(os.path.join(ingest_dir, LEASE_NAME), os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)
    return False


def live_refs(ingest_root: str) -> set[str]:
    """Digests named by every live lease (call under the exclusive store lock)."""
    refs: set[str] = set()
    with os.scandir(ingest_root) as it:
        dirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
    for path in dirs:
        if lease_is_live(path):
            refs |= scan_digests(os.path.join(path, REFS_NAME))
    return refs
