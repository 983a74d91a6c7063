"""Which chunks a lazy pull may leave in the registry: those only the memory images use.

The memory of a checkpoint (CRIU's ``pages-<id>.img`` files) is most of its
bytes and is what a lazy restore reads on demand; everything else (process
state, file tables, the writable-layer diff) is needed before a restore
starts, so a lazy pull brings it in at once.
"""

from __future__ import annotations

from node_agent.podformat import PAGES_PATH
from node_agent.store import Store
from node_agent.store.manifest import decode_config


def memory_chunks(store: Store, config_digest: str, config_size: int) -> set[str]:
    """Digests of the chunks that only memory images use, from the checkpoint config in ``store``."""
    config = decode_config(store.blobs.read(config_digest, config_size), what=f"config {config_digest}")
    memory: set[str] = set()
    other: set[str] = set()
    for entry in config.files:
        target = memory if PAGES_PATH.match(entry.path) else other
        target.update(c.digest for c in entry.chunks)
    return memory - other
