"""Checkpoints: writing, publishing, reading, removing and recovering them.

Rule: a checkpoint is listed only once its manifest is published, and its
manifest is published only after every blob it names is durable and verified.
Removal unpublishes first, then deletes the blobs that no other manifest and
no live writer references. Every id, path and manifest that comes in is
validated; nothing is ever written outside the store or a caller's ``dest``.
"""

from __future__ import annotations

import bisect
import builtins
import contextlib
import errno
import hashlib
import io
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Final

from node_agent.errors import (
    AgentError,
    DataLoss,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from node_agent.store.blobs import (
    FILE_MODE,
    BlobStore,
    Ingest,
    ensure_dir,
    fsync_dir,
    lease_is_live,
    live_refs,
    read_bounded,
    scan_digests,
    store_lock,
    write_file_synced,
)
from node_agent.store.manifest import (
    MAX_CHUNK_SIZE,
    MAX_ENTRIES,
    MAX_MANIFEST_BYTES,
    Chunk,
    FileEntry,
    Manifest,
    check_tree,
    decode_manifest,
    encode_manifest,
    is_hex_digest,
    join_path,
    normalize_path,
)

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE: Final = 4 << 20
MIN_PREFIX_LEN: Final = 6
_ID_RE: Final = re.compile(r"[0-9a-f]{6,64}")
_MANIFEST_SUFFIX: Final = ".json"
_O_CLOEXEC: Final = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY: Final = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK: Final = getattr(os, "O_NONBLOCK", 0)
_DIR_OPEN: Final = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC


@dataclass(frozen=True)
class CheckpointRecord:
    """A published checkpoint, as loaded and validated from its manifest."""

    id: str
    created: str
    metadata: Mapping[str, Any]
    files: tuple[FileEntry, ...]
    size: int
    stored_size: int
    manifest_path: str

    def entry(self, path: str) -> FileEntry:
        """The entry at ``path``; NotFound if absent."""
        for entry in self.files:
            if entry.path == path:
                return entry
        raise NotFound(f"checkpoint {self.id}: no entry {path!r}")


@dataclass(frozen=True)
class BadBlob:
    """A blob referenced by a checkpoint that is missing or corrupt."""

    digest: str
    reason: str
    paths: tuple[str, ...]


@dataclass(frozen=True)
class RecoveryReport:
    """What ``Store.recover`` cleaned up."""

    ingest_removed: tuple[str, ...] = ()
    strays_removed: tuple[str, ...] = ()
    quarantined: tuple[str, ...] = ()
    blobs_removed: tuple[str, ...] = ()
    bytes_freed: int = 0

    @property
    def clean(self) -> bool:
        """Whether there was nothing to do."""
        return not (self.ingest_removed or self.strays_removed or self.quarantined or self.blobs_removed)


def _os_error(exc: OSError, what: str) -> AgentError:
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


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _created_key(created: str) -> datetime:
    try:
        return datetime.fromisoformat(created)
    except ValueError:
        return datetime.min.replace(tzinfo=UTC)


def _fill(fd: int, buf: memoryview) -> int:
    """Read into ``buf`` until it is full or the file ends; return the count."""
    got = 0
    while got < len(buf):
        n = os.readv(fd, [buf[got:]])
        if n == 0:
            break
        got += n
    return got


def _record(hexid: str, manifest: Manifest, manifest_path: str) -> CheckpointRecord:
    unique: dict[str, int] = {}
    size = 0
    for entry in manifest.files:
        size += entry.size
        for chunk in entry.chunks:
            unique[chunk.digest] = chunk.size
    return CheckpointRecord(
        id="sha256:" + hexid,
        created=manifest.created,
        metadata=MappingProxyType(dict(manifest.metadata)),
        files=manifest.files,
        size=size,
        stored_size=sum(unique.values()),
        manifest_path=manifest_path,
    )


def _publish(store: Store, ingest: Ingest, hexid: str, data: bytes, digests: Sequence[str]) -> str:
    """Write the manifest durably and make it visible: the commit point."""
    temp = os.path.join(ingest.dir, "manifest.json")
    write_file_synced(temp, data)
    final = store.manifest_path(hexid)
    with store_lock(store.lock_path, exclusive=True):
        missing = [d for d in digests if store.blobs.size_of(d) is None]
        if missing:
            raise DataLoss(f"checkpoint sha256:{hexid}: blob {missing[0]} vanished before publish")
        with contextlib.suppress(FileExistsError):
            os.link(temp, final)
        fsync_dir(store.checkpoints_dir)
    return final


class CheckpointWriter:
    """Builds one checkpoint; a context manager that aborts unless committed.

    One writer belongs to one thread. Data is chunked, hashed and written to
    the writer's ingest directory as it is added; ``commit`` makes it durable
    and publishes the manifest.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._chunk_size = store.chunk_size
        self._ingest = Ingest(store.ingest_dir, store.lock_path, store.blobs)
        self._entries: dict[str, FileEntry] = {}
        self._buffer: bytearray | None = None
        self._written = 0
        self._total = 0
        self._state = "open"

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state == "open":
            self.abort()

    @property
    def bytes_written(self) -> int:
        """New bytes actually stored (chunks that were not already present)."""
        return self._written

    @property
    def bytes_total(self) -> int:
        """Bytes of file content added so far."""
        return self._total

    def add_file(self, path: str, src: str | os.PathLike[str], *, mode: int | None = None) -> None:
        """Add the regular file ``src`` as ``path``, streamed in chunk-size pieces."""
        self._check_open()
        path = self._new_path(path)
        try:
            fd = os.open(src, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise InvalidArgument(f"source {os.fspath(src)!r} for {path!r} is a symlink") from exc
            raise _os_error(exc, f"source {os.fspath(src)!r} for {path!r}") from exc
        try:
            self._add_fd(path, fd, mode, os.fspath(src))
        finally:
            os.close(fd)

    def add_bytes(self, path: str, data: bytes, *, mode: int = 0o600) -> None:
        """Add ``data`` as the regular file ``path``."""
        self._check_open()
        path = self._new_path(path)
        _check_mode(mode, path)
        view = memoryview(data).cast("B")
        chunks = [self._put(view[off : off + self._chunk_size], off) for off in range(0, len(view), self._chunk_size)]
        self._entries[path] = FileEntry(path=path, type="file", mode=mode, size=len(view), chunks=tuple(chunks))
        self._total += len(view)

    def add_dir(self, path: str, *, mode: int = 0o700) -> None:
        """Add an (empty) directory entry."""
        self._check_open()
        path = self._new_path(path)
        _check_mode(mode, path)
        self._entries[path] = FileEntry(path=path, type="dir", mode=mode)

    def add_tree(self, prefix: str, src_dir: str | os.PathLike[str]) -> None:
        """Add every file and directory under ``src_dir`` below ``prefix``.

        ``prefix`` "" puts the tree's contents at the top level; otherwise
        ``prefix`` itself becomes a directory entry. Symlinks are never
        followed: a symlink, device, FIFO or socket is InvalidArgument.
        """
        self._check_open()
        if prefix:
            normalize_path(prefix)
        src = os.fspath(src_dir)
        try:
            root_fd = os.open(src, _DIR_OPEN)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise InvalidArgument(f"source tree {src!r} is not a directory (symlinks are not followed)") from exc
            raise _os_error(exc, f"source tree {src!r}") from exc
        stack: list[tuple[str, str, int, list[str]]] = []
        try:
            if prefix:
                self._entries[self._new_path(prefix)] = FileEntry(
                    path=prefix, type="dir", mode=stat.S_IMODE(os.fstat(root_fd).st_mode)
                )
            stack.append((prefix, src, root_fd, self._scan_dir(prefix, src, root_fd)))
            while stack:
                rel, src_path, dir_fd, subdirs = stack[-1]
                if not subdirs:
                    stack.pop()
                    os.close(dir_fd)
                    continue
                name = subdirs.pop()
                child_fd = os.open(name, _DIR_OPEN, dir_fd=dir_fd)
                child_rel, child_src = join_path(rel, name), os.path.join(src_path, name)
                try:
                    subs = self._scan_dir(child_rel, child_src, child_fd)
                except BaseException:
                    os.close(child_fd)
                    raise
                stack.append((child_rel, child_src, child_fd, subs))
        except OSError as exc:
            raise _os_error(exc, f"source tree {src!r}") from exc
        finally:
            for _, _, fd, _ in stack:
                os.close(fd)

    def _scan_dir(self, rel: str, src_path: str, dir_fd: int) -> list[str]:
        """Add the files and dir entries of one directory; return subdir names, reversed."""
        with os.scandir(dir_fd) as it:
            names = sorted(e.name for e in it)
        subdirs: list[str] = []
        for name in names:
            path = join_path(rel, name)
            where = os.path.join(src_path, name)
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                self._entries[self._new_path(path)] = FileEntry(path=path, type="dir", mode=stat.S_IMODE(st.st_mode))
                subdirs.append(name)
            elif stat.S_ISREG(st.st_mode):
                path = self._new_path(path)
                fd = os.open(name, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC, dir_fd=dir_fd)
                try:
                    self._add_fd(path, fd, None, where)
                finally:
                    os.close(fd)
            else:
                kind = "symlink" if stat.S_ISLNK(st.st_mode) else "special file"
                raise InvalidArgument(f"source {where!r} is a {kind}; only regular files and directories are supported")
        subdirs.reverse()
        return subdirs

    def _add_fd(self, path: str, fd: int, mode: int | None, where: str) -> None:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"source {where!r} for {path!r} is not a regular file")
        if mode is None:
            mode = stat.S_IMODE(st.st_mode)
        _check_mode(mode, path)
        if self._buffer is None:
            self._buffer = bytearray(self._chunk_size)
        buf = memoryview(self._buffer)
        chunks: list[Chunk] = []
        offset = 0
        while True:
            try:
                n = _fill(fd, buf)
            except OSError as exc:
                raise _os_error(exc, f"reading {where!r} for {path!r}") from exc
            if n == 0:
                break
            chunks.append(self._put(buf[:n], offset))
            offset += n
            if n < len(buf):
                break
        self._entries[path] = FileEntry(path=path, type="file", mode=mode, size=offset, chunks=tuple(chunks))
        self._total += offset

    def _put(self, data: memoryview, offset: int) -> Chunk:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        try:
            if self._ingest.put(digest, data):
                self._written += len(data)
        except OSError as exc:
            raise _os_error(exc, f"writing blob {digest} to {self._ingest.dir}") from exc
        return Chunk(digest=digest, size=len(data), offset=offset)

    def _new_path(self, path: str) -> str:
        normalize_path(path)
        if path in self._entries:
            raise InvalidArgument(f"path {path!r} was already added to this checkpoint")
        if len(self._entries) >= MAX_ENTRIES:
            raise InvalidArgument(f"a checkpoint holds at most {MAX_ENTRIES} entries")
        return path

    def _check_open(self) -> None:
        if self._state != "open":
            raise FailedPrecondition(f"checkpoint writer is already {self._state}")

    def commit(self, metadata: Mapping[str, Any]) -> CheckpointRecord:
        """Make every blob durable, then publish the manifest; return the record."""
        self._check_open()
        try:
            if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
                raise InvalidArgument("metadata must be a JSON object (a mapping with string keys)")
            entries = sorted(self._entries.values(), key=lambda e: e.path)
            check_tree(entries)
            data = encode_manifest(_now(), metadata, entries)
            if len(data) > MAX_MANIFEST_BYTES:
                raise InvalidArgument(f"manifest of {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
            manifest = decode_manifest(data, error=InvalidArgument, what="new manifest")
            hexid = hashlib.sha256(data).hexdigest()
            used = {chunk.digest for entry in entries for chunk in entry.chunks}
            try:
                self._ingest.commit_blobs(used)
                path = _publish(self._store, self._ingest, hexid, data, sorted(used))
            except OSError as exc:
                raise _os_error(exc, f"committing checkpoint sha256:{hexid}") from exc
        except BaseException:
            self.abort()
            raise
        self._ingest.release()
        self._state = "committed"
        record = _record(hexid, manifest, path)
        log.info(
            "published checkpoint %s (%d files, %d bytes, %d new)",
            record.id,
            len(record.files),
            record.size,
            self._written,
            extra={"checkpoint": record.id},
        )
        return record

    def abort(self) -> None:
        """Discard everything written so far. Idempotent."""
        if self._state == "open":
            self._state = "aborted"
        self._ingest.release()


def _check_mode(mode: int, path: str) -> None:
    if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777:
        raise InvalidArgument(f"mode {mode!r} for {path!r} is not in [0, 0o7777]")


class FileReader(io.RawIOBase):
    """Random access to one file of a checkpoint; each chunk is verified when read."""

    def __init__(self, blobs: BlobStore, checkpoint_id: str, entry: FileEntry) -> None:
        super().__init__()
        self._blobs = blobs
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
        return b"".join(parts)

    def _chunk(self, index: int) -> bytes:
        if self._cached is not None and self._cached[0] == index:
            return self._cached[1]
        chunk = self._entry.chunks[index]
        try:
            data = self._blobs.read(chunk.digest, chunk.size)
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


class _DestTree:
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
            fd = os.open(name, _DIR_OPEN, dir_fd=fd)
            self._fds[sub] = fd
        return fd

    def close(self) -> None:
        """Close every fd but the destination's own."""
        for key in [k for k in self._fds if k]:
            os.close(self._fds.pop(key))


def _open_chain(dest_fd: int, parts: Sequence[str]) -> int:
    """Open the directory ``parts`` below ``dest_fd`` without following symlinks."""
    fd = os.dup(dest_fd)
    for name in parts:
        try:
            nxt = os.open(name, _DIR_OPEN, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _undo(dest_fd: int, created: Sequence[tuple[str, bool]]) -> None:
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


def _check_dest_only_dirs(dest: str, dest_fd: int) -> None:
    stack = [("", os.dup(dest_fd))]
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
                    stack.append((sub, os.open(name, _DIR_OPEN, dir_fd=fd)))
            finally:
                os.close(fd)
    finally:
        for _, fd in stack:
            os.close(fd)


class Store:
    """A content-addressed checkpoint store rooted at one directory.

    All methods are synchronous and safe to call from several threads and
    processes at once; run them in worker threads from async code.
    """

    def __init__(self, root: str | os.PathLike[str], *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or not 0 < chunk_size <= MAX_CHUNK_SIZE:
            raise InvalidArgument(f"chunk_size {chunk_size!r} is not in [1, {MAX_CHUNK_SIZE}]")
        self.root = os.path.abspath(os.fspath(root))
        self.chunk_size = chunk_size
        self.blobs = BlobStore(self.root)
        self.ingest_dir = os.path.join(self.root, "ingest")
        self.checkpoints_dir = os.path.join(self.root, "checkpoints")
        self.quarantine_dir = os.path.join(self.root, "quarantine")
        self.lock_path = os.path.join(self.root, ".lock")
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            if stat.S_IMODE(os.stat(self.root).st_mode) != 0o700:
                os.chmod(self.root, 0o700)
            self.blobs.setup()
            for path in (self.ingest_dir, self.checkpoints_dir, self.quarantine_dir):
                ensure_dir(path)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC, FILE_MODE)
            try:
                if stat.S_IMODE(os.fstat(fd).st_mode) != FILE_MODE:
                    os.fchmod(fd, FILE_MODE)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _os_error(exc, f"store root {self.root!r}") from exc

    # -- paths and ids ---------------------------------------------------------------

    def manifest_path(self, hexid: str) -> str:
        """Path of the manifest for a full hex id."""
        return os.path.join(self.checkpoints_dir, hexid + _MANIFEST_SUFFIX)

    def blob_path(self, digest: str) -> str:
        """Path of a blob (``sha256:<hex>``); the blob need not exist."""
        return self.blobs.path(digest)

    def _manifest_ids(self) -> list[str]:
        out: list[str] = []
        with os.scandir(self.checkpoints_dir) as it:
            for entry in it:
                name = entry.name
                if name.endswith(_MANIFEST_SUFFIX) and is_hex_digest(name[: -len(_MANIFEST_SUFFIX)]):
                    out.append(name[: -len(_MANIFEST_SUFFIX)])
        return out

    def _resolve(self, checkpoint_id: str) -> str:
        """Full hex id for ``sha256:<hex>`` or a unique hex prefix of at least 6 characters."""
        if not isinstance(checkpoint_id, str):
            raise InvalidArgument(f"malformed checkpoint id {checkpoint_id!r}")
        text = checkpoint_id.lower()
        if text.startswith("sha256:"):
            text = text[len("sha256:") :]
        if not _ID_RE.fullmatch(text):
            raise InvalidArgument(
                f"malformed checkpoint id {checkpoint_id!r}: want sha256:<hex> or at least {MIN_PREFIX_LEN} hex characters"
            )
        if len(text) == 64:
            if not os.path.lexists(self.manifest_path(text)):
                raise NotFound(f"checkpoint sha256:{text} not found")
            return text
        matches = sorted(h for h in self._manifest_ids() if h.startswith(text))
        if not matches:
            raise NotFound(f"no checkpoint matches {checkpoint_id!r}")
        if len(matches) > 1:
            shown = ", ".join(h[:12] for h in matches[:5])
            raise InvalidArgument(f"checkpoint id {checkpoint_id!r} is ambiguous ({len(matches)} matches: {shown})")
        return matches[0]

    def _load(self, hexid: str) -> CheckpointRecord:
        path = self.manifest_path(hexid)
        cid = "sha256:" + hexid
        try:
            data = read_bounded(path, MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise NotFound(f"checkpoint {cid} not found") from None
        except ValueError as exc:
            raise DataLoss(f"checkpoint {cid}: manifest {path}: {exc}") from exc
        except OSError as exc:
            raise DataLoss(f"checkpoint {cid}: manifest {path} unreadable: {exc.strerror}") from exc
        actual = hashlib.sha256(data).hexdigest()
        if actual != hexid:
            raise DataLoss(f"checkpoint {cid}: manifest {path} content hashes to sha256:{actual}")
        manifest = decode_manifest(data, error=DataLoss, what=f"checkpoint {cid}: manifest {path}")
        return _record(hexid, manifest, path)

    # -- public API --------------------------------------------------------------------

    def writer(self) -> CheckpointWriter:
        """Start a new checkpoint (takes a lease in ``ingest/``)."""
        try:
            return CheckpointWriter(self)
        except OSError as exc:
            raise _os_error(exc, f"creating a writer in {self.ingest_dir}") from exc

    def list(self) -> list[CheckpointRecord]:
        """Every readable checkpoint, newest first; unreadable manifests are logged and skipped."""
        records: list[CheckpointRecord] = []
        for hexid in self._manifest_ids():
            try:
                records.append(self._load(hexid))
            except NotFound:
                continue
            except AgentError as exc:
                log.warning("skipping unreadable checkpoint: %s", exc, extra={"checkpoint": "sha256:" + hexid})
        records.sort(key=lambda r: (_created_key(r.created), r.id), reverse=True)
        return records

    def get(self, checkpoint_id: str) -> CheckpointRecord:
        """The checkpoint for a full id or unique prefix."""
        return self._load(self._resolve(checkpoint_id))

    def remove(self, checkpoint_id: str) -> None:
        """Unpublish a checkpoint, then delete the blobs nothing else references."""
        hexid = self._resolve(checkpoint_id)
        path = self.manifest_path(hexid)
        try:
            with store_lock(self.lock_path, exclusive=True):
                try:
                    candidates = scan_digests(path)
                except OSError as exc:
                    log.warning("cannot read manifest %s (%s); its blobs wait for recover()", path, exc.strerror)
                    candidates = set()
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    raise NotFound(f"checkpoint sha256:{hexid} not found") from None
                fsync_dir(self.checkpoints_dir)
                removed, freed = self.blobs.delete(candidates - self._referenced())
        except OSError as exc:
            raise _os_error(exc, f"removing checkpoint sha256:{hexid}") from exc
        log.info(
            "removed checkpoint sha256:%s (%d blobs, %d bytes freed)",
            hexid,
            len(removed),
            freed,
            extra={"checkpoint": "sha256:" + hexid},
        )

    def _referenced(self) -> set[str]:
        """Digests that must be kept: named by any manifest, quarantined file or live lease.

        Call with the exclusive store lock held.
        """
        refs = live_refs(self.ingest_dir)
        for folder in (self.checkpoints_dir, self.quarantine_dir):
            with os.scandir(folder) as it:
                paths = [e.path for e in it if e.is_file(follow_symlinks=False)]
            for path in paths:
                refs |= scan_digests(path)
        return refs

    def open(self, checkpoint_id: str, path: str) -> FileReader:
        """A random-access reader for one regular file of a checkpoint."""
        record = self.get(checkpoint_id)
        normalize_path(path)
        entry = record.entry(path)
        if entry.is_dir:
            raise InvalidArgument(f"checkpoint {record.id}: {path!r} is a directory")
        return FileReader(self.blobs, record.id, entry)

    def verify(self, checkpoint_id: str) -> builtins.list[BadBlob]:
        """Check every referenced blob (present, size, digest); [] when whole."""
        record = self.get(checkpoint_id)
        users: dict[str, list[str]] = {}
        sizes: dict[str, int] = {}
        for entry in record.files:
            for chunk in entry.chunks:
                users.setdefault(chunk.digest, [])
                if entry.path not in users[chunk.digest]:
                    users[chunk.digest].append(entry.path)
                sizes[chunk.digest] = chunk.size
        bad: list[BadBlob] = []
        for digest, size in sizes.items():
            reason = self.blobs.check(digest, size)
            if reason is not None:
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

    def materialize(self, checkpoint_id: str, dest: str | os.PathLike[str], *, prefix: str = "") -> None:
        """Write a checkpoint's files (those at or under ``prefix``, if given) into ``dest``.

        Paths keep their full checkpoint-relative names. ``dest`` must exist
        and hold nothing but directories. Every chunk is verified; on any
        error everything this call created is removed again.
        """
        record = self.get(checkpoint_id)
        entries: Sequence[FileEntry] = record.files
        if prefix:
            normalize_path(prefix)
            entries = [e for e in record.files if e.path == prefix or e.path.startswith(prefix + "/")]
            if not entries:
                raise NotFound(f"checkpoint {record.id}: nothing at {prefix!r}")
        dest_path = os.fspath(dest)
        try:
            dest_fd = os.open(dest_path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
        except OSError as exc:
            raise _os_error(exc, f"destination {dest_path!r}") from exc
        tree = _DestTree(dest_fd)
        try:
            _check_dest_only_dirs(dest_path, dest_fd)
            self._write_entries(record, entries, tree)
        except BaseException as exc:
            tree.close()
            _undo(dest_fd, tree.created)
            if isinstance(exc, OSError):
                raise _os_error(exc, f"materializing checkpoint {record.id} into {dest_path!r}") from exc
            raise
        finally:
            tree.close()
            os.close(dest_fd)

    def _write_entries(self, record: CheckpointRecord, entries: Sequence[FileEntry], tree: _DestTree) -> None:
        dirs = sorted((e for e in entries if e.is_dir), key=lambda e: e.path)
        for entry in dirs:
            tree.dir_fd(entry.path)
        for entry in sorted((e for e in entries if not e.is_dir), key=lambda e: e.path):
            parent, _, name = entry.path.rpartition("/")
            parent_fd = tree.dir_fd(parent)
            fd = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, FILE_MODE, dir_fd=parent_fd
            )
            tree.created.append((entry.path, False))
            try:
                for chunk in entry.chunks:
                    try:
                        data = self.blobs.read(chunk.digest, chunk.size)
                    except DataLoss as exc:
                        raise DataLoss(
                            f"checkpoint {record.id}: file {entry.path!r} at offset {chunk.offset}: {exc}"
                        ) from exc
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                os.fchmod(fd, entry.mode & 0o777)
            finally:
                os.close(fd)
        made = {rel for rel, is_dir in tree.created if is_dir}
        for entry in reversed(dirs):
            if entry.path in made:
                os.fchmod(tree.dir_fd(entry.path), entry.mode & 0o777)

    def recover(self) -> RecoveryReport:
        """Clean up after crashes: dead ingest dirs, strays, bad manifests, orphan blobs.

        Safe while other writers run: live leases and what they reference are kept.
        """
        ingest_removed: list[str] = []
        strays: list[str] = []
        quarantined: list[str] = []
        try:
            with store_lock(self.lock_path, exclusive=True):
                with os.scandir(self.ingest_dir) as it:
                    entries = list(it)
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        if not lease_is_live(entry.path):
                            shutil.rmtree(entry.path)
                            ingest_removed.append(entry.name)
                    else:
                        os.unlink(entry.path)
                        strays.append(os.path.join("ingest", entry.name))
                with os.scandir(self.checkpoints_dir) as it:
                    entries = list(it)
                for entry in entries:
                    name = entry.name
                    hexid = name[: -len(_MANIFEST_SUFFIX)] if name.endswith(_MANIFEST_SUFFIX) else ""
                    reason = "unexpected name"
                    if is_hex_digest(hexid) and entry.is_file(follow_symlinks=False):
                        try:
                            self._load(hexid)
                            continue
                        except AgentError as exc:
                            reason = str(exc)
                    self._quarantine(entry.path, name, reason)
                    quarantined.append(name)
                with os.scandir(self.blobs.dir) as it:
                    entries = list(it)
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        log.warning("leaving unexpected directory %s in the blob store", entry.path)
                    elif not (is_hex_digest(entry.name) and entry.is_file(follow_symlinks=False)):
                        os.unlink(entry.path)
                        strays.append(os.path.join("blobs", "sha256", entry.name))
                if quarantined:
                    fsync_dir(self.checkpoints_dir)
                keep = self._referenced()
                orphans = [d for d, _ in self.blobs.digests() if d not in keep]
                blobs_removed, freed = self.blobs.delete(orphans)
        except OSError as exc:
            raise _os_error(exc, f"recovering store {self.root!r}") from exc
        report = RecoveryReport(
            ingest_removed=tuple(sorted(ingest_removed)),
            strays_removed=tuple(sorted(strays)),
            quarantined=tuple(sorted(quarantined)),
            blobs_removed=tuple(blobs_removed),
            bytes_freed=freed,
        )
        if not report.clean:
            log.warning(
                "store recovery: %d ingest dirs, %d strays, %d manifests quarantined, %d orphan blobs (%d bytes)",
                len(report.ingest_removed),
                len(report.strays_removed),
                len(report.quarantined),
                len(report.blobs_removed),
                report.bytes_freed,
            )
        return report

    def _quarantine(self, path: str, name: str, reason: str) -> None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        target = os.path.join(self.quarantine_dir, f"{name}.{stamp}.{secrets.token_hex(4)}")
        os.rename(path, target)
        log.error("quarantined manifest %s as %s: %s", path, target, reason)

    def usage(self) -> int:
        """Bytes used by blobs and manifests."""
        total = 0
        try:
            for _, entry in self.blobs.digests():
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat(follow_symlinks=False).st_size
            with os.scandir(self.checkpoints_dir) as it:
                for entry in it:
                    with contextlib.suppress(FileNotFoundError):
                        total += entry.stat(follow_symlinks=False).st_size
        except OSError as exc:
            raise _os_error(exc, f"measuring store {self.root!r}") from exc
        return total

    def __repr__(self) -> str:
        return f"Store({self.root!r}, chunk_size={self.chunk_size})"

