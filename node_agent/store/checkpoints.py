"""The store: an OCI image layout of checkpoints, and everything done to it as a whole.

Rule: a checkpoint is listed only once its manifest is published in
``index.json``, and it is published only after every blob it names is
durable and verified. ``index.json`` changes only under the exclusive store
lock, by an atomic, fsynced rewrite. Unpublishing comes before deleting
blobs, and a blob is deleted only when nothing reaches it (see ``gc``).
Every id, path and document that comes in is validated; nothing is written
outside the store or a caller's ``dest``.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import io
import json
import logging
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, BinaryIO, Final

from node_agent.errors import AgentError, DataLoss, FailedPrecondition, InvalidArgument, NotFound
from node_agent.store.blobs import (
    FILE_MODE,
    O_CLOEXEC,
    O_DIRECTORY,
    O_NOFOLLOW,
    BlobStore,
    Ingest,
    ensure_dir,
    fsync_dir,
    lease_is_live,
    live_refs,
    os_error,
    read_bounded,
    scan_digests,
    store_lock,
    write_new_file,
)
from node_agent.store.chunking import Chunker
from node_agent.store.gc import GcReport, RetentionPolicy, created_epoch, entry_refs, select_drops
from node_agent.store.importing import BlobImporter
from node_agent.store.manifest import (
    EMPTY_DESCRIPTOR,
    MAX_CONFIG_BYTES,
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    CheckpointConfig,
    CheckpointManifest,
    Chunk,
    Descriptor,
    FileEntry,
    check_manifest_matches,
    decode_config,
    decode_index,
    decode_manifest,
    digest_hex,
    encode_index,
    index_entry,
    is_checkpoint_entry,
    is_hex_digest,
    normalize_path,
    oci_layout,
)
from node_agent.store.reading import (
    DestTree,
    FileReader,
    check_dest_only_dirs,
    undo,
    verify_blobs,
    write_entries,
)
from node_agent.store.records import BadBlob, CheckpointRecord, RecoveryReport
from node_agent.store.writer import CheckpointWriter, ProgressFn

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)

# About 1 MiB on average (256 KiB to 4 MiB): per-chunk costs stay small and a
# 1 GiB checkpoint stays near a thousand manifest layers. A workload that
# dirties scattered pages between checkpoints may want smaller chunks
# (docs/store.md has the trade-off).
DEFAULT_CHUNK_SIZE: Final = 1 << 20
MIN_PREFIX_LEN: Final = 6
INDEX_NAME: Final = "index.json"
LAYOUT_NAME: Final = "oci-layout"
_ID_RE: Final = re.compile(r"[0-9a-f]{6,64}")
_DIR_OPEN: Final = os.O_RDONLY | O_DIRECTORY | O_CLOEXEC
# Directories whose files are scanned for digests that must be kept: the
# quarantine, and the manifests of the store's first format.
_KEEP_DIRS: Final = ("quarantine", "checkpoints")


def _index_digests(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    return [e["digest"] for e in entries if is_checkpoint_entry(e)]


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
    materialize or verify use (default: every core).
    """

    def __init__(
        self, root: str | os.PathLike[str], *, chunk_size: int = DEFAULT_CHUNK_SIZE, workers: int | None = None
    ) -> None:
        self.chunker = Chunker(chunk_size)
        self.chunk_size = chunk_size
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise InvalidArgument(f"workers {workers!r} is not a positive integer")
        self.workers = workers or os.cpu_count() or 1
        self.root = os.path.abspath(os.fspath(root))
        self.blobs = BlobStore(self.root)
        self.ingest_dir = os.path.join(self.root, "ingest")
        self.quarantine_dir = os.path.join(self.root, "quarantine")
        self.origins_dir = os.path.join(self.root, "origins")
        # Fetches a missing blob of a lazily pulled checkpoint from its origin
        # (set by whoever holds the registry credentials; see set_origin).
        self.fetcher: Callable[[Mapping[str, Any], Chunk], None] | None = None
        self.index_path = os.path.join(self.root, INDEX_NAME)
        self.layout_path = os.path.join(self.root, LAYOUT_NAME)
        self.lock_path = os.path.join(self.root, ".lock")
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            if stat.S_IMODE(os.stat(self.root).st_mode) != 0o700:
                os.chmod(self.root, 0o700)
            self.blobs.setup()
            for path in (self.ingest_dir, self.quarantine_dir, self.origins_dir):
                ensure_dir(path)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC, FILE_MODE)
            try:
                if stat.S_IMODE(os.fstat(fd).st_mode) != FILE_MODE:
                    os.fchmod(fd, FILE_MODE)
            finally:
                os.close(fd)
            if not (os.path.lexists(self.layout_path) and os.path.lexists(self.index_path)):
                with store_lock(self.lock_path, exclusive=True):
                    if not os.path.lexists(self.layout_path):
                        self._replace_file(self.layout_path, oci_layout())
                    if not os.path.lexists(self.index_path):
                        self._write_index([])
        except OSError as exc:
            raise os_error(exc, f"store root {self.root!r}") from exc

    # -- index.json --------------------------------------------------------------------------

    def _replace_file(self, path: str, data: bytes) -> None:
        """Atomically replace ``path`` with ``data`` (fsync the file, rename, fsync the root)."""
        temp = os.path.join(self.ingest_dir, f".{os.path.basename(path)}-{secrets.token_hex(8)}")
        write_new_file(temp, data, sync=True)
        try:
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        fsync_dir(self.root)

    def _read_index(self) -> list[dict[str, Any]]:
        """Every index.json record (validated); DataLoss when the index is unreadable."""
        try:
            data = read_bounded(self.index_path, MAX_INDEX_BYTES)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise DataLoss(f"store index {self.index_path}: {exc}") from exc
        return decode_index(data, error=DataLoss, what=f"store index {self.index_path}")

    def _write_index(self, entries: Sequence[Mapping[str, Any]]) -> None:
        """Rewrite index.json (call under the exclusive store lock)."""
        self._replace_file(self.index_path, encode_index(entries))

    def _publish(self, entry: Mapping[str, Any], required: Mapping[str, int]) -> None:
        """Add a manifest to index.json once every blob it needs is present: the commit point."""
        with store_lock(self.lock_path, exclusive=True):
            for digest, size in required.items():
                found = self.blobs.size_of(digest)
                if found != size:
                    raise DataLoss(
                        f"checkpoint {entry['digest']}: blob {digest} "
                        f"{'vanished' if found is None else 'changed size'} before publish"
                    )
            entries = self._read_index()
            if any(e["digest"] == entry["digest"] for e in entries):
                return
            entries.append(dict(entry))
            self._write_index(entries)

    # -- paths, ids, records -----------------------------------------------------------------

    def blob_path(self, digest: str) -> str:
        """Path of a blob (``sha256:<hex>``); the blob need not exist."""
        return self.blobs.path(digest)

    def manifest_path(self, checkpoint_id: str) -> str:
        """Path of a checkpoint's manifest blob (full id or 64 hex; need not exist)."""
        text = checkpoint_id.removeprefix("sha256:")
        return self.blobs.path("sha256:" + text)

    def _resolve(self, checkpoint_id: str, within: Callable[[CheckpointRecord], bool] | None = None) -> str:
        """Full id for ``sha256:<hex>`` or a unique hex prefix of at least 6 characters.

        `within`: only checkpoints it accepts exist for this call (an
        authorization scope): the others are neither found nor counted.
        """
        if not isinstance(checkpoint_id, str):
            raise InvalidArgument(f"malformed checkpoint id {checkpoint_id!r}")
        text = checkpoint_id.lower()
        if text.startswith("sha256:"):
            text = text[len("sha256:") :]
        if not _ID_RE.fullmatch(text):
            raise InvalidArgument(
                f"malformed checkpoint id {checkpoint_id!r}: want sha256:<hex> or at least {MIN_PREFIX_LEN} hex characters"
            )
        ids = _index_digests(self._read_index())
        matches = sorted({d for d in ids if d[len("sha256:") :].startswith(text)})
        if within is not None:
            matches = [d for d in matches if self._accepts(d, within)]
        if not matches:
            if len(text) == 64:
                raise NotFound(f"checkpoint sha256:{text} not found")
            raise NotFound(f"no checkpoint matches {checkpoint_id!r}")
        if len(matches) > 1:
            shown = ", ".join(d[len("sha256:") :][:12] for d in matches[:5])
            raise InvalidArgument(f"checkpoint id {checkpoint_id!r} is ambiguous ({len(matches)} matches: {shown})")
        return matches[0]

    def _load_documents(self, cid: str) -> tuple[bytes, CheckpointManifest, CheckpointConfig]:
        """Read and validate a published checkpoint's manifest and config blobs."""
        path = self.blobs.path(cid)
        try:
            data = read_bounded(path, MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise DataLoss(f"checkpoint {cid}: manifest blob {path} is missing") from None
        except ValueError as exc:
            raise DataLoss(f"checkpoint {cid}: manifest {path}: {exc}") from exc
        except OSError as exc:
            raise DataLoss(f"checkpoint {cid}: manifest {path} unreadable: {exc.strerror}") from exc
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if actual != cid:
            raise DataLoss(f"checkpoint {cid}: manifest {path} content hashes to {actual}")
        manifest = decode_manifest(data, error=DataLoss, what=f"checkpoint {cid}: manifest {path}")
        desc = manifest.config
        if desc.size > MAX_CONFIG_BYTES:
            raise DataLoss(f"checkpoint {cid}: config blob of {desc.size} bytes exceeds the limit")
        try:
            config_bytes = self.blobs.read(desc.digest, desc.size)
        except DataLoss as exc:
            raise DataLoss(f"checkpoint {cid}: config {exc}") from exc
        what = f"checkpoint {cid}: config blob {desc.digest}"
        config = decode_config(config_bytes, error=DataLoss, what=what)
        check_manifest_matches(manifest, config, error=DataLoss, what=f"checkpoint {cid}: manifest {path}")
        return data, manifest, config

    def _load(self, cid: str) -> CheckpointRecord:
        _, manifest, config = self._load_documents(cid)
        return self._record(cid, manifest, config)

    def _record(self, manifest_digest: str, manifest: CheckpointManifest, config: CheckpointConfig) -> CheckpointRecord:
        return CheckpointRecord(
            id=manifest_digest,
            created=manifest.created,
            metadata=MappingProxyType(dict(config.metadata)),
            files=config.files,
            size=sum(e.size for e in config.files),
            stored_size=sum(layer.size for layer in manifest.layers if layer != EMPTY_DESCRIPTOR),
            manifest_path=self.blobs.path(manifest_digest),
            annotations=manifest.annotations,
        )

    # -- writing and importing ---------------------------------------------------------------

    def writer(self, *, progress: ProgressFn | None = None) -> CheckpointWriter:
        """Start a new checkpoint (takes a lease in ``ingest/``); see CheckpointWriter for ``progress``."""
        try:
            return CheckpointWriter(self, progress=progress)
        except OSError as exc:
            raise os_error(exc, f"creating a writer in {self.ingest_dir}") from exc

    def importer(self) -> BlobImporter:
        """Start importing a checkpoint's blobs and manifest (takes a lease in ``ingest/``)."""
        try:
            return BlobImporter(self)
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
        cid = self._resolve(checkpoint) if isinstance(checkpoint, str) else checkpoint.id
        try:
            ingest = Ingest(self.ingest_dir, self.lock_path, self.blobs)
        except OSError as exc:
            raise os_error(exc, f"creating a hold in {self.ingest_dir}") from exc
        try:
            with store_lock(self.lock_path, exclusive=False):
                if published and cid not in _index_digests(self._read_index()):
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
            dest = Store(root, chunk_size=self.chunk_size, workers=self.workers)
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
        for cid in _index_digests(self._read_index()):
            try:
                records.append(self._load(cid))
            except AgentError as exc:
                log.warning("skipping unreadable checkpoint: %s", exc, extra={"checkpoint": cid})
                problems.append(exc)
        records.sort(key=lambda r: (created_epoch(r.created), r.id), reverse=True)
        return records, problems

    def _accepts(self, cid: str, within: Callable[[CheckpointRecord], bool]) -> bool:
        try:
            return within(self._load(cid))
        except AgentError:
            return False

    def get(self, checkpoint_id: str, *, within: Callable[[CheckpointRecord], bool] | None = None) -> CheckpointRecord:
        """The checkpoint for a full id or unique prefix (among those `within` accepts, if given)."""
        return self._load(self._resolve(checkpoint_id, within))

    def held(self, checkpoint_id: str) -> CheckpointRecord:
        """The checkpoint with this full id, published or not: for a reader that holds it (`hold`)."""
        return self._load("sha256:" + digest_hex(checkpoint_id))

    def _as_record(self, checkpoint: CheckpointRecord | str) -> CheckpointRecord:
        """A record as given (a reader that loaded it keeps reading it), or the published one for an id."""
        return checkpoint if isinstance(checkpoint, CheckpointRecord) else self.get(checkpoint)

    def open(self, checkpoint: CheckpointRecord | str, path: str) -> FileReader:
        """A random-access reader for one regular file of a checkpoint (a record, or an id)."""
        record = self._as_record(checkpoint)
        normalize_path(path)
        entry = record.entry(path)
        if entry.is_dir:
            raise InvalidArgument(f"checkpoint {record.id}: {path!r} is a directory")
        return FileReader(self.blobs, record.id, entry, fetch=self.fetch_for(record.id))

    def verify(self, checkpoint_id: str) -> builtins.list[BadBlob]:
        """Check every chunk blob (present, size, digest, decodes to its size); [] when whole.

        The manifest and config blobs are verified by loading the checkpoint.
        Of a lazily pulled checkpoint, blobs still only at its origin are not
        bad: they are verified when they arrive.
        """
        record = self.get(checkpoint_id)
        origin = self.origin(record.id)
        if origin is not None:
            log.info("checkpoint %s: %d blobs are still only in %s (pulled lazily)", record.id,
                     len(self.missing(record)), origin["reference"], extra={"checkpoint": record.id})
        return verify_blobs(self.blobs, record, self.workers, remote_ok=origin is not None)

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
            self._write_entries(record, entries, tree)
        except BaseException as exc:
            tree.close()
            undo(dest_fd, tree.created)
            if isinstance(exc, OSError):
                raise os_error(exc, f"materializing checkpoint {record.id} into {dest_path!r}") from exc
            raise
        finally:
            tree.close()
            os.close(dest_fd)

    def _write_entries(self, record: CheckpointRecord, entries: Sequence[FileEntry], tree: DestTree) -> None:
        write_entries(self.blobs, record, entries, tree, self.workers, self.fetch_for(record.id))

    # -- checkpoints pulled lazily ------------------------------------------------------------

    def _origin_path(self, checkpoint_id: str) -> str:
        return os.path.join(self.origins_dir, digest_hex(checkpoint_id) + ".json")

    def set_origin(self, checkpoint_id: str, origin: Mapping[str, Any]) -> None:
        """Record where the blobs a lazy pull left behind come from (before the checkpoint is published).

        ``origin`` holds the registry reference (``reference``, pinned by
        digest) and how to reach it, never a password.
        """
        self._replace_file(self._origin_path(checkpoint_id), json.dumps(dict(origin), sort_keys=True).encode())

    def origin(self, checkpoint_id: str) -> dict[str, Any] | None:
        """Where a lazily pulled checkpoint's missing blobs come from, or None."""
        try:
            data = read_bounded(self._origin_path(checkpoint_id), 64 << 10)
            doc = json.loads(data)
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) and isinstance(doc.get("reference"), str) else None

    def missing(self, record: CheckpointRecord) -> builtins.list[Chunk]:
        """The chunks of ``record`` whose blobs are not (yet) in this store."""
        seen: set[str] = set()
        out: list[Chunk] = []
        for entry in record.files:
            for chunk in entry.chunks:
                if chunk.digest not in seen:
                    seen.add(chunk.digest)
                    if not self.has_blob(chunk.digest):
                        out.append(chunk)
        return out

    def settle_origin(self, checkpoint_id: str) -> bool:
        """Forget the origin of a checkpoint whose blobs have all arrived; True if it is whole."""
        record = self.get(checkpoint_id)
        if self.missing(record):
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._origin_path(record.id))
        return True

    def fetch_for(
        self, checkpoint_id: str, origin: Mapping[str, Any] | None = None
    ) -> Callable[[Chunk], None] | None:
        """A fetcher of the checkpoint's missing chunks, or None if it has no origin.

        The origin is read once, here, unless the caller read it earlier and
        passes it: a reader that started keeps fetching even if the
        checkpoint is removed meanwhile (see `hold`).
        """
        if origin is None:
            origin = self.origin(checkpoint_id)
        if origin is None:
            return None
        where = str(origin.get("reference"))

        def fetch(chunk: Chunk) -> None:
            if self.fetcher is None:
                raise FailedPrecondition(
                    f"blob {chunk.digest} is still only in {where} (pulled lazily), "
                    "and nothing here can fetch it"
                )
            self.fetcher(origin, chunk)

        return fetch

    # -- moving checkpoints between stores ---------------------------------------------------

    def manifest_bytes(self, checkpoint_id: str) -> bytes:
        """The exact published manifest bytes (verified; their sha256 is the id)."""
        return self._load_documents(self._resolve(checkpoint_id))[0]

    def descriptors(self, checkpoint_id: str) -> builtins.list[Descriptor]:
        """Every blob a copy of the checkpoint needs besides its manifest: the config, then the layers."""
        _, manifest, _ = self._load_documents(self._resolve(checkpoint_id))
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

    # -- removing and collecting -------------------------------------------------------------

    def remove(self, checkpoint_id: str) -> GcReport:
        """Unpublish a checkpoint, then delete the blobs nothing else reaches."""
        cid = self._resolve(checkpoint_id)
        try:
            with store_lock(self.lock_path, exclusive=True):
                entries = self._read_index()
                kept = [e for e in entries if not (is_checkpoint_entry(e) and e["digest"] == cid)]
                if len(kept) == len(entries):
                    raise NotFound(f"checkpoint {cid} not found")
                self._write_index(kept)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._origin_path(cid))
                removed, freed = self._sweep(kept, dry_run=False)
        except OSError as exc:
            raise os_error(exc, f"removing checkpoint {cid}") from exc
        log.info(
            "removed checkpoint %s (%d blobs, %d bytes freed)",
            cid,
            len(removed),
            freed,
            extra={"checkpoint": cid},
        )
        return GcReport((cid,), tuple(removed), freed, len(_index_digests(kept)), False)

    def gc(self, policy: RetentionPolicy | None = None, *, dry_run: bool = False, now: float | None = None) -> GcReport:
        """Unpublish the checkpoints ``policy`` drops (oldest first), then delete unreachable blobs.

        Also removes ingest directories whose lease is gone. With
        ``dry_run`` nothing is touched and the report says what would go.
        Checkpoints that fail to load are never dropped by a policy (and
        their blobs are kept); ``recover`` quarantines them.
        """
        now = time.time() if now is None else now
        try:
            with store_lock(self.lock_path, exclusive=True):
                entries = self._read_index()
                dropped: list[str] = []
                if policy is not None:
                    dropped = self._policy_drops(entries, policy, now)
                kept = [e for e in entries if not (is_checkpoint_entry(e) and e["digest"] in dropped)]
                if dropped and not dry_run:
                    self._write_index(kept)
                removed, freed = self._sweep(kept, dry_run=dry_run)
        except OSError as exc:
            raise os_error(exc, f"collecting garbage in {self.root!r}") from exc
        report = GcReport(tuple(dropped), tuple(removed), freed, len(_index_digests(kept)), dry_run)
        if dropped or removed:
            log.info(
                "store gc%s: %d checkpoints unpublished, %d blobs (%d bytes) freed, %d checkpoints kept",
                " (dry run)" if dry_run else "",
                len(dropped),
                len(removed),
                freed,
                report.kept,
            )
        return report

    def _policy_drops(self, entries: Sequence[Mapping[str, Any]], policy: RetentionPolicy, now: float) -> builtins.list[str]:
        records: builtins.list[CheckpointRecord] = []
        for cid in _index_digests(entries):
            try:
                records.append(self._load(cid))
            except AgentError as exc:
                log.warning("gc keeps unreadable checkpoint %s: %s", cid, exc, extra={"checkpoint": cid})
        ours = {r.id for r in records}
        refs = {r.id: entry_refs(self.blobs, r.id, "") for r in records}
        base = self._pinned()
        for entry in entries:
            if entry["digest"] not in ours:
                base |= entry_refs(self.blobs, entry["digest"], str(entry.get("mediaType", "")))
        return select_drops(records, policy, now, refs, self.blobs.sizes(), base)

    def _pinned(self) -> set[str]:
        """Digests kept whatever the index says: live leases, the quarantine (call under the exclusive lock)."""
        refs = live_refs(self.ingest_dir)
        for name in _KEEP_DIRS:
            folder = os.path.join(self.root, name)
            try:
                with os.scandir(folder) as it:
                    paths = [e.path for e in it if e.is_file(follow_symlinks=False)]
            except FileNotFoundError:
                continue
            for path in paths:
                refs |= scan_digests(path)
        return refs

    def _sweep(self, entries: Sequence[Mapping[str, Any]], *, dry_run: bool) -> tuple[builtins.list[str], int]:
        """Delete every blob nothing reaches and every dead ingest directory (exclusive lock held)."""
        keep = self._pinned()
        for entry in entries:
            keep |= entry_refs(self.blobs, entry["digest"], str(entry.get("mediaType", "")))
        sizes = self.blobs.sizes()
        orphans = sorted(d for d in sizes if d not in keep)
        if dry_run:
            return orphans, sum(sizes[d] for d in orphans)
        self._remove_dead_ingest()
        # Origins of checkpoints no longer published (one being pulled right
        # now is recorded just before it is published: spare recent ones).
        published = {digest_hex(e["digest"]) for e in entries}
        with os.scandir(self.origins_dir) as it:
            for found in it:
                if (found.name.endswith(".json") and found.name[:-5] not in published
                        and found.stat(follow_symlinks=False).st_mtime < time.time() - 3600):
                    os.unlink(found.path)
        removed, freed = self.blobs.delete(orphans)
        return removed, freed

    def _remove_dead_ingest(self) -> builtins.list[str]:
        removed: list[str] = []
        with os.scandir(self.ingest_dir) as it:
            dirs = [e for e in it if e.is_dir(follow_symlinks=False)]
        for entry in dirs:
            if not lease_is_live(entry.path):
                shutil.rmtree(entry.path)
                removed.append(entry.name)
        return removed

    # -- recovery ----------------------------------------------------------------------------

    def recover(self) -> RecoveryReport:
        """Clean up after crashes: dead ingest dirs, strays, unloadable checkpoints, orphan blobs.

        A checkpoint whose manifest or config fails to load is unpublished and
        its index record and manifest bytes are kept under ``quarantine/``
        (their blobs stay reachable from there). An unreadable index.json is
        moved to the quarantine and rebuilt from the manifest blobs found in
        the store. Safe while other writers run: live leases and what they
        reference are kept.
        """
        strays: list[str] = []
        quarantined: list[str] = []
        rebuilt = False
        try:
            with store_lock(self.lock_path, exclusive=True):
                ingest_removed = self._remove_dead_ingest()
                with os.scandir(self.ingest_dir) as it:
                    files = [e for e in it if not e.is_dir(follow_symlinks=False)]
                for stray in files:
                    os.unlink(stray.path)
                    strays.append(os.path.join("ingest", stray.name))
                with os.scandir(self.blobs.dir) as it:
                    blob_entries = list(it)
                for found in blob_entries:
                    if found.is_dir(follow_symlinks=False):
                        log.warning("leaving unexpected directory %s in the blob store", found.path)
                    elif not (is_hex_digest(found.name) and found.is_file(follow_symlinks=False)):
                        os.unlink(found.path)
                        strays.append(os.path.join("blobs", "sha256", found.name))
                try:
                    entries = self._read_index()
                except DataLoss as exc:
                    self._quarantine_bytes(INDEX_NAME, None, str(exc))
                    quarantined.append(INDEX_NAME)
                    entries = self._rebuild_index()
                    rebuilt = True
                kept: list[dict[str, Any]] = []
                for entry in entries:
                    if is_checkpoint_entry(entry):
                        try:
                            self._load(entry["digest"])
                        except AgentError as exc:
                            self._quarantine_entry(entry, str(exc))
                            quarantined.append(entry["digest"])
                            continue
                    kept.append(entry)
                if rebuilt or len(kept) != len(entries):
                    self._write_index(kept)
                blobs_removed, freed = self._sweep(kept, dry_run=False)
        except OSError as exc:
            raise os_error(exc, f"recovering store {self.root!r}") from exc
        report = RecoveryReport(
            ingest_removed=tuple(sorted(ingest_removed)),
            strays_removed=tuple(sorted(strays)),
            quarantined=tuple(quarantined),
            blobs_removed=tuple(blobs_removed),
            bytes_freed=freed,
            index_rebuilt=rebuilt,
        )
        if not report.clean:
            log.warning(
                "store recovery: %d ingest dirs, %d strays, %d quarantined, %d orphan blobs (%d bytes)%s",
                len(report.ingest_removed),
                len(report.strays_removed),
                len(report.quarantined),
                len(report.blobs_removed),
                report.bytes_freed,
                ", index.json rebuilt" if rebuilt else "",
            )
        return report

    def _quarantine_bytes(self, name: str, data: bytes | None, reason: str) -> None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        target = os.path.join(self.quarantine_dir, f"{name}.{stamp}.{secrets.token_hex(4)}")
        if data is None:
            os.rename(self.index_path, target)
        else:
            write_new_file(target, data, sync=True)
        fsync_dir(self.quarantine_dir)
        log.error("quarantined %s as %s: %s", name, target, reason)

    def _quarantine_entry(self, entry: Mapping[str, Any], reason: str) -> None:
        """Keep an unloadable checkpoint's index record and manifest bytes under ``quarantine/``."""
        parts = [json.dumps(dict(entry), sort_keys=True).encode()]
        with contextlib.suppress(OSError, ValueError, InvalidArgument):
            parts.append(read_bounded(self.blobs.path(entry["digest"]), MAX_MANIFEST_BYTES))
        self._quarantine_bytes(digest_hex(entry["digest"]) + ".json", b"\n".join(parts) + b"\n", reason)

    def _rebuild_index(self) -> builtins.list[dict[str, Any]]:
        """Index records for every loadable checkpoint manifest among the blobs, oldest first."""
        found: list[tuple[float, str, dict[str, Any]]] = []
        for digest, entry in self.blobs.digests():
            try:
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
                    continue
                with open(entry.path, "rb") as fh:
                    if fh.read(1) != b"{":
                        continue
                data, manifest, _ = self._load_documents(digest)
            except (OSError, AgentError):
                continue
            found.append(
                (created_epoch(manifest.created), digest, index_entry(digest, len(data), manifest.annotations))
            )
        found.sort(key=lambda item: (item[0], item[1]))
        return [item[2] for item in found]

    def usage(self) -> int:
        """Bytes used by blobs (chunks, configs and manifests)."""
        try:
            return sum(self.blobs.sizes().values())
        except OSError as exc:
            raise os_error(exc, f"measuring store {self.root!r}") from exc

    def __repr__(self) -> str:
        return f"Store({self.root!r}, chunk_size={self.chunk_size}, workers={self.workers})"

