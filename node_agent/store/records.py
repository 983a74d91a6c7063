"""The values the store hands out: checkpoint records and reports.

Rule: plain frozen data, and how records order by creation time; no I/O
happens here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any

from node_agent.errors import FailedPrecondition, NotFound
from node_agent.store.manifest import FileEntry


def created_epoch(created: str) -> float:
    """Seconds since the epoch of an RFC 3339 ``created`` value (-inf when unreadable)."""
    try:
        return datetime.fromisoformat(created).timestamp()
    except ValueError:
        return -math.inf


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
