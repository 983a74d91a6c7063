"""``index.json``: which checkpoints are published, and loading what each one names.

Rule: a checkpoint is listed only once its manifest is published in
``index.json``, and it is published only after every blob it names is
durable and verified (``publish`` checks them under the lock). The index
changes only under the exclusive store lock, by an atomic, fsynced rewrite.
A checkpoint's record there also says when this store published it and
how it came (made here, pulled, imported: ``records.receipt``), which its
manifest, chosen by its maker, cannot. Every id that comes in is validated
before it is looked up, and every manifest and config blob is read bounded,
hashed and decoded as hostile data when a checkpoint is loaded. What fails to load is moved aside into
``quarantine/``, never deleted.

A process keeps the documents it validated (`Kept`): a checkpoint's id is
the digest of its manifest, which names its config's digest, so the same id
always decodes to the same documents. They are used again only while both
blob files are the ones they were read from (device, inode, size, mtime and
ctime: any write or replacement changes the ctime), and, for a sealed
config, while a key source still has its key. A restore loads its checkpoint
several times (resolving, admitting, unpacking); a 1 GiB checkpoint's
documents, hundreds of chunks each checked, take some 15 ms to decode.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Final

from node_agent.errors import AgentError, DataLoss, InvalidArgument, NotFound
from node_agent.oci import EMPTY_DESCRIPTOR, MAX_MANIFEST_BYTES, digest_hex
from node_agent.store import sealing
from node_agent.store.blobs import BlobStore
from node_agent.store.chunk_reader import ChunkReader
from node_agent.store.files import fsync_dir, read_bounded, replace_file, write_new_file
from node_agent.store.locking import store_lock
from node_agent.store.documents import (
    CONFIG_SEALED_MEDIA_TYPE,
    MAX_CONFIG_BYTES,
    MAX_INDEX_BYTES,
    CheckpointConfig,
    CheckpointManifest,
    check_manifest_matches,
    decode_config,
    decode_index,
    decode_manifest,
    encode_index,
    index_entry,
    is_checkpoint_entry,
    oci_layout,
)
from node_agent.store.records import (
    CheckpointRecord,
    created_epoch,
    now_rfc3339,
    receipt,
    receipt_annotations,
    without_store_annotations,
)

log = logging.getLogger(__name__)

INDEX_NAME: Final = "index.json"
LAYOUT_NAME: Final = "oci-layout"
MIN_PREFIX_LEN: Final = 6
_ID_RE: Final = re.compile(r"[0-9a-f]{6,64}")
KEPT_DOCUMENTS: Final = 64  # checkpoints whose validated documents a process keeps (`Kept`)

FileIdentity = tuple[int, int, int, int, int]


def file_identity(path: str) -> FileIdentity | None:
    """Which file ``path`` is now: device, inode, size, mtime and ctime (None when it cannot be stat'ed)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class _Documents:
    """A checkpoint's documents as validated, and the files and key they came from."""

    data: bytes
    manifest: CheckpointManifest
    config: CheckpointConfig
    files: tuple[tuple[str, FileIdentity], ...]  # (path, identity when read) of the manifest and config blobs
    sealed_key: str  # the key id a sealed config was opened with ("" when not sealed)


def _own(config: CheckpointConfig) -> CheckpointConfig:
    """``config`` with metadata of its own: the file table is immutable, the metadata's nested values plain JSON."""
    return CheckpointConfig(metadata=MappingProxyType(copy.deepcopy(dict(config.metadata))), files=config.files)


class Kept:
    """The documents of the checkpoints a process loaded last, each used again while its files are the same."""

    def __init__(self, size: int = KEPT_DOCUMENTS) -> None:
        self.size = size
        self._docs: OrderedDict[str, _Documents] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, cid: str, has_key: Callable[[str], bool]) -> _Documents | None:
        with self._lock:
            docs = self._docs.get(cid)
            if docs is not None:
                self._docs.move_to_end(cid)
        if docs is None:
            return None
        if any(file_identity(path) != ident for path, ident in docs.files) or (
                docs.sealed_key and not has_key(docs.sealed_key)):
            self.drop(cid)
            return None
        return docs

    def put(self, cid: str, docs: _Documents) -> None:
        with self._lock:
            self._docs[cid] = docs
            self._docs.move_to_end(cid)
            while len(self._docs) > self.size:
                self._docs.popitem(last=False)

    def drop(self, cid: str) -> None:
        with self._lock:
            self._docs.pop(cid, None)


def checkpoint_ids(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ids of the checkpoint records among index entries, in index order."""
    return [e["digest"] for e in entries if is_checkpoint_entry(e)]


class Index:
    """The store's ``index.json`` and ``oci-layout``, and the checkpoint records they lead to.

    ``scratch_dir`` (the store's ``ingest/``) takes the temporary files of
    atomic rewrites; ``lock_path`` is the store-wide lock; unloadable
    records and an unreadable index go to ``quarantine_dir``.
    ``lazily_pulled(id)`` says whether a checkpoint has a recorded origin
    (``Origins``): how a record from before the store kept provenance is
    known to be pulled.
    """

    def __init__(self, root: str, chunks: ChunkReader, *, scratch_dir: str, lock_path: str, quarantine_dir: str,
                 lazily_pulled: Callable[[str], bool] | None = None) -> None:
        self.root = root
        self.lazily_pulled = lazily_pulled
        self.chunks = chunks
        self.blobs: BlobStore = chunks.blobs
        self.scratch_dir = scratch_dir
        self.lock_path = lock_path
        self.quarantine_dir = quarantine_dir
        self.path = os.path.join(root, INDEX_NAME)
        self.layout_path = os.path.join(root, LAYOUT_NAME)
        self.kept = Kept()

    def setup(self) -> None:
        """Write ``oci-layout`` and an empty ``index.json`` where they are missing."""
        if os.path.lexists(self.layout_path) and os.path.lexists(self.path):
            return
        with self.locked(exclusive=True):
            if not os.path.lexists(self.layout_path):
                self.replace_file(self.layout_path, oci_layout())
            if not os.path.lexists(self.path):
                self.write([])

    def locked(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        """The store lock: shared for writers' short steps, exclusive to change the index or delete blobs."""
        return store_lock(self.lock_path, exclusive=exclusive)

    def replace_file(self, path: str, data: bytes) -> None:
        """Atomically replace a file of the store (fsync the file, rename, fsync its directory)."""
        replace_file(path, data, scratch_dir=self.scratch_dir)

    # -- the records -------------------------------------------------------------------------

    def read(self) -> list[dict[str, Any]]:
        """Every index.json record (validated); DataLoss when the index is unreadable."""
        try:
            data = read_bounded(self.path, MAX_INDEX_BYTES)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise DataLoss(f"store index {self.path}: {exc}") from exc
        return decode_index(data, error=DataLoss, what=f"store index {self.path}")

    def write(self, entries: Sequence[Mapping[str, Any]]) -> None:
        """Rewrite index.json (call under the exclusive store lock)."""
        self.replace_file(self.path, encode_index(entries))

    def ids(self) -> list[str]:
        """The ids of every published checkpoint, in index order."""
        return checkpoint_ids(self.read())

    def publish(self, manifest_digest: str, manifest_size: int, annotations: Mapping[str, str],
                required: Mapping[str, int], *, provenance: str) -> dict[str, Any]:
        """Add a manifest's record once every blob in ``required`` (digest: size) is present: the commit point.

        The record repeats the manifest's ``annotations`` and adds the
        store's own: received now, with ``provenance``. Publishing a manifest
        that is listed already changes nothing. Returns the record listed.
        """
        notes = {**without_store_annotations(annotations), **receipt_annotations(now_rfc3339(), provenance)}
        entry = index_entry(manifest_digest, manifest_size, notes)
        with self.locked(exclusive=True):
            for digest, size in required.items():
                found = self.blobs.size_of(digest)
                if found != size:
                    raise DataLoss(
                        f"checkpoint {manifest_digest}: blob {digest} "
                        f"{'vanished' if found is None else 'changed size'} before publish"
                    )
            entries = self.read()
            for listed in entries:
                if listed["digest"] == manifest_digest:
                    return listed
            entries.append(entry)
            self.write(entries)
        return entry

    def entry(self, cid: str, entries: Sequence[Mapping[str, Any]] | None = None) -> Mapping[str, Any] | None:
        """The index record of the checkpoint ``cid`` (in ``entries``, else in index.json), or None."""
        for found in self.read() if entries is None else entries:
            if found["digest"] == cid and is_checkpoint_entry(found):
                return found
        return None

    def resolve(self, checkpoint_id: str, within: Callable[[CheckpointRecord], bool] | None = None) -> str:
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
        entries = self.read()
        matches = sorted({d for d in checkpoint_ids(entries) if d[len("sha256:") :].startswith(text)})
        if within is not None:
            matches = [d for d in matches if self._accepts(d, within, entries)]
        if not matches:
            if len(text) == 64:
                raise NotFound(f"checkpoint sha256:{text} not found")
            raise NotFound(f"no checkpoint matches {checkpoint_id!r}")
        if len(matches) > 1:
            shown = ", ".join(d[len("sha256:") :][:12] for d in matches[:5])
            raise InvalidArgument(f"checkpoint id {checkpoint_id!r} is ambiguous ({len(matches)} matches: {shown})")
        return matches[0]

    def _accepts(self, cid: str, within: Callable[[CheckpointRecord], bool],
                 entries: Sequence[Mapping[str, Any]]) -> bool:
        try:
            return within(self.load(cid, self.entry(cid, entries)))
        except AgentError:
            return False

    # -- loading checkpoints -----------------------------------------------------------------

    def documents(self, cid: str) -> tuple[bytes, CheckpointManifest, CheckpointConfig | None]:
        """Read and validate a checkpoint's manifest and config blobs (published or not); DataLoss if they fail.

        The config of a sealed checkpoint is opened with its key; it is None
        when no key source has that key (the manifest alone is checked then).
        Documents validated before are used again while their files are the
        same (`Kept`).
        """
        path = self.blobs.path(cid)
        kept = self.kept.get(cid, self._has_key)
        if kept is not None:
            return kept.data, kept.manifest, _own(kept.config)
        # Which files are read is taken first: one replaced in between is read again next time.
        manifest_file = file_identity(path)
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
        config_path = self.blobs.path(desc.digest)
        config_file = file_identity(config_path)
        try:
            config_bytes = self.blobs.read(desc.digest, desc.size)
        except DataLoss as exc:
            raise DataLoss(f"checkpoint {cid}: config {exc}") from exc
        what = f"checkpoint {cid}: config blob {desc.digest}"
        sealed_key = ""
        if desc.media_type == CONFIG_SEALED_MEDIA_TYPE:
            try:
                sealed_key = sealing.key_id_of(config_bytes, sealing.CONFIG)
                opened = self.chunks.open_config(config_bytes, manifest.key_id)
            except sealing.SealError as exc:
                raise DataLoss(f"{what}: {exc}") from None
            if opened is None:
                return data, manifest, None
            config_bytes = opened
        config = decode_config(config_bytes, error=DataLoss, what=what)
        check_manifest_matches(manifest, config, error=DataLoss, what=f"checkpoint {cid}: manifest {path}")
        if manifest_file is not None and config_file is not None:
            self.kept.put(cid, _Documents(data, manifest, _own(config),
                                          ((path, manifest_file), (config_path, config_file)), sealed_key))
        return data, manifest, config

    def _has_key(self, key_id: str) -> bool:
        keys = self.chunks.keys
        return keys is not None and keys.key(key_id) is not None

    def load(self, cid: str, entry: Mapping[str, Any] | None = None) -> CheckpointRecord:
        """The record of the checkpoint whose full id is ``cid``, loaded and validated.

        ``entry`` is its index record when the caller has read it already
        (else it is looked up; an unpublished checkpoint has none).
        """
        _, manifest, config = self.documents(cid)
        return self.record(cid, manifest, config, entry if entry is not None else self.entry(cid))

    def record(
        self, manifest_digest: str, manifest: CheckpointManifest, config: CheckpointConfig | None,
        entry: Mapping[str, Any] | None = None,
    ) -> CheckpointRecord:
        """The record of validated documents (a writer's or an importer's, or ones just loaded).

        Without a config (a sealed checkpoint whose key is not configured) the
        record is ``locked``: only the manifest's clear annotations and sizes.
        ``entry`` (its index record, if published) says when and how the
        store got it (``records.receipt``).
        """
        metadata = dict(config.metadata) if config is not None else {}
        hook = self.lazily_pulled
        received, provenance = receipt(entry, manifest.annotations, manifest.created, metadata,
                                       lazily_pulled=lambda: hook is not None and hook(manifest_digest))
        return CheckpointRecord(
            id=manifest_digest,
            created=manifest.created,
            metadata=MappingProxyType(metadata),
            files=config.files if config is not None else (),
            size=sum(e.size for e in config.files) if config is not None else -1,
            stored_size=sum(layer.size for layer in manifest.layers if layer != EMPTY_DESCRIPTOR),
            manifest_path=self.blobs.path(manifest_digest),
            annotations=manifest.annotations,
            key_id=manifest.key_id,
            locked=config is None,
            received=received,
            provenance=provenance,
        )

    # -- quarantine and rebuilding (exclusive lock held) -------------------------------------

    def quarantine_index(self, reason: str) -> None:
        """Move an unreadable index.json aside into the quarantine."""
        self._quarantine(INDEX_NAME, None, reason)

    def quarantine_entry(self, entry: Mapping[str, Any], reason: str) -> None:
        """Keep an unloadable checkpoint's index record and manifest bytes under ``quarantine/``.

        Their blobs stay reachable from there (see ``gc``).
        """
        parts = [json.dumps(dict(entry), sort_keys=True).encode()]
        with contextlib.suppress(OSError, ValueError, InvalidArgument):
            parts.append(read_bounded(self.blobs.path(entry["digest"]), MAX_MANIFEST_BYTES))
        self._quarantine(digest_hex(entry["digest"]) + ".json", b"\n".join(parts) + b"\n", reason)

    def _quarantine(self, name: str, data: bytes | None, reason: str) -> None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        target = os.path.join(self.quarantine_dir, f"{name}.{stamp}.{secrets.token_hex(4)}")
        if data is None:
            os.rename(self.path, target)
        else:
            write_new_file(target, data, sync=True)
        fsync_dir(self.quarantine_dir)
        log.error("quarantined %s as %s: %s", name, target, reason)

    def rebuild(self) -> list[dict[str, Any]]:
        """Index records for every loadable checkpoint manifest among the blobs, oldest first.

        When and how each came is lost with the index: the records have no
        store annotations, so ``records.receipt``'s rule for old records
        applies to them.
        """
        found: list[tuple[float, str, dict[str, Any]]] = []
        for digest, entry in self.blobs.digests():
            try:
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
                    continue
                with open(entry.path, "rb") as fh:
                    if fh.read(1) != b"{":
                        continue
                data, manifest, _ = self.documents(digest)
            except (OSError, AgentError):
                continue
            notes = without_store_annotations(manifest.annotations)
            found.append((created_epoch(manifest.created), digest, index_entry(digest, len(data), notes)))
        found.sort(key=lambda item: (item[0], item[1]))
        return [item[2] for item in found]
