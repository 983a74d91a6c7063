"""Origins: where the blobs of a lazily pulled checkpoint still are.

Rule: a lazy pull publishes a checkpoint with some of its chunks left in the
registry; before it publishes, it records their origin in
``origins/<hex>.json`` (the registry reference, pinned by digest, and how to
reach it; never a password). Readers fetch a missing chunk through
``fetcher``, which whoever holds the registry credentials sets, and verify it
like any other blob. An origin is forgotten once every blob has arrived or
its checkpoint is removed; garbage collection prunes the records of
checkpoints no longer published (sparing recent ones: a pull in progress
records its origin just before it publishes).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any, Final

from node_agent.errors import FailedPrecondition
from node_agent.oci import digest_hex
from node_agent.store.blobs import BlobStore
from node_agent.store.files import read_bounded
from node_agent.store.index import Index
from node_agent.store.documents import Chunk, ChunkFetch
from node_agent.store.records import CheckpointRecord

Fetcher = Callable[[Mapping[str, Any], Chunk], "bytes | None"]
"""``fetcher(origin, chunk)``: bring the chunk's blob from ``origin`` into the store, verified; its stored bytes
when it has them at hand (see ``ChunkFetch``)."""

MAX_ORIGIN_BYTES: Final = 64 << 10
PRUNE_AFTER_SECONDS: Final = 3600


class Origins:
    """The ``origins/`` directory of a store: one record per lazily pulled checkpoint not yet whole."""

    def __init__(self, root: str, blobs: BlobStore, index: Index) -> None:
        self.dir = os.path.join(root, "origins")
        self.blobs = blobs
        self.index = index
        self.fetcher: Fetcher | None = None
        # How many fetches ``fetcher`` serves at once (a registry's connections): a reader that fetches
        # many chunks (``Store.materialize``) keeps that many in flight.
        self.fetch_lanes = 1

    def _path(self, checkpoint_id: str) -> str:
        return os.path.join(self.dir, digest_hex(checkpoint_id) + ".json")

    def remember(self, checkpoint_id: str, origin: Mapping[str, Any]) -> None:
        """Record where the blobs a lazy pull leaves behind come from (before the checkpoint is published).

        ``origin`` holds the registry reference (``reference``, pinned by
        digest) and how to reach it, never a password.
        """
        self.index.replace_file(self._path(checkpoint_id), json.dumps(dict(origin), sort_keys=True).encode())

    def get(self, checkpoint_id: str) -> dict[str, Any] | None:
        """Where a lazily pulled checkpoint's missing blobs come from, or None."""
        try:
            data = read_bounded(self._path(checkpoint_id), MAX_ORIGIN_BYTES)
            doc = json.loads(data)
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) and isinstance(doc.get("reference"), str) else None

    def forget(self, checkpoint_id: str) -> None:
        """Drop a checkpoint's origin record, if it has one."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(checkpoint_id))

    def missing(self, record: CheckpointRecord) -> list[Chunk]:
        """The chunks of ``record`` whose blobs are not (yet) in this store."""
        seen: set[str] = set()
        out: list[Chunk] = []
        for entry in record.files:
            for chunk in entry.chunks:
                if chunk.digest not in seen:
                    seen.add(chunk.digest)
                    if self.blobs.size_of(chunk.digest) is None:
                        out.append(chunk)
        return out

    def settle(self, checkpoint_id: str) -> bool:
        """Forget the origin of a published checkpoint whose blobs have all arrived; True if it is whole.

        Blobs the fetcher brought are waited for first (its ``drain``, where it has one): a fetch hands its
        reader the verified bytes before the blob is durable and linked.
        """
        drain = getattr(self.fetcher, "drain", None)
        if callable(drain):
            drain()
        record = self.index.load(self.index.resolve(checkpoint_id))
        if self.missing(record):
            return False
        self.forget(record.id)
        return True

    def fetch_for(self, checkpoint_id: str, origin: Mapping[str, Any] | None = None) -> ChunkFetch | None:
        """A fetcher of the checkpoint's missing chunks, or None if it has no origin.

        The origin is read once, here, unless the caller read it earlier and
        passes it: a reader that started keeps fetching even if the
        checkpoint is removed meanwhile (see ``Store.hold``).
        """
        if origin is None:
            origin = self.get(checkpoint_id)
        if origin is None:
            return None
        where = str(origin.get("reference"))

        def fetch(chunk: Chunk) -> bytes | None:
            if self.fetcher is None:
                raise FailedPrecondition(
                    f"blob {chunk.digest} is still only in {where} (pulled lazily), "
                    "and nothing here can fetch it"
                )
            return self.fetcher(origin, chunk)

        return fetch

    def prune(self, published: Collection[str], *, now: float | None = None) -> None:
        """Remove the records of checkpoints not in ``published`` (ids) older than an hour (exclusive lock held)."""
        keep = {digest_hex(cid) for cid in published}
        cutoff = (time.time() if now is None else now) - PRUNE_AFTER_SECONDS
        with os.scandir(self.dir) as it:
            for found in it:
                if (found.name.endswith(".json") and found.name[:-5] not in keep
                        and found.stat(follow_symlinks=False).st_mtime < cutoff):
                    os.unlink(found.path)
