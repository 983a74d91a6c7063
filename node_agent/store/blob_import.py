"""Moving checkpoints between stores: blobs in one by one, then the manifest.

Rule: imported bytes and documents are hostile. ``add_blob`` streams a blob
into the importer's ingest directory while hashing it, and returns once its
size and digest match; link threads then fsync it and link it into the
blob directory (so a blob that survives a crash is whole, and the fsync
holds up neither the next blob nor a reader that kept the verified bytes).
From then on the importer's lease keeps it until commit or abort, and a
later import finds it present. ``wait_linked`` waits for every blob added
so far; ``stage`` and ``abort`` wait for them first.
``stage`` validates the manifest and config like any stored document,
requires every blob they name to be present and stores the manifest blob:
the checkpoint is then whole and readable through its record, but
unpublished, so nothing lists it, resolves it or applies retention to it,
and the importer's lease keeps its blobs. ``commit`` publishes it in
``index.json``; ``discard`` drops it and deletes the blobs this import
brought in that nothing else reaches (the store's own sweep decides, under
its lock, with every lease and published record counted), so a checkpoint
refused before publishing leaves the store as it found it. An importer made
with ``keep_for`` (a pull) that stops unpublished for any other reason keeps
its lease that long (``kept``), across restarts, so that running it again
resumes; publishing or discarding the same manifest later ends those leases.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, BinaryIO, Final

from node_agent.errors import AgentError, DataLoss, FailedPrecondition, InvalidArgument
from node_agent.oci import digest_hex, sha256_digest
from node_agent.offload import Offload
from node_agent.store.blobs import BlobStore
from node_agent.store.chunk_reader import ChunkReader
from node_agent.store.direct import NewFile
from node_agent.store.files import O_CLOEXEC, O_NOFOLLOW, os_error
from node_agent.store.ingest import BLOB_PREFIX, Ingest
from node_agent.store.locking import store_lock
from node_agent.store.gc import Collector
from node_agent.store.index import Index
from node_agent.store import kept, sealing
from node_agent.store.documents import (
    MAX_BLOB_SIZE,
    CheckpointConfig,
    CheckpointManifest,
    check_manifest_matches,
    decode_config,
    decode_manifest,
)
from node_agent.store.origins import Origins
from node_agent.store.records import PULLED, check_provenance, refuse_store_annotations

if TYPE_CHECKING:
    from node_agent.store.records import CheckpointRecord

log = logging.getLogger(__name__)

_READ_SIZE: Final = 1 << 20
_LINKERS: Final = 4  # fsyncs at once: several, so that a pull's lanes seldom wait for a link thread


def _pieces(stream: BinaryIO | Iterable[bytes]) -> Iterator[bytes]:
    read = getattr(stream, "read", None)
    if read is not None:
        while True:
            piece = read(_READ_SIZE)
            if not piece:
                return
            yield piece
    else:
        yield from stream


def _arrivals(stream: BinaryIO | Iterable[bytes], out: NewFile, hasher: hashlib._Hash, size: int) -> Iterator[int]:
    """How many bytes of ``stream`` arrive at each step, each hashed and written to ``out``: straight into its
    buffer where the stream reads into one (``readinto``), else piece by piece. Up to ``size`` + 1 are asked
    for, so that a longer stream shows."""
    readinto = getattr(stream, "readinto", None)
    if readinto is None:
        for piece in _pieces(stream):
            hasher.update(piece)
            out.write(piece)
            yield len(piece)
        return
    left = size + 1
    while left and (taken := out.receive(readinto, left, hasher.update)):
        left -= taken
        yield taken


class BlobImporter:
    """Brings the blobs of one checkpoint in from elsewhere, then stages and publishes its manifest.

    A context manager that aborts unless committed. ``add_blob`` may be
    called from several threads at once. It takes its lease in
    ``ingest_dir``, links blobs into ``blobs`` and publishes through
    ``index``; ``origins`` must know where any deferred blob is;
    ``collector`` sweeps what ``discard`` leaves.
    """

    def __init__(self, chunks: ChunkReader, index: Index, origins: Origins, collector: Collector, *,
                 ingest_dir: str, keep_for: float = 0.0, manifest: str = "", reference: str = "") -> None:
        self._chunks = chunks
        self._blobs: BlobStore = chunks.blobs
        self._index = index
        self._origins = origins
        self._collector = collector
        self._ingest = Ingest(ingest_dir, index.lock_path, self._blobs)
        # Keep what it brought for this long if it stops unpublished (a pull; see ``abort``).
        self._keep = (float(keep_for), manifest, reference or manifest) if keep_for > 0 and manifest else None
        if self._keep is not None:
            try:
                kept.reserve(self._ingest.dir)
            except BaseException:
                self._ingest.release()
                raise
        self._state = "open"
        self._lock = threading.Lock()
        self._linked = False
        self._brought: set[str] = set()  # blobs this import linked in (they were not stored before)
        self._links = Offload(_LINKERS, "import-link")  # blobs verified, being made durable and linked
        self._link_failed: BaseException | None = None
        self._staged: tuple[str, bytes, CheckpointManifest, CheckpointConfig | None, dict[str, int]] | None = None
        self._provenance = PULLED
        self.blobs_added = 0
        self.blobs_skipped = 0
        self.bytes_added = 0

    def __enter__(self) -> BlobImporter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state != "committed":
            self.abort(exc)
        self._stop_linking()

    def _check_open(self) -> None:
        if self._state != "open":
            raise FailedPrecondition(f"blob importer is already {self._state}")

    def add_blob(self, digest: str, size: int, stream: BinaryIO | Iterable[bytes]) -> None:
        """Store the blob ``digest`` of ``size`` bytes read from ``stream``.

        A blob already present (or already added here) is skipped without
        reading the stream. Bytes that don't match the size or digest are
        DataLoss and nothing is kept. Returns once the bytes are verified;
        the blob is durable and in the blob directory after ``wait_linked``.
        """
        self._check_open()
        digest_hex(digest)
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_BLOB_SIZE:
            raise InvalidArgument(f"blob {digest}: size {size!r} is not in [0, {MAX_BLOB_SIZE}]")
        if not self._ingest.claim(digest):
            return
        temp = self._ingest.temp_path(digest)
        try:
            if self._ingest.reference(digest, size):
                with self._lock:
                    self.blobs_skipped += 1
                return
            self._receive(temp, digest, size, stream)
        except BaseException as exc:
            self._unclaim(digest, temp)
            if isinstance(exc, OSError):
                raise os_error(exc, f"importing blob {digest}") from exc
            raise
        self._links.submit(functools.partial(self._link, temp, digest, size))

    def _unclaim(self, digest: str, temp: str) -> None:
        self._ingest.forget(digest)
        with contextlib.suppress(OSError):
            os.unlink(temp)

    def _link(self, temp: str, digest: str, size: int) -> None:
        """Make a verified blob durable, then link it into the blob directory (a link thread). A failure is
        kept for ``wait_linked``, the first one of the import."""
        try:
            fd = os.open(temp, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._blobs.link_in(temp, digest)
        except Exception as exc:  # noqa: BLE001 - kept for wait_linked, which raises it
            self._unclaim(digest, temp)
            failure = os_error(exc, f"importing blob {digest}") if isinstance(exc, OSError) else exc
            with self._lock:
                self._link_failed = self._link_failed or failure
            return
        with self._lock:
            self._linked = True
            self._brought.add(digest)
            self.blobs_added += 1
            self.bytes_added += size

    def wait_linked(self) -> None:
        """Wait until every blob added so far is durable and linked; the first that could not be raises (again
        at every later call)."""
        self._links.wait()
        if self._link_failed is not None:
            raise self._link_failed

    def _stop_linking(self) -> None:
        """Wait for the link threads and end them; a failure is left to whoever waits with ``wait_linked``."""
        self._links.close()

    def _receive(self, temp: str, digest: str, size: int, stream: BinaryIO | Iterable[bytes]) -> None:
        hasher = hashlib.sha256()
        got = 0
        out = NewFile(temp)  # past the page cache: nobody reads it back soon (store/direct.py)
        try:
            for taken in _arrivals(stream, out, hasher, size):
                got += taken
                if got > size:
                    raise DataLoss(f"blob {digest}: received more than the expected {size} bytes")
            if got != size:
                raise DataLoss(f"blob {digest}: received {got} bytes, expected {size}")
            actual = "sha256:" + hasher.hexdigest()
            if actual != digest:
                raise DataLoss(f"blob {digest}: received bytes hash to {actual}")
            out.finish()
        finally:
            out.close()

    def stage(self, manifest: bytes, *, deferred: Collection[str] = (), provenance: str = PULLED) -> CheckpointRecord:
        """Validate ``manifest`` and its config, require every blob, store the manifest blob; the record.

        The checkpoint is whole but not published: nothing lists, resolves
        or collects it, its record reads like any (``Store.open`` takes it),
        and this importer's lease keeps its blobs until ``commit`` publishes
        it, ``discard`` drops it or the importer ends. Layers whose digests
        are in ``deferred`` may be missing: the caller has recorded where
        they come from (`Origins.remember`), and readers fetch them from
        there on demand. A manifest that carries the store's own
        annotations (``records.STORE_ANNOTATIONS``) is InvalidArgument.
        The record says ``provenance``, which ``commit`` records, and no
        receipt time yet (or, for a checkpoint published already, what its
        index record says).
        """
        self._check_open()
        try:
            self.wait_linked()
            check_provenance(provenance)
            data = bytes(manifest)
            doc = decode_manifest(data, error=InvalidArgument, what="imported manifest")
            manifest_digest = sha256_digest(data)
            where = f"imported checkpoint {manifest_digest}"
            refuse_store_annotations(doc.annotations, where)
            config_desc = doc.config
            if not self._ingest.reference(config_desc.digest, config_desc.size):
                raise FailedPrecondition(f"{where}: config blob {config_desc.digest} is missing; add it first")
            config_bytes = self._blobs.read(config_desc.digest, config_desc.size)
            config = self._open_config(doc, config_bytes, where)
            if config is not None:
                check_manifest_matches(doc, config, error=InvalidArgument, what=where)
            present = [layer for layer in doc.layers
                       if layer.digest not in deferred or self._blobs.size_of(layer.digest) is not None]
            for layer in present:
                if not self._ingest.reference(layer.digest, layer.size):
                    raise FailedPrecondition(f"{where}: blob {layer.digest} is missing; add it first")
            if len(present) != len(doc.layers) and self._origins.get(manifest_digest) is None:
                raise FailedPrecondition(f"{where}: blobs are deferred but no origin is recorded")
            written = self._ingest.put(manifest_digest, data)
            required = {d.digest: d.size for d in (*present, config_desc)}
            required[manifest_digest] = len(data)
            self._ingest.commit_blobs(required)
            if written:
                self._brought.add(manifest_digest)
            if self._linked:
                self._blobs.sync()
        except BaseException as exc:
            self.abort(exc)
            if isinstance(exc, OSError):
                raise os_error(exc, "staging an imported checkpoint") from exc
            raise
        self._staged = (manifest_digest, data, doc, config, required)
        self._provenance = provenance
        self._state = "staged"
        listed = self._index.entry(manifest_digest)
        record = self._index.record(manifest_digest, doc, config, listed)
        return record if listed is not None else replace(record, received="", provenance=provenance)

    def commit(self, manifest: bytes, *, deferred: Collection[str] = (), provenance: str | None = None
               ) -> CheckpointRecord:
        """Publish ``manifest`` (staged first, see ``stage``, unless it is already); return the record.

        The index record says the store received it now, with
        ``provenance`` (the one it was staged with unless told: ``pulled``
        by default). Committing a manifest that is already published returns
        its record, as it was published.
        """
        if self._state == "open":
            self.stage(manifest, deferred=deferred, provenance=provenance or PULLED)
        if self._state != "staged" or self._staged is None:
            raise FailedPrecondition(f"blob importer is already {self._state}")
        manifest_digest, data, doc, config, required = self._staged
        if sha256_digest(bytes(manifest)) != manifest_digest:
            raise FailedPrecondition(f"blob importer staged {manifest_digest}, not the manifest given to commit")
        try:
            listed = self._index.publish(manifest_digest, len(data), doc.annotations, required,
                                         provenance=provenance or self._provenance)
        except BaseException as exc:
            self.abort(exc)
            if isinstance(exc, OSError):
                raise os_error(exc, "committing an imported checkpoint") from exc
            raise
        self._stop_linking()  # every blob is linked (``stage`` waited): the link threads end
        self._ingest.release()
        self._state = "committed"
        if self._keep is not None:  # what earlier runs of it kept is reached from the index now
            try:
                self._collector.forget_kept(self._keep[1])
            except AgentError as exc:
                log.warning("imported checkpoint %s: the leases its earlier imports kept stay until they end: %s",
                            manifest_digest, exc)
        record = self._index.record(manifest_digest, doc, config, listed)
        log.info(
            "imported checkpoint %s (%d blobs added, %d already present)",
            record.id,
            self.blobs_added,
            self.blobs_skipped,
            extra={"checkpoint": record.id},
        )
        return record

    def _open_config(self, doc: CheckpointManifest, data: bytes, where: str) -> CheckpointConfig | None:
        """The imported config, validated; None for a sealed one whose key is not configured.

        That one is checked when it is first loaded with its key, like every
        stored document.
        """
        if doc.key_id:
            try:
                opened = self._chunks.open_config(data, doc.key_id)
            except sealing.SealError as exc:
                raise InvalidArgument(f"{where}: config: {exc}") from None
            if opened is None:
                log.warning("%s: encrypted with key id %s, which no configured key source has; "
                            "it is stored and opens once the key is configured", where, doc.key_id)
                return None
            data = opened
        return decode_config(data, error=InvalidArgument, what=f"{where}: config")

    def abort(self, reason: BaseException | None = None) -> None:
        """Stop; blobs already verified and linked stay until garbage collection. Idempotent.

        An importer made with ``keep_for`` that referenced any blob keeps
        them longer: its lease is kept (``kept``) for ``keep_for`` seconds,
        even across restarts, so that running the import again resumes;
        ``reason`` (why it stopped) is noted with it. Where even that fails
        (an unwritable store), the lease ends as usual.
        """
        self._stop_linking()
        if self._state in ("open", "staged"):
            self._state = "aborted"
            if self._keep is not None and (self.blobs_added or self.blobs_skipped) and self._keep_lease(reason):
                self._state = "kept"
        if self._state != "kept":
            self._ingest.release()

    def _keep_lease(self, reason: BaseException | None) -> bool:
        """Keep this import's lease until ``keep_for`` seconds from now; whether it is kept."""
        assert self._keep is not None
        seconds, manifest, reference = self._keep
        until = time.time() + seconds
        why = "" if reason is None else f"{type(reason).__name__}: {reason}".removesuffix(": ")
        try:
            for name in os.listdir(self._ingest.dir):  # a blob half-written when it stopped
                if name.startswith(BLOB_PREFIX):
                    os.unlink(os.path.join(self._ingest.dir, name))
            with store_lock(self._index.lock_path, exclusive=False):  # collectors see it whole, or still held
                path = kept.write(self._ingest.dir, until, {"manifest": manifest, "reference": reference,
                                                            "reason": why})
                self._ingest.detach()
        except OSError as exc:
            log.warning("import of %s stopped, and what it brought cannot be kept for a resume (%s): "
                        "it stays until the next garbage collection", reference, exc.strerror or exc)
            return False
        log.info("import of %s stopped; the %d blob(s) it brought and the %d it found stored are kept until %s, "
                 "so that running it again resumes (%s)", reference, self.blobs_added, self.blobs_skipped,
                 kept.iso(until), path)
        return True

    def discard(self) -> list[str]:
        """Stop, and delete every blob this import brought in that nothing else reaches; their digests.

        The lease goes first, then the store's sweep runs on those blobs
        alone, under the exclusive lock: a published checkpoint (this one,
        published before by another pull), another import's, writer's or
        hold's lease keeps what it names, and blobs that were stored before
        this import began are never touched, but for those that only the
        leases kept by earlier imports of the same manifest (``keep_for``)
        reached: those leases end, and what they named counts as brought.
        The origin recorded for a staged checkpoint goes too, unless it is
        published. After a crash the same is left to ``recover``.
        """
        if self._state == "committed":
            raise FailedPrecondition("blob importer is already committed")
        self._stop_linking()
        staged = self._staged[0] if self._staged is not None else None
        self._state = "aborted"
        self._ingest.release()  # a kept lease too
        with self._lock:
            brought = sorted(self._brought)
        return self._collector.discard(brought, unpublished=staged,
                                       manifest=self._keep[1] if self._keep is not None else None)
