"""Content-addressed blobs, the ingest area and the store's locks.

Rule: a blob is verified before it becomes visible, and verified again when it
is read. Blobs live at ``blobs/sha256/<hex>`` and never change once linked
there. New data is written to a writer's own ``ingest/<random>/`` directory,
which holds a lease (an exclusive flock) and an append-only ``refs`` file
naming every digest the writer uses; garbage collection keeps every digest
named by a live lease, or by one kept past its owner until a time
(``kept``). This module knows bytes and digests, not checkpoints.
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
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import Executor
from typing import Final

from node_agent.errors import (
    AgentError,
    DataLoss,
    FailedPrecondition,
    Internal,
    NotFound,
    ResourceExhausted,
)
from node_agent.oci import digest_hex, is_hex_digest
from node_agent.store import codec, kept, sealing
from node_agent.store.manifest import Chunk

log = logging.getLogger(__name__)

DIR_MODE: Final = 0o700
FILE_MODE: Final = 0o600
LEASE_NAME: Final = "lease"
REFS_NAME: Final = "refs"
BLOB_PREFIX: Final = "blob-"
_DIGEST_SCAN_RE: Final = re.compile(rb"sha256:([0-9a-f]{64})")
_SCAN_BLOCK: Final = 1 << 20
O_CLOEXEC: Final = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY: Final = getattr(os, "O_DIRECTORY", 0)
_NEW_FILE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC


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
    fd = os.open(path, _NEW_FILE, FILE_MODE)
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
        data = _read_upto(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"more than {limit} bytes")
    return data


def _read_upto(fd: int, limit: int) -> bytes:
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


@contextlib.contextmanager
def store_lock(lock_path: str, *, exclusive: bool) -> Iterator[None]:
    """Hold the store-wide flock (shared for writers, exclusive for publish/GC).

    Each acquisition opens its own file description, so threads of one
    process exclude each other exactly as separate processes do.
    """
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


class BlobStore:
    """The ``blobs/sha256`` directory: paths, verified reads, sizes, linking, deletion."""

    def __init__(self, root: str, keys: sealing.Keyring | None = None) -> None:
        self.parent = os.path.join(root, "blobs")
        self.dir = os.path.join(self.parent, "sha256")
        # Where sealed blobs' keys come from (none: sealed blobs do not open).
        self.keys = keys

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

    def read_chunk(self, chunk: Chunk) -> bytes:
        """A chunk's content: its blob read, verified, opened and decoded.

        DataLoss when the blob is bad; FailedPrecondition naming the key id
        when it is sealed under a key no source has.
        """
        return self.decode_chunk(chunk, self.read(chunk.digest, chunk.stored_size))

    def decode_chunk(self, chunk: Chunk, data: bytes) -> bytes:
        """The content of a chunk's verified stored bytes (see ``read_chunk``)."""
        try:
            if chunk.sealed:
                data = self.unseal(sealing.CHUNK, data, bytes.fromhex(digest_hex(chunk.plain)))
            return codec.decode(data, chunk.inner_encoding, chunk.size)
        except (codec.DecodeError, sealing.SealError) as exc:
            raise DataLoss(f"blob {chunk.digest}: {exc}") from None

    def open_config(self, data: bytes, key_id: str = "") -> bytes | None:
        """A sealed config blob opened; None when no source has its key.

        SealError when it is altered, or sealed under another key than
        ``key_id`` (the one its manifest names), when given.
        """
        named = sealing.key_id_of(data, sealing.CONFIG)
        if key_id and named != key_id:
            raise sealing.SealError(f"sealed under key {named}, not {key_id}, which the manifest names")
        try:
            return self.unseal(sealing.CONFIG, data)
        except FailedPrecondition:
            return None

    def unseal(self, kind: int, data: bytes, plain_digest: bytes = b"") -> bytes:
        """Sealed bytes opened with the key they name; SealError if bad, FailedPrecondition if no key."""
        key_id = sealing.key_id_of(data, kind)
        key = self.keys.key(key_id) if self.keys is not None else None
        if key is None:
            raise FailedPrecondition(f"encrypted with key id {key_id}, which no configured key source has")
        return key.open(kind, data, plain_digest)

    def check(self, digest: str, size: int) -> str | None:
        """Verify a stored blob; return the reason it is bad, or None."""
        return self._load(digest, size)[0]

    def check_chunk(self, chunk: Chunk) -> str | None:
        """Verify a chunk's blob and that it decodes to the chunk's size; the reason it is bad, or None."""
        problem, data = self._load(chunk.digest, chunk.stored_size)
        if problem is not None:
            return problem
        try:
            self.decode_chunk(chunk, data)
        except DataLoss as exc:
            return f"undecodable ({str(exc).removeprefix(f'blob {chunk.digest}: ')})"
        except FailedPrecondition as exc:
            return f"unopened ({exc})"
        return None

    def _load(self, digest: str, size: int) -> tuple[str | None, bytes]:
        path = self.path(digest)
        try:
            fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
        except FileNotFoundError:
            return "missing", b""
        except OSError as exc:
            return f"unreadable ({exc.strerror})", b""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return "not a regular file", b""
            if st.st_size != size:
                return f"size mismatch (expected {size} bytes, found {st.st_size})", b""
            data = _read_upto(fd, size + 1)
        except OSError as exc:
            return f"unreadable ({exc.strerror})", b""
        finally:
            os.close(fd)
        if len(data) != size:
            return f"size mismatch (expected {size} bytes, read {len(data) if len(data) <= size else 'more'})", b""
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

    def sizes(self) -> dict[str, int]:
        """Size of every well-named regular blob."""
        out: dict[str, int] = {}
        for digest, entry in self.digests():
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat(follow_symlinks=False)
                out[digest] = st.st_size
        return out

    def link_in(self, temp: str, digest: str) -> None:
        """Make the verified file ``temp`` the blob ``digest`` (renamed into place).

        A blob of that name already there holds the same bytes or is damaged;
        either way the verified copy may replace it (readers that have the old
        file open keep reading it). The caller fsyncs the blob directory.
        """
        os.replace(temp, self.path(digest))

    def sync(self) -> None:
        """Flush the blob directories' entries to disk."""
        fsync_dir(self.dir)
        fsync_dir(self.parent)

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
        data = "".join(f"{d}\n" for d in sorted(set(digests))).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._refs_fd, view):]

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
