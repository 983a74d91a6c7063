"""The store's repair at start-up: what crashed writers, importers and collections left behind.

Rule: repair only removes what nothing can need and moves aside what fails
to load; it never deletes a checkpoint's documents. Under the exclusive
store lock it removes ingest directories whose lease is dead (and not kept
past its owner: ``kept``) and stray files; a checkpoint whose manifest or config fails to load is unpublished
and its index record and manifest bytes are kept under ``quarantine/``
(their blobs stay reachable from there); an unreadable ``index.json`` is
moved to the quarantine and rebuilt from the manifest blobs found in the
store (with the referrers of the checkpoints found); then the usual sweep
deletes the blobs nothing reaches. Safe while other writers run: live
leases and what they reference are kept.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from node_agent.errors import AgentError, DataLoss
from node_agent.oci import is_hex_digest
from node_agent.store.blobs import BlobStore
from node_agent.store.files import os_error
from node_agent.store.gc import Collector
from node_agent.store.index import INDEX_NAME, Index
from node_agent.store.documents import is_checkpoint_entry
from node_agent.store.records import RecoveryReport
from node_agent.store.referrers import rediscover

log = logging.getLogger(__name__)


def recover(index: Index, blobs: BlobStore, collector: Collector, *, ingest_dir: str) -> RecoveryReport:
    """Clean up after crashes: dead ingest dirs, strays, unloadable checkpoints, orphan blobs."""
    quarantined: list[str] = []
    rebuilt = False
    try:
        with index.locked(exclusive=True):
            ingest_removed = collector.remove_dead_ingest()
            strays = _remove_strays(blobs, ingest_dir)
            try:
                entries = index.read()
            except DataLoss as exc:
                index.quarantine_index(str(exc))
                quarantined.append(INDEX_NAME)
                entries = index.rebuild()
                entries += rediscover(blobs, entries)  # the checkpoints' signatures come back too
                rebuilt = True
            kept: list[dict[str, Any]] = []
            for entry in entries:
                if is_checkpoint_entry(entry):
                    try:
                        index.load(entry["digest"], entry)
                    except AgentError as exc:
                        index.quarantine_entry(entry, str(exc))
                        quarantined.append(entry["digest"])
                        continue
                kept.append(entry)
            if rebuilt or len(kept) != len(entries):
                index.write(kept)
            blobs_removed, freed = collector.sweep(kept, dry_run=False)
    except OSError as exc:
        raise os_error(exc, f"recovering store {index.root!r}") from exc
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


def _remove_strays(blobs: BlobStore, ingest_dir: str) -> list[str]:
    """Delete loose files in ``ingest/`` and badly named entries in the blob directory; their store paths."""
    strays: list[str] = []
    with os.scandir(ingest_dir) as it:
        files = [e for e in it if not e.is_dir(follow_symlinks=False)]
    for stray in files:
        os.unlink(stray.path)
        strays.append(os.path.join("ingest", stray.name))
    with os.scandir(blobs.dir) as it:
        blob_entries = list(it)
    for found in blob_entries:
        if found.is_dir(follow_symlinks=False):
            log.warning("leaving unexpected directory %s in the blob store", found.path)
        elif not (is_hex_digest(found.name) and found.is_file(follow_symlinks=False)):
            os.unlink(found.path)
            strays.append(os.path.join("blobs", "sha256", found.name))
    return strays
