"""Garbage collection: retention, reachability, and the sweep that deletes what nothing reaches.

Rule: a blob that anything may still need is never removed. Reachability is
a safe superset: every ``sha256:<hex>`` string found in a published
manifest's raw bytes and in its config blob's raw bytes (so it works even
for documents that fail validation), nested indexes followed, plus every
digest a live writer or importer lease names (or one kept until a time by
an import that stopped half-way, ``kept``: until then) and every digest in
the quarantine. Retention only picks which published checkpoints to unpublish,
by what the store itself recorded (when each was received, whether it was
made here), never by what a checkpoint says of itself, so checkpoints that
came from elsewhere cannot push out the node's own; unpublishing comes
first, and the sweep that follows, under the same exclusive store lock,
removes what nothing reaches (``discard`` applies the same rule to the
blobs of an import that was refused). A checkpoint's referrer
records (its signatures) are unpublished with it. The policy functions do
no I/O; ``entry_refs`` reads blobs; the ``Collector`` does the rest.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from node_agent.errors import AgentError, InvalidArgument, NotFound
from node_agent.oci import MAX_MANIFEST_BYTES, OCI_INDEX_MEDIA_TYPE, digest_hex
from node_agent.store.blobs import BlobStore
from node_agent.store.files import os_error, read_bounded, scan_digests
from node_agent.store.ingest import REFS_NAME, lease_is_live, live_refs
from node_agent.store.kept import read as read_kept
from node_agent.store.index import Index, checkpoint_ids
from node_agent.store.documents import is_checkpoint_entry
from node_agent.store.origins import Origins
from node_agent.store.records import CheckpointRecord
from node_agent.store.referrers import subject_of, without_orphans

log = logging.getLogger(__name__)

DEFAULT_GROUP_ANNOTATION: Final = "io.node-agent.pod"
_NESTED_INDEX_TYPES: Final = frozenset({OCI_INDEX_MEDIA_TYPE, "application/vnd.docker.distribution.manifest.list.v2+json"})
_MAX_DEPTH: Final = 4
# Directories whose files are scanned for digests that must be kept: the
# quarantine, and the manifests of the store's first format.
_KEEP_DIRS: Final = ("quarantine", "checkpoints")


@dataclass(frozen=True)
class RetentionPolicy:
    """Which published checkpoints garbage collection keeps.

    Age and order are the store's receipt time (``CheckpointRecord.received``),
    never a checkpoint's own ``created``. Rules apply in this order, each to
    what the previous ones kept: ``max_age_seconds`` drops checkpoints
    received longer ago; ``max_per_group`` keeps the newest N of each group
    (checkpoints whose manifest has the ``group_annotation``, "namespace/name"
    for the agent's pod checkpoints; others belong to no group and are not
    limited), counting the local ones (made here) and the others (pulled,
    imported) apart, so N local and N others of a group stay;
    ``max_total_bytes`` then drops checkpoints until the blobs still needed
    fit: the others first, oldest received first, and local ones only once
    no other is left (this may drop every checkpoint). ``None`` disables a rule.
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


def oldest_first(records: Sequence[CheckpointRecord]) -> list[CheckpointRecord]:
    """Records ordered by receipt, oldest first (ties broken by id)."""
    return sorted(records, key=lambda r: (r.received_epoch, r.id))


def select_drops(
    records: Sequence[CheckpointRecord],
    policy: RetentionPolicy,
    now: float,
    refs: Mapping[str, set[str]],
    sizes: Mapping[str, int],
    base: set[str],
) -> list[str]:
    """Ids of the checkpoints ``policy`` drops, oldest received first.

    ``refs`` maps each record id to the blobs it reaches, ``sizes`` gives
    blob sizes, and ``base`` names blobs kept regardless (leases, other
    index entries, the quarantine).
    """
    ordered = oldest_first(records)
    dropped: set[str] = set()
    if policy.max_age_seconds is not None:
        limit = now - policy.max_age_seconds
        dropped.update(r.id for r in ordered if r.received_epoch < limit)
    if policy.max_per_group is not None:
        # The group is the maker's claim: what came from elsewhere is counted apart from the node's own.
        groups: dict[tuple[str, bool], list[CheckpointRecord]] = {}
        for record in ordered:
            group = record.annotations.get(policy.group_annotation)
            if group is not None and record.id not in dropped:
                groups.setdefault((group, record.local), []).append(record)
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
        for record in sorted(ordered, key=lambda r: r.local):  # stable: the others first, each oldest first
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


class Collector:
    """Unpublishing and sweeping a store: what ``Store.remove`` and ``Store.gc`` do, and ``recover`` ends with."""

    def __init__(self, root: str, blobs: BlobStore, index: Index, origins: Origins, *, ingest_dir: str) -> None:
        self.root = root
        self.blobs = blobs
        self.index = index
        self.origins = origins
        self.ingest_dir = ingest_dir

    def remove(self, cid: str) -> GcReport:
        """Unpublish the checkpoint ``cid`` (a full id), then delete the blobs nothing else reaches."""
        try:
            with self.index.locked(exclusive=True):
                entries = self.index.read()
                kept = [e for e in entries if not (is_checkpoint_entry(e) and e["digest"] == cid)]
                if len(kept) == len(entries):
                    raise NotFound(f"checkpoint {cid} not found")
                kept = without_orphans(kept)  # its referrers (signatures) go with it
                self.index.write(kept)
                self.origins.forget(cid)
                removed, freed = self.sweep(kept, dry_run=False)
        except OSError as exc:
            raise os_error(exc, f"removing checkpoint {cid}") from exc
        log.info(
            "removed checkpoint %s (%d blobs, %d bytes freed)",
            cid,
            len(removed),
            freed,
            extra={"checkpoint": cid},
        )
        return GcReport((cid,), tuple(removed), freed, len(checkpoint_ids(kept)), False)

    def collect(self, policy: RetentionPolicy | None, *, dry_run: bool, now: float) -> GcReport:
        """Unpublish the checkpoints ``policy`` drops (oldest first), then delete unreachable blobs (see ``Store.gc``)."""
        try:
            with self.index.locked(exclusive=True):
                entries = self.index.read()
                dropped: list[str] = []
                if policy is not None:
                    dropped = self._policy_drops(entries, policy, now)
                # A dropped checkpoint's referrers (its signatures) go with it.
                kept = without_orphans([e for e in entries if not (is_checkpoint_entry(e) and e["digest"] in dropped)])
                if len(kept) != len(entries) and not dry_run:
                    self.index.write(kept)
                removed, freed = self.sweep(kept, dry_run=dry_run, now=now)
        except OSError as exc:
            raise os_error(exc, f"collecting garbage in {self.root!r}") from exc
        report = GcReport(tuple(dropped), tuple(removed), freed, len(checkpoint_ids(kept)), dry_run)
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

    def _policy_drops(self, entries: Sequence[Mapping[str, Any]], policy: RetentionPolicy, now: float) -> list[str]:
        records: list[CheckpointRecord] = []
        for entry in entries:
            if not is_checkpoint_entry(entry):
                continue
            cid = entry["digest"]
            try:
                records.append(self.index.load(cid, entry))
            except AgentError as exc:
                log.warning("gc keeps unreadable checkpoint %s: %s", cid, exc, extra={"checkpoint": cid})
        ours = {r.id for r in records}
        refs = {r.id: entry_refs(self.blobs, r.id, "") for r in records}
        base = self._pinned(now)
        for entry in entries:
            subject = subject_of(entry)
            if subject in refs:  # a referrer goes with its checkpoint: its blobs count there
                refs[subject] |= entry_refs(self.blobs, entry["digest"], str(entry.get("mediaType", "")))
            elif entry["digest"] not in ours:
                base |= entry_refs(self.blobs, entry["digest"], str(entry.get("mediaType", "")))
        return select_drops(records, policy, now, refs, self.blobs.sizes(), base)

    def _pinned(self, now: float | None = None) -> set[str]:
        """Digests kept whatever the index says: live and kept leases, the quarantine (exclusive lock held)."""
        refs = live_refs(self.ingest_dir, now)
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

    def sweep(self, entries: Sequence[Mapping[str, Any]], *, dry_run: bool, now: float | None = None
              ) -> tuple[list[str], int]:
        """Delete every blob nothing reaches and every dead ingest directory (exclusive lock held).

        ``entries`` is the index as it now stands; a kept lease lives until
        its time passes ``now`` (the current time by default). Returns the
        digests deleted (or that would be, with ``dry_run``) and the bytes
        freed.
        """
        keep = self._reachable(entries, now)
        sizes = self.blobs.sizes()
        orphans = sorted(d for d in sizes if d not in keep)
        if dry_run:
            return orphans, sum(sizes[d] for d in orphans)
        self.remove_dead_ingest(now)
        self.origins.prune([e["digest"] for e in entries])
        return self.blobs.delete(orphans)

    def _reachable(self, entries: Sequence[Mapping[str, Any]], now: float | None = None) -> set[str]:
        """Every digest kept: pinned, or reached from ``entries`` (exclusive lock held)."""
        keep = self._pinned(now)
        for entry in entries:
            keep |= entry_refs(self.blobs, entry["digest"], str(entry.get("mediaType", "")))
        return keep

    def discard(self, digests: Collection[str], *, unpublished: str | None = None, manifest: str | None = None
                ) -> list[str]:
        """Delete those of ``digests`` that nothing reaches; the ones deleted.

        For an import that stopped before publishing (``BlobImporter.discard``,
        its lease already gone): the sweep's rule applied to the blobs it
        brought in alone, so blobs stored before it stay whatever reaches
        them. ``unpublished``: the checkpoint it staged, whose origin record
        goes too unless it is published. ``manifest``: the leases that
        earlier imports of that manifest kept (``forget_kept``) go too, and
        the blobs they name count as brought.
        """
        try:
            with self.index.locked(exclusive=True):
                if manifest is not None:
                    digests = set(digests) | self._forget_kept(manifest)
                entries = self.index.read()
                if unpublished is not None and unpublished not in checkpoint_ids(entries):
                    self.origins.forget(unpublished)
                keep = self._reachable(entries)
                removed, freed = self.blobs.delete(d for d in digests if d not in keep)
        except OSError as exc:
            raise os_error(exc, "deleting the blobs of an import that was not published") from exc
        if removed:
            log.info("%d blob(s) (%d bytes) of an import that was not published deleted", len(removed), freed,
                     extra={"checkpoint": unpublished} if unpublished else None)
        return removed

    def forget_kept(self, manifest: str) -> set[str]:
        """End the leases kept by imports of ``manifest`` (published now, or refused); the digests they named."""
        try:
            with self.index.locked(exclusive=True):
                return self._forget_kept(manifest)
        except OSError as exc:
            raise os_error(exc, f"ending the kept leases of {manifest}") from exc

    def _forget_kept(self, manifest: str) -> set[str]:
        """``forget_kept`` with the exclusive lock held (an importer writes its kept record under the shared one)."""
        named: set[str] = set()
        with os.scandir(self.ingest_dir) as it:
            dirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
        for path in dirs:
            note = read_kept(path)
            if note is not None and note.get("manifest") == manifest:
                named |= scan_digests(os.path.join(path, REFS_NAME))
                shutil.rmtree(path, onerror=_vanished_ok)
                log.info("the lease kept for an earlier import of %s (%s) ended: it is published or refused now",
                         note.get("reference") or manifest, os.path.basename(path))
        return named

    def remove_dead_ingest(self, now: float | None = None) -> list[str]:
        """Remove the ingest directories whose lease is gone (or was kept until before ``now``); their names.

        Call with the exclusive lock held.
        """
        removed: list[str] = []
        with os.scandir(self.ingest_dir) as it:
            dirs = [e for e in it if e.is_dir(follow_symlinks=False)]
        for entry in dirs:
            if not lease_is_live(entry.path, now):
                note = read_kept(entry.path)
                if note is not None and note.get("manifest"):
                    log.info("the lease kept for the import of %s until %s has ended: the blobs it brought go "
                             "unless something else needs them", note.get("reference") or note["manifest"],
                             note.get("until_utc", note["until"]))
                # A writer deletes its own directory before it drops its lease, and without the
                # store lock: its lease file may be gone already, and the rest go while this runs.
                shutil.rmtree(entry.path, onerror=_vanished_ok)
                removed.append(entry.name)
        return removed


def _vanished_ok(_func: object, _path: str, exc_info: tuple[type[BaseException], BaseException, object]) -> None:
    """rmtree's error handler: what another remover took first is gone, as wanted; the rest is raised."""
    if not issubclass(exc_info[0], FileNotFoundError):
        raise exc_info[1]
