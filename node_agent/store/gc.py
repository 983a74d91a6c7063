"""Retention and reachability: which checkpoints to drop, which blobs are still needed.

Rule: a blob that anything may still need is never removed. Reachability is
a safe superset: every ``sha256:<hex>`` string found in a published
manifest's raw bytes and in its config blob's raw bytes (so it works even
for documents that fail validation), nested indexes followed, plus every
digest a live writer or importer lease names and every digest in the
quarantine. Retention only picks which published checkpoints to unpublish;
the sweep that follows removes what nothing reaches. The policy functions
do no I/O; ``entry_refs`` reads blobs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from node_agent.errors import InvalidArgument
from node_agent.store.blobs import BlobStore, read_bounded, scan_digests
from node_agent.store.manifest import MAX_MANIFEST_BYTES, OCI_INDEX_MEDIA_TYPE, digest_hex
from node_agent.store.records import CheckpointRecord

DEFAULT_GROUP_ANNOTATION: Final = "io.node-agent.pod"
_NESTED_INDEX_TYPES: Final = frozenset({OCI_INDEX_MEDIA_TYPE, "application/vnd.docker.distribution.manifest.list.v2+json"})
_MAX_DEPTH: Final = 4


@dataclass(frozen=True)
class RetentionPolicy:
    """Which published checkpoints garbage collection keeps.

    Rules apply in this order, each to what the previous ones kept:
    ``max_age_seconds`` drops checkpoints created longer ago;
    ``max_per_group`` keeps the newest N of each group (checkpoints whose
    manifest has the ``group_annotation``, "namespace/name" for the agent's
    pod checkpoints; others belong to no group and are not limited);
    ``max_total_bytes`` then drops the oldest checkpoints until the blobs
    still needed fit (this may drop every checkpoint). ``None`` disables a rule.
    """

    max_per_group: int | None = None
    group_annotation: str = DEFAULT_GROUP_ANNOTATION
    max_total_bytes: int | None = None
    max_age_seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_per_group", "max_total_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise InvalidArgument(f"retention {name} {value!r} is not a non-negative integer")
        age = self.max_age_seconds
        if age is not None and (
            isinstance(age, bool) or not isinstance(age, (int, float)) or not math.isfinite(age) or age < 0
        ):
            raise InvalidArgument(f"retention max_age_seconds {age!r} is not a non-negative number")
        if not isinstance(self.group_annotation, str) or not self.group_annotation:
            raise InvalidArgument("retention group_annotation must be a non-empty string")


@dataclass(frozen=True)
class GcReport:
    """What ``Store.gc`` (or ``remove``) unpublished and deleted, or would have with ``dry_run``."""

    removed_checkpoints: tuple[str, ...]
    removed_blobs: tuple[str, ...]
    bytes_freed: int
    kept: int
    dry_run: bool


def created_epoch(created: str) -> float:
    """Seconds since the epoch of an RFC 3339 ``created`` value (-inf when unreadable)."""
    try:
        return datetime.fromisoformat(created).timestamp()
    except ValueError:
        return -math.inf


def oldest_first(records: Sequence[CheckpointRecord]) -> list[CheckpointRecord]:
    """Records ordered oldest first (ties broken by id)."""
    return sorted(records, key=lambda r: (created_epoch(r.created), r.id))


def select_drops(
    records: Sequence[CheckpointRecord],
    policy: RetentionPolicy,
    now: float,
    refs: Mapping[str, set[str]],
    sizes: Mapping[str, int],
    base: set[str],
) -> list[str]:
    """Ids of the checkpoints ``policy`` drops, oldest first.

    ``refs`` maps each record id to the blobs it reaches, ``sizes`` gives
    blob sizes, and ``base`` names blobs kept regardless (leases, other
    index entries, the quarantine).
    """
    ordered = oldest_first(records)
    dropped: set[str] = set()
    if policy.max_age_seconds is not None:
        limit = now - policy.max_age_seconds
        dropped.update(r.id for r in ordered if created_epoch(r.created) < limit)
    if policy.max_per_group is not None:
        groups: dict[str, list[CheckpointRecord]] = {}
        for record in ordered:
            group = record.annotations.get(policy.group_annotation)
            if group is not None and record.id not in dropped:
                groups.setdefault(group, []).append(record)
        for members in groups.values():
            excess = len(members) - policy.max_per_group
            dropped.update(r.id for r in members[: max(0, excess)])
    if policy.max_total_bytes is not None:
        counts: dict[str, int] = {}
        for record in ordered:
            if record.id not in dropped:
                for digest in refs.get(record.id, ()):
                    counts[digest] = counts.get(digest, 0) + 1
        needed = base | set(counts)
        total = sum(sizes.get(d, 0) for d in needed)
        for record in ordered:
            if total <= policy.max_total_bytes:
                break
            if record.id in dropped:
                continue
            dropped.add(record.id)
            for digest in refs.get(record.id, ()):
                counts[digest] -= 1
                if counts[digest] == 0 and digest not in base:
                    total -= sizes.get(digest, 0)
    return [r.id for r in ordered if r.id in dropped]


def entry_refs(blobs: BlobStore, digest: str, media_type: str, depth: int = 0) -> set[str]:
    """Every blob an index entry reaches: itself, what its bytes name, what its config names.

    Raw digest scans keep this a superset even for documents that do not
    parse; a parsed document's ``config`` blob is scanned too, and the
    entries of a nested index are followed.
    """
    try:
        digest_hex(digest)
    except InvalidArgument:
        return set()
    found = {digest}
    path = blobs.path(digest)
    found |= scan_digests(path)
    try:
        doc: Any = json.loads(read_bounded(path, MAX_MANIFEST_BYTES))
    except (OSError, ValueError, RecursionError):
        return found
    if not isinstance(doc, dict):
        return found
    config = doc.get("config")
    if isinstance(config, dict) and isinstance(config.get("digest"), str):
        try:
            found |= scan_digests(blobs.path(config["digest"]))
        except InvalidArgument:
            pass
    children = doc.get("manifests")
    if (media_type in _NESTED_INDEX_TYPES or doc.get("mediaType") in _NESTED_INDEX_TYPES) and depth < _MAX_DEPTH:
        for child in children if isinstance(children, list) else []:
            if isinstance(child, dict) and isinstance(child.get("digest"), str):
                found |= entry_refs(blobs, child["digest"], str(child.get("mediaType", "")), depth + 1)
    return found
