"""A restored task's pages file, read from the checkpoint's chunks by offset, verified, in whole pages.

Each chunk is read from the store (or fetched from the checkpoint's origin),
checked against its sha256 and decoded when first needed, kept in a small
LRU (bounded in chunks and in bytes: `CACHE_BYTES`), and the next chunks of
the file are read ahead in threads. Chunks are
cut by content, so their edges fall anywhere; `pieces` hands out whole
pages: runs of pages inside one chunk as views of it, and a page that
straddles two chunks as its own assembled copy.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Final

from node_agent.errors import AgentError
from node_agent.store.chunk_reader import ChunkReader
from node_agent.store.documents import ChunkFetch, FileEntry
from node_agent.store.reading import read_or_fetch

PAGE_SIZE: Final = 4096
CACHE_CHUNKS: Final = 32
CACHE_BYTES: Final = 64 << 20
"""What one file's cache holds at most, about (never fewer chunks than it reads ahead, and two more)."""
READ_AHEAD: Final = 6


class SourceError(Exception):
    """Serving the pages cannot go on."""


class ChunkCache:
    """Verified, decoded chunks of one file: a small LRU plus read-ahead in threads."""

    def __init__(
        self, chunks: ChunkReader, checkpoint_id: str, entry: FileEntry, pool: ThreadPoolExecutor,
        fetch: ChunkFetch | None = None, read_ahead: int = READ_AHEAD,
    ) -> None:
        self.read_ahead = max(READ_AHEAD, read_ahead)
        average = max(1, entry.size // max(1, len(entry.chunks)))
        self.keep = max(self.read_ahead + 2, min(max(CACHE_CHUNKS, 2 * self.read_ahead), CACHE_BYTES // average))
        self.chunks = chunks
        self.fetch = fetch
        self.checkpoint_id = checkpoint_id
        self.entry = entry
        self.offsets = [c.offset for c in entry.chunks]
        self.pool = pool
        self.lock = threading.Lock()
        self.cache: OrderedDict[int, Future[bytes]] = OrderedDict()

    def _load(self, index: int) -> bytes:
        chunk = self.entry.chunks[index]
        try:
            data = read_or_fetch(self.chunks, chunk, self.fetch)
        except AgentError as exc:
            raise SourceError(
                f"checkpoint {self.checkpoint_id}: {self.entry.path} at offset {chunk.offset}: {exc}"
            ) from exc
        if len(data) != chunk.size:
            raise SourceError(f"{self.entry.path}: chunk at {chunk.offset} decoded to {len(data)} bytes, "
                              f"not {chunk.size}")
        return data

    def _future(self, index: int) -> Future[bytes]:
        with self.lock:
            fut = self.cache.get(index)
            if fut is None or fut.cancelled():
                fut = self.pool.submit(self._load, index)
                self.cache[index] = fut
                while len(self.cache) > self.keep:
                    self.cache.popitem(last=False)
            else:
                self.cache.move_to_end(index)
            return fut

    def chunk(self, index: int, ahead: bool = True) -> bytes:
        """Chunk ``index``, verified and decoded; ``ahead``: start reading the next ones too."""
        while True:
            fut = self._future(index)
            if fut.cancel():
                # Still queued behind reads ahead (slow fetches from an origin,
                # say): a page someone waits for is read here and now.
                own: Future[bytes] = Future()
                own.set_running_or_notify_cancel()
                with self.lock:
                    self.cache[index] = own
                try:
                    own.set_result(self._load(index))
                except BaseException as exc:
                    own.set_exception(exc)
                fut = own
            try:
                data = fut.result()
                break
            except CancelledError:
                continue  # another reader took it over: wait for that one
        if ahead:
            for later in range(index + 1, min(index + 1 + self.read_ahead, len(self.entry.chunks))):
                self._future(later)
        return data

    def release(self) -> None:
        """Let go of the chunks held (their reader is done); a later read reads them again."""
        with self.lock:
            self.cache.clear()

    def warm(self, offset: int) -> None:
        """Start reading the chunks from ``offset`` on (before anyone asks for them)."""
        if 0 <= offset < self.entry.size:
            index = bisect.bisect_right(self.offsets, offset) - 1
            for ahead in range(index, min(index + self.read_ahead, len(self.entry.chunks))):
                self._future(ahead)

    def bounds(self, offset: int, size: int) -> tuple[int, int]:
        """Whole chunks from the one holding ``offset``, at least one, until they hold ``size`` bytes: their
        range in the file, widened to whole pages (a page that straddles two chunks is in both ranges)."""
        self._check(offset, 0)
        index = bisect.bisect_right(self.offsets, offset) - 1
        lo = self.offsets[index]
        last = index
        while last + 1 < len(self.offsets) and self.offsets[last + 1] - lo < size:
            last += 1
        c = self.entry.chunks[last]
        hi = c.offset + c.size
        return lo - lo % PAGE_SIZE, min(self.entry.size, hi + (-hi) % PAGE_SIZE)

    def _check(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.entry.size:
            raise SourceError(f"{self.entry.path}: range {offset}+{size} is outside the file ({self.entry.size} bytes)")

    def read(self, offset: int, size: int, ahead: bool = True) -> list[memoryview]:
        """``size`` bytes at ``offset``, as views into the cached chunks."""
        self._check(offset, size)
        parts: list[memoryview] = []
        pos, end = offset, offset + size
        while pos < end:
            index = bisect.bisect_right(self.offsets, pos) - 1
            c = self.entry.chunks[index]
            data = self.chunk(index, ahead)
            stop = min(c.size, end - c.offset)
            parts.append(memoryview(data)[pos - c.offset : stop])
            pos = c.offset + stop
        return parts

    def pieces(self, offset: int, size: int, ahead: bool = True) -> Iterator[tuple[bytes, int, int]]:
        """(data, start in data, length) covering ``size`` bytes at page-aligned ``offset``, in whole pages.

        ``ahead``: read the following chunks ahead (a sequential reader); a
        read at a scattered place reads only what it needs, so that it
        neither wastes the workers nor pushes the stream's chunks out of the
        cache.
        """
        if offset % PAGE_SIZE or size % PAGE_SIZE:
            raise SourceError(f"{self.entry.path}: range {offset}+{size} is not in whole pages")
        self._check(offset, size)
        pos, end = offset, offset + size
        while pos < end:
            index = bisect.bisect_right(self.offsets, pos) - 1
            c = self.entry.chunks[index]
            inside = min(end, c.offset + c.size) - pos
            inside -= inside % PAGE_SIZE
            if inside > 0:
                yield self.chunk(index, ahead), pos - c.offset, inside
                pos += inside
            else:  # the page at pos runs on into the next chunk
                yield b"".join(self.read(pos, PAGE_SIZE, ahead)), 0, PAGE_SIZE
                pos += PAGE_SIZE
