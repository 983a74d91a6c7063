"""Which chunks a lazy pull may leave in the registry: those only the memory images use.

The memory of a checkpoint (CRIU's ``pages-<id>.img`` files) is most of its
bytes and is what a lazy restore reads on demand; everything else (process
state, file tables, the writable-layer diff) is needed before a restore
starts, so a lazy pull brings it in at once.
"""

from __future__ import annotations

from node_agent.errors import DataLoss
from node_agent.podformat import PAGES_PATH
from node_agent.store import Store
from node_agent.store import sealing
from node_agent.store.documents import decode_config


def memory_chunks(store: Store, config_digest: str, config_size: int) -> set[str]:
    """Digests of the chunks that only memory images use, from the checkpoint config in ``store``.

    An encrypted checkpoint's config is opened with its key; without the key
    nothing is left behind (the pull is whole, and opens once the key is here).
    """
    data = store.blobs.read(config_digest, config_size)
    if sealing.is_sealed(data):
        try:
            opened = store.chunks.open_config(data)
        except sealing.SealError as exc:
            raise DataLoss(f"config {config_digest}: {exc}") from None
        if opened is None:
            return set()
        data = opened
    config = decode_config(data, what=f"config {config_digest}")
    memory: set[str] = set()
    other: set[str] = set()
    for entry in config.files:
        target = memory if PAGES_PATH.match(entry.path) else other
        target.update(c.digest for c in entry.chunks)
    return memory - other
