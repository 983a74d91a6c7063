"""Reading checkpoints back: random access, materializing trees, verifying blobs.

Rule: every chunk is verified (size, sha256 of the stored bytes, and that it
decodes to exactly its declared size) each time it is read. Nothing is
written outside the caller's destination: files are created with
``O_CREAT|O_EXCL|O_NOFOLLOW`` relative to directory fds opened with
``O_NOFOLLOW``. Materialize and verify spread the chunk work over a thread
pool with a bounded number of chunks in flight.
"""

from __future__ import annotations

import bisect
import io
import logging
import os
import stat
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Final

from node_agent.errors import DataLoss, FailedPrecondition
from node_agent.store.chunk_reader import ChunkReader
from node_agent.store.files import FILE_MODE, NEW_FILE, O_CLOEXEC, O_DIRECTORY, O_NOFOLLOW
from node_agent.store.documents import Chunk, ChunkFetch, FileEntry, join_path
from node_agent.store.records import BadBlob, CheckpointRecord

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)

DIR_OPEN: Final = os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC
_MAX_OPEN_FILES: Final = 64


class FileReader(io.RawIOBase):
    """Random access to one file of a checkpoint; each chunk is verified when read.

    The chunk for an offset is found by bisection over the file table; the
    last chunk read is cached.
    """

    def __init__(
        self, chunks: ChunkReader, checkpoint_id: str, entry: FileEntry, *, fetch: ChunkFetch | None = None
    ) -> None:
        super().__init__()
        self._chunks = chunks
        self._fetch = fetch
        self._checkpoint_id = checkpoint_id
        self._entry = entry
        self._offsets = [c.offset for c in entry.chunks]
        self._pos = 0
        self._cached: tuple[int, bytes] | None = None

    @property
    def size(self) -> int:
        """The file's size in bytes."""
        return self._entry.size

    @property
    def path(self) -> str:
        """The file's path within the checkpoint."""
        return self._entry.path

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        self._check_closed()
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET, /) -> int:
        self._check_closed()
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._entry.size + offset
        else:
            raise ValueError(f"invalid whence {whence!r}")
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos

    def readinto(self, buffer: WriteableBuffer, /) -> int:
        view = memoryview(buffer).cast("B")
        data = self.pread(self._pos, len(view))
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def pread(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset``, without moving the position."""
        self._check_closed()
        if offset < 0 or n < 0:
            raise ValueError(f"negative offset or length ({offset}, {n})")
        end = min(offset + n, self._entry.size)
        parts: list[bytes] = []
        pos = offset
        while pos < end:
            index = bisect.bisect_right(self._offsets, pos) - 1
            chunk = self._entry.chunks[index]
            data = self._chunk(index)
            start, stop = pos - chunk.offset, min(chunk.size, end - chunk.offset)
            parts.append(data[start:stop] if (start, stop) != (0, chunk.size) else data)
            pos = chunk.offset + stop
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _chunk(self, index: int) -> bytes:
        if self._cached is not None and self._cached[0] == index:
            return self._cached[1]
        chunk = self._entry.chunks[index]
        try:
            data = read_or_fetch(self._chunks, chunk, self._fetch)
        except DataLoss as exc:
            raise DataLoss(
                f"checkpoint {self._checkpoint_id}: file {self._entry.path!r} at offset {chunk.offset}: {exc}"
            ) from exc
        self._cached = (index, data)
        return data

    def close(self) -> None:
        self._cached = None
        super().close()

    def _check_closed(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on a closed FileReader")


def read_or_fetch(chunks: ChunkReader, chunk: Chunk, fetch: ChunkFetch | None) -> bytes:
    """A chunk's verified content; a missing blob is first fetched with ``fetch`` (a lazily pulled checkpoint),
    and the stored bytes it verified on the way in are decoded as they are, not read and hashed again."""
    if fetch is not None and chunks.blobs.size_of(chunk.digest) is None:
        fetched = fetch(chunk)
        if fetched is not None:
            return chunks.decode_stored(chunk, fetched)
    return chunks.read_chunk(chunk)


class DestTree:
    """Directory fds below a materialize destination, opened without following symlinks.

    Only the fds of the current path's ancestors stay open, so a deep or
    wide tree never exhausts the fd table.
    """

    def __init__(self, dest_fd: int) -> None:
        self._fds: dict[str, int] = {"": dest_fd}
        self.created: list[tuple[str, bool]] = []

    def dir_fd(self, rel: str) -> int:
        """Fd of directory ``rel`` (created 0700 if missing)."""
        for key in [k for k in self._fds if k and not (rel == k or rel.startswith(k + "/"))]:
            os.close(self._fds.pop(key))
        if rel in self._fds:
            return self._fds[rel]
        parts = rel.split("/")
        depth = len(parts)
        while depth > 0 and "/".join(parts[:depth]) not in self._fds:
            depth -= 1
        fd = self._fds["/".join(parts[:depth])]
        for i in range(depth, len(parts)):
            name, sub = parts[i], "/".join(parts[: i + 1])
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
                self.created.append((sub, True))
            except FileExistsError:
                pass
            fd = os.open(name, DIR_OPEN, dir_fd=fd)
            self._fds[sub] = fd
        return fd

    def close(self) -> None:
        """Close every fd but the destination's own."""
        for key in [k for k in self._fds if k]:
            os.close(self._fds.pop(key))


class _Failure:
    """The first error of a batch of chunk jobs."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def set(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def write_entries(
    reader: ChunkReader, record: CheckpointRecord, entries: Sequence[FileEntry], tree: DestTree, workers: int,
    fetch: ChunkFetch | None = None,
) -> None:
    """Create ``entries`` under ``tree``: directories first, then files, their chunks written in parallel.

    Each chunk is read, verified, decoded and written with ``pwrite`` at its
    offset by a worker; at most ``2 * workers`` chunks are in flight. A
    file's mode is applied once all its chunks are written.
    """
    dirs = sorted((e for e in entries if e.is_dir), key=lambda e: e.path)
    for entry in dirs:
        tree.dir_fd(entry.path)
    files = sorted((e for e in entries if not e.is_dir), key=lambda e: e.path)
    slots = threading.BoundedSemaphore(2 * workers)
    failure = _Failure()
    open_files: deque[tuple[FileEntry, int, list[Future[None]]]] = deque()

    def put(fd: int, entry: FileEntry, chunk: Chunk) -> None:
        try:
            if failure.error is not None:
                return
            try:
                data = read_or_fetch(reader, chunk, fetch)
            except DataLoss as exc:
                raise DataLoss(f"checkpoint {record.id}: file {entry.path!r} at offset {chunk.offset}: {exc}") from exc
            view = memoryview(data)
            pos = chunk.offset
            while view:
                n = os.pwrite(fd, view, pos)
                view, pos = view[n:], pos + n
        except BaseException as exc:
            failure.set(exc)
        finally:
            slots.release()

    def finish(entry: FileEntry, fd: int, futures: list[Future[None]]) -> None:
        try:
            wait(futures)
            failure.check()
            os.fchmod(fd, entry.mode & 0o777)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="store-restore") as pool:
        try:
            for entry in files:
                parent, _, name = entry.path.rpartition("/")
                fd = os.open(name, NEW_FILE, FILE_MODE, dir_fd=tree.dir_fd(parent))
                tree.created.append((entry.path, False))
                if entry.size:
                    # Size the file first: parallel pwrite()s then fill it in place.
                    os.ftruncate(fd, entry.size)
                futures: list[Future[None]] = []
                open_files.append((entry, fd, futures))
                for chunk in entry.chunks:
                    slots.acquire()
                    try:
                        failure.check()
                        futures.append(pool.submit(put, fd, entry, chunk))
                    except BaseException:
                        slots.release()
                        raise
                while open_files and (
                    len(open_files) > _MAX_OPEN_FILES or all(f.done() for f in open_files[0][2])
                ):
                    finish(*open_files.popleft())
            while open_files:
                finish(*open_files.popleft())
        finally:
            for _, _, futures in open_files:
                for future in futures:
                    future.cancel()
            for _, fd, futures in open_files:
                wait(futures)
                os.close(fd)
            open_files.clear()
    made = {rel for rel, is_dir in tree.created if is_dir}
    for entry in reversed(dirs):
        if entry.path in made:
            os.fchmod(tree.dir_fd(entry.path), entry.mode & 0o777)


def _open_chain(dest_fd: int, parts: Sequence[str]) -> int:
    """Open the directory ``parts`` below ``dest_fd`` without following symlinks."""
    fd = os.dup(dest_fd)
    for name in parts:
        try:
            nxt = os.open(name, DIR_OPEN, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def undo(dest_fd: int, created: Sequence[tuple[str, bool]]) -> None:
    """Remove what materialize created, newest first; best effort."""
    for rel, is_dir in reversed(created):
        parts = rel.split("/")
        try:
            parent = _open_chain(dest_fd, parts[:-1])
            try:
                if is_dir:
                    os.rmdir(parts[-1], dir_fd=parent)
                else:
                    os.unlink(parts[-1], dir_fd=parent)
            finally:
                os.close(parent)
        except OSError as exc:
            log.warning("could not remove %r after a failed materialize: %s", rel, exc)


def check_dest_only_dirs(dest: str, dest_fd: int, prefix: str = "") -> None:
    """FailedPrecondition unless everything at or under ``dest/prefix`` (if it exists) is a directory.

    Other parts of ``dest`` may hold anything, so several prefixes of one
    checkpoint can be materialized into the same destination.
    """
    fd = os.dup(dest_fd)
    rel = ""
    for part in prefix.split("/") if prefix else []:
        try:
            st = os.stat(part, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            os.close(fd)
            return
        except BaseException:
            os.close(fd)
            raise
        rel = join_path(rel, part)
        if not stat.S_ISDIR(st.st_mode):
            os.close(fd)
            raise FailedPrecondition(f"destination {dest!r} is not empty: {rel!r} is not a directory")
        try:
            nxt = os.open(part, DIR_OPEN, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    stack = [(rel, fd)]
    try:
        while stack:
            rel, fd = stack.pop()
            try:
                with os.scandir(fd) as it:
                    entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
                for name, is_dir in entries:
                    sub = join_path(rel, name)
                    if not is_dir:
                        raise FailedPrecondition(f"destination {dest!r} is not empty: {sub!r} is not a directory")
                    stack.append((sub, os.open(name, DIR_OPEN, dir_fd=fd)))
            finally:
                os.close(fd)
    finally:
        for _, fd in stack:
            os.close(fd)


def verify_blobs(reader: ChunkReader, record: CheckpointRecord, workers: int, *, remote_ok: bool = False) -> list[BadBlob]:
    """Check every chunk blob of ``record`` in parallel; one BadBlob per bad blob, in order of first use.

    With ``remote_ok`` (a lazily pulled checkpoint), a missing blob is not bad.
    """
    users: dict[str, list[str]] = {}
    chunks: dict[str, Chunk] = {}
    for entry in record.files:
        for chunk in entry.chunks:
            paths = users.setdefault(chunk.digest, [])
            if entry.path not in paths:
                paths.append(entry.path)
            chunks.setdefault(chunk.digest, chunk)
    if not chunks:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(chunks))), thread_name_prefix="store-verify") as pool:
        reasons = list(pool.map(reader.check_chunk, chunks.values()))
    bad: list[BadBlob] = []
    for digest, reason in zip(chunks, reasons, strict=True):
        if reason is None or (remote_ok and reason == "missing"):
            continue
        bad.append(BadBlob(digest=digest, reason=reason, paths=tuple(users[digest])))
        log.error(
            "checkpoint %s: blob %s %s (used by %s)",
            record.id,
            digest,
            reason,
            ", ".join(users[digest]),
            extra={"checkpoint": record.id, "digest": digest},
        )
    return bad
