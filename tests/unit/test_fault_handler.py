"""The page source's fault handler against the kernel's real userfaultfd, in a process made to look restored.

`uffd_process.py` maps memory, registers it as CRIU's restore does and
hands the userfaultfd over the same way; the handler fills it from a real
store's chunks. What the process reads is checked against the pages file.
"""

from __future__ import annotations

import hashlib
import os
import random
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from node_agent.lazy import fault_handler
from node_agent.lazy.chunks import SourceError
from node_agent.lazy.fault_handler import Handler
from node_agent.lazy.source import Source, accept_restore
from node_agent.store import Store
from testbed.lazyimages import LAZY, PAGE, UFFD_PROCESS, mm_image, pagemap_image

PAGES = 512
CHILD = UFFD_PROCESS
PAGES_PATH = "containers/c/checkpoint/pages-1.img"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Restored:
    """The process, its expected memory, the store and the handler serving it."""

    proc: subprocess.Popen[str]
    addr: int
    pages: bytes
    store: Store
    checkpoint: str
    images: Path
    sock: str
    handed: list[int] = field(default_factory=list)
    result: list[object] = field(default_factory=list)
    thread: threading.Thread | None = None
    handler: Handler | None = None

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], 20)
        assert ready, f"no answer to {line!r}; the handler: {self.result}"
        answer = self.proc.stdout.readline().strip()
        assert answer, f"the process died on {line!r} (exit {self.proc.poll()})"
        return answer

    def serve(self, source: Source, linger: threading.Event | None = None, command: str = "connect",
              prepared: Callable[[], object] | None = None) -> None:
        """Run the handler on ``source`` in a thread; with ``linger``, it then answers the faults left (zero
        pages) until that is set, as the page source does until the agent lets it go. ``command``: how the
        process hands its memory over (``hand-over``: the restore is not finished yet). ``prepared`` runs once
        the handler has prepared, before the process connects."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.sock)
        listener.listen(1)
        self.handler = Handler(source.maps, source.files, str(self.images), lambda fd, task: self.handed.append(task))
        self.handler.prepare()  # as the page source does, before it waits for the restore
        if prepared is not None:
            prepared()

        def run() -> None:
            conn = None
            try:
                conn = accept_restore(listener, 10)
                assert self.handler is not None
                self.handler.run(conn)
                self.result.append(True)
                if linger is not None:
                    self.handler.serve_until(linger.is_set)
            except SourceError as exc:
                self.result.append(exc)
            finally:
                listener.close()
                if conn is not None:
                    conn.close()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.ask(f"{command} {self.sock}") == "ok"

    def expect(self, first: int, n: int) -> str:
        return sha(self.pages[first * PAGE:(first + n) * PAGE])


Layout = Callable[[int], tuple[list[tuple[int, int, int]], bytes, bytes]]
"""From the process's address: the pagemap's extents, the pages file, and the memory the process must read."""


@contextmanager
def _restored(tmp_path: Path, layout: Layout) -> Iterator[Restored]:
    """The process made to look restored, its checkpoint in a store laid out by ``layout``; killed at the end."""
    proc = subprocess.Popen([sys.executable, str(CHILD), "42", str(PAGES)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    addr = int(proc.stdout.readline(), 16)
    extents, present, memory = layout(addr)
    store = Store(tmp_path / "store", chunk_size=64 << 10)  # chunk edges fall inside pages
    with store.writer() as w:
        w.add_bytes("containers/c/checkpoint/pagemap-42.img", pagemap_image(extents))
        w.add_bytes(PAGES_PATH, present)
        record = w.commit({"kind": "test"})
    images = tmp_path / "images"
    images.mkdir()
    (images / "pagemap-42.img").write_bytes(pagemap_image(extents))
    (images / "mm-42.img").write_bytes(mm_image([(addr, addr + PAGES * PAGE)]))
    r = Restored(proc, addr, memory, store, record.id, images, str(tmp_path / "lazy-pages.socket"))
    try:
        yield r
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        if r.thread is not None:
            r.thread.join(10)
        if r.handler is not None:
            r.handler.close()


@pytest.fixture
def restored(tmp_path: Path) -> Iterator[Restored]:
    pages = random.Random(7).randbytes(PAGES * PAGE)
    with _restored(tmp_path, lambda addr: ([(addr, PAGES, LAZY)], pages, pages)) as r:
        yield r


def test_the_process_reads_its_checkpointed_memory_and_the_rest_streams_in(restored: Restored) -> None:
    r = restored
    source = Source(r.store, r.checkpoint, "c", str(r.images))
    assert source.total == PAGES
    r.serve(source)
    assert r.ask("hash 100 3") == r.expect(100, 3)  # a fault in the middle first
    assert r.ask(f"hash 0 {PAGES}") == r.expect(0, PAGES)
    assert r.thread is not None
    r.thread.join(10)
    assert r.result == [True] and r.handed == [42]
    assert r.handler is not None and r.handler.copied == PAGES * PAGE and r.handler.total_pages == PAGES
    source.close()


def test_the_mappings_are_read_before_the_restore_connects(restored: Restored) -> None:
    """The handler cuts the memory at the process's mappings while it waits: when CRIU hands the memory
    over, nothing is left to read (here the memory map is gone by then) and the pages move at once."""
    r = restored
    source = Source(r.store, r.checkpoint, "c", str(r.images))
    r.serve(source, prepared=(r.images / "mm-42.img").unlink)
    assert r.ask(f"hash 0 {PAGES}") == r.expect(0, PAGES)
    assert r.thread is not None
    r.thread.join(10)
    assert r.result == [True] and r.handed == [42]
    source.close()


def test_a_memory_map_unreadable_while_waiting_is_read_again_and_named(tmp_path: Path) -> None:
    pages = random.Random(7).randbytes(PAGES * PAGE)
    with _restored(tmp_path, lambda addr: ([(addr, PAGES, LAZY)], pages, pages)) as r:
        (r.images / "mm-42.img").unlink()
        source = Source(r.store, r.checkpoint, "c", str(r.images))
        r.serve(source)
        assert r.thread is not None
        r.thread.join(10)
        assert len(r.result) == 1 and isinstance(r.result[0], SourceError) and "mm-42.img" in str(r.result[0])
        source.close()


def test_the_stream_starts_when_the_memory_arrives(restored: Restored, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore sends the process's userfaultfd and is still under way; nothing faults. The streams, idle
    until then, start on it at once (its arrival wakes them: they do not wait to look again, here for ten
    minutes) and every page is in before the restore finishes."""
    monkeypatch.setattr(fault_handler, "IDLE_WAIT", 600.0)
    r = restored
    source = Source(r.store, r.checkpoint, "c", str(r.images))
    r.serve(source, command="hand-over")
    handler = r.handler
    assert handler is not None and r.thread is not None
    with handler.lock:
        assert handler.lock.wait_for(lambda: handler.copied == PAGES * PAGE, 60)
    assert handler.faults == 0 and r.thread.is_alive()  # not over: the restore has not finished
    assert r.ask("finish") == "ok"
    r.thread.join(60)
    assert not r.thread.is_alive() and r.result == [True]
    assert r.ask(f"hash 0 {PAGES}") == r.expect(0, PAGES)
    source.close()


def test_fork_remove_and_mremap_while_pages_are_missing(restored: Restored) -> None:
    """Chunks held back (a lazily pulled checkpoint's origin, slow) while the process forks, drops and moves memory."""
    r = restored
    record = r.store.get(r.checkpoint)
    held = [c for c in record.entry(PAGES_PATH).chunks if c.offset >= 256 * PAGE]
    gate = -(-held[0].offset // PAGE)  # the first page whose bytes are held back
    assert gate + 100 <= PAGES
    away = Path(r.images).parent / "away"
    away.mkdir()
    for c in held:
        os.replace(r.store.blob_path(c.digest), away / c.digest.split(":")[1])
    release = threading.Event()

    def fetcher(_origin: object, chunk: object) -> None:
        release.wait(30)
        for c in held:
            try:
                os.link(away / c.digest.split(":")[1], r.store.blob_path(c.digest))
            except FileExistsError:
                pass  # fetched by another reader meanwhile

    origin: dict[str, object] = {"reference": "registry.test/ckpt@" + r.checkpoint}
    r.store.origins.remember(r.checkpoint, origin)
    r.store.origins.fetcher = fetcher
    source = Source(r.store, r.checkpoint, "c", str(r.images), origin)
    r.serve(source)
    assert r.ask("hash 0 128") == r.expect(0, 128)
    assert r.ask("fork-hash 0 200") == r.expect(0, 200)  # the child gets the memory too
    assert r.ask(f"remove {gate + 20} 10") == "ok"
    moved = r.ask(f"move {gate + 60} 40")
    release.set()
    assert r.ask(f"hash {gate} 20") == r.expect(gate, 20)
    assert r.ask(f"hash-at {moved} 40") == r.expect(gate + 60, 40)
    assert r.ask(f"hash {gate + 20} 10") == sha(bytes(10 * PAGE))  # removed: zeros, as the kernel gives
    assert r.ask(f"hash {gate + 100} {PAGES - gate - 100}") == r.expect(gate + 100, PAGES - gate - 100)
    assert r.thread is not None
    r.thread.join(10)
    assert r.result == [True] and r.handed == [42, 42]  # the parent's userfaultfd and the child's
    source.close()


def test_a_corrupt_chunk_stops_the_transfer_and_names_it(restored: Restored) -> None:
    r = restored
    victim = r.store.get(r.checkpoint).entry(PAGES_PATH).chunks[-1]
    path = r.store.blob_path(victim.digest)
    os.chmod(path, 0o600)
    with open(path, "r+b") as fh:
        fh.write(b"\xff" * 16)
    source = Source(r.store, r.checkpoint, "c", str(r.images))
    r.serve(source)
    assert r.thread is not None
    r.thread.join(10)
    assert len(r.result) == 1 and isinstance(r.result[0], SourceError), r.result
    assert "pages-1.img" in str(r.result[0]) and victim.digest in str(r.result[0])
    source.close()


def test_a_restore_that_ends_before_it_finished_is_an_error(tmp_path: Path) -> None:
    sock = str(tmp_path / "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock)
    listener.listen(1)
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.connect(sock)
    conn = accept_restore(listener, 5)
    peer.close()
    handler = Handler({}, {}, str(tmp_path), lambda fd, task: None)
    try:
        with pytest.raises(SourceError, match="before it finished"):
            handler.run(conn)
    finally:
        handler.close()
        listener.close()
        conn.close()


def test_only_root_may_connect_to_the_lazy_pages_socket() -> None:
    d = tempfile.mkdtemp(prefix="na-unit-peer-")  # not under pytest's own 0700 directory
    os.chmod(d, 0o755)
    sock = os.path.join(d, "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock)
    os.chmod(sock, 0o777)
    listener.listen(2)
    connect = (f"import socket,time; s=socket.socket(socket.AF_UNIX); s.connect({sock!r}); print('in', flush=True); "
               "time.sleep(10)")
    nobody = subprocess.Popen([sys.executable, "-c", connect], user=65534, stdout=subprocess.PIPE, text=True)
    root: subprocess.Popen[str] | None = None
    try:
        assert nobody.stdout is not None and nobody.stdout.readline().strip() == "in"  # queued first
        root = subprocess.Popen([sys.executable, "-c", connect], stdout=subprocess.PIPE, text=True)
        conn = accept_restore(listener, 5)
        pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        assert pid == root.pid
        conn.close()
    finally:
        for p in (nobody, root):
            if p is not None:
                p.kill()
                p.wait()
                if p.stdout is not None:
                    p.stdout.close()
        listener.close()
        shutil.rmtree(d)


def _fragmented(addr: int) -> list[tuple[int, int, int]]:
    """Extents of 8 pages every 16 pages, as a framework's memory is: many mappings, each a few pages."""
    return [(addr + i * 16 * PAGE, 8, LAZY) for i in range(PAGES // 16)]


def test_fragmented_memory_fills_right(tmp_path: Path) -> None:
    """Many extents with holes between them: every present page gets its bytes, every hole zeros."""
    present = random.Random(11).randbytes(PAGES // 2 * PAGE)

    def layout(addr: int) -> tuple[list[tuple[int, int, int]], bytes, bytes]:
        extents = _fragmented(addr)
        memory = b"".join(present[i * 8 * PAGE:(i + 1) * 8 * PAGE] + bytes(8 * PAGE) for i in range(len(extents)))
        return extents, present, memory

    linger = threading.Event()
    with _restored(tmp_path, layout) as r:
        try:
            source = Source(r.store, r.checkpoint, "c", str(r.images))
            r.serve(source, linger)
            assert r.ask("hash 200 20") == r.expect(200, 20)  # faults first, across holes
            assert r.ask(f"hash 0 {PAGES}") == r.expect(0, PAGES)
            linger.set()
            assert r.thread is not None
            r.thread.join(10)
            assert r.result == [True]
            assert r.handler is not None and r.handler.copied == len(present)
            source.close()
        finally:
            linger.set()


def test_a_claim_takes_every_waiting_page_of_its_chunks_across_extents(tmp_path: Path) -> None:
    """A fault claims whole chunks of the pages file: every waiting page whose bytes they hold, in every
    extent they span, so that no chunk is read twice because its pages went out in several claims."""
    from concurrent.futures import ThreadPoolExecutor

    from node_agent.lazy import pagemap
    from node_agent.lazy.chunks import ChunkCache
    from node_agent.lazy.fault_handler import FAULT_WINDOW, Task
    from node_agent.lazy.spans import Span, Spans

    addr = 0x7F0000000000
    extents = _fragmented(addr)
    present = random.Random(5).randbytes(len(extents) * 8 * PAGE)
    store = Store(tmp_path / "store", chunk_size=64 << 10)
    with store.writer() as w:
        w.add_bytes(PAGES_PATH, present)
        record = w.commit({"kind": "test"})
    entry = record.entry(PAGES_PATH)
    pm = pagemap.parse(pagemap_image(extents), 42)
    with ThreadPoolExecutor(2) as pool:
        cache = ChunkCache(store.chunks, record.id, entry, pool)
        handler = Handler({42: pm}, {42: cache}, str(tmp_path), lambda fd, task: None)
        try:
            waiting = Spans(Span(v, v + n * PAGE, v) for v, n, _f in extents)
            task = Task(42, -1, pm, cache, waiting)
            fault = addr + 5 * 16 * PAGE + 3 * PAGE  # page 3 of the sixth extent
            with handler.lock:
                job = handler._claim(task, fault, FAULT_WINDOW)
            assert job is not None and len(job) > 1, "the claim spans several extents"
            lo, hi = cache.bounds(task.file_offset(fault), FAULT_WINDOW)
            expected = {e.vaddr + k for e in pm.extents for k in range(0, e.nr_pages * PAGE, PAGE)
                        if e.lazy and lo <= e.offset + k < hi}
            claimed = {s.start + k for s in job for k in range(0, s.size, PAGE)}
            assert fault in claimed and claimed == expected
            left = {s.start + k for s in task.pending for k in range(0, s.size, PAGE)}
            assert not left & claimed and len(left) + len(claimed) == len(present) // PAGE
        finally:
            handler.close()
