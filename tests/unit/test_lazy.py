"""Lazy restore's pieces on their own: CRIU pagemaps, the page-server protocol, the page source."""

from __future__ import annotations

import os
import socket
import subprocess
import struct
import threading
from pathlib import Path

import pytest

from node_agent.lazy import background, pagemap, protocol
from node_agent.lazy.source import Source, SourceError
from node_agent.lazy.staging import lazy_pages_files, write_sparse_pages
from node_agent.store import Store

PAGE = pagemap.PAGE_SIZE
LAZY = pagemap.PE_LAZY | pagemap.PE_PRESENT


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _msg(fields: dict[int, int]) -> bytes:
    body = b"".join(_varint(k << 3) + _varint(v) for k, v in fields.items())
    return struct.pack("<I", len(body)) + body


def pagemap_image(pages_id: int, extents: list[tuple[int, int, int]]) -> bytes:
    """A pagemap image as CRIU 4 writes it: magics, head, then (vaddr, nr_pages, flags) entries."""
    data = b"\x19\x43\x56\x54\x25\x40\x08\x56" + _msg({1: pages_id})
    for vaddr, nr, flags in extents:
        data += _msg({1: vaddr, 2: 0, 4: flags, 5: nr})
    return data


EXTENTS = [(0x400000, 2, pagemap.PE_PRESENT), (0x7F0000000000, 300, LAZY), (0x7F0000200000, 1, pagemap.PE_PARENT),
           (0x7F0000400000, 5, LAZY)]


def test_pagemap_offsets_flags_and_lookup() -> None:
    pm = pagemap.parse(pagemap_image(7, EXTENTS), 42)
    assert pm.task_id == 42 and pm.pages_file == "pages-7.img"
    assert [e.offset for e in pm.extents] == [0, 2 * PAGE, -1, 302 * PAGE]
    assert pm.pages_size == 307 * PAGE and pm.lazy_pages == 305
    assert pm.find(0x7F0000000000 + 5 * PAGE) == pm.extents[1]
    assert pm.find(0x7F0000200000) is None  # in the parent, not here
    assert pm.find(0x1000) is None
    assert not pm.extents[0].lazy and pm.extents[1].lazy


def test_pagemap_older_images_count_pages_in_field_two() -> None:
    data = b"\0" * 8 + _msg({1: 1}) + _msg({1: 0x1000, 2: 3, 4: LAZY})
    assert pagemap.parse(data, 1).extents[0].nr_pages == 3


@pytest.mark.parametrize("data, why", [
    (b"\0" * 4, "truncated"),
    (b"\0" * 8, "no head"),
    (b"\0" * 8 + _msg({1: 1}) + _msg({1: 0x2000, 5: 2, 4: LAZY}) + _msg({1: 0x2000, 5: 1, 4: LAZY}), "bad extent"),
    (b"\0" * 8 + _msg({1: 1}) + _msg({1: 0x2001, 5: 1}), "bad extent"),
    (b"\0" * 8 + _msg({1: 1}) + _msg({1: 0x2000, 5: 0}), "bad extent"),
    (b"\0" * 8 + struct.pack("<I", 1 << 20), "out of bounds"),
    (b"\0" * 8 + struct.pack("<I", 2) + b"\x0a\x00", "wire type"),
    (b"\0" * 8 + struct.pack("<I", 2) + b"\x08\xff", "varint"),
])
def test_hostile_pagemaps_are_refused(data: bytes, why: str) -> None:
    with pytest.raises(pagemap.PagemapError, match=why):
        pagemap.parse(data, 1)


def _pages_bytes(n: int) -> bytes:
    return b"".join(struct.pack("<Q", i) * (PAGE // 8) for i in range(n))


@pytest.fixture
def lazy_checkpoint(tmp_path: Path) -> tuple[Store, str, Path]:
    """A store holding one container's memory images, and those images' pagemaps on disk."""
    store = Store(tmp_path / "store", chunk_size=64 << 10)
    pm = pagemap_image(1, EXTENTS)
    with store.writer() as w:
        w.add_bytes("containers/c/checkpoint/pagemap-42.img", pm)
        w.add_bytes("containers/c/checkpoint/pages-1.img", _pages_bytes(307))
        w.add_bytes("containers/c/checkpoint/core-42.img", b"core")
        record = w.commit({"kind": "test"})
    images = tmp_path / "images"
    images.mkdir()
    (images / "pagemap-42.img").write_bytes(pm)
    return store, record.id, images


class FakeDaemon:
    """The lazy-pages daemon's side of the page-server protocol, over a socketpair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def get(self, task: int, vaddr: int, nr: int) -> tuple[int, int, bytes]:
        self.sock.sendall(protocol.HEADER.pack(protocol.PS_IOV_GET, nr, vaddr, task))
        head = self._exact(protocol.HEADER.size)
        cmd, got, addr, dst = protocol.HEADER.unpack(head)
        assert cmd == protocol.reply_cmd(pagemap.PE_PRESENT | pagemap.PE_LAZY) and addr == vaddr and dst == task
        return got, addr, self._exact(got * PAGE)

    def close(self) -> int:
        self.sock.sendall(protocol.HEADER.pack(protocol.PS_IOV_CLOSE, 0, 0, 0))
        return int(protocol.STATUS.unpack(self._exact(4))[0])

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = self.sock.recv(n - len(buf))
            assert got, "the source closed the connection"
            buf += got
        return buf


def _serve(source: Source) -> tuple[FakeDaemon, threading.Thread, list[object]]:
    ours, theirs = socket.socketpair()
    result: list[object] = []

    def run() -> None:
        try:
            result.append(source.serve(theirs))
        except SourceError as exc:
            result.append(exc)
        finally:
            theirs.close()
            source.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    daemon = FakeDaemon(ours)
    opened.append(ours)
    return daemon, t, result


opened: list[socket.socket] = []


@pytest.fixture(autouse=True)
def _close_sockets() -> object:
    yield
    while opened:
        opened.pop().close()


def test_the_source_serves_pages_by_offset_and_ends_on_close(lazy_checkpoint: tuple[Store, str, Path]) -> None:
    store, cid, images = lazy_checkpoint
    source = Source(store, cid, "c", str(images))
    assert source.total == 305
    daemon, t, result = _serve(source)
    expected = _pages_bytes(307)
    # A fault in the middle of an extent, then a request running past its end (answered short).
    got, addr, data = daemon.get(42, 0x7F0000000000 + 100 * PAGE, 1)
    assert got == 1 and data == expected[(2 + 100) * PAGE:(2 + 101) * PAGE]
    got, addr, data = daemon.get(42, 0x7F0000000000 + 250 * PAGE, 400)
    assert got == 50 and data == expected[252 * PAGE:302 * PAGE]
    got, addr, data = daemon.get(42, 0x7F0000400000, 5)
    assert data == expected[302 * PAGE:]
    assert daemon.close() == 0
    t.join(5)
    assert result == [True] and source.served == 56


@pytest.mark.parametrize("task, vaddr", [(42, 0x400000), (42, 0x7F0000200000), (7, 0x7F0000000000)])
def test_requests_for_pages_that_are_not_lazy_here_are_refused(
    lazy_checkpoint: tuple[Store, str, Path], task: int, vaddr: int
) -> None:
    store, cid, images = lazy_checkpoint
    daemon, t, result = _serve(Source(store, cid, "c", str(images)))
    daemon.sock.sendall(protocol.HEADER.pack(protocol.PS_IOV_GET, 1, vaddr, task))
    t.join(5)
    assert isinstance(result[0], SourceError) and "does not hold lazily" in str(result[0])


def test_a_corrupt_chunk_stops_the_source_and_names_the_file(lazy_checkpoint: tuple[Store, str, Path]) -> None:
    store, cid, images = lazy_checkpoint
    entry = store.get(cid).entry("containers/c/checkpoint/pages-1.img")
    victim = entry.chunks[-1]
    path = store.blob_path(victim.digest)
    os.chmod(path, 0o600)
    with open(path, "r+b") as fh:
        fh.write(b"\xff" * 16)
    daemon, t, result = _serve(Source(store, cid, "c", str(images)))
    daemon.sock.sendall(protocol.HEADER.pack(protocol.PS_IOV_GET, 5, 0x7F0000400000, 42))
    t.join(5)
    assert isinstance(result[0], SourceError), result
    assert "pages-1.img" in str(result[0]) and victim.digest in str(result[0])


def test_a_held_checkpoint_removed_mid_transfer_still_serves_and_fetches(
    lazy_checkpoint: tuple[Store, str, Path], tmp_path: Path
) -> None:
    """The store's hold keeps the blobs; the origin the agent read keeps missing chunks coming."""
    store, cid, images = lazy_checkpoint
    entry = store.get(cid).entry("containers/c/checkpoint/pages-1.img")
    remote = entry.chunks[-1]
    away = tmp_path / "registry-copy"
    os.replace(store.blob_path(remote.digest), away)  # as a lazy pull leaves it: only at the origin
    origin = {"reference": "registry.test/ckpt@" + cid}
    store.origins.remember(cid, origin)
    asked: list[object] = []

    def fetcher(where: object, chunk: object) -> None:
        asked.append(where)
        os.link(away, store.blob_path(remote.digest))

    store.origins.fetcher = fetcher
    with store.hold(cid):
        store.remove(cid)  # unpublishes it and forgets its origin
        assert store.origins.get(cid) is None
        daemon, t, result = _serve(Source(store, cid, "c", str(images), origin))
        got, _, data = daemon.get(42, 0x7F0000400000, 5)
        assert data == _pages_bytes(307)[302 * PAGE:]
        got, _, data = daemon.get(42, 0x7F0000000000, 1)
        assert data == _pages_bytes(307)[2 * PAGE:3 * PAGE]
        assert daemon.close() == 0
        t.join(5)
    assert result == [True] and asked == [origin]


def test_a_disconnect_mid_request_is_an_error(lazy_checkpoint: tuple[Store, str, Path]) -> None:
    store, cid, images = lazy_checkpoint
    daemon, t, result = _serve(Source(store, cid, "c", str(images)))
    daemon.sock.sendall(b"\x07\x00")
    daemon.sock.close()
    t.join(5)
    assert isinstance(result[0], SourceError) and "mid-request" in str(result[0])


def test_staging_writes_only_the_pages_that_cannot_come_lazily(
    lazy_checkpoint: tuple[Store, str, Path], tmp_path: Path
) -> None:
    store, cid, _ = lazy_checkpoint
    record = store.get(cid)
    sparse = lazy_pages_files(store, record)
    assert list(sparse) == ["containers/c/checkpoint/pages-1.img"]
    staging = tmp_path / "staging"
    staging.mkdir()
    store.materialize(cid, staging, prefix="containers", exclude=set(sparse))
    target = staging / "containers/c/checkpoint/pages-1.img"
    assert not target.exists() and (staging / "containers/c/checkpoint/core-42.img").read_bytes() == b"core"
    for path, pm in sparse.items():
        write_sparse_pages(store, record, str(staging), path, pm)
    data = target.read_bytes()
    expected = _pages_bytes(307)
    assert len(data) == len(expected)
    assert data[: 2 * PAGE] == expected[: 2 * PAGE]
    assert data[2 * PAGE:] == b"\0" * (305 * PAGE)
    # Sparse on disk: the lazy part takes no blocks.
    assert os.stat(target).st_blocks * 512 < 64 * PAGE


def test_background_priority_lowers_the_process_and_its_session() -> None:
    """Nice 10 for the task and, where the kernel groups sessions (autogroup), for its session."""
    def own_group() -> str:
        try:
            with open("/proc/self/autogroup", encoding="ascii") as fh:
                return fh.read()
        except FileNotFoundError:
            return ""

    mine = own_group()
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        background.lower(child.pid)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == background.NICE
        background.lower(child.pid)  # never lowered twice
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == background.NICE
        try:
            with open(f"/proc/{child.pid}/autogroup", encoding="ascii") as fh:
                group = fh.read()
        except FileNotFoundError:
            return  # a kernel without autogroup
        assert group.strip().endswith(f"nice {background.NICE}"), group
        assert own_group() == mine, "the caller's own session changed"
    finally:
        child.kill()
        child.wait()
