"""The bound on what one pull brings into the store: ``registry.max-pull-bytes`` and ``min-free-bytes``.

Rule: a pull is refused before a byte of it is written unless the blobs it
brings now (from the manifest's descriptors) total at most
``max-pull-bytes`` and the ones the store lacks fit in the free space of
the store's filesystem with ``min-free-bytes`` left over. Then every byte is
counted as it arrives, before it is written: the bytes written may never
pass ``max-pull-bytes``, and the free space is read again before more than
``CHECK_EVERY`` bytes have been written since the last look, so that what
is still to come, and whatever else fills the disk meanwhile, still leaves
``min-free-bytes`` free. (A registry cannot send more than a descriptor
says: the transport and the store's import refuse a blob that is longer or
does not match its digest.) A refusal is ResourceExhausted naming the
reference, the sizes and the setting.
"""

from __future__ import annotations

import threading

from collections.abc import Sequence
from typing import Final, Protocol

from node_agent.errors import ResourceExhausted

CHECK_EVERY: Final = 64 << 20
"""Most bytes written between two looks at the free space."""


class Space(Protocol):
    """The store, as the bound sees it."""

    @property
    def root(self) -> str: ...

    def has_blob(self, digest: str) -> bool: ...

    def free_bytes(self) -> int: ...


class PullBudget:
    """What one pull may still bring in; ``plan`` before its blobs, ``charge`` for each piece received.

    ``charge`` and ``refund`` may be called from several threads at once (blobs fetched in parallel).
    """

    def __init__(self, store: Space, reference: str, *, max_bytes: int, min_free: int) -> None:
        self._store = store
        self._reference = reference
        self._max = max_bytes
        self._min_free = min_free
        self.planned = 0  # bytes of the blobs the pull brings (present or not)
        self._count = 0  # and how many they are
        self.missing = 0  # of those, the bytes the store lacked when planned
        self.written = 0  # bytes received so far
        self._credit = 0  # bytes that may come before the free space is read again
        self._lock = threading.Lock()

    def plan(self, blobs: Sequence[tuple[str, int]], what: str) -> None:
        """Add ``blobs`` ((digest, size) pairs, each once) to what the pull brings; ResourceExhausted if over a bound.

        ``what`` says what they are in a message ("the checkpoint", "what
        a lazy pull brings now").
        """
        planned = self.planned + sum(size for _, size in blobs)
        count = self._count + len(blobs)
        self.bound(planned, count, what)
        self.planned, self._count = planned, count
        self.missing += sum(size for digest, size in blobs if not self._store.has_blob(digest))
        self._look(what)

    def bound(self, size: int, count: int, what: str) -> None:
        """ResourceExhausted if ``size`` bytes (``count`` blobs) are more than the pull may bring in all: a lazy
        pull is held to it for the whole checkpoint, what it leaves in the registry included."""
        if size > self._max:
            raise ResourceExhausted(
                f"pull of {self._reference}: {what} is {size} bytes ({count} blobs by its manifest), "
                f"more than registry.max-pull-bytes ({self._max} bytes)"
            )

    def charge(self, n: int) -> None:
        """Count ``n`` more bytes received, before they are written; ResourceExhausted if over a bound."""
        with self._lock:
            if self.written + n > self._max:
                raise ResourceExhausted(
                    f"pull of {self._reference}: more than registry.max-pull-bytes ({self._max} bytes) received"
                )
            self.written += n
            self._credit -= n
            if self._credit < 0:
                self._look("the rest")

    def refund(self, n: int) -> None:
        """Give back ``n`` bytes counted for a blob whose transfer failed (and that is fetched again)."""
        with self._lock:
            self.written -= n
            self._credit += n

    def _look(self, what: str) -> None:
        """Read the free space: what is still to come must leave ``min-free-bytes`` free."""
        free = self._store.free_bytes()
        coming = max(0, self.missing - self.written)
        room = free - coming - self._min_free
        if room < 0:
            raise ResourceExhausted(
                f"pull of {self._reference}: {what} needs {coming} more bytes in the store "
                f"({self.missing} of the {self.planned} it brings are not there yet, {self.written} written), "
                f"but {free} bytes are free under {self._store.root} and min-free-bytes "
                f"({self._min_free} bytes) must stay free"
            )
        self._credit = min(CHECK_EVERY, room)
