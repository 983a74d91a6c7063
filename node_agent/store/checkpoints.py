"""The store: an OCI image layout of checkpoints, and the one object callers hold.

Rule: ``Store`` owns no rule of its own; it wires the parts and delegates.
The index (``index``) decides what is published, the blob store
(``blobs``) holds verified bytes, the chunk reader (``chunk_reader``)
decodes and opens them, writers and importers publish through
the index, ``origins`` say where a lazily pulled checkpoint's blobs still
are, ``gc`` collects and ``repair`` recovers. What is here is reading:
records, holds, random access and materializing, all of which verify what
they read. Every id, path and document that comes in is validated; nothing
is written outside the store or a caller's ``dest``.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, BinaryIO, Final

from node_agent.errors import AgentError, DataLoss, InvalidArgument, NotFound
from node_agent.oci import Descriptor, digest_hex
from node_agent.store import repair
from node_agent.store.blobs import BlobStore
from node_agent.store.chunk_reader import ChunkReader
from node_agent.store.files import FILE_MODE, O_CLOEXEC, O_DIRECTORY, O_NOFOLLOW, ensure_dir, os_error
from node_agent.store.ingest import Ingest
from node_agent.store.chunking import Chunker
from node_agent.store.gc import Collector, GcReport, RetentionPolicy, entry_refs
from node_agent.store.blob_import import BlobImporter
from node_agent.store.index import Index
from node_agent.store.documents import FileEntry, is_checkpoint_entry, normalize_path
from node_agent.store.origins import Origins
from node_agent.store.reading import (
    DestTree,
    FileReader,
    check_dest_only_dirs,
    undo,
    verify_blobs,
    write_entries,
)
from node_agent.store.records import (
    BadBlob,
    CheckpointRecord,
    RecoveryReport,
    created_epoch,
    without_store_annotations,
)
from node_agent.store.referrers import attach as attach_referrer
from node_agent.store.referrers import listed as listed_referrers
from node_agent.store.referrers import read_blob as read_referrer_blob
from node_agent.store.sealing import Keyring, SealKey
from node_agent.store.writer import CheckpointWriter, ProgressFn, WriterHooks

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)

# About 1 MiB on average (256 KiB to 4 MiB): per-chunk costs stay small and a
# 1 GiB checkpoint stays near a thousand manifest layers. A workload that
# dirties scattered pages between checkpoints may want smaller chunks
# (docs/store.md has the trade-off).
DEFAULT_CHUNK_SIZE: Final = 1 << 20
_DIR_OPEN: Final = os.O_RDONLY | O_DIRECTORY | O_CLOEXEC


class _VerifyingReader(io.RawIOBase):
    """A blob's raw bytes; DataLoss at the end if they don't match its digest."""

    def __init__(self, fd: int, digest: str, size: int) -> None:
        super().__init__()
        self._fd = fd
        self._digest = digest
        self._size = size
        self._got = 0
        self._hasher = hashlib.sha256()
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer, /) -> int:
        if self.closed:
            raise ValueError("I/O operation on a closed blob reader")
        view = memoryview(buffer).cast("B")
        n = os.readv(self._fd, [view])
        if n:
            self._hasher.update(view[:n])
            self._got += n
        if not self._done and (self._got >= self._size or (n == 0 and len(view))):
            # Checked as soon as the expected size is reached, so a caller that
            # reads exactly that many bytes is covered too.
            self._done = True
            actual = "sha256:" + self._hasher.hexdigest()
            if actual != self._digest or self._got != self._size:
                raise DataLoss(f"blob {self._digest}: content hashes to {actual} ({self._got} bytes)")
        return n

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


class Store:
    """A content-addressed checkpoint store: an OCI image layout rooted at one directory.

    All methods are synchronous and safe to call from several threads and
    processes at once; run them in worker threads from async code.
    ``chunk_size`` is the content-defined chunking average (chunks run from
    a quarter of it to four times it); ``workers`` the threads a writer,
    materialize or verify use (default: every core); ``writer_hooks`` are
    told about every writer this object starts (see ``WriterHooks``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        workers: int | None = None,
        writer_hooks: WriterHooks | None = None,
        keys: Keyring | None = None,
    ) -> None:
        self.chunker = Chunker(chunk_size)
        self.chunk_size = chunk_size
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise InvalidArgument(f"workers {workers!r} is not a positive integer")
        self.workers = workers or os.cpu_count() or 1
        self.writer_hooks = writer_hooks
        self.root = os.path.abspath(os.fspath(root))
        # Sealed checkpoints open with keys from here (store/sealing.py).
        self.keys = keys
        self.blobs = BlobStore(self.root)
        self.chunks = ChunkReader(self.blobs, keys)
        self.ingest_dir = os.path.join(self.root, "ingest")
        self.quarantine_dir = os.path.join(self.root, "quarantine")
        self.lock_path = os.path.join(self.root, ".lock")
        self.index = Index(self.root, self.chunks, scratch_dir=self.ingest_dir, lock_path=self.lock_path,
                           quarantine_dir=self.quarantine_dir,
                           lazily_pulled=lambda cid: self.origins.get(cid) is not None)
        self.index_path = self.index.path
        self.layout_path = self.index.layout_path
        self.origins = Origins(self.root, self.blobs, self.index)
        self.collector = Collector(self.root, self.blobs, self.index, self.origins, ingest_dir=self.ingest_dir)
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            if stat.S_IMODE(os.stat(self.root).st_mode) != 0o700:
                os.chmod(self.root, 0o700)
            self.blobs.setup()
            for path in (self.ingest_dir, self.quarantine_dir, self.origins.dir):
                ensure_dir(path)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC, FILE_MODE)
            try:
                if stat.S_IMODE(os.fstat(fd).st_mode) != FILE_MODE:
                    os.fchmod(fd, FILE_MODE)
            finally:
                os.close(fd)
            self.index.setup()
        except OSError as exc:
            raise os_error(exc, f"store root {self.root!r}") from exc

    def blob_path(self, digest: str) -> str:
        """Path of a blob (``sha256:<hex>``); the blob need not exist."""
        return self.blobs.path(digest)

    def manifest_path(self, checkpoint_id: str) -> str:
        """Path of a checkpoint's manifest blob (full id or 64 hex; need not exist)."""
        text = checkpoint_id.removeprefix("sha256:")
        return self.blobs.path("sha256:" + text)

    # -- writing and importing ---------------------------------------------------------------

    def writer(self, *, progress: ProgressFn | None = None, seal: SealKey | None = None) -> CheckpointWriter:
        """Start a new checkpoint (takes a lease in ``ingest/``); see CheckpointWriter for ``progress``.

        With ``seal``, every chunk and the config blob are sealed under that
        key (store/sealing.py): the checkpoint is encrypted.
        """
        try:
            return CheckpointWriter(self.blobs, self.index, ingest_dir=self.ingest_dir, chunker=self.chunker,
                                    workers=self.workers, progress=progress, hooks=self.writer_hooks, seal=seal)
        except OSError as exc:
            raise os_error(exc, f"creating a writer in {self.ingest_dir}") from exc

    def importer(self, *, keep_for: float = 0.0, manifest: str = "", reference: str = "") -> BlobImporter:
        """Start importing a checkpoint's blobs and manifest (takes a lease in ``ingest/``).

        With ``keep_for`` (seconds) and ``manifest`` (the digest imported;
        ``reference``: where from, for people), an import that stops without
        publishing or discarding keeps what it brought that long, so that
        running it again resumes (``store/kept.py``).
        """
        try:
            return BlobImporter(self.chunks, self.index, self.origins, self.collector, ingest_dir=self.ingest_dir,
                                keep_for=keep_for, manifest=manifest, reference=reference)
        except OSError as exc:
            raise os_error(exc, f"creating an importer in {self.ingest_dir}") from exc

    def hold(self, checkpoint: CheckpointRecord | str) -> Ingest:
        """Keep every blob of a checkpoint while the returned lease lives, even if it is removed.

        Restores take one for as long as they read the checkpoint, and each
        lazily restored container's page source holds one until its pages are
        in: removing the checkpoint (or retention dropping it) meanwhile only
        unpublishes it, and the next collection after the lease ends deletes
        the blobs. ``release()`` ends the lease; ``detach()`` hands it to a
        child process that inherited ``lease_fd``. An id must name a
        published checkpoint; a record is taken as it is (its reader holds
        it already, or accepts that it may have gone).
        """
        published = not isinstance(checkpoint, CheckpointRecord)
        cid = self.index.resolve(checkpoint) if isinstance(checkpoint, str) else checkpoint.id
        try:
            ingest = Ingest(self.ingest_dir, self.lock_path, self.blobs)
        except OSError as exc:
            raise os_error(exc, f"creating a hold in {self.ingest_dir}") from exc
        try:
            with self.index.locked(exclusive=False):
                if published and cid not in self.index.ids():
                    raise NotFound(f"checkpoint {cid} not found")
                ingest.reference_all(entry_refs(self.blobs, cid, ""))
        except OSError as exc:
            ingest.release()
            raise os_error(exc, f"holding checkpoint {cid}") from exc
        except BaseException:
            ingest.release()
            raise
        return ingest

    def link_into(self, checkpoint: CheckpointRecord, root: str) -> Store:
        """A new private store at ``root`` (which must not exist) with hard links to the checkpoint's blobs.

        Its readers keep reading whatever later happens to this store: made
        for a lazy restore from a caller's directory (CRI RestorePod), which
        the caller may delete once the call returns. Nothing is published
        there (`held` loads the checkpoint). The blobs are linked as they are,
        never trusted: readers verify each one as they read it. Works within
        one filesystem only (OSError with EXDEV otherwise); on any error
        ``root`` is removed again.
        """
        os.mkdir(root, 0o700)
        try:
            dest = Store(root, chunk_size=self.chunk_size, workers=self.workers, keys=self.keys)
            for digest in sorted(entry_refs(self.blobs, checkpoint.id, "")):
                src = self.blobs.path(digest)
                try:
                    if not stat.S_ISREG(os.lstat(src).st_mode):
                        continue  # read from the caller's store it would fail too: let the reader say so
                except FileNotFoundError:
                    continue
                os.link(src, dest.blobs.path(digest), follow_symlinks=False)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return dest

    # -- reading -----------------------------------------------------------------------------

    def list(self) -> builtins.list[CheckpointRecord]:
        """Every readable checkpoint, newest first; unreadable ones are logged and skipped."""
        return self.scan()[0]

    def scan(self) -> tuple[builtins.list[CheckpointRecord], builtins.list[AgentError]]:
        """(every readable checkpoint, newest first; why each unreadable one is unreadable)."""
        records: list[CheckpointRecord] = []
        problems: list[AgentError] = []
        for entry in self.index.read():
            if not is_checkpoint_entry(entry):
                continue
            cid = entry["digest"]
            try:
                records.append(self.index.load(cid, entry))
            except AgentError as exc:
                log.warning("skipping unreadable checkpoint: %s", exc, extra={"checkpoint": cid})
                problems.append(exc)
        records.sort(key=lambda r: (created_epoch(r.created), r.id), reverse=True)
        return records, problems

    def get(self, checkpoint_id: str, *, within: Callable[[CheckpointRecord], bool] | None = None) -> CheckpointRecord:
        """The checkpoint for a full id or unique prefix (among those `within` accepts, if given)."""
        return self.index.load(self.index.resolve(checkpoint_id, within))

    def held(self, checkpoint_id: str) -> CheckpointRecord:
        """The checkpoint with this full id, published or not: for a reader that holds it (`hold`)."""
        return self.index.load("sha256:" + digest_hex(checkpoint_id))

    def _as_record(self, checkpoint: CheckpointRecord | str) -> CheckpointRecord:
        """A record as given (a reader that loaded it keeps reading it), or the published one for an id."""
        return checkpoint if isinstance(checkpoint, CheckpointRecord) else self.get(checkpoint)

    def open(self, checkpoint: CheckpointRecord | str, path: str) -> FileReader:
        """A random-access reader for one regular file of a checkpoint (a record, or an id)."""
        record = self._as_record(checkpoint)
        record.require_open()
        normalize_path(path)
        entry = record.entry(path)
        if entry.is_dir:
            raise InvalidArgument(f"checkpoint {record.id}: {path!r} is a directory")
        return FileReader(self.chunks, record.id, entry, fetch=self.origins.fetch_for(record.id))

    def verify(self, checkpoint_id: str) -> builtins.list[BadBlob]:
        """Check every chunk blob (present, size, digest, decodes to its size); [] when whole.

        The manifest and config blobs are verified by loading the checkpoint.
        Of a lazily pulled checkpoint, blobs still only at its origin are not
        bad: they are verified when they arrive.
        """
        record = self.get(checkpoint_id)
        record.require_open()
        origin = self.origins.get(record.id)
        if origin is not None:
            log.info("checkpoint %s: %d blobs are still only in %s (pulled lazily)", record.id,
                     len(self.origins.missing(record)), origin["reference"], extra={"checkpoint": record.id})
        return verify_blobs(self.chunks, record, self.workers, remote_ok=origin is not None)

    def materialize(
        self, checkpoint: CheckpointRecord | str, dest: str | os.PathLike[str], *, prefix: str = "",
        exclude: Collection[str] = (),
    ) -> None:
        """Write a checkpoint's files (those at or under ``prefix``, if given) into ``dest``.

        Paths keep their full checkpoint-relative names. ``dest`` must exist,
        and ``dest/prefix`` must be missing or hold nothing but directories
        (so several prefixes can go into one destination). Files whose paths
        are in ``exclude`` are left out. Every chunk is verified; on any
        error everything this call created is removed again.
        """
        record = self._as_record(checkpoint)
        record.require_open()
        entries: Sequence[FileEntry] = record.files
        if prefix:
            normalize_path(prefix)
            entries = [e for e in record.files if e.path == prefix or e.path.startswith(prefix + "/")]
            if not entries:
                raise NotFound(f"checkpoint {record.id}: nothing at {prefix!r}")
        if exclude:
            entries = [e for e in entries if e.path not in exclude]
        dest_path = os.fspath(dest)
        try:
            dest_fd = os.open(dest_path, _DIR_OPEN)
        except OSError as exc:
            raise os_error(exc, f"destination {dest_path!r}") from exc
        tree = DestTree(dest_fd)
        try:
            check_dest_only_dirs(dest_path, dest_fd, prefix)
            fetch = self.origins.fetch_for(record.id)
            # Chunks still in a registry come over its connections: as many in flight as it serves at once.
            workers = self.workers if fetch is None else max(self.workers, self.origins.fetch_lanes)
            write_entries(self.chunks, record, entries, tree, workers, fetch)
        except BaseException as exc:
            tree.close()
            undo(dest_fd, tree.created)
            if isinstance(exc, OSError):
                raise os_error(exc, f"materializing checkpoint {record.id} into {dest_path!r}") from exc
            raise
        finally:
            tree.close()
            os.close(dest_fd)

    def copy(self, checkpoint: CheckpointRecord | str, *, seal: SealKey | None) -> CheckpointRecord:
        """A new checkpoint with the same files, metadata and annotations, sealed under ``seal`` (None: clear).

        Every chunk is read, verified and written again (re-encrypted): the
        plaintext passes through memory only. The creation time is kept, and
        so is the provenance (a copy of a pulled checkpoint is pulled); the
        copy is received now.
        """
        record = self._as_record(checkpoint)
        record.require_open()
        with self.writer(seal=seal) as w:
            for entry in record.files:
                if entry.is_dir:
                    w.add_dir(entry.path, mode=entry.mode)
                    continue
                with FileReader(self.chunks, record.id, entry, fetch=self.origins.fetch_for(record.id)) as reader:
                    w.add_reader(entry.path, reader, entry.size, mode=entry.mode)
            return w.commit(record.metadata, annotations=without_store_annotations(record.annotations),
                            provenance=record.provenance)

    # -- moving checkpoints between stores ---------------------------------------------------

    def manifest_bytes(self, checkpoint_id: str) -> bytes:
        """The exact published manifest bytes (verified; their sha256 is the id)."""
        return self.index.documents(self.index.resolve(checkpoint_id))[0]

    def descriptors(self, checkpoint_id: str) -> builtins.list[Descriptor]:
        """Every blob a copy of the checkpoint needs besides its manifest: the config, then the layers."""
        _, manifest, _ = self.index.documents(self.index.resolve(checkpoint_id))
        return [manifest.config, *manifest.layers]

    def has_blob(self, digest: str) -> bool:
        """Whether the blob ``digest`` is stored (as a regular file)."""
        return self.blobs.size_of(digest) is not None

    def open_blob(self, digest: str) -> BinaryIO:
        """A stream of a blob's raw stored bytes; reading to the end raises DataLoss if they don't hash to ``digest``."""
        path = self.blobs.path(digest)
        try:
            fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"blob {digest} not found") from None
        except OSError as exc:
            raise os_error(exc, f"opening blob {digest}") from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise DataLoss(f"blob {digest} is not a regular file")
        return io.BufferedReader(_VerifyingReader(fd, digest, st.st_size), buffer_size=1 << 20)

    # -- referrers (signatures) ----------------------------------------------------------------

    def attach(self, subject_id: str, manifest: bytes, blobs: Mapping[str, bytes] | None = None) -> str:
        """Store a referrer (an OCI manifest whose ``subject`` is this checkpoint) and the blobs it names; its digest.

        ``blobs`` (digest: bytes) are the ones the store may lack. All is
        verified, made durable and published under the exclusive lock while
        the checkpoint is published; removing the checkpoint removes it too.
        """
        return attach_referrer(self.index, self.blobs, self.ingest_dir, self.index.resolve(subject_id), manifest,
                               blobs or {})

    def referrers(self, subject_id: str, artifact_type: str | None = None) -> builtins.list[tuple[str, bytes]]:
        """(digest, verified manifest bytes) of every referrer of a checkpoint (of ``artifact_type``, if given)."""
        text = subject_id.lower().removeprefix("sha256:") if isinstance(subject_id, str) else ""
        cid = "sha256:" + text if len(text) == 64 else self.index.resolve(subject_id)
        return listed_referrers(self.index, self.blobs, "sha256:" + digest_hex(cid), artifact_type)

    def read_blob(self, digest: str, size: int) -> bytes:
        """A small blob (a referrer's, at most 4 MiB) whole, its size and digest verified; DataLoss otherwise."""
        return read_referrer_blob(self.blobs, digest, size)

    # -- removing, collecting, recovering ----------------------------------------------------

    def remove(self, checkpoint_id: str) -> GcReport:
        """Unpublish a checkpoint, then delete the blobs nothing else reaches."""
        return self.collector.remove(self.index.resolve(checkpoint_id))

    def gc(self, policy: RetentionPolicy | None = None, *, dry_run: bool = False, now: float | None = None) -> GcReport:
        """Unpublish the checkpoints ``policy`` drops (oldest first), then delete unreachable blobs.

        Also removes ingest directories whose lease is gone (a kept lease:
        once its time is before ``now``, the current time by default). With
        ``dry_run`` nothing is touched and the report says what would go.
        Checkpoints that fail to load are never dropped by a policy (and
        their blobs are kept); ``recover`` quarantines them.
        """
        return self.collector.collect(policy, dry_run=dry_run, now=time.time() if now is None else now)

    def recover(self) -> RecoveryReport:
        """Clean up after crashes: dead ingest dirs, strays, unloadable checkpoints, orphan blobs (see ``repair``)."""
        return repair.recover(self.index, self.blobs, self.collector, ingest_dir=self.ingest_dir)

    def free_bytes(self) -> int:
        """Bytes an unprivileged writer may still use on the store's filesystem."""
        try:
            st = os.statvfs(self.root)
        except OSError as exc:
            raise os_error(exc, f"measuring the free space of store {self.root!r}") from exc
        return st.f_bavail * st.f_frsize

    def short_of_room(self, size: int, min_free: int) -> int | None:
        """The bytes free on the store's filesystem when ``size`` more would leave less than ``min_free`` there;
        None when they fit (the one rule for what a fetch may keep: docs/registry.md, "Bounds")."""
        free = self.free_bytes()
        return free if free - size < min_free else None

    def usage(self) -> int:
        """Bytes used by blobs (chunks, configs and manifests)."""
        try:
            return sum(self.blobs.sizes().values())
        except OSError as exc:
            raise os_error(exc, f"measuring store {self.root!r}") from exc

    def __repr__(self) -> str:
        return f"Store({self.root!r}, chunk_size={self.chunk_size}, workers={self.workers})"
