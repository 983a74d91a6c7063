"""Counting a transfer's blobs and bytes, and telling the progress callback."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from node_agent.errors import InvalidArgument
from node_agent.registry.ports import Progress, ProgressCallback


class Tally:
    """Blobs and bytes moved or skipped so far; every change is reported to ``callback``."""

    def __init__(self, callback: ProgressCallback | None) -> None:
        self._callback = callback
        self.phase = "manifest"
        self.blobs_total = 0
        self.bytes_total = 0
        self.moved = 0
        self.skipped = 0
        self.bytes_moved = 0
        self.bytes_skipped = 0
        self._blob_bytes = 0  # of the blob in flight

    def plan(self, sizes: Sequence[int]) -> None:
        self.blobs_total = len(sizes)
        self.bytes_total = sum(sizes)

    def report(self, phase: str | None = None) -> None:
        if phase is not None:
            self.phase = phase
        if self._callback is not None:
            self._callback(
                Progress(
                    phase=self.phase,
                    blobs_done=self.moved + self.skipped,
                    blobs_total=self.blobs_total,
                    bytes_done=self.bytes_moved + self.bytes_skipped + self._blob_bytes,
                    bytes_total=self.bytes_total,
                    skipped=self.skipped,
                )
            )

    def skip(self, size: int) -> None:
        self.skipped += 1
        self.bytes_skipped += size
        self.report()

    def restart_blob(self) -> None:
        """The blob in flight starts again from its first byte."""
        self._blob_bytes = 0

    def counted(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """Pass ``chunks`` through, reporting each one after it was consumed."""
        for chunk in chunks:
            yield chunk
            self._blob_bytes += len(chunk)
            self.report()

    def blob_done(self) -> None:
        self.moved += 1
        self.bytes_moved += self._blob_bytes
        self._blob_bytes = 0
        self.report()


def unique_blobs(blobs: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """``(digest, size)`` pairs in first-seen order, each digest once; a digest with two sizes is refused."""
    seen: dict[str, int] = {}
    for digest, size in blobs:
        if seen.setdefault(digest, size) != size:
            raise InvalidArgument(f"blob {digest} is listed with two sizes ({seen[digest]} and {size})")
    return list(seen.items())
