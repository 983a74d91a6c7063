"""A lazy replica rides out a registry blip, and fails visibly, as a whole pod, when its memory cannot come.

Real pieces throughout: an HTTP server on loopback whose socket refuses
connections until the test opens it (bound, not listening); the page source
as its own process, started by the agent's session; processes made to look
restored (`uffd_process.py`, and a plain process for a container restored
in full), each in a cgroup of its own that its runc state names; the
agent's records of the pod. Order is proven by events (a log record, a
process's answer, a process's exit, a session's outcome), never by sleeping.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from criu_bridge import resumegate
from criu_bridge.wrapper import FAILED
from node_agent.config.loading import from_mapping
from node_agent.errors import DataLoss, Unavailable
from node_agent.lazy.kill import kill_container
from node_agent.lazy.restores import LazyRestores
from node_agent.lazy.session import LazySession
from node_agent.lazy.staging import read_memory
from node_agent.registry.fetching import RemoteBlobs
from node_agent.replicas import Replica, Replicas, now_rfc3339
from node_agent.store import Store
from node_agent.store.blob_import import BlobImporter
from node_agent.store.reading import read_or_fetch
from testbed.httpanswers import LoopbackServer, answer
from test_fault_handler import CHILD, LAZY, PAGE, Restored, mm_image, pagemap_image, restored  # noqa: F401

SANDBOX = "5a" * 32
PAGES = 256
LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?Z stderr F (.*)\n$")


# ---- a registry's blob endpoint that refuses connections until opened ----------------------------


class Gated:
    """``GET /v2/<repo>/blobs/<digest>`` on 127.0.0.1, from ``blobs``; refused (bound, not listening) until `open`."""

    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs = blobs
        self.requests: list[str] = []
        self.server = LoopbackServer(self._respond, listen=False, name="gated")
        self.port = self.server.port

    def _respond(self, handler: BaseHTTPRequestHandler) -> None:
        self.requests.append(handler.path)
        data = self.blobs.get(handler.path.rsplit("/", 1)[-1])
        answer(handler, 200 if data is not None else 404, data or b"")

    def origin(self) -> dict[str, Any]:
        return {"reference": f"127.0.0.1:{self.port}/ckpt/web@sha256:" + "0" * 64, "plain_http": True}

    def open(self) -> None:
        self.server.start()

    def close(self) -> None:
        self.server.stop()


class Seen(logging.Handler):
    """Sets ``event`` on the first record whose message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


@pytest.fixture
def retrying() -> Iterator[Seen]:
    seen = Seen("trying again for up to")
    logger = logging.getLogger("node_agent.registry.fetching")
    logger.addHandler(seen)
    try:
        yield seen
    finally:
        logger.removeHandler(seen)


def _chunk_store(root: Path) -> tuple[Store, Any, bytes]:
    src = Store(root, chunk_size=64 << 10)
    with src.writer() as w:
        w.add_bytes("containers/c/checkpoint/pages-1.img", random.Random(3).randbytes(256 << 10))
        record = w.commit({"kind": "test"})
    chunk = record.entry("containers/c/checkpoint/pages-1.img").chunks[0]
    return src, chunk, Path(src.blob_path(chunk.digest)).read_bytes()


def test_a_fetch_refused_for_a_while_is_tried_again_until_the_registry_answers(tmp_path: Path, retrying: Seen) -> None:
    _src, chunk, data = _chunk_store(tmp_path / "src")
    dst = Store(tmp_path / "dst")
    server = Gated({chunk.digest: data})
    fetcher = RemoteBlobs(dst, retry_for=60)
    failed: list[BaseException] = []

    def fetch() -> None:
        try:
            fetcher(server.origin(), chunk)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            failed.append(exc)

    worker = threading.Thread(target=fetch)
    try:
        worker.start()
        assert retrying.event.wait(30), "the fetch did not fail and say it tries again"
        assert not dst.has_blob(chunk.digest) and server.requests == []
        server.open()  # the registry is back
        worker.join(30)
        assert not worker.is_alive() and failed == []
        fetcher.drain()
        assert dst.has_blob(chunk.digest) and len(server.requests) == 1
        assert fetcher.fetched == 1
    finally:
        server.close()
        worker.join(30)
        fetcher.close()


def test_a_fetched_chunk_comes_back_verified_and_is_not_read_and_hashed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fetcher hands a reader the stored bytes it verified on the way in; a reader of a chunk already
    in the store reads it from there, and the fetcher asks the registry for nothing."""
    src, chunk, data = _chunk_store(tmp_path / "src")
    dst = Store(tmp_path / "dst")
    server = Gated({chunk.digest: data})
    server.open()
    fetcher = RemoteBlobs(dst)
    reads: list[str] = []
    real_read = dst.chunks.blobs.read
    monkeypatch.setattr(dst.chunks.blobs, "read", lambda digest, size: reads.append(digest) or real_read(digest, size))
    try:
        def fetch(c: Any) -> bytes | None:
            return fetcher(server.origin(), c)

        content = read_or_fetch(dst.chunks, chunk, fetch)
        fetcher.drain()  # the fetched blob's link into the store follows the reader's bytes
        assert content == src.chunks.read_chunk(chunk) and reads == [] and dst.has_blob(chunk.digest)
        assert fetcher(server.origin(), chunk) is None and len(server.requests) == 1  # there already
        assert read_or_fetch(dst.chunks, chunk, fetch) == content and reads == [chunk.digest]
    finally:
        server.close()
        fetcher.close()


def test_the_chunks_one_connection_fetches_go_into_one_import_at_a_time_and_drain_ends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch's chunk goes into its connection's import (one lease in ingest/, not one per chunk); the import
    ends after a batch of chunks and at ``drain``, once its chunks are linked, leaving ingest/ empty."""
    src = Store(tmp_path / "src", chunk_size=64 << 10)
    with src.writer() as w:
        w.add_bytes("containers/c/checkpoint/pages-1.img", random.Random(5).randbytes(1 << 20))
        chunks = w.commit({"kind": "test"}).entry("containers/c/checkpoint/pages-1.img").chunks
    assert len(chunks) >= 6
    dst = Store(tmp_path / "dst")
    server = Gated({c.digest: Path(src.blob_path(c.digest)).read_bytes() for c in chunks})
    server.open()
    fetcher = RemoteBlobs(dst, settings=from_mapping({"registry": {"connections": 1}}).registry)
    begun: list[object] = []
    real_importer = dst.importer
    monkeypatch.setattr(dst, "importer", lambda **kw: begun.append(kw) or real_importer(**kw))
    monkeypatch.setattr("node_agent.registry.fetching.IMPORT_BATCH", 2)
    try:
        for c in chunks[:5]:
            assert read_or_fetch(dst.chunks, c, lambda c: fetcher(server.origin(), c)) == src.chunks.read_chunk(c)
        assert len(begun) == 3, "five chunks, two to an import: three imports"
        fetcher.drain()
        assert os.listdir(dst.ingest_dir) == [] and all(dst.has_blob(c.digest) for c in chunks[:5])
        assert read_or_fetch(dst.chunks, chunks[5], lambda c: fetcher(server.origin(), c))
        assert len(os.listdir(dst.ingest_dir)) == 1 and len(begun) == 4, "the next fetch begins an import again"
    finally:
        server.close()
        fetcher.close()
    assert os.listdir(dst.ingest_dir) == [] and dst.has_blob(chunks[5].digest)


def test_a_chunk_fetched_again_before_its_first_fetch_is_linked_is_read_from_the_store_once_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same chunk asked for twice through one connection (a file whose content repeats): the second
    fetch finds it taken by the import already, waits for its link and lets the reader read the store."""
    src, chunk, data = _chunk_store(tmp_path / "src")
    dst = Store(tmp_path / "dst")
    server = Gated({chunk.digest: data})
    server.open()
    fetcher = RemoteBlobs(dst, settings=from_mapping({"registry": {"connections": 1}}).registry)
    linking = threading.Event()  # the link threads wait until someone waits for them
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if threading.current_thread().name.startswith("import-link"):
            assert linking.wait(60), "nobody waited for the link"
        real_fsync(fd)

    real_wait = BlobImporter.wait_linked

    def wait_linked(self: BlobImporter) -> None:
        linking.set()
        real_wait(self)

    monkeypatch.setattr("node_agent.store.blob_import.os.fsync", fsync)
    monkeypatch.setattr(BlobImporter, "wait_linked", wait_linked)
    try:
        def fetch(c: Any) -> bytes | None:
            return fetcher(server.origin(), c)

        want = src.chunks.read_chunk(chunk)
        assert read_or_fetch(dst.chunks, chunk, fetch) == want and not dst.has_blob(chunk.digest)
        assert fetcher(server.origin(), chunk) is None and dst.has_blob(chunk.digest)
        assert read_or_fetch(dst.chunks, chunk, fetch) == want and len(server.requests) == 1
    finally:
        linking.set()
        server.close()
        fetcher.close()


def test_a_fetched_chunk_the_store_cannot_keep_still_serves_its_reader_and_is_fetched_again_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The verified bytes go to the reader at once; a blob whose fsync fails is not linked, the failure is
    logged when the fetch's import ends, and the next reader fetches it again."""
    src, chunk, data = _chunk_store(tmp_path / "src")
    dst = Store(tmp_path / "dst")
    server = Gated({chunk.digest: data})
    server.open()
    fetcher = RemoteBlobs(dst)
    real_fsync = os.fsync
    failing = [True]

    def fsync(fd: int) -> None:
        if failing[0] and threading.current_thread().name.startswith("import-link"):
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr("node_agent.store.blob_import.os.fsync", fsync)
    try:
        assert read_or_fetch(dst.chunks, chunk, lambda c: fetcher(server.origin(), c)) == src.chunks.read_chunk(chunk)
        fetcher.drain()
        assert not dst.has_blob(chunk.digest) and os.listdir(dst.ingest_dir) == []
        assert "a blob was fetched and verified, but the store could not keep it" in caplog.text
        assert f"importing blob {chunk.digest}" in caplog.text
        failing[0] = False
        assert read_or_fetch(dst.chunks, chunk, lambda c: fetcher(server.origin(), c)) == src.chunks.read_chunk(chunk)
        fetcher.drain()
        assert dst.has_blob(chunk.digest) and len(server.requests) == 2
    finally:
        server.close()
        fetcher.close()


def test_a_registry_that_stays_away_fails_the_fetch_after_the_deadline(tmp_path: Path, retrying: Seen) -> None:
    _src, chunk, _data = _chunk_store(tmp_path / "src")
    dst = Store(tmp_path / "dst")
    server = Gated({})
    fetcher = RemoteBlobs(dst, retry_for=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(Unavailable) as info:
            fetcher(server.origin(), chunk)
    finally:
        server.close()
        fetcher.close()
    assert time.monotonic() - started >= 0.5
    assert retrying.event.is_set()
    text = str(info.value)
    assert "refused the connection" in text and re.search(r"still failing after \d+ tries in 0\.5s "
                                                          r"\(timeouts\.lazy-fetch\)$", text), text
    assert not dst.has_blob(chunk.digest)


def test_a_chunk_that_fails_verification_is_not_tried_again(tmp_path: Path, retrying: Seen) -> None:
    _src, chunk, data = _chunk_store(tmp_path / "src")
    dst = Store(tmp_path / "dst")
    server = Gated({chunk.digest: bytes([data[0] ^ 1]) + data[1:]})
    server.open()
    fetcher = RemoteBlobs(dst, retry_for=60)
    try:
        with pytest.raises(DataLoss, match=chunk.digest):
            fetcher(server.origin(), chunk)
    finally:
        server.close()
        fetcher.close()
    assert len(server.requests) == 1 and not retrying.event.is_set()
    assert not dst.has_blob(chunk.digest)


def test_the_faulting_process_waits_for_a_registry_blip(restored: Restored, retrying: Seen) -> None:  # noqa: F811
    """A lazily pulled checkpoint, its registry away when the process touches those chunks: it waits, then runs right."""
    from node_agent.lazy.source import Source

    r = restored
    record = r.store.get(r.checkpoint)
    entry = record.entry("containers/c/checkpoint/pages-1.img")
    held = {c.digest: Path(r.store.blob_path(c.digest)).read_bytes() for c in entry.chunks if c.offset >= 128 * PAGE}
    for digest in held:
        os.unlink(r.store.blob_path(digest))
    gate = -(-min(c.offset for c in entry.chunks if c.digest in held) // PAGE)
    server = Gated(held)
    r.store.origins.remember(r.checkpoint, server.origin())
    fetcher = r.store.origins.fetcher = RemoteBlobs(r.store, retry_for=60)
    source = Source(r.store, r.checkpoint, "c", str(r.images), server.origin())
    try:
        r.serve(source)
        assert r.ask("hash 0 100") == r.expect(0, 100)  # what is here comes at once
        assert retrying.event.wait(30), "no fetch failed while the registry was away"
        server.open()
        assert r.ask(f"hash {gate} {PAGES - gate}") == r.expect(gate, PAGES - gate)
        assert r.thread is not None
        r.thread.join(30)
        assert r.result == [True]
    finally:
        server.close()
        source.close()
        fetcher.close()


# ---- a pod whose memory cannot be restored ------------------------------------------------------


def _cgroup_base() -> str:
    for base in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        if os.path.isfile(os.path.join(base, "cgroup.procs")) and os.access(base, os.W_OK):
            return base
    pytest.skip("no writable cgroup hierarchy to put the test's processes in")
    raise AssertionError("unreachable")


class Pod:
    """One restored pod as the agent sees it: its records, plans, runc state, cgroups and processes.

    Every path lies under a short directory of its own: the lazy-pages
    socket's path must fit a Unix socket address.
    """

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="na-lf-"))
        self.settings = from_mapping({"store": str(self.root / "s"), "runc-root": str(self.root / "runc")})
        self.store = Store(self.settings.store, chunk_size=64 << 10)
        self.replicas = Replicas(self.settings.replicas_dir)
        self.lazy = LazyRestores(self.settings, self.replicas)
        self.logs = self.root / "logs"
        self.base = _cgroup_base()
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.addrs: dict[str, int] = {}
        self.groups: list[str] = []

    def cid(self, name: str) -> str:
        return hashlib.sha256(name.encode()).hexdigest()[:12]

    def plan(self, name: str) -> Path:
        return Path(self.settings.plans_dir) / self.cid(name)

    def lazy_process(self, name: str, started: bool = True) -> None:
        """A process whose memory is missing; ``started``: its container has runc state (it was started)."""
        proc = subprocess.Popen([sys.executable, str(CHILD), "42", str(PAGES)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        self.procs[name] = proc
        self.addrs[name] = int(proc.stdout.readline(), 16)
        if started:
            self._contain(name, proc.pid)

    def full_process(self, name: str) -> None:
        proc = subprocess.Popen(["sleep", "600"], text=True)
        self.procs[name] = proc
        self._contain(name, proc.pid)

    def _contain(self, name: str, pid: int) -> None:
        group = os.path.join(self.base, f"na-unit-{self.cid(name)}-{os.getpid()}")
        os.mkdir(group)
        self.groups.append(group)
        with open(os.path.join(group, "cgroup.procs"), "w", encoding="ascii") as fh:
            fh.write(str(pid))
        state = Path(self.settings.runc_root) / self.cid(name)
        state.mkdir(parents=True)
        (state / "state.json").write_text(json.dumps({"cgroup_paths": {"": group}}))

    def checkpoint(self, pages: dict[str, bytes]) -> str:
        """A checkpoint with each lazy container's memory; each gets its restore plan's images."""
        with self.store.writer() as w:
            for name, data in pages.items():
                addr = self.addrs[name]
                w.add_bytes(f"containers/{name}/checkpoint/pagemap-42.img", pagemap_image([(addr, PAGES, LAZY)]))
                w.add_bytes(f"containers/{name}/checkpoint/pages-1.img", data)
            cid = w.commit({"kind": "test"}).id
        for name in pages:
            images = self.plan(name) / "images"
            images.mkdir(parents=True)
            addr = self.addrs[name]
            (images / "pagemap-42.img").write_bytes(pagemap_image([(addr, PAGES, LAZY)]))
            (images / "mm-42.img").write_bytes(mm_image([(addr, addr + PAGES * PAGE)]))
        return cid

    def record(self, name: str, checkpoint: str, lazy: bool) -> Replica:
        (self.logs / name).mkdir(parents=True)
        rep = Replica(self.cid(name), SANDBOX, "ns/web", name, checkpoint, lazy, str(self.logs / name / "0.log"),
                      str(self.logs), now_rfc3339())
        self.replicas.record(rep)
        return rep

    async def start(self, name: str, checkpoint: str) -> LazySession:
        self.plan(name).mkdir(parents=True, exist_ok=True)

        async def exists() -> bool:
            return True

        record = self.store.get(checkpoint)
        memory = read_memory(self.store, record, (name,))[name]
        await self.lazy.start("op", self.store, record, "ns/web", name, self.cid(name),
                              str(self.plan(name)), callers=False, exists=exists, memory=memory)
        return next(s for s in self.lazy._by_op["op"] if s.container == name)

    async def connect(self, name: str) -> None:
        """As the wrapper and CRIU do at StartContainer: the memory CRIU places itself first, then the restore."""
        work = self.plan(name) / "work"
        assert await asyncio.to_thread(resumegate.ask, str(work / resumegate.MEMORY_SOCKET_NAME)) == "ok"
        assert (self.plan(name) / "images" / "pages-1.img").stat().st_size == PAGES * PAGE
        assert self.ask(name, f"connect {work / 'lazy-pages.socket'}") == "ok"

    def ask(self, name: str, line: str) -> str:
        proc = self.procs[name]
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, f"{name}: no answer to {line!r}"
        return proc.stdout.readline().strip()

    async def dead(self, name: str) -> int:
        return await asyncio.to_thread(self.procs[name].wait, 30)

    def lines(self, name: str) -> list[str]:
        text = (self.logs / name / "0.log").read_text()
        out = []
        for line in text.splitlines(keepends=True):
            m = LINE.match(line)
            assert m, line
            out.append(m.group(1))
        return out

    async def close(self) -> None:
        await self.lazy.shutdown()
        for proc in self.procs.values():
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        for group in self.groups:
            try:
                os.rmdir(group)
            except OSError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
async def pod() -> Any:
    p = Pod()
    try:
        yield p
    finally:
        await p.close()


def _corrupt(store: Store, checkpoint: str, name: str) -> str:
    victim = store.get(checkpoint).entry(f"containers/{name}/checkpoint/pages-1.img").chunks[-1]
    path = store.blob_path(victim.digest)
    os.chmod(path, 0o600)
    with open(path, "r+b") as fh:
        fh.write(b"\xff" * 16)
    return victim.digest


def _pages(seed: int) -> bytes:
    return random.Random(seed).randbytes(PAGES * PAGE)


async def test_a_chunk_that_fails_verification_stops_the_whole_pod(pod: Pod) -> None:
    """app's memory is corrupt; sidecar was restored in full and runs; late, lazy, is not started yet."""
    pod.lazy_process("app")
    pod.lazy_process("late", started=False)
    pod.full_process("sidecar")
    ckpt = pod.checkpoint({"app": _pages(1), "late": _pages(2)})
    digest = _corrupt(pod.store, ckpt, "app")
    app, sidecar = pod.record("app", ckpt, True), pod.record("sidecar", ckpt, False)
    late = pod.record("late", ckpt, True)
    session = await pod.start("app", ckpt)
    waiting = await pod.start("late", ckpt)
    await pod.connect("app")
    async with asyncio.timeout(60):
        outcome = await session.wait()
        assert await pod.dead("app") == -9 and await pod.dead("sidecar") == -9
        ended = await waiting.wait()
    assert not outcome.ok and digest in outcome.message and "the container was killed" in outcome.message
    assert await session.failure(5) == outcome.message  # a failed StartContainer's reason: the source's
    # As the restore's error (also for a later container the wrapper refused because of it): DATA_LOSS, at once.
    lost = await pod.lazy.failure("op", pod.cid("app"), 0.0, early=True)
    assert isinstance(lost, DataLoss) and str(lost) == outcome.message
    assert await pod.lazy.failure("op", pod.cid("sidecar"), 0.0, early=True) is None  # no transfer of its own
    assert pod.procs["late"].poll() is None  # never started: nothing of it ran, nothing to kill
    reason = pod.replicas.failure(app)
    assert reason is not None and reason.startswith(f"checkpoint {ckpt}: containers/app/checkpoint/pages-1.img")
    assert digest in reason
    others = f"the restore of container app of the same pod failed ({reason})"
    assert pod.replicas.failure(sidecar) == others and pod.replicas.failure(late) == others
    assert pod.lines("app") == [f"node-agent: restore of pod ns/web, container app failed: {reason}; "
                                "the container was stopped"]
    assert pod.lines("sidecar") == [f"node-agent: restore of pod ns/web, container sidecar failed: {others}; "
                                    "the container was stopped"]
    assert pod.lines("late") == [f"node-agent: restore of pod ns/web, container late failed: {others}; "
                                 "the container was stopped"]
    # The one not started ends, and its StartContainer would fail with the reason (the wrapper reads it).
    assert not ended.ok and others in (pod.plan("late") / "lazy.failed").read_text()
    assert (pod.plan("app") / "lazy.failed").exists() and not (pod.plan("app") / "lazy.done").exists()
    states = {s.replica.container: s for s in pod.lazy.report(None)}
    assert {n: s.state for n, s in states.items()} == {"app": "failed", "sidecar": "failed", "late": "failed"}
    assert states["app"].reason == reason


async def test_a_restore_that_ends_on_its_own_leaves_the_reason_to_criu(pod: Pod) -> None:
    """CRIU fails mid-restore: its page source sees the connection end before the restore finished. The
    container is killed as after any failed transfer, but the failed StartContainer's reason is CRIU's own
    account (the wrapper's), not the source's word that the restore went away."""
    pod.lazy_process("app")
    ckpt = pod.checkpoint({"app": _pages(1)})
    pod.record("app", ckpt, True)
    session = await pod.start("app", ckpt)
    work = pod.plan("app") / "work"
    assert await asyncio.to_thread(resumegate.ask, str(work / resumegate.MEMORY_SOCKET_NAME)) == "ok"
    assert pod.ask("app", f"hand-over {work / 'lazy-pages.socket'}") == "ok"
    assert pod.ask("app", "hang-up") == "ok"
    async with asyncio.timeout(60):
        outcome = await session.wait()
        assert await pod.dead("app") == -9
    assert not outcome.ok and "closed its connection before it finished" in outcome.message
    assert await session.failure(5) == "" and await session.failure(5, early=True) == ""


async def test_a_restore_marked_failed_is_not_waited_for(pod: Pod) -> None:
    """The kill of a container whose restore runc never finished waits for runc's state, but not once the
    wrapper has marked the restore failed (runc has exited then, and left none): it returns at once instead
    of holding the page source, and the failed restore's end, for the whole wait."""
    plan = pod.plan("app")
    plan.mkdir(parents=True)
    (plan / FAILED).write_text("restore of pod ns/web, container app, phase restore: ...")
    done = threading.Event()

    def kill() -> None:
        assert kill_container(pod.settings.runc_root, pod.cid("app"), timeout=3600, plan_dir=str(plan)) == 0
        done.set()

    threading.Thread(target=kill, daemon=True).start()
    assert await asyncio.to_thread(done.wait, 60), "the kill waited for a state no restore will make"
    # A container that has runc state is killed as before, mark or not.
    pod.full_process("sidecar")
    (pod.plan("sidecar") / FAILED).parent.mkdir(parents=True)
    (pod.plan("sidecar") / FAILED).write_text("marked")
    assert kill_container(pod.settings.runc_root, pod.cid("sidecar"), plan_dir=str(pod.plan("sidecar"))) == 1
    assert await pod.dead("sidecar") == -9


async def test_a_page_source_whose_agent_is_gone_stops_the_pod_itself(pod: Pod) -> None:
    pod.lazy_process("app")
    pod.full_process("sidecar")
    ckpt = pod.checkpoint({"app": _pages(1)})
    digest = _corrupt(pod.store, ckpt, "app")
    app, sidecar = pod.record("app", ckpt, True), pod.record("sidecar", ckpt, False)
    session = await pod.start("app", ckpt)
    source = session._source
    assert source is not None
    await session.detach()  # the agent's end of the control socket closes, as when the agent is killed
    await pod.connect("app")
    async with asyncio.timeout(60):
        assert await source.wait() == 1
        assert await pod.dead("app") == -9 and await pod.dead("sidecar") == -9
    reason = pod.replicas.failure(app)
    assert reason is not None and digest in reason
    assert pod.replicas.failure(sidecar) == f"the restore of container app of the same pod failed ({reason})"
    assert [line.split(": ")[1] for line in pod.lines("app") + pod.lines("sidecar")] == [
        "restore of pod ns/web, container app failed", "restore of pod ns/web, container sidecar failed"]
    assert (pod.plan("app") / "lazy.failed").read_text() == reason


async def test_a_page_source_whose_agent_is_gone_writes_the_outcome_and_settles_the_origin(pod: Pod) -> None:
    pod.lazy_process("app")
    memory = _pages(1)
    ckpt = pod.checkpoint({"app": memory})
    pod.record("app", ckpt, True)
    # Pulled lazily once; every blob has arrived since (the origin record is what is left to clear).
    pod.store.origins.remember(ckpt, {"reference": "registry.test/ckpt/web@" + ckpt})
    session = await pod.start("app", ckpt)
    source = session._source
    assert source is not None
    await session.detach()
    await pod.connect("app")
    assert pod.ask("app", f"hash 0 {PAGES}") == hashlib.sha256(memory).hexdigest()
    async with asyncio.timeout(60):
        assert await source.wait() == 0
    done = json.loads((pod.plan("app") / "lazy.done").read_text())
    assert done["pages"] == done["total"] == PAGES and done["seconds"] >= done["transfer_seconds"] >= 0
    assert pod.store.origins.get(ckpt) is None and not (pod.plan("app") / "images").exists()
    assert pod.procs["app"].poll() is None  # it runs on, with all its memory
    assert [s.state for s in pod.lazy.report(None)] == ["done"]
