"""Referrers: small OCI artifacts about a published checkpoint (its signatures), kept beside it.

Rule: a referrer is an OCI image manifest whose ``subject`` is a published
checkpoint's manifest. It is stored as a blob like any other, with every
blob it names, and recorded in ``index.json`` as a record of its own
``artifactType`` whose annotation ``SUBJECT_ANNOTATION`` names the
checkpoint; it is never a checkpoint record, so listing, resolving and
loading checkpoints never see it. Attaching verifies every byte first, makes
the blobs durable, and publishes the record under the exclusive store lock
only while the subject is published; a checkpoint that goes (``remove``,
retention, a collection that finds its subject gone) takes its referrer
records with it, and the sweep then deletes their blobs. Referrer documents
read back from disk are hostile: bounded, hashed and decoded again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from node_agent import strictjson
from node_agent.errors import AgentError, DataLoss, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from node_agent.oci import (
    ARTIFACT_TYPE,
    OCI_MANIFEST_MEDIA_TYPE,
    Descriptor,
    DocumentError,
    digest_hex,
    is_media_type,
    read_manifest,
    sha256_digest,
)
from node_agent.store.blobs import BlobStore
from node_agent.store.files import os_error, read_bounded
from node_agent.store.ingest import Ingest
from node_agent.store.index import Index, checkpoint_ids
from node_agent.store.documents import check_annotations

log = logging.getLogger(__name__)

SUBJECT_ANNOTATION: Final = "io.node-agent.referrer.subject"
"""The index record's annotation naming the checkpoint a referrer is about."""
MAX_REFERRER_BYTES: Final = 256 << 10
"""Largest referrer manifest attached or read back."""
MAX_REFERRER_BLOB_BYTES: Final = 4 << 20
"""Largest blob a referrer may bring (given whole, in memory)."""
MAX_REFERRER_BLOBS: Final = 64
MAX_REFERRERS: Final = 256
"""Most referrers one checkpoint may have."""
_KEYS: Final = frozenset({"schemaVersion", "mediaType", "artifactType", "config", "layers", "subject", "annotations"})
_REQUIRED: Final = frozenset({"schemaVersion", "mediaType", "artifactType", "config", "layers", "subject"})


@dataclass(frozen=True)
class Referrer:
    """A referrer manifest, decoded: its type, what it is about, the blobs it names, its annotations."""

    artifact_type: str
    subject: Descriptor
    blobs: tuple[Descriptor, ...]
    annotations: Mapping[str, str]


def _is_referrer_type(kind: object) -> bool:
    return is_media_type(kind) and kind != ARTIFACT_TYPE


def decode_referrer(data: bytes, *, error: type[AgentError] = InvalidArgument, what: str = "referrer manifest") -> Referrer:
    """A referrer manifest read as hostile input (bounded, strict JSON, known keys); ``error`` otherwise."""
    try:
        if len(data) > MAX_REFERRER_BYTES:
            raise InvalidArgument(f"more than {MAX_REFERRER_BYTES} bytes")
        try:
            doc: Any = strictjson.loads(bytes(data))
        except strictjson.StrictJsonError as exc:
            raise InvalidArgument(str(exc)) from None
        try:
            read = read_manifest(doc, required=_REQUIRED, allowed=_KEYS, artifact_type=_is_referrer_type,
                                 max_layers=MAX_REFERRER_BLOBS - 1, keys="required", max_size=MAX_REFERRER_BLOB_BYTES,
                                 subject=True)
        except DocumentError as exc:
            raise InvalidArgument(_fault(doc, exc)) from None
        subject = read.subject
        assert subject is not None  # read with subject=True
        if subject.media_type != OCI_MANIFEST_MEDIA_TYPE:
            raise InvalidArgument(f"subject is {subject.media_type!r}, not a checkpoint's OCI image manifest")
        notes = check_annotations(doc.get("annotations", {}))
    except InvalidArgument as exc:
        raise error(f"{what}: {exc}") from None
    return Referrer(str(read.artifact_type), subject, (read.config, *read.layers), notes)


def _fault(doc: object, exc: DocumentError) -> str:
    """What ``read_manifest`` found wrong with a referrer, in the store's words."""
    if exc.descriptor is not None:
        return f"{exc.where}: {exc.detail}"
    if exc.field in ("object", "keys"):
        found = sorted(doc)[:10] if isinstance(doc, dict) else type(doc).__name__
        return f"keys {found}: want {sorted(_REQUIRED)}, and annotations"
    if exc.field in ("schemaVersion", "mediaType"):
        return "not an OCI image manifest (schemaVersion 2)"
    if exc.field == "artifactType":
        return f"artifactType {str(exc.value)[:100]!r} is not that of a referrer"
    return f"layers is not a list of at most {MAX_REFERRER_BLOBS - 1} descriptors"


def subject_of(entry: Mapping[str, Any]) -> str | None:
    """The checkpoint an index record is a referrer of, or None when it is not a referrer record."""
    if entry.get("artifactType") == ARTIFACT_TYPE:
        return None
    notes = entry.get("annotations")
    subject = notes.get(SUBJECT_ANNOTATION) if isinstance(notes, dict) else None
    return subject if isinstance(subject, str) else None


def without_orphans(entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The index records less the referrers whose subject is not a checkpoint among them."""
    published = set(checkpoint_ids(entries))
    return [e for e in entries if (subject := subject_of(e)) is None or subject in published]


def referrer_entry(digest: str, size: int, referrer: Referrer) -> dict[str, Any]:
    """The index.json record of a referrer manifest."""
    return {
        "mediaType": OCI_MANIFEST_MEDIA_TYPE,
        "digest": digest,
        "size": size,
        "artifactType": referrer.artifact_type,
        "annotations": {**referrer.annotations, SUBJECT_ANNOTATION: referrer.subject.digest},
    }


def attach(index: Index, blobs: BlobStore, ingest_dir: str, subject_id: str, manifest: bytes,
           given: Mapping[str, bytes]) -> str:
    """Store a referrer of the published checkpoint ``subject_id`` with the blobs it names; its digest.

    ``given`` holds the blobs (digest: bytes) the store may lack; the rest
    must be stored already. Everything is verified before anything is
    written; the record is published under the exclusive lock, and only
    while the subject is published (NotFound otherwise). Attaching a
    referrer that is there already changes nothing.
    """
    data = bytes(manifest)
    digest = sha256_digest(data)
    ref = decode_referrer(data)
    if ref.subject.digest != subject_id:
        raise InvalidArgument(f"referrer {digest} is about {ref.subject.digest}, not checkpoint {subject_id}")
    if blobs.size_of(subject_id) != ref.subject.size:
        raise InvalidArgument(f"referrer {digest}: its subject's size {ref.subject.size} is not that of {subject_id}")
    named = {d.digest: d.size for d in ref.blobs}
    extra = sorted(set(given) - set(named))
    if extra:
        raise InvalidArgument(f"referrer {digest} does not name blob {extra[0]}")
    for blob_digest, data_given in given.items():
        if len(data_given) != named[blob_digest] or sha256_digest(data_given) != blob_digest:
            raise InvalidArgument(f"referrer {digest}: blob {blob_digest} does not match its descriptor")
    required = {**named, digest: len(data)}
    try:
        ingest = Ingest(ingest_dir, index.lock_path, blobs)
    except OSError as exc:
        raise os_error(exc, f"attaching referrer {digest}") from exc
    try:
        for blob_digest, size in named.items():
            if blob_digest in given:
                ingest.put(blob_digest, given[blob_digest])
            elif not ingest.reference(blob_digest, size):
                raise FailedPrecondition(f"referrer {digest}: blob {blob_digest} is not stored; give it")
        ingest.put(digest, data)
        ingest.commit_blobs(required)
        _publish(index, blobs, referrer_entry(digest, len(data), ref), required)
    except OSError as exc:
        raise os_error(exc, f"attaching referrer {digest}") from exc
    finally:
        ingest.release()
    log.info("checkpoint %s: referrer %s (%s) attached", subject_id, digest, ref.artifact_type,
             extra={"checkpoint": subject_id})
    return digest


def _publish(index: Index, blobs: BlobStore, entry: dict[str, Any], required: Mapping[str, int]) -> None:
    subject = entry["annotations"][SUBJECT_ANNOTATION]
    with index.locked(exclusive=True):
        for blob_digest, size in required.items():
            if blobs.size_of(blob_digest) != size:
                raise DataLoss(f"referrer {entry['digest']}: blob {blob_digest} vanished or changed before publish")
        entries = index.read()
        if subject not in checkpoint_ids(entries):
            raise NotFound(f"checkpoint {subject} not found")
        if any(e["digest"] == entry["digest"] for e in entries):
            return
        if sum(1 for e in entries if subject_of(e) == subject) >= MAX_REFERRERS:
            raise ResourceExhausted(f"checkpoint {subject} has {MAX_REFERRERS} referrers already")
        entries.append(entry)
        index.write(entries)


def listed(index: Index, blobs: BlobStore, subject_id: str, artifact_type: str | None = None) -> list[tuple[str, bytes]]:
    """(digest, manifest bytes) of each referrer of ``subject_id`` (of ``artifact_type``, if given), in index order.

    Each manifest is read bounded, checked against its digest and decoded
    again; one that fails is logged and left out.
    """
    out: list[tuple[str, bytes]] = []
    for entry in index.read():
        if subject_of(entry) != subject_id or (artifact_type is not None and entry.get("artifactType") != artifact_type):
            continue
        digest, size = entry["digest"], entry["size"]
        try:
            if size > MAX_REFERRER_BYTES:
                raise DataLoss(f"its record says {size} bytes, more than {MAX_REFERRER_BYTES}")
            data = blobs.read(digest, size)
            ref = decode_referrer(data, error=DataLoss, what="manifest")
            if ref.subject.digest != subject_id or ref.artifact_type != entry.get("artifactType"):
                raise DataLoss("its manifest does not match its index record")
        except AgentError as exc:
            log.warning("checkpoint %s: skipping unreadable referrer %s: %s", subject_id, digest, exc,
                        extra={"checkpoint": subject_id})
            continue
        out.append((digest, data))
    return out


def read_blob(blobs: BlobStore, digest: str, size: int) -> bytes:
    """A referrer's blob, whole and verified (at most MAX_REFERRER_BLOB_BYTES); DataLoss if missing or bad."""
    digest_hex(digest)
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_REFERRER_BLOB_BYTES:
        raise InvalidArgument(f"blob {digest}: size {size!r} is not in [0, {MAX_REFERRER_BLOB_BYTES}]")
    return blobs.read(digest, size)


def rediscover(blobs: BlobStore, entries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Records for the referrer manifests among the blobs whose subject is a checkpoint in ``entries``.

    For an index rebuilt from the blobs (``repair``): the referrers of the
    checkpoints found come back, those whose blobs are all there.
    """
    subjects = set(checkpoint_ids(entries))
    found: list[dict[str, Any]] = []
    for digest, item in blobs.digests():
        with contextlib.suppress(OSError, ValueError, AgentError):
            st = item.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_REFERRER_BYTES:
                continue
            with open(item.path, "rb") as fh:
                if fh.read(1) != b"{":
                    continue
            data = read_bounded(os.path.join(blobs.dir, item.name), MAX_REFERRER_BYTES)
            if sha256_digest(data) != digest:
                continue
            ref = decode_referrer(data, error=DataLoss)
            if ref.subject.digest in subjects and all(blobs.size_of(d.digest) == d.size for d in ref.blobs):
                found.append(referrer_entry(digest, len(data), ref))
    return sorted(found, key=lambda e: str(e["digest"]))
