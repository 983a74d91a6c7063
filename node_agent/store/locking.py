"""The store-wide lock: an flock shared by writers' short steps, exclusive to publish or collect.

Rule: every change to the index and every deletion of blobs happens under the
exclusive lock; a writer names the digests it relies on under the shared
lock, so the holder of the exclusive lock sees a consistent set.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from node_agent.store.files import FILE_MODE, O_CLOEXEC, O_NOFOLLOW


@contextlib.contextmanager
def store_lock(lock_path: str, *, exclusive: bool) -> Iterator[None]:
    """Hold the store-wide flock (shared for writers, exclusive for publish/GC).

    Each acquisition opens its own file description, so threads of one
    process exclude each other exactly as separate processes do.
    """
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | O_NOFOLLOW | O_CLOEXEC, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)
