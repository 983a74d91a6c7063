"""Which chunks a pull may leave in the registry, to be fetched when a reader needs them.

The memory of a checkpoint (CRIU's ``pages-<id>.img`` files) is most of its
bytes and is what a lazy restore reads on demand; everything else (process
state, file tables, the writable-layer diff) is needed before a restore
starts, so a lazy pull (`memory_chunks`) brings it in at once. A restore
through a Pod needs even less before its sandbox exists: the saved configs
it is admitted by and the CPU features it is checked against
(`beyond_sandbox`); each container's files come when the kubelet creates it.
"""

from __future__ import annotations

from collections.abc import Callable

from node_agent.errors import DataLoss
from node_agent.podformat import PAGES_PATH, SANDBOX_PATH
from node_agent.store import Store
from node_agent.store import sealing
from node_agent.store.documents import decode_config


def memory_chunks(store: Store, config_digest: str, config_size: int) -> set[str]:
    """Digests of the chunks that only memory images use, from the checkpoint config in ``store``."""
    return _only_in(store, config_digest, config_size, lambda path: PAGES_PATH.match(path) is not None)


def beyond_sandbox(store: Store, config_digest: str, config_size: int) -> set[str]:
    """Digests of the chunks no file needed before a Pod's sandbox is made uses (`podformat.SANDBOX_PATH`)."""
    return _only_in(store, config_digest, config_size, lambda path: SANDBOX_PATH.match(path) is None)


def _only_in(store: Store, config_digest: str, config_size: int, deferrable: Callable[[str], bool]) -> set[str]:
    """Digests of the chunks that only files ``deferrable`` names use.

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
    later: set[str] = set()
    now: set[str] = set()
    for entry in config.files:
        (later if deferrable(entry.path) else now).update(c.digest for c in entry.chunks)
    return later - now
