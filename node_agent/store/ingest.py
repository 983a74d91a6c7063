"""The ingest area: each writer's or importer's scratch directory, held by a lease.

Rule: new data is written to a writer's own ``ingest/<random>/`` directory,
which holds a lease (an exclusive flock) and an append-only ``refs`` file
naming every digest the writer uses; garbage collection keeps every digest
named by a live lease, or by one kept past its owner until a time
(``kept``). New blobs are linked into the blob directory only after fsync
and verification.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Executor
from typing import Final

from node_agent.errors import DataLoss
from node_agent.oci import digest_hex
from node_agent.store import kept
from node_agent.store.blobs import BlobStore
from node_agent.store.files import DIR_MODE, FILE_MODE, O_CLOEXEC, O_NOFOLLOW, scan_digests, write_all, write_new_file
from node_agent.store.locking import store_lock

LEASE_NAME: Final = "lease"
REFS_NAME: Final = "refs"
BLOB_PREFIX: Final = "blob-"


class Ingest:
    """One writer's or importer's scratch directory under ``ingest/``, held by a lease.

    Every digest the owner relies on is appended to ``refs`` before the
    owner checks whether the blob exists, under the shared store lock, so an
    exclusive-lock holder (publish, GC) sees a consistent set. New blobs are
    written as ``blob-<hex>`` files and linked into the blob directory only
    after fsync and verification. Safe to use from several threads.
    """

    def __init__(self, ingest_root: str, lock_path: str, blobs: BlobStore) -> None:
        self._blobs = blobs
        self._lock_path = lock_path
        self._mutex = threading.Lock()
        self.dir = os.path.join(ingest_root, secrets.token_hex(16))
        self._lease_fd = -1
        self._refs_fd = -1
        self._known: set[str] = set()
        self._synced: set[str] = set()
        self.pending: dict[str, int] = {}
        with store_lock(lock_path, exclusive=False):
            os.mkdir(self.dir, DIR_MODE)
            try:
                self._lease_fd = os.open(
                    os.path.join(self.dir, LEASE_NAME), os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, FILE_MODE
                )
                fcntl.flock(self._lease_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.write(self._lease_fd, f"pid={os.getpid()}\n".encode())
                self._refs_fd = os.open(
                    os.path.join(self.dir, REFS_NAME),
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | O_NOFOLLOW | O_CLOEXEC,
                    FILE_MODE,
                )
            except BaseException:
                self.release()
                raise

    def temp_path(self, digest: str) -> str:
        """Where this ingest writes the new blob ``digest`` before it is linked in."""
        return os.path.join(self.dir, BLOB_PREFIX + digest_hex(digest))

    def claim(self, digest: str) -> bool:
        """Whether this is the first time the owner asks for ``digest`` (thread-safe)."""
        with self._mutex:
            if digest in self._known:
                return False
            self._known.add(digest)
            return True

    def forget(self, digest: str) -> None:
        """Undo ``claim`` after a failed write, so a retry writes the blob again."""
        with self._mutex:
            self._known.discard(digest)
            self.pending.pop(digest, None)

    def reference(self, digest: str, size: int) -> bool:
        """Record ``digest`` in ``refs``; return whether an intact-sized blob is already stored.

        From here on garbage collection keeps the blob while the lease lives.
        """
        with store_lock(self._lock_path, exclusive=False):
            os.write(self._refs_fd, f"{digest}\n".encode())
            return self._blobs.size_of(digest) == size

    def reference_all(self, digests: Iterable[str]) -> None:
        """Record every digest in ``refs`` at once (the caller holds the shared store lock)."""
        write_all(self._refs_fd, "".join(f"{d}\n" for d in sorted(set(digests))).encode())

    @property
    def lease_fd(self) -> int:
        """The descriptor whose lock is the lease (inherit it to hand the lease on)."""
        return self._lease_fd

    def detach(self) -> None:
        """Close this process's descriptors but keep the directory.

        For a lease handed to a child process that inherited ``lease_fd``:
        the lease then lives exactly as long as the child keeps it open, and
        the child (or garbage collection, once the lease is dead) removes
        the directory.
        """
        for name in ("_refs_fd", "_lease_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def add_pending(self, digest: str, size: int) -> None:
        """Note that ``temp_path(digest)`` holds ``size`` new bytes to link in at commit."""
        with self._mutex:
            self.pending[digest] = size

    def put(self, digest: str, data: bytes | bytearray | memoryview) -> bool:
        """Make ``data`` (whose sha256 is ``digest``) available to the owner.

        Returns True when the bytes were written (a new blob), False when an
        existing blob or an earlier call already holds them.
        """
        if not self.claim(digest):
            return False
        size = len(data)
        try:
            if self.reference(digest, size):
                return False
            write_new_file(self.temp_path(digest), data)
        except BaseException:
            self.forget(digest)
            raise
        self.add_pending(digest, size)
        return True

    def flush(self, digest: str) -> None:
        """Fsync a new blob's ingest file early (commit then only checks it)."""
        fd = os.open(self.temp_path(digest), os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        with self._mutex:
            self._synced.add(digest)

    def commit_blobs(self, used: Collection[str], executor: Executor | None = None) -> None:
        """Fsync and check the new blobs in ``used``, link them into place, fsync the dirs once.

        Pending blobs that nothing uses (left by a failed add) stay in the
        ingest directory and vanish with it.
        """
        todo = [(d, s) for d, s in self.pending.items() if d in used]
        run: Callable[[tuple[str, int]], None] = self._sync_one
        if executor is not None and len(todo) > 1:
            for _ in executor.map(run, todo):
                pass
        else:
            for item in todo:
                run(item)
        for digest, _ in todo:
            self._blobs.link_in(self.temp_path(digest), digest)
        if todo:
            self._blobs.sync()
        with self._mutex:
            for digest, _ in todo:
                self.pending.pop(digest, None)

    def _sync_one(self, item: tuple[str, int]) -> None:
        digest, size = item
        path = self.temp_path(digest)
        with self._mutex:
            synced = digest in self._synced
        if synced:
            st = os.lstat(path)
        else:
            fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
            try:
                os.fsync(fd)
                st = os.fstat(fd)
            finally:
                os.close(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise DataLoss(
                f"blob {digest}: ingest copy failed verification ({st.st_size} bytes on disk, {size} written)"
            )

    def __enter__(self) -> Ingest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

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


def lease_is_live(ingest_dir: str, now: float | None = None) -> bool:
    """Whether some writer still holds the lease of ``ingest_dir``, or it is kept (``kept``) past ``now``.

    Call with the exclusive store lock held: a writer creates its directory
    and takes its lease under the shared lock, so no half-made lease is seen.
    ``now`` defaults to the current time.
    """
    try:
        fd = os.open(os.path.join(ingest_dir, LEASE_NAME), os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
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
    return kept.until(ingest_dir) > (time.time() if now is None else now)


def live_refs(ingest_root: str, now: float | None = None) -> set[str]:
    """Digests named by every live or kept lease (call under the exclusive store lock)."""
    refs: set[str] = set()
    with os.scandir(ingest_root) as it:
        dirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
    for path in dirs:
        if lease_is_live(path, now):
            refs |= scan_digests(os.path.join(path, REFS_NAME))
    return refs
