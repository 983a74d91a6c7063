"""The ingest pipeline: read in segments, cut, then compress, hash and write on every core.

Rule: memory stays flat whatever the file size. One reader (the caller's
thread) reads each file in large segments into buffers drawn from a fixed
budget, cuts them into content-defined chunks and hands each chunk to a
thread pool; a worker encodes the chunk, hashes the stored bytes and writes
them to the ingest directory unless the blob already exists. A segment's
buffer goes back to the budget only when its last chunk is done, so the
reader waits when the workers fall behind. zstd, hashlib and file writes
release the GIL, so the workers run in parallel. New blob files are fsynced
early by two flush threads, so the commit's durability barrier finds little
left to write.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final, Protocol

from node_agent.offload import Offload
from node_agent.store import codec, sealing
from node_agent.store.ingest import Ingest
from node_agent.store.chunking import Chunker
from node_agent.store.documents import SEALED_ENCODINGS

SEGMENT_SIZE: Final = 8 << 20
_FLUSHERS: Final = 2


@dataclass(frozen=True)
class StoredChunk:
    """What a worker made of one chunk."""

    digest: str
    stored_size: int
    encoding: str
    new: bool
    plain: str = ""


@dataclass(frozen=True)
class PendingChunk:
    """A chunk handed to the pool: its place in the file and the worker's future."""

    offset: int
    size: int
    future: Future[StoredChunk]


class _Budget:
    """Buffers for segments, bounded in total bytes; big buffers are reused.

    Reusing big buffers keeps the kernel from zero-filling fresh pages for
    every segment.
    """

    def __init__(self, big: int, limit: int) -> None:
        self.big = big
        self._limit = max(limit, big)
        self._used = 0
        self._free: list[bytearray] = []
        self._cond = threading.Condition()

    def take(self, n: int) -> bytearray:
        cap = self.big if n > self.big // 4 else n
        with self._cond:
            while self._used and self._used + cap > self._limit:
                self._cond.wait()
            self._used += cap
            if cap == self.big and self._free:
                return self._free.pop()
        return bytearray(cap)

    def give(self, buf: bytearray) -> None:
        with self._cond:
            self._used -= len(buf)
            if len(buf) == self.big and len(self._free) * self.big < self._limit:
                self._free.append(buf)
            self._cond.notify_all()

    def drop(self) -> None:
        with self._cond:
            self._free.clear()


class _Segment:
    """A buffer shared by the reader and the chunks cut from it; returned when the last lets go."""

    def __init__(self, budget: _Budget | None, buf: bytearray | bytes | memoryview) -> None:
        self._budget = budget
        self.buf = buf
        self._refs = 1
        self._lock = threading.Lock()

    def retain(self) -> None:
        with self._lock:
            self._refs += 1

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last and self._budget is not None:
            buf, self.buf = self.buf, b""
            assert isinstance(buf, bytearray)
            self._budget.give(buf)


class Readable(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


def fill(src: int | Readable, buf: memoryview) -> int:
    """Read into ``buf`` from a file descriptor or a reader until it is full or the source ends; return the count."""
    got = 0
    while got < len(buf):
        n = os.readv(src, [buf[got:]]) if isinstance(src, int) else src.readinto(buf[got:]) or 0
        if n == 0:
            break
        got += n
    return got


class ChunkPipeline:
    """Turns file contents into stored chunks for one writer, on ``workers`` threads."""

    def __init__(self, chunker: Chunker, ingest: Ingest, workers: int, seal: sealing.SealKey | None = None) -> None:
        self._chunker = chunker
        self._seal = seal
        self._local = threading.local()
        self._ingest = ingest
        self._workers = max(1, workers)
        segment = max(SEGMENT_SIZE, chunker.max_size)
        # A round reads up to a segment past what the last one left uncut (less than a chunk), and at least
        # half a segment: its buffer holds at least one longest chunk, and at most a segment and a half.
        big = segment + segment // 2
        self._segment = segment
        self._budget = _Budget(big, big * min(6, max(3, 2 + self._workers // 4)))
        self._executor: ThreadPoolExecutor | None = None
        self._flusher = Offload(_FLUSHERS, "store-flush")
        self._lock = threading.Lock()
        self._failed: BaseException | None = None
        self.bytes_done = 0
        self.bytes_written = 0

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The pool (started on first use)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="store-chunk")
        return self._executor

    def _flush(self, digest: str) -> None:
        """Start writing a new blob back to disk now, so the commit's fsync finds little to do."""
        self._flusher.submit(functools.partial(self._ingest.flush, digest))

    def wait_flushed(self) -> None:
        """Wait for the early fsyncs; raise the first failure."""
        self._flusher.wait()

    def add_fd(
        self, fd: int | Readable, size_hint: int, on_segment: Callable[[], None] | None = None
    ) -> list[PendingChunk]:
        """Read ``fd`` (a descriptor or a reader) to its end and queue its chunks; ``size_hint`` sizes the reads.

        OSError from reading propagates; a worker's failure is raised here
        as soon as the reader notices it, and by the chunk's future.
        """
        out: list[PendingChunk] = []
        # The last round's segment, held until what its chunker left uncut (at most one chunk) is copied to
        # the front of the next round's buffer.
        held: tuple[_Segment, memoryview, int, int] | None = None
        pos = 0
        left = max(0, size_hint)
        first = True
        try:
            while True:
                self.raise_failure()
                carried = held[3] - held[2] if held is not None else 0
                # Read one byte past the expected end, to see the end in the same round.
                room = max(self._segment - carried, self._segment // 2)
                room = min(room, left + 1) if left or first else room
                first = False
                buf = self._budget.take(carried + room)
                seg = _Segment(self._budget, buf)
                try:
                    view = memoryview(buf)[: carried + room]
                    if held is not None:
                        old, old_view, start, end = held
                        held = None
                        view[:carried] = old_view[start:end]
                        old_view.release()
                        old.release()
                    n = fill(fd, view[carried:])
                    filled = carried + n
                    eof = n < room
                    left = max(0, left - n)
                    cuts, consumed = self._chunker.cut(view[:filled], final=eof)
                    for start, length in cuts:
                        out.append(PendingChunk(pos + start, length, self._submit(seg, start, length)))
                    pos += consumed
                    if consumed < filled:
                        seg.retain()
                        held = (seg, view, consumed, filled)
                    else:
                        view.release()
                    del view
                finally:
                    seg.release()
                if on_segment is not None:
                    on_segment()
                if eof:
                    return out
        finally:
            if held is not None:
                held[1].release()
                held[0].release()

    def add_buffer(self, data: bytes | bytearray | memoryview) -> list[PendingChunk]:
        """Queue the chunks of an in-memory buffer (the caller keeps it alive and unchanged)."""
        view = memoryview(data).cast("B")
        seg = _Segment(None, view)
        try:
            cuts, _ = self._chunker.cut(view, final=True)
            return [PendingChunk(start, length, self._submit(seg, start, length)) for start, length in cuts]
        finally:
            seg.release()

    def _submit(self, seg: _Segment, start: int, length: int) -> Future[StoredChunk]:
        seg.retain()
        try:
            return self.executor.submit(self._store, seg, start, length)
        except BaseException:
            seg.release()
            raise

    def _store(self, seg: _Segment, start: int, length: int) -> StoredChunk:
        try:
            view = memoryview(seg.buf)[start : start + length]
            stored, encoding = codec.encode(view)
            plain = ""
            if self._seal is not None:
                raw = sealing.plain_digest(view)
                # The seal's key derives from the digest of the bytes it encrypts. For a chunk
                # stored as it is (codec returns the very view) that is the plaintext's, in hand.
                known = raw if stored is view else None
                stored = self._seal.seal_into(
                    sealing.CHUNK, stored, raw, self._sealed_buffer(len(stored)), data_digest=known
                )
                encoding, plain = SEALED_ENCODINGS[encoding], "sha256:" + raw.hex()
            digest = "sha256:" + hashlib.sha256(stored).hexdigest()
            new = self._ingest.put(digest, stored)
            if new:
                self._flush(digest)
            result = StoredChunk(digest=digest, stored_size=len(stored), encoding=encoding, new=new, plain=plain)
            del view, stored
        except BaseException as exc:
            with self._lock:
                if self._failed is None:
                    self._failed = exc
            raise
        finally:
            seg.release()
        with self._lock:
            self.bytes_done += length
            if new:
                self.bytes_written += result.stored_size
        return result

    def _sealed_buffer(self, n: int) -> bytearray:
        """This worker thread's buffer for sealed chunks, reused (fresh pages for every chunk cost kernel time)."""
        assert self._seal is not None
        extra = sealing.overhead(self._seal.key_id)
        buf: bytearray | None = getattr(self._local, "sealed", None)
        if buf is None or len(buf) < n + extra:
            buf = self._local.sealed = bytearray(max(n, self._chunker.max_size) + extra)
        return buf

    def raise_failure(self) -> None:
        """Raise the first worker failure, if any."""
        if self._failed is not None:
            raise self._failed

    def close(self, *, cancel: bool = False) -> None:
        """Wait for (or cancel) queued work and stop the pool. Idempotent."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=cancel)
            self._executor = None
        self._flusher.close(cancel=cancel)
        self._budget.drop()
