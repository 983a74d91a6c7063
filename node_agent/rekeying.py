"""Re-encryption of a stored checkpoint under its namespace's newest key (`checkpoints rekey`).

Rule: a rekey reads and writes the store only; no pod is involved. A copy
that differs from its source is signed by the node only when the source is
vouched for (`signing.sign_copy`), never laundered.
"""

from __future__ import annotations

import logging

from node_agent import errors, podformat, signing
from node_agent.config.schema import Settings
from node_agent.keys import Keys
from node_agent.store import CheckpointRecord, Store
from node_agent.store.sealing import SealKey

log = logging.getLogger(__name__)


class Rekeyer:
    def __init__(self, settings: Settings, store: Store, keys: Keys | None = None) -> None:
        self.settings = settings
        self.store = store
        # Where each namespace's encryption key comes from (None: checkpoints stay in the clear).
        self.keys = keys

    def seal_key(self, namespace: str) -> SealKey | None:
        """The key the namespace's checkpoints are sealed under (None: not encrypted)."""
        return self.keys.seal_key(namespace) if self.keys is not None else None

    def rekey(self, record: CheckpointRecord) -> tuple[CheckpointRecord, signing.CopySignature]:
        """A copy of ``record`` sealed under its namespace's newest key (or in the clear if its domain has none).

        Synchronous (a worker thread). Unchanged when it is sealed under that
        key already: the copy is the same bytes, so the same id. A new copy
        is signed by the node only if ``record`` carries a signature trusted
        for its namespace or by the node's key (``signing.sign_copy``, which
        says why not).
        """
        record.require_open()
        pod = record.metadata.get("pod")
        namespace = str(pod.get("namespace", "")) if isinstance(pod, dict) else ""
        namespace = namespace or record.annotations.get(podformat.POD_ANNOTATION, "").partition("/")[0]
        if not namespace:
            raise errors.FailedPrecondition(f"checkpoint {record.id} names no namespace: its key domain is unknown")
        new = self.store.copy(record, seal=self.seal_key(namespace))
        signed = signing.CopySignature()
        if new.id != record.id:  # a new checkpoint: signed if its source is vouched for, never laundered
            signed = signing.sign_copy(self.settings.signing.key_file, self.store, record, new.id, self.settings,
                                       namespace)
        log.info("checkpoint %s re-encrypted as %s (key %s -> %s)", record.id, new.id, record.key_id or "none",
                 new.key_id or "none", extra={"checkpoint": new.id})
        return new, signed
