"""Fetching ahead of a restore: what a lazy pull left in the registry comes in before the restore asks.

A real HTTP server on loopback serves the blobs (`GET /v2/<repo>/blobs/<digest>`) and can hold a request
until the test lets it go; the store, the fetcher and the threads are the agent's own. Order is proven by
the requests the server saw and by events, never by sleeping.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from node_agent.config.loading import from_mapping
from node_agent.lazy.chunks import PAGE_SIZE
from node_agent.lazy.pagemap import PE_LAZY, PE_PRESENT
from node_agent.lazy.prefetch import Prefetch, order
from node_agent.lazy.staging import read_memory
from node_agent.lazy.restores import LazyRestores
from node_agent.registry.fetching import RemoteBlobs
from node_agent.replicas import Replicas
from node_agent.store import CheckpointRecord, Store
from testbed.faults import killed_outright
from testbed.httpanswers import LoopbackServer, answer
from testbed.layout import write_hosts_toml
from test_lazy import pagemap_image
from test_lazy_failures import PAGES as PAGES_N, Pod, _pages, pod  # noqa: F401 - the restored pod's harness and its fixture

PAGES = "containers/app/checkpoint/pages-1.img"
STATE = "containers/app/checkpoint/core-1.img"
CONFIG = "containers/app/config.dump"
LAZY = PE_LAZY | PE_PRESENT


class Blobs:
    """A registry's blob endpoint on 127.0.0.1; ``hold``: the first request waits until `release`."""

    def __init__(self, blobs: dict[str, bytes], hold: bool = False) -> None:
        self.blobs = blobs
        self.requests: list[str] = []
        self.arrived = threading.Event()
        self.released = threading.Event()
        if not hold:
            self.released.set()
        self._lock = threading.Lock()
        self.server = LoopbackServer(self._respond, name="blobs")
        self.server.start()

    def _respond(self, handler: BaseHTTPRequestHandler) -> None:
        digest = handler.path.split("?", 1)[0].rsplit("/", 1)[-1]  # a mirror is asked with ?ns=<registry>
        with self._lock:
            first = not self.requests
            self.requests.append(digest)
        if first:
            self.arrived.set()
            self.released.wait(60)
        data = self.blobs.get(digest)
        answer(handler, 200 if data is not None else 404, data or b"")

    def origin(self) -> dict[str, Any]:
        return {"reference": f"127.0.0.1:{self.server.port}/ckpt/web@sha256:" + "0" * 64, "plain_http": True}

    def close(self) -> None:
        self.released.set()
        self.server.stop()


def _lazily_pulled(tmp_path: Path, connections: int = 2) -> tuple[Store, CheckpointRecord, dict[str, bytes]]:
    """A checkpoint published in a store with its chunk blobs still only at an origin, as a lazy pull leaves
    it: memory, process state and a config, in small chunks; and the blobs as the origin serves them."""
    store = Store(tmp_path / "store", chunk_size=64 << 10)
    rnd = random.Random(11)
    with store.writer() as w:
        w.add_bytes(PAGES, rnd.randbytes(512 << 10))
        w.add_bytes(STATE, rnd.randbytes(192 << 10))
        w.add_bytes(CONFIG, b'{"config": {}}')
        record = w.commit({"kind": "test"})
    blobs = {c.digest: Path(store.blob_path(c.digest)).read_bytes() for e in record.files for c in e.chunks}
    for digest in blobs:
        Path(store.blob_path(digest)).unlink()
    store.origins.fetcher = RemoteBlobs(store, settings=from_mapping({"registry": {"connections": connections}}).registry)
    store.origins.fetch_lanes = connections
    return store, record, blobs


@pytest.fixture
def close_after() -> Iterator[list[Any]]:
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        thing.close()


def test_the_order_is_every_file_but_the_memory_first_then_the_memory_each_chunk_once(
    tmp_path: Path, close_after: list[Any]
) -> None:
    store, record, _blobs = _lazily_pulled(tmp_path)
    close_after.append(store.origins.fetcher)
    chunks = order(store, record)
    memory = [c.digest for c in record.entry(PAGES).chunks]
    rest = [c.digest for p in (STATE, CONFIG) for c in record.entry(p).chunks]
    got = [c.digest for c in chunks]
    assert sorted(got[:len(rest)]) == sorted(rest) and got[len(rest):] == memory
    assert len(set(got)) == len(got)
    # What is in the store already is not in it.
    Path(store.blob_path(memory[0])).write_bytes(b"")  # presence is all `order` asks about
    assert memory[0] not in [c.digest for c in order(store, record)]


def test_it_fetches_every_missing_chunk_into_the_store_each_once(tmp_path: Path, close_after: list[Any]) -> None:
    store, record, blobs = _lazily_pulled(tmp_path)
    server = Blobs(blobs)
    close_after += [store.origins.fetcher, server]
    store.origins.remember(record.id, server.origin())
    ahead = Prefetch(store, record, 2, "pod ns/web")
    ahead.start()
    assert ahead.wait(60) and ahead.complete
    store.origins.fetcher.drain()  # type: ignore[union-attr]
    assert all(store.has_blob(d) for d in blobs)
    assert sorted(server.requests) == sorted(blobs) and ahead.fetched == len(blobs)
    assert store.origins.settle(record.id)  # whole: its origin is forgotten
    assert store.verify(record.id) == []


def test_it_reports_once_when_its_last_lane_ends_even_one_that_ends_before_the_next_starts(
    tmp_path: Path, close_after: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    store, record, blobs = _lazily_pulled(tmp_path)
    server = Blobs(blobs)
    close_after += [store.origins.fetcher, server]
    store.origins.remember(record.id, server.origin())
    caplog.set_level(logging.INFO, logger="node_agent.lazy.prefetch")
    short = shutil.disk_usage(store.root).total + 1  # it stops at once: no room for any chunk
    ahead = Prefetch(store, record, 2, "pod ns/web", min_free=short)
    first, second = ahead._threads
    first.start()
    first.join(30)  # its first lane has ended before the second one starts
    assert not first.is_alive()
    assert not [r for r in caplog.records if "ahead of its restore in" in r.message]  # a lane is still to come
    second.start()
    assert ahead.wait(30)
    reports = [r.message for r in caplog.records if "ahead of its restore in" in r.message]
    assert len(reports) == 1 and "; the store's filesystem is short of space" in reports[0], reports


def test_stopped_it_fetches_nothing_more_and_the_fetch_under_way_ends_first(
    tmp_path: Path, close_after: list[Any]
) -> None:
    store, record, blobs = _lazily_pulled(tmp_path, connections=1)
    server = Blobs(blobs, hold=True)
    close_after += [store.origins.fetcher, server]
    store.origins.remember(record.id, server.origin())
    ahead = Prefetch(store, record, 1, "pod ns/web")
    ahead.start()
    assert server.arrived.wait(30), "the first fetch did not reach the registry"
    ahead.stop("the page source took over")
    assert ahead.running  # its fetch is under way, held by the registry
    server.released.set()
    assert ahead.wait(60) and not ahead.complete
    store.origins.fetcher.drain()  # type: ignore[union-attr]
    assert len(server.requests) == 1 and ahead.fetched == 1
    assert sum(store.has_blob(d) for d in blobs) == 1


def test_it_stops_before_a_chunk_the_store_has_no_room_for_and_a_reader_still_gets_each_chunk_verified(
    tmp_path: Path, close_after: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    store, record, blobs = _lazily_pulled(tmp_path)
    server = Blobs(blobs)
    fetcher = store.origins.fetcher
    assert isinstance(fetcher, RemoteBlobs)
    close_after += [fetcher, server]
    store.origins.remember(record.id, server.origin())
    short = shutil.disk_usage(store.root).total + 1  # min-free-bytes beyond the filesystem's size: never room
    ahead = Prefetch(store, record, 2, "pod ns/web", min_free=short)
    ahead.start()
    assert ahead.wait(60) and not ahead.complete
    assert ahead.why.startswith("the store's filesystem is short of space") and f"min-free-bytes {short})" in ahead.why
    assert server.requests == [] and ahead.fetched == 0
    # The restore's own reader gets every chunk, verified; the store keeps none while it is short of space.
    caplog.set_level(logging.INFO, logger="node_agent.registry.fetching")
    fetcher.min_free = short
    state = record.entry(STATE)
    expected = b"".join(blobs[c.digest] for c in state.chunks)  # identity chunks: their blobs are the file
    with store.open(record, STATE) as reader:
        assert reader.read() == expected
    fetcher.drain()
    assert not any(store.has_blob(c.digest) for c in state.chunks) and fetcher.not_kept == len(state.chunks)
    assert store.origins.get(record.id) is not None  # still lazily pulled
    assert [r.message for r in caplog.records].count(
        f"the store's filesystem has less than min-free-bytes ({short} bytes) free beyond blob "
        f"{state.chunks[0].digest} ({state.chunks[0].stored_size} bytes): blobs fetched from "
        f"{server.origin()['reference']} are verified and handed to their readers, not kept; the checkpoint "
        "stays lazily pulled") == 1
    # With room again, what is fetched is kept again (said once).
    fetcher.min_free = 0
    with store.open(record, STATE) as reader:
        assert reader.read() == expected
    fetcher.drain()
    assert all(store.has_blob(c.digest) for c in state.chunks)
    assert sum("keeps the blobs fetched from" in r.message and "again" in r.message for r in caplog.records) == 1


class HoldOne(Blobs):
    """`Blobs`, holding the requests for one blob (and only those) until `release`."""

    def __init__(self, blobs: dict[str, bytes], held: str) -> None:
        self.held = held
        super().__init__(blobs, hold=True)

    def _respond(self, handler: BaseHTTPRequestHandler) -> None:
        digest = handler.path.split("?", 1)[0].rsplit("/", 1)[-1]
        with self._lock:
            self.requests.append(digest)
        if digest == self.held:
            self.arrived.set()
            self.released.wait(60)
        data = self.blobs.get(digest)
        answer(handler, 200 if data is not None else 404, data or b"")


_KILLED = r"""
import sys, time
from node_agent.config.loading import from_mapping
from node_agent.lazy.prefetch import Prefetch
from node_agent.registry.fetching import RemoteBlobs
from node_agent.store import Store

store = Store(sys.argv[1], chunk_size=64 << 10)
store.origins.fetcher = RemoteBlobs(store, settings=from_mapping({"registry": {"connections": 2}}).registry)
Prefetch(store, store.get(sys.argv[2]), 2, "pod ns/web").start()
deadline = time.monotonic() + 60  # the blobs fetched are linked by the imports' threads, which go on meanwhile
while any(store.blobs.size_of(d) is None for d in sys.argv[3:]) and time.monotonic() < deadline:
    time.sleep(0.01)
print("fetched", flush=True)
sys.stdin.read()  # held here, one fetch under way, until killed
"""


def test_an_agent_killed_while_it_fetches_ahead_leaves_what_it_fetched_and_the_repair_clears_the_rest(
    tmp_path: Path, close_after: list[Any]
) -> None:
    store, record, blobs = _lazily_pulled(tmp_path)
    close_after.append(store.origins.fetcher)
    held = record.entry(PAGES).chunks[-1].digest
    server = HoldOne(blobs, held)
    close_after.append(server)
    store.origins.remember(record.id, server.origin())
    others = [d for d in blobs if d != held]
    with killed_outright(_KILLED, store.root, record.id, *others) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == "fetched\n"
        assert server.arrived.wait(30), "the held blob was never asked for"
    after = Store(store.root, chunk_size=64 << 10)
    assert os.listdir(after.ingest_dir)  # the imports it had open
    report = after.recover()
    assert report.ingest_removed and report.blobs_removed == () and os.listdir(after.ingest_dir) == []
    # What it fetched is in the store, whole; the blob under way is still only at the origin, which is kept.
    assert [c.digest for c in after.origins.missing(after.get(record.id))] == [held]
    assert after.verify(record.id) == [] and after.origins.get(record.id) == server.origin()
    # The next restore's fetches bring the rest.
    server.released.set()
    after.origins.fetcher = RemoteBlobs(after)
    close_after.append(after.origins.fetcher)
    ahead = Prefetch(after, after.get(record.id), 1, "pod ns/web")
    ahead.start()
    assert ahead.wait(60) and ahead.complete and ahead.fetched == 1
    assert after.origins.settle(record.id) and after.verify(record.id) == []


def test_a_fetch_of_a_blob_already_on_its_way_waits_for_it_and_the_registry_serves_it_once(
    tmp_path: Path, close_after: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, record, blobs = _lazily_pulled(tmp_path)
    server = Blobs(blobs, hold=True)
    close_after += [store.origins.fetcher, server]
    fetcher = store.origins.fetcher
    assert isinstance(fetcher, RemoteBlobs)
    waiting = threading.Event()

    class Watched(Future[Any]):
        def result(self, timeout: float | None = None) -> Any:
            waiting.set()  # a second fetcher of the blob waits on the first
            return super().result(timeout)

    monkeypatch.setattr("node_agent.registry.fetching.Future", Watched)
    chunk = record.entry(PAGES).chunks[0]
    got: list[bytes | None] = []

    def fetch() -> None:
        got.append(fetcher(server.origin(), chunk))

    first, second = threading.Thread(target=fetch), threading.Thread(target=fetch)
    first.start()
    assert server.arrived.wait(30)
    second.start()
    assert waiting.wait(30), "the second fetch did not wait for the first"
    server.released.set()
    first.join(30)
    second.join(30)
    assert got == [blobs[chunk.digest]] * 2 and server.requests == [chunk.digest]
    fetcher.drain()
    assert store.has_blob(chunk.digest)


async def test_the_node_can_turn_it_off_and_the_agents_stop_ends_it(tmp_path: Path, close_after: list[Any]) -> None:
    store, record, blobs = _lazily_pulled(tmp_path, connections=1)
    server = Blobs(blobs, hold=True)
    close_after += [store.origins.fetcher, server]
    store.origins.remember(record.id, server.origin())
    off = LazyRestores(from_mapping({"registry": {"prefetch": False}}), Replicas(str(tmp_path / "r1")))
    off.prefetch(store, record, "pod ns/web")
    assert off._prefetches == {}
    lazy = LazyRestores(from_mapping({}), Replicas(str(tmp_path / "r2")))
    lazy.prefetch(store, record, "pod ns/web")
    lazy.prefetch(store, record, "pod ns/other")  # one at a time per checkpoint
    (ahead,) = lazy._prefetches.values()
    assert server.arrived.wait(30)
    server.released.set()
    await lazy.shutdown()
    assert not ahead.running and len(server.requests) <= len(blobs)


async def test_the_restore_connecting_ends_the_fetches_ahead_of_it(pod: Pod) -> None:  # noqa: F811
    """The page source takes over once the restore connects: the agent's fetches ahead of it stop then."""
    pod.lazy_process("app")
    ckpt = pod.checkpoint({"app": _pages(1)})
    pod.record("app", ckpt, True)
    ahead = Prefetch(pod.store, pod.store.get(ckpt), 1, "pod ns/web")  # not started: only its stop is watched
    pod.lazy._prefetches[ckpt] = ahead
    session = await pod.start("app", ckpt)
    assert ahead.why == ""
    await pod.connect("app")
    async with asyncio.timeout(60):
        outcome = await session.wait()
    assert outcome.ok, outcome.message
    assert ahead.why == "the page source took over"
    assert pod.ask("app", f"hash 0 {PAGES_N}") == hashlib.sha256(_pages(1)).hexdigest()  # its own memory


async def test_a_page_source_on_a_store_short_of_space_fills_the_process_and_keeps_nothing(
    pod: Pod, close_after: list[Any]  # noqa: F811
) -> None:
    """The store's filesystem filled after the lazy pull: the restored process still gets every page, verified;
    no chunk is kept, and the checkpoint stays lazily pulled (its origin kept for the next restore)."""
    short = shutil.disk_usage(pod.store.root).total + 1  # min-free-bytes beyond the filesystem's size
    pod.lazy.settings = from_mapping({"store": pod.settings.store, "runc-root": pod.settings.runc_root,
                                      "min-free-bytes": short})
    pod.lazy_process("app")
    memory = _pages(1)
    ckpt = pod.checkpoint({"app": memory})
    chunks = pod.store.get(ckpt).entry("containers/app/checkpoint/pages-1.img").chunks
    blobs = {c.digest: Path(pod.store.blob_path(c.digest)).read_bytes() for c in chunks}
    for digest in blobs:  # left in the registry by a lazy pull
        os.unlink(pod.store.blob_path(digest))
    server = Blobs(blobs)
    close_after.append(server)
    pod.store.origins.remember(ckpt, server.origin())
    pod.record("app", ckpt, True)
    session = await pod.start("app", ckpt)
    await pod.connect("app")
    async with asyncio.timeout(60):
        outcome = await session.wait()
    assert outcome.ok, outcome.message
    assert pod.ask("app", f"hash 0 {PAGES_N}") == hashlib.sha256(memory).hexdigest()  # its own memory
    assert sorted(set(server.requests)) == sorted(blobs)
    assert not any(pod.store.has_blob(d) for d in blobs)
    assert pod.store.origins.get(ckpt) == server.origin()


def test_fetches_follow_the_nodes_hosts_when_a_mirror_is_replaced(
    tmp_path: Path, close_after: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's fetcher lives as long as the agent; the mirror hosts.toml names may change meanwhile (a
    pull-through cache replaced by another): kept connections to the old one are not used again."""
    store, record, blobs = _lazily_pulled(tmp_path)
    first, second, origin = Blobs(blobs), Blobs(blobs), Blobs({})
    close_after += [first, second, origin]
    hosts = tmp_path / "certs.d"
    registry = f"127.0.0.1:{origin.server.port}"

    def mirror(server: Blobs) -> None:
        write_hosts_toml(hosts, registry, f'server = "http://{registry}"\n'
                                          f'[host."http://127.0.0.1:{server.server.port}"]\n  capabilities = ["pull"]\n')

    mirror(first)
    settings = from_mapping({"registry": {"connections": 2, "config-path": str(hosts)}}).registry
    fetcher = RemoteBlobs(store, settings=settings)
    close_after.append(fetcher)
    monkeypatch.setattr("node_agent.registry.fetching.HOSTS_FOR", 0.0)  # read the hosts at every fetch
    a, b = record.entry(PAGES).chunks[:2]
    assert fetcher(origin.origin(), a) == blobs[a.digest]
    mirror(second)
    assert fetcher(origin.origin(), b) == blobs[b.digest]
    assert first.requests == [a.digest] and second.requests == [b.digest] and origin.requests == []


PAGEMAP = "containers/app/checkpoint/pagemap-1.img"
# 128 pages, CRIU places pages 40-41 and 62-65 itself; the rest is lazy.
EXTENTS = [(0x10000000, 40, LAZY), (0x20000000, 2, PE_PRESENT), (0x30000000, 20, LAZY), (0x40000000, 4, PE_PRESENT),
           (0x50000000, 62, LAZY)]


def _with_pagemap(tmp_path: Path) -> tuple[Store, CheckpointRecord, dict[str, bytes]]:
    store = Store(tmp_path / "store", chunk_size=64 << 10)
    with store.writer() as w:
        w.add_bytes(PAGES, random.Random(5).randbytes(128 * PAGE_SIZE))
        w.add_bytes(PAGEMAP, pagemap_image(1, EXTENTS))
        w.add_bytes(STATE, random.Random(6).randbytes(192 << 10))
        record = w.commit({"kind": "test"})
    blobs = {c.digest: Path(store.blob_path(c.digest)).read_bytes() for e in record.files for c in e.chunks}
    for digest in blobs:
        Path(store.blob_path(digest)).unlink()
    store.origins.fetcher = RemoteBlobs(store, settings=from_mapping({"registry": {"connections": 1}}).registry)
    store.origins.fetch_lanes = 1
    return store, record, blobs


def test_the_memory_criu_places_itself_comes_right_after_the_files_before_the_rest_of_the_memory(
    tmp_path: Path, close_after: list[Any]
) -> None:
    store, record, blobs = _with_pagemap(tmp_path)
    server = Blobs(blobs)
    close_after += [store.origins.fetcher, server]
    store.origins.remember(record.id, server.origin())
    memory = [c.digest for c in record.entry(PAGES).chunks]
    files = [c.digest for p in (PAGEMAP, STATE) for c in record.entry(p).chunks]
    # One lane: the registry sees the fetches in the order they are made.
    ahead = Prefetch(store, record, 1, "pod ns/web")
    ahead.start()
    assert ahead.wait(60) and ahead.complete
    got = server.requests
    assert sorted(got[:len(files)]) == sorted(files)
    runs = [(40 * PAGE_SIZE, 42 * PAGE_SIZE), (62 * PAGE_SIZE, 66 * PAGE_SIZE)]
    placed = [c.digest for c in record.entry(PAGES).chunks
              if any(c.offset < end and start < c.offset + c.size for start, end in runs)]
    assert placed and memory[0] not in placed  # the chunker's cuts: the order differs from the file's
    assert got[len(files):] == placed + [d for d in memory if d not in placed]
    assert sorted(got) == sorted(blobs)  # each crossed the network once, the pagemap too
    # The pages CRIU places itself are read from the store as CreateContainer reads them.
    store.origins.fetcher.drain()  # type: ignore[union-attr]
    held = read_memory(store, record)["app"].files[0].held
    assert sorted(held) == [40 * PAGE_SIZE, 62 * PAGE_SIZE] and len(held[62 * PAGE_SIZE]) == 4 * PAGE_SIZE
