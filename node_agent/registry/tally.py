"""Counting a transfer's blobs and bytes, and telling the progress callback."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence

from node_agent.errors import InvalidArgument
from node_agent.registry.ports import Progress, ProgressCallback


class Tally:
    """Blobs and bytes moved or skipped so far; every change is reported to ``callback``.

    Several blobs may be in flight at once, from several threads: each has its own ``BlobCount``
    (``blob``), and the callback is called under one lock, so its reports come one at a time.
    """

    def __init__(self, callback: ProgressCallback | None) -> None:
        self._callback = callback
        self._lock = threading.RLock()
        self.phase = "manifest"
        self.blobs_total = 0
        self.bytes_total = 0
        self.moved = 0
        self.skipped = 0
        self.bytes_moved = 0
        self.bytes_skipped = 0
        self._in_flight = 0  # bytes of the blobs in flight

    def plan(self, sizes: Sequence[int]) -> None:
        self.blobs_total = len(sizes)
        self.bytes_total = sum(sizes)

    def report(self, phase: str | None = None) -> None:
        with self._lock:
            if phase is not None:
                self.phase = phase
            if self._callback is not None:
                self._callback(
                    Progress(
                        phase=self.phase,
                        blobs_done=self.moved + self.skipped,
                        blobs_total=self.blobs_total,
                        bytes_done=self.bytes_moved + self.bytes_skipped + self._in_flight,
                        bytes_total=self.bytes_total,
                        skipped=self.skipped,
                    )
                )

    def skip(self, size: int) -> None:
        with self._lock:
            self.skipped += 1
            self.bytes_skipped += size
            self.report()

    def blob(self) -> BlobCount:
        """The count of one blob in flight."""
        return BlobCount(self)

    def _move(self, in_flight: int, arrived: int | None = None) -> None:
        """``in_flight`` more bytes in flight (fewer when negative); with ``arrived``, one more blob of that size done."""
        with self._lock:
            self._in_flight += in_flight
            if arrived is not None:
                self.moved += 1
                self.bytes_moved += arrived
            self.report()


class BlobCount:
    """One blob's bytes as they move; ``restart`` when it starts again, ``done`` once it has arrived."""

    def __init__(self, tally: Tally) -> None:
        self._tally = tally
        self.bytes = 0

    def restart(self) -> None:
        """The blob starts again from its first byte."""
        if self.bytes:
            self._tally._move(-self.bytes)
            self.bytes = 0

    def counted(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """Pass ``chunks`` through, reporting each one after it was consumed."""
        for chunk in chunks:
            yield chunk
            self.add(len(chunk))

    def add(self, moved: int) -> None:
        """``moved`` more bytes of the blob have arrived (or gone)."""
        self.bytes += moved
        self._tally._move(moved)

    def done(self) -> None:
        arrived, self.bytes = self.bytes, 0
        self._tally._move(-arrived, arrived)


def unique_blobs(blobs: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """``(digest, size)`` pairs in first-seen order, each digest once; a digest with two sizes is refused."""
    seen: dict[str, int] = {}
    for digest, size in blobs:
        if seen.setdefault(digest, size) != size:
            raise InvalidArgument(f"blob {digest} is listed with two sizes ({seen[digest]} and {size})")
    return list(seen.items())
