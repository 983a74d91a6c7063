"""Writing one checkpoint: files in, chunks stored, config and manifest published.

Rule: nothing is visible until ``commit``. Data is chunked, encoded, hashed
and written to the writer's ingest directory as it is added (by the
pipeline's workers); ``commit`` waits for every chunk, builds the config
blob and the manifest, makes every new blob durable (fsync the files, link
them in, fsync the directories) and then publishes the manifest in
``index.json``, last. Sources are opened without following symlinks, and
only regular files and directories are accepted. A writer reaches the store
through its blob store and index alone; ``WriterHooks`` let the store's
owner watch (and stop) its writers.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Protocol

from node_agent.errors import FailedPrecondition, InvalidArgument
from node_agent.oci import EMPTY_BLOB, EMPTY_DESCRIPTOR, MAX_MANIFEST_BYTES, Descriptor, sha256_digest
from node_agent.store.blobs import BlobStore
from node_agent.store.files import O_CLOEXEC, O_DIRECTORY, O_NOFOLLOW, os_error
from node_agent.store.ingest import Ingest
from node_agent.store.chunking import Chunker
from node_agent.store.index import Index
from node_agent.store import sealing
from node_agent.store.documents import (
    CONFIG_MEDIA_TYPE,
    CONFIG_SEALED_MEDIA_TYPE,
    CREATED_ANNOTATION,
    KEY_ID_ANNOTATION,
    MAX_CONFIG_BYTES,
    MAX_ENTRIES,
    Chunk,
    FileEntry,
    check_annotations,
    check_tree,
    decode_config,
    decode_manifest,
    encode_config,
    encode_manifest,
    is_created,
    join_path,
    layers_for,
    normalize_path,
)
from node_agent.store.pipeline import ChunkPipeline, PendingChunk, Readable
from node_agent.store.records import LOCAL, check_provenance, now_rfc3339, refuse_store_annotations
from node_agent.store.sealing import SealKey

if TYPE_CHECKING:
    from node_agent.store.records import CheckpointRecord

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]

_O_NONBLOCK: Final = getattr(os, "O_NONBLOCK", 0)
_DIR_OPEN: Final = os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC
_FILE_OPEN: Final = os.O_RDONLY | O_NOFOLLOW | _O_NONBLOCK | O_CLOEXEC


class WriterHooks(Protocol):
    """What the owner of a store is told about each of its writers (``Store(writer_hooks=...)``).

    ``opened`` runs before a writer takes its lease, and ``progress`` with
    each of its progress reports, from the writer's thread; an exception
    from either fails that writer. ``closed`` runs exactly once for each
    writer ``opened`` let through, when it lets go of the store: committed,
    aborted, or failed while starting.
    """

    def opened(self) -> None: ...

    def progress(self, done: int, total: int) -> None: ...

    def closed(self) -> None: ...


@dataclass
class _PendingFile:
    path: str
    mode: int
    chunks: list[PendingChunk]
    size: int


def _open_dir(root_fd: int, rel: str) -> int:
    """Open the directory ``rel`` below ``root_fd``, following no symlink on the way."""
    fd = os.dup(root_fd)
    for part in rel.split("/") if rel else []:
        try:
            nxt = os.open(part, _DIR_OPEN, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _check_mode(mode: int, path: str) -> None:
    if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777:
        raise InvalidArgument(f"mode {mode!r} for {path!r} is not in [0, 0o7777]")


class CheckpointWriter:
    """Builds one checkpoint; a context manager that aborts unless committed.

    One writer belongs to one thread; it spreads the chunk work over the
    store's worker threads itself. ``progress``, if given, is called from the
    writer's thread as ``progress(bytes_done, bytes_total)``: the bytes of
    content stored so far and the bytes expected so far (a tree's size is
    known once ``add_tree`` has scanned it). ``bytes_done`` and
    ``bytes_total`` can also be polled. ``hooks`` are told first (see
    ``WriterHooks``). The writer takes its lease in ``ingest_dir`` and
    publishes through ``index``.
    """

    def __init__(
        self,
        blobs: BlobStore,
        index: Index,
        *,
        ingest_dir: str,
        chunker: Chunker,
        workers: int,
        progress: ProgressFn | None = None,
        hooks: WriterHooks | None = None,
        seal: SealKey | None = None,
    ) -> None:
        self._index = index
        self._seal = seal
        self._progress = progress
        self._hooks = hooks
        if hooks is not None:
            hooks.opened()
        try:
            self._ingest = Ingest(ingest_dir, index.lock_path, blobs)
        except BaseException:
            self._let_go()
            raise
        self._pipeline = ChunkPipeline(chunker, self._ingest, workers, seal)
        self._entries: dict[str, FileEntry | _PendingFile] = {}
        self._total = 0
        self._expected = 0
        self._state = "open"

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state != "committed":
            self.abort()

    @property
    def bytes_written(self) -> int:
        """New bytes actually stored for file content (after compression; blobs that were not yet present)."""
        return self._pipeline.bytes_written

    @property
    def bytes_total(self) -> int:
        """Bytes of file content added so far."""
        return self._total

    @property
    def bytes_done(self) -> int:
        """Bytes of file content whose chunks are stored (or found already stored)."""
        return self._pipeline.bytes_done

    def wait(self) -> None:
        """Block until every chunk added so far is stored (or found stored); raise the first failure."""
        self._check_open()
        for item in self._entries.values():
            if isinstance(item, _PendingFile):
                for pending in item.chunks:
                    pending.future.result()
        self._report()

    def _report(self) -> None:
        self._tell(self._pipeline.bytes_done, max(self._expected, self._total))

    def _tell(self, done: int, total: int) -> None:
        if self._hooks is not None:
            self._hooks.progress(done, total)
        if self._progress is not None:
            self._progress(done, total)

    def _let_go(self) -> None:
        """Tell the hooks, once, that this writer holds nothing of the store any more."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.closed()

    # -- adding ------------------------------------------------------------------------------

    def add_file(self, path: str, src: str | os.PathLike[str], *, mode: int | None = None) -> None:
        """Add the regular file ``src`` as ``path`` (streamed; the source is never held in memory)."""
        self._check_open()
        path = self._new_path(path)
        try:
            fd = os.open(src, _FILE_OPEN)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise InvalidArgument(f"source {os.fspath(src)!r} for {path!r} is a symlink") from exc
            raise os_error(exc, f"source {os.fspath(src)!r} for {path!r}") from exc
        try:
            with self._poison_on_error():
                self._add_fd(path, fd, mode, os.fspath(src))
        finally:
            os.close(fd)

    def add_bytes(self, path: str, data: bytes, *, mode: int = 0o600) -> None:
        """Add ``data`` as the regular file ``path``."""
        self._check_open()
        path = self._new_path(path)
        _check_mode(mode, path)
        data = bytes(data)
        self._expected += len(data)
        chunks = self._pipeline.add_buffer(data)
        self._entries[path] = _PendingFile(path, mode, chunks, len(data))
        self._total += len(data)
        self._report()

    def add_reader(self, path: str, reader: Readable, size: int, *, mode: int = 0o600) -> None:
        """Add the regular file ``path`` from a reader (of ``size`` bytes, as expected; what it gives counts)."""
        self._check_open()
        path = self._new_path(path)
        _check_mode(mode, path)
        self._expected += size
        with self._poison_on_error():
            chunks = self._pipeline.add_fd(reader, size, self._report)
        got = sum(c.size for c in chunks)
        self._entries[path] = _PendingFile(path, mode, chunks, got)
        self._total += got
        self._report()

    def add_dir(self, path: str, *, mode: int = 0o700) -> None:
        """Add an (empty) directory entry."""
        self._check_open()
        path = self._new_path(path)
        _check_mode(mode, path)
        self._entries[path] = FileEntry(path=path, type="dir", mode=mode)

    def add_tree(self, prefix: str, src_dir: str | os.PathLike[str]) -> None:
        """Add every file and directory under ``src_dir`` below ``prefix``.

        ``prefix`` "" puts the tree's contents at the top level; otherwise
        ``prefix`` itself becomes a directory entry. The tree is scanned
        first (so a symlink, device, FIFO or socket anywhere is
        InvalidArgument before any data is read, and the total size is
        known), then its files are read in order. Symlinks are never
        followed.
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
            raise os_error(exc, f"source tree {src!r}") from exc
        try:
            with self._poison_on_error():
                if prefix:
                    self._entries[self._new_path(prefix)] = FileEntry(
                        path=prefix, type="dir", mode=stat.S_IMODE(os.fstat(root_fd).st_mode)
                    )
                files = self._scan_tree(prefix, src, root_fd)
                self._expected += sum(size for _, _, size in files)
                self._report()
                self._read_files(src, root_fd, files)
        except OSError as exc:
            raise os_error(exc, f"source tree {src!r}") from exc
        finally:
            os.close(root_fd)

    def _scan_tree(self, prefix: str, src: str, root_fd: int) -> list[tuple[str, str, int]]:
        """Add the directory entries; return ``(checkpoint path, source-relative path, size)`` per file."""
        files: list[tuple[str, str, int]] = []
        stack = [""]
        while stack:
            rel = stack.pop()
            dir_fd = _open_dir(root_fd, rel)
            try:
                with os.scandir(dir_fd) as it:
                    names = sorted(e.name for e in it)
                subdirs: list[str] = []
                for name in names:
                    sub = join_path(rel, name)
                    path = join_path(prefix, sub)
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        self._entries[self._new_path(path)] = FileEntry(
                            path=path, type="dir", mode=stat.S_IMODE(st.st_mode)
                        )
                        subdirs.append(sub)
                    elif stat.S_ISREG(st.st_mode):
                        files.append((self._new_path(path), sub, st.st_size))
                        self._entries[path] = _PendingFile(path, stat.S_IMODE(st.st_mode), [], 0)
                    else:
                        kind = "symlink" if stat.S_ISLNK(st.st_mode) else "special file"
                        raise InvalidArgument(
                            f"source {os.path.join(src, sub)!r} is a {kind}; "
                            "only regular files and directories are supported"
                        )
                stack.extend(reversed(subdirs))
            finally:
                os.close(dir_fd)
        return files

    def _read_files(self, src: str, root_fd: int, files: list[tuple[str, str, int]]) -> None:
        dir_rel, dir_fd = "", os.dup(root_fd)
        try:
            for path, sub, _ in files:
                parent, _, name = sub.rpartition("/")
                if parent != dir_rel:
                    os.close(dir_fd)
                    dir_fd = -1
                    dir_fd = _open_dir(root_fd, parent)
                    dir_rel = parent
                where = os.path.join(src, sub)
                try:
                    fd = os.open(name, _FILE_OPEN, dir_fd=dir_fd)
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        raise InvalidArgument(f"source {where!r} became a symlink while it was read") from exc
                    raise
                try:
                    pending = self._entries[path]
                    assert isinstance(pending, _PendingFile)
                    self._add_fd(path, fd, pending.mode, where, counted=True)
                finally:
                    os.close(fd)
        finally:
            if dir_fd >= 0:
                os.close(dir_fd)

    def _add_fd(self, path: str, fd: int, mode: int | None, where: str, *, counted: bool = False) -> None:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"source {where!r} for {path!r} is not a regular file")
        if mode is None:
            mode = stat.S_IMODE(st.st_mode)
        _check_mode(mode, path)
        if not counted:
            self._expected += st.st_size
        try:
            chunks = self._pipeline.add_fd(fd, st.st_size, self._report)
        except OSError as exc:  # reading the source; or the store's disk is full under its chunks
            doing = "storing" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "reading"
            raise os_error(exc, f"{doing} {where!r} for {path!r}") from exc
        size = sum(c.size for c in chunks)
        self._entries[path] = _PendingFile(path, mode, chunks, size)
        self._total += size
        self._report()

    @contextlib.contextmanager
    def _poison_on_error(self) -> Iterator[None]:
        """A failure half-way through adding leaves the writer unusable (only abort works)."""
        try:
            yield
        except BaseException:
            if self._state == "open":
                self._state = "failed"
            raise

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

    # -- commit ------------------------------------------------------------------------------

    def _finish_entries(self) -> list[FileEntry]:
        """Wait for every chunk; the sorted file table."""
        out: list[FileEntry] = []
        for item in self._entries.values():
            if isinstance(item, FileEntry):
                out.append(item)
                continue
            chunks = []
            for pending in item.chunks:
                try:
                    done = pending.future.result()
                except OSError as exc:  # writing its chunk (a full disk, say)
                    raise os_error(exc, f"storing {item.path!r}") from exc
                chunks.append(
                    Chunk(
                        digest=done.digest,
                        size=pending.size,
                        offset=pending.offset,
                        encoding=done.encoding,
                        stored_size=done.stored_size,
                        plain=done.plain,
                    )
                )
            out.append(FileEntry(path=item.path, type="file", mode=item.mode, size=item.size, chunks=tuple(chunks)))
        out.sort(key=lambda e: e.path)
        return out

    def commit(self, metadata: Mapping[str, Any], annotations: Mapping[str, str] | None = None, *,
               provenance: str = LOCAL) -> CheckpointRecord:
        """Make every blob durable, then publish the manifest; return the record.

        ``metadata`` (a JSON object) goes into the config blob;
        ``annotations`` (strings) into the manifest and its index.json
        entry. ``org.opencontainers.image.created`` is set to now unless
        given. ``provenance`` (``local``, or ``imported`` for an archive's
        content, or that of the checkpoint a copy is of) goes into the index
        record with the time of publishing (``records.receipt``).
        """
        self._check_open()
        try:
            if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
                raise InvalidArgument("metadata must be a JSON object (a mapping with string keys)")
            check_provenance(provenance)
            notes = check_annotations(annotations if annotations is not None else {})
            refuse_store_annotations(notes, "new checkpoint")
            notes.setdefault(CREATED_ANNOTATION, now_rfc3339())
            if not is_created(notes[CREATED_ANNOTATION]):
                raise InvalidArgument(
                    f"annotation {CREATED_ANNOTATION} {notes[CREATED_ANNOTATION]!r} is not an RFC 3339 UTC timestamp"
                )
            entries = self._finish_entries()
            check_tree(entries)
            config_bytes = encode_config(metadata, entries)
            if len(config_bytes) > MAX_CONFIG_BYTES:
                raise InvalidArgument(f"config of {len(config_bytes)} bytes exceeds the {MAX_CONFIG_BYTES}-byte limit")
            config = decode_config(config_bytes, error=InvalidArgument, what="new config")
            if self._seal is not None:
                # The config names every chunk's plaintext digest: it is sealed too.
                config_bytes = self._seal.seal(sealing.CONFIG, config_bytes)
                config_desc = Descriptor(CONFIG_SEALED_MEDIA_TYPE, sha256_digest(config_bytes), len(config_bytes))
                notes[KEY_ID_ANNOTATION] = self._seal.key_id
            else:
                notes.pop(KEY_ID_ANNOTATION, None)
                config_desc = Descriptor(CONFIG_MEDIA_TYPE, sha256_digest(config_bytes), len(config_bytes))
            layers = layers_for(entries)
            data = encode_manifest(config_desc, layers, notes)
            if len(data) > MAX_MANIFEST_BYTES:
                raise InvalidArgument(f"manifest of {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
            manifest = decode_manifest(data, error=InvalidArgument, what="new manifest")
            manifest_digest = sha256_digest(data)
            try:
                self._ingest.put(config_desc.digest, config_bytes)
                self._ingest.put(manifest_digest, data)
                if layers == (EMPTY_DESCRIPTOR,):
                    self._ingest.put(EMPTY_DESCRIPTOR.digest, EMPTY_BLOB)
                required = {d.digest: d.size for d in (*layers, config_desc)}
                required[manifest_digest] = len(data)
                self._pipeline.wait_flushed()
                self._ingest.commit_blobs(required, self._pipeline.executor)
                listed = self._index.publish(manifest_digest, len(data), notes, required, provenance=provenance)
            except OSError as exc:
                raise os_error(exc, f"committing checkpoint {manifest_digest}") from exc
        except BaseException:
            self.abort()
            raise
        self._pipeline.close()
        self._ingest.release()
        self._state = "committed"
        try:
            self._tell(self._total, self._total)
        finally:
            self._let_go()
        record = self._index.record(manifest_digest, manifest, config, listed)
        log.info(
            "published checkpoint %s (%d files, %d bytes, %d new stored bytes)",
            record.id,
            len(record.files),
            record.size,
            self.bytes_written,
            extra={"checkpoint": record.id},
        )
        return record

    def abort(self) -> None:
        """Discard everything written so far. Idempotent."""
        if self._state in ("open", "failed"):
            self._state = "aborted"
        self._pipeline.close(cancel=True)
        self._ingest.release()
        self._let_go()
