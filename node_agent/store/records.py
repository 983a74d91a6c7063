"""The values the store hands out: checkpoint records and reports.

Rule: plain frozen data, how records order by time, and what the store
itself records about each checkpoint it publishes; no I/O happens here.
A checkpoint's manifest is its maker's word (its ``created`` and its
annotations are whatever the maker chose); how and when this store got it
is the store's own word, kept in the checkpoint's ``index.json`` record
under the annotations ``RECEIVED_ANNOTATION`` and ``PROVENANCE_ANNOTATION``,
which no manifest may carry (``receipt`` reads them, ``receipt_annotations``
writes them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Final

from node_agent.errors import FailedPrecondition, InvalidArgument, NotFound
from node_agent.store.documents import FileEntry, is_created

RECEIVED_ANNOTATION: Final = "io.node-agent.store.received"
"""In a checkpoint's index record: when this store published it (RFC 3339 UTC)."""
PROVENANCE_ANNOTATION: Final = "io.node-agent.store.provenance"
"""In a checkpoint's index record: how it came into this store (one of ``PROVENANCES``)."""
STORE_ANNOTATIONS: Final = frozenset({RECEIVED_ANNOTATION, PROVENANCE_ANNOTATION})
LOCAL: Final = "local"
"""Made on this node: a checkpoint, or a copy (rekey) of a local one."""
PULLED: Final = "pulled"
"""Pulled from a registry (or a copy of a pulled one)."""
IMPORTED: Final = "imported"
"""Imported from an archive (or a copy of an imported one)."""
PROVENANCES: Final = frozenset({LOCAL, PULLED, IMPORTED})
LEGACY_IMPORTED_KEY: Final = "imported"
"""The metadata key the agent's archive import has always written: how a record
published before the store kept its provenance is known to be imported."""


def created_epoch(created: str) -> float:
    """Seconds since the epoch of an RFC 3339 ``created`` value (-inf when unreadable)."""
    try:
        return datetime.fromisoformat(created).timestamp()
    except ValueError:
        return -math.inf


def now_rfc3339() -> str:
    """The current time as the store writes it (RFC 3339, UTC, microseconds)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def check_provenance(provenance: str) -> str:
    """``provenance`` if it is one of ``PROVENANCES``; InvalidArgument otherwise."""
    if provenance not in PROVENANCES:
        raise InvalidArgument(f"provenance {provenance!r} is not one of {sorted(PROVENANCES)}")
    return provenance


def without_store_annotations(annotations: Mapping[str, str]) -> dict[str, str]:
    """The annotations less the store's own (a copy of a checkpoint gets its own)."""
    return {k: v for k, v in annotations.items() if k not in STORE_ANNOTATIONS}


def refuse_store_annotations(annotations: Mapping[str, str], what: str) -> None:
    """InvalidArgument when a manifest's annotations carry the store's own: only the store says those."""
    claimed = sorted(STORE_ANNOTATIONS & set(annotations))
    if claimed:
        raise InvalidArgument(f"{what}: annotation {claimed[0]} is the store's own record of a checkpoint, "
                              "not a manifest's to carry")


def receipt_annotations(received: str, provenance: str) -> dict[str, str]:
    """What the store adds to a checkpoint's index record when it publishes it."""
    return {RECEIVED_ANNOTATION: received, PROVENANCE_ANNOTATION: check_provenance(provenance)}


def receipt(
    entry: Mapping[str, Any] | None, manifest_annotations: Mapping[str, str], created: str,
    metadata: Mapping[str, Any], *, lazily_pulled: Callable[[], bool],
) -> tuple[str, str]:
    """(received, provenance) of a checkpoint, from its index record ``entry``.

    A record the store wrote with both annotations says them. Any other
    (published before the store kept them, rebuilt by ``recover``, or not
    published) counts as received at its ``created``, and as local unless
    it is ``lazily_pulled()`` (an origin is recorded) or its metadata has
    ``LEGACY_IMPORTED_KEY``. So does a checkpoint whose manifest itself
    carries a store annotation (only a store that did not yet refuse them
    could have taken it): its record's values may be the maker's.
    """
    notes = entry.get("annotations") if entry is not None else None
    if isinstance(notes, Mapping) and not STORE_ANNOTATIONS & set(manifest_annotations):
        received, provenance = notes.get(RECEIVED_ANNOTATION), notes.get(PROVENANCE_ANNOTATION)
        if is_created(received) and provenance in PROVENANCES:
            return str(received), str(provenance)
    if lazily_pulled():
        return created, PULLED
    return created, IMPORTED if isinstance(metadata.get(LEGACY_IMPORTED_KEY), Mapping) else LOCAL


def _no_annotations() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True)
class CheckpointRecord:
    """A published checkpoint, as loaded and validated from its manifest and config blob.

    ``id`` is the manifest's digest. ``size`` is the sum of the file sizes,
    ``stored_size`` the sum of the distinct chunk blobs' stored sizes.
    ``manifest_path`` is the manifest blob's path. ``key_id`` names the key
    a sealed checkpoint is sealed under ("" when it is not). ``locked``: its
    key is not configured, so only what the manifest says in the clear is
    known: ``metadata`` is empty, ``files`` is empty and ``size`` is -1.
    """

    id: str
    created: str
    metadata: Mapping[str, Any]
    files: tuple[FileEntry, ...]
    size: int
    stored_size: int
    manifest_path: str
    annotations: Mapping[str, str] = field(default_factory=_no_annotations)
    key_id: str = ""
    locked: bool = False
    received: str = ""
    provenance: str = LOCAL

    @property
    def local(self) -> bool:
        """Whether it was made on this node (a checkpoint, or a copy of a local one)."""
        return self.provenance == LOCAL

    @property
    def received_epoch(self) -> float:
        """Seconds since the epoch of ``received`` (of ``created`` when the record has none)."""
        return created_epoch(self.received or self.created)

    def require_open(self) -> None:
        """FailedPrecondition naming the key id when the checkpoint's key is not configured."""
        if self.locked:
            raise FailedPrecondition(
                f"checkpoint {self.id} is encrypted with key id {self.key_id}, which no configured key source has"
            )

    def entry(self, path: str) -> FileEntry:
        """The entry at ``path``; NotFound if absent."""
        for entry in self.files:
            if entry.path == path:
                return entry
        raise NotFound(f"checkpoint {self.id}: no entry {path!r}")


@dataclass(frozen=True)
class BadBlob:
    """A blob referenced by a checkpoint that is missing or corrupt, and the files that use it."""

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
    index_rebuilt: bool = False

    @property
    def clean(self) -> bool:
        """Whether there was nothing to do."""
        return not (
            self.ingest_removed or self.strays_removed or self.quarantined or self.blobs_removed or self.index_rebuilt
        )
