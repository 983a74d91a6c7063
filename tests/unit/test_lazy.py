"""Lazy restore's pieces on their own: CRIU pagemaps and memory maps, the pages by chunk, the books of spans."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import struct
from pathlib import Path

import pytest

from criu_bridge.criuimg import encode_varint as _varint
from node_agent.lazy import background, pagemap
from node_agent.lazy.chunks import SourceError
from node_agent.lazy.source import Source
from node_agent.lazy.spans import Span, Spans
from node_agent.lazy.staging import read_memory
from node_agent.store import Store

PAGE = pagemap.PAGE_SIZE
LAZY = pagemap.PE_LAZY | pagemap.PE_PRESENT


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
    return random.Random(n).randbytes(n * PAGE)  # no two pages alike: chunk edges fall anywhere


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


def test_the_source_reads_each_tasks_pagemap_and_pages_file(lazy_checkpoint: tuple[Store, str, Path]) -> None:
    store, cid, images = lazy_checkpoint
    source = Source(store, cid, "c", str(images))
    try:
        assert source.total == 305 and list(source.files) == [42]
        expected = _pages_bytes(307)
        cache = source.files[42]
        # Whole pages, each exactly once, though 64 KiB chunks are cut by content (edges inside pages).
        pieces = list(cache.pieces(2 * PAGE, 300 * PAGE))
        assert all(length % PAGE == 0 for _d, _s, length in pieces)
        assert b"".join(bytes(d[st:st + n]) for d, st, n in pieces) == expected[2 * PAGE:302 * PAGE]
        assert any(st == 0 and n == PAGE and len(d) == PAGE for d, st, n in pieces), "no page straddled two chunks"
        with pytest.raises(SourceError, match="whole pages"):
            list(cache.pieces(100, PAGE))
        with pytest.raises(SourceError, match="outside the file"):
            list(cache.pieces(300 * PAGE, 10 * PAGE))
    finally:
        source.close()


def test_a_corrupt_chunk_names_the_file_and_the_chunk(lazy_checkpoint: tuple[Store, str, Path]) -> None:
    store, cid, images = lazy_checkpoint
    victim = store.get(cid).entry("containers/c/checkpoint/pages-1.img").chunks[-1]
    path = store.blob_path(victim.digest)
    os.chmod(path, 0o600)
    with open(path, "r+b") as fh:
        fh.write(b"\xff" * 16)
    source = Source(store, cid, "c", str(images))
    try:
        with pytest.raises(SourceError) as err:
            list(source.files[42].pieces(302 * PAGE, 5 * PAGE))
        assert "pages-1.img" in str(err.value) and victim.digest in str(err.value)
    finally:
        source.close()


def _mm(vmas: list[tuple[int, int]]) -> bytes:
    body = b"".join(_varint(14 << 3 | 2) + _varint(len(v)) + v
                    for v in (_varint(1 << 3) + _varint(lo) + _varint(2 << 3) + _varint(hi) for lo, hi in vmas))
    return b"\0" * 8 + struct.pack("<I", len(body)) + body


def test_lazy_ranges_are_cut_at_mapping_edges() -> None:
    pm = pagemap.parse(pagemap_image(7, EXTENTS), 42)
    base = 0x7F0000000000
    vmas = pagemap.parse_vmas(_mm([(0x400000, 0x402000), (base, base + 100 * PAGE), (base + 100 * PAGE, base + 400 * PAGE),
                                   (0x7F0000400000, 0x7F0000402000)]), 42)
    assert pagemap.lazy_ranges(pm, vmas) == [(base, base + 100 * PAGE), (base + 100 * PAGE, base + 300 * PAGE),
                                             (0x7F0000400000, 0x7F0000402000)]  # the last extent's tail is unmapped
    with pytest.raises(pagemap.PagemapError, match="bad mapping"):
        pagemap.parse_vmas(_mm([(base, base + PAGE), (0x1000, 0x2000)]), 42)


def test_spans_follow_remaps_removals_and_progress() -> None:
    s = Spans([Span(0x10000, 0x20000, 0x10000), Span(0x30000, 0x40000, 0x30000)])
    assert s.bytes == 0x20000 and s.find(0x1FFFF) is not None and s.find(0x20000) is None
    taken = s.take(0x18000, 0x34000)
    assert [(t.start, t.end, t.img) for t in taken] == [(0x18000, 0x20000, 0x18000), (0x30000, 0x34000, 0x30000)]
    s.remap(0x34000, 0x90000, 0x8000)  # part of the second span moves
    assert [(t.start, t.end, t.img) for t in s] == [(0x10000, 0x18000, 0x10000), (0x3C000, 0x40000, 0x3C000),
                                                    (0x90000, 0x98000, 0x34000)]
    s.drop_image(0x35000, 0x36000)  # a copy by image address lands at the moved place
    assert [(t.start, t.end) for t in s][2:] == [(0x90000, 0x91000), (0x92000, 0x98000)]
    assert s.at_or_after(0x50000).start == 0x90000 and s.at_or_after(0xA0000).start == 0x10000
    s.add(Span(0x3C000, 0x40000, 0x3C000))
    assert len(s) == 4


def test_staging_writes_only_the_pages_that_cannot_come_lazily(
    lazy_checkpoint: tuple[Store, str, Path], tmp_path: Path
) -> None:
    store, cid, _ = lazy_checkpoint
    record = store.get(cid)
    expected = _pages_bytes(307)
    for budget in (0, 2 * PAGE):  # nothing held (read when written), or the one run of two pages held
        memory = read_memory(store, record, budget=budget)
        assert list(memory) == ["c"] and [f.path for f in memory["c"].files] == ["containers/c/checkpoint/pages-1.img"]
        assert memory["c"].held == budget
        staging = tmp_path / f"staging-{budget}"
        staging.mkdir()
        store.materialize(cid, staging, prefix="containers", exclude={"containers/c/checkpoint/pages-1.img"})
        images = staging / "containers/c/checkpoint"
        assert not (images / "pages-1.img").exists() and (images / "core-42.img").read_bytes() == b"core"
        # Written when the container starts, into its plan's images.
        assert memory["c"].write(str(images)) == 2 * PAGE and memory["c"].held == 0
        target = images / "pages-1.img"
        data = target.read_bytes()
        assert len(data) == len(expected)
        assert data[: 2 * PAGE] == expected[: 2 * PAGE]
        assert data[2 * PAGE:] == b"\0" * (305 * PAGE)
        # Sparse on disk: the lazy part takes no blocks.
        assert os.stat(target).st_blocks * 512 < 64 * PAGE
        with pytest.raises(FileExistsError):  # written once
            memory["c"].write(str(images))


def test_background_priority_lowers_the_process_and_its_session() -> None:
    """Nice 10 for the task and, where the kernel groups sessions (autogroup), for its session."""
    def own_group() -> str:
        try:
            with open("/proc/self/autogroup", encoding="ascii") as fh:
                return fh.read()
        except FileNotFoundError:
            return ""

    mine = own_group()
    # The child starts at this process's nice; a suite run under `nice` starts above NICE already,
    # and a priority is only ever lowered, never raised back.
    expected = max(background.NICE, os.getpriority(os.PRIO_PROCESS, 0))
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        background.lower(child.pid)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == expected
        background.lower(child.pid)  # never lowered twice
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == expected
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


def test_spans_agree_with_a_page_by_page_model_under_random_changes() -> None:
    """Take, add, remap and drop_image in any order keep the books a set of pages would."""
    rng = random.Random(5)
    P = 0x1000
    model = {(a, a) for a in range(0, 64 * P, P)}  # (address now, image address), page by page
    s = Spans([Span(0, 64 * P, 0)])
    for _ in range(400):
        op = rng.choice(["take", "remap", "drop", "add"])
        lo = rng.randrange(0, 200) * P
        hi = lo + rng.randrange(1, 20) * P
        if op == "take":
            s.take(lo, hi)
            model = {(a, i) for a, i in model if not lo <= a < hi}
        elif op == "remap":
            to = rng.randrange(0, 200) * P
            s.remap(lo, to, hi - lo)
            moved = {(a - lo + to, i) for a, i in model if lo <= a < hi}
            model = {(a, i) for a, i in model if not lo <= a < hi and not to <= a < to + hi - lo} | moved
        elif op == "drop":
            s.drop_image(lo, hi)
            model = {(a, i) for a, i in model if not lo <= i < hi}
        else:
            s.add(Span(lo, hi, lo + 0x100000))
            model = {(a, i) for a, i in model if not lo <= a < hi} | {(a, a + 0x100000) for a in range(lo, hi, P)}
        pages = {(sp.start + k, sp.img + k) for sp in s for k in range(0, sp.size, P)}
        assert pages == model, op
        starts = [sp.start for sp in s]
        assert starts == sorted(starts) and all(a.end <= b.start for a, b in zip(list(s), list(s)[1:]))
        for a, _i in list(model)[:5]:
            found = s.find(a)
            assert found is not None and found.start <= a < found.end


def test_a_files_cache_is_bounded_in_bytes_and_let_go_when_its_reader_is_done(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from node_agent.lazy.chunks import CACHE_BYTES, CACHE_CHUNKS, ChunkCache

    store = Store(tmp_path / "store", chunk_size=64 << 10)
    data = _pages_bytes(2048)  # 8 MiB in chunks of about 80 KiB
    with store.writer() as w:
        w.add_bytes("pages-1.img", data)
        record = w.commit({"kind": "test"})
    entry = record.entry("pages-1.img")
    with ThreadPoolExecutor(2) as pool:
        small = ChunkCache(store.chunks, record.id, entry, pool, read_ahead=8)
        assert small.keep == CACHE_CHUNKS  # small chunks: the count bounds it
        assert b"".join(bytes(d[s:s + n]) for d, s, n in small.pieces(0, len(data))) == data
        assert 0 < len(small.cache) <= small.keep
        small.release()
        assert not small.cache
        assert bytes(small.read(PAGE, PAGE)[0]) == data[PAGE:2 * PAGE]  # read again, from the store
    # Chunks of CACHE_BYTES / 4 each: four of them fill the budget, but a reader always keeps what it
    # reads ahead and two more.
    quarter = CACHE_BYTES // 4
    big = dataclasses.replace(entry, size=8 * quarter, chunks=tuple(
        dataclasses.replace(entry.chunks[0], offset=i * quarter, size=quarter) for i in range(8)))
    with ThreadPoolExecutor(2) as pool:
        assert ChunkCache(store.chunks, record.id, big, pool, read_ahead=8).keep == 10
        assert ChunkCache(store.chunks, record.id, big, pool, read_ahead=1).keep == 8
