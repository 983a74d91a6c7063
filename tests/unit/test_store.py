"""Tests of the content-addressed checkpoint store (node_agent.store)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node_agent.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from node_agent.store import CheckpointRecord, Store
from node_agent.store import checkpoints as checkpoints_mod
from node_agent.store import manifest as manifest_mod
from node_agent.store.manifest import MEDIA_TYPE, FileEntry, encode_manifest

MiB = 1 << 20
SPAWN = multiprocessing.get_context("spawn")


# -- helpers ---------------------------------------------------------------------------


def _tree(root: Path) -> dict[str, tuple[str, int, bytes | None]]:
    """Map relative path -> (kind, mode, content) for everything under root."""
    out: dict[str, tuple[str, int, bytes | None]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            p = Path(dirpath, name)
            out[p.relative_to(root).as_posix()] = ("dir", stat.S_IMODE(p.lstat().st_mode), None)
        for name in filenames:
            p = Path(dirpath, name)
            out[p.relative_to(root).as_posix()] = ("file", stat.S_IMODE(p.lstat().st_mode), p.read_bytes())
    return out


def _blob_files(store: Store) -> set[str]:
    return set(os.listdir(store.blobs.dir))


def _make_source(root: Path) -> Path:
    src = root / "src"
    (src / "containers" / "app" / "checkpoint").mkdir(parents=True)
    (src / "containers" / "app" / "empty-dir").mkdir()
    (src / "containers" / "side" / "checkpoint").mkdir(parents=True)
    big = os.urandom(12 * MiB) + bytes(8 * MiB) + b"tail"
    (src / "containers" / "app" / "checkpoint" / "pages-1.img").write_bytes(big)
    (src / "containers" / "app" / "checkpoint" / "empty.img").write_bytes(b"")
    (src / "containers" / "app" / "config.dump").write_text('{"id": "abc"}')
    (src / "containers" / "side" / "checkpoint" / "core.img").write_bytes(os.urandom(1000))
    (src / "spec.dump").write_bytes(b"{}")
    os.chmod(src / "spec.dump", 0o640)
    os.chmod(src / "containers" / "app" / "empty-dir", 0o750)
    return src


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store", chunk_size=4 * MiB)


@pytest.fixture
def small_store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store", chunk_size=1024)


def _commit_bytes(store: Store, files: dict[str, bytes], meta: dict[str, Any] | None = None) -> CheckpointRecord:
    with store.writer() as w:
        for path, data in files.items():
            w.add_bytes(path, data)
        return w.commit(meta or {})


def _write_manifest(store: Store, doc: Any, *, raw: bytes | None = None) -> str:
    data = raw if raw is not None else json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    hexid = hashlib.sha256(data).hexdigest()
    Path(store.manifest_path(hexid)).write_bytes(data)
    return hexid


def _doc(files: list[Any], **over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schemaVersion": 1,
        "mediaType": MEDIA_TYPE,
        "created": "2026-01-01T00:00:00Z",
        "metadata": {},
        "files": files,
    }
    doc.update(over)
    return doc


# -- round trip, ids, dedup ------------------------------------------------------------


def test_round_trip_tree(store: Store, tmp_path: Path) -> None:
    src = _make_source(tmp_path)
    with store.writer() as w:
        w.add_tree("pod", src)
        w.add_bytes("extra/note.txt", b"hello", mode=0o644)
        w.add_file("extra/copy.img", src / "containers" / "side" / "checkpoint" / "core.img", mode=0o400)
        rec = w.commit({"pod": {"name": "web"}, "n": 1})
    assert rec.metadata == {"pod": {"name": "web"}, "n": 1}
    assert store.get(rec.id) == rec
    assert [r.id for r in store.list()] == [rec.id]
    big = rec.entry("pod/containers/app/checkpoint/pages-1.img")
    assert big.size == 20 * MiB + 4 and len(big.chunks) == 6
    assert rec.entry("pod/containers/app/checkpoint/empty.img").chunks == ()
    # the two all-zero chunks are stored once, the side file and its copy once
    assert rec.stored_size == rec.size - 4 * MiB - 1000

    dest = tmp_path / "dest"
    dest.mkdir()
    store.materialize(rec.id, str(dest))
    got = _tree(dest)
    want = {f"pod/{k}": v for k, v in _tree(src).items()}
    want["pod"] = ("dir", stat.S_IMODE(src.stat().st_mode), None)
    want["extra"] = ("dir", 0o700, None)
    want["extra/note.txt"] = ("file", 0o644, b"hello")
    want["extra/copy.img"] = ("file", 0o400, (src / "containers/side/checkpoint/core.img").read_bytes())
    assert got == want


def test_materialize_prefix_keeps_paths(store: Store, tmp_path: Path) -> None:
    rec = _commit_bytes(store, {"a/x/1": b"1", "a/x/2": b"2", "a/y": b"y", "b": b"b"})
    dest = tmp_path / "dest"
    (dest / "a").mkdir(parents=True)  # pre-existing dirs are fine
    store.materialize(rec.id, dest, prefix="a/x")
    assert {k: v[2] for k, v in _tree(dest).items()} == {"a": None, "a/x": None, "a/x/1": b"1", "a/x/2": b"2"}
    with pytest.raises(NotFound):
        store.materialize(rec.id, tmp_path, prefix="nope")


def test_materialize_dest_must_hold_only_dirs(store: Store, tmp_path: Path) -> None:
    rec = _commit_bytes(store, {"f": b"data"})
    dest = tmp_path / "dest"
    (dest / "sub").mkdir(parents=True)
    (dest / "sub" / "file").write_bytes(b"x")
    with pytest.raises(FailedPrecondition, match="not empty"):
        store.materialize(rec.id, dest)
    (dest / "sub" / "file").unlink()
    (dest / "link").symlink_to(tmp_path)
    with pytest.raises(FailedPrecondition, match="not a directory"):
        store.materialize(rec.id, dest)


def test_checkpoint_id_is_sha256_of_manifest(store: Store) -> None:
    rec = _commit_bytes(store, {"a": b"x" * 5000, "b/c": b""}, {"k": "v"})
    data = Path(rec.manifest_path).read_bytes()
    assert rec.id == "sha256:" + hashlib.sha256(data).hexdigest()
    assert Path(rec.manifest_path).name == rec.id.removeprefix("sha256:") + ".json"
    doc = json.loads(data)
    assert data == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert doc["schemaVersion"] == 1 and doc["mediaType"] == MEDIA_TYPE
    assert doc["files"][0]["chunks"] == [{"digest": "sha256:" + hashlib.sha256(b"x" * 5000).hexdigest(),
                                          "size": 5000, "offset": 0}]


def test_dedup(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(os.urandom(9 * MiB))
    with store.writer() as w:
        w.add_file("one", src)
        first = w.commit({})
        assert w.bytes_written == w.bytes_total == 9 * MiB
    blobs = _blob_files(store)
    assert len(blobs) == 3
    with store.writer() as w:
        w.add_file("one", src)
        w.add_file("two", src)  # shares every chunk with "one"
        second = w.commit({})
        assert w.bytes_written == 0 and w.bytes_total == 18 * MiB
    assert _blob_files(store) == blobs
    assert second.stored_size == first.stored_size == 9 * MiB
    assert store.usage() == 9 * MiB + os.path.getsize(first.manifest_path) + os.path.getsize(second.manifest_path)


def test_writer_rejects_bad_input(store: Store, tmp_path: Path) -> None:
    with store.writer() as w:
        w.add_bytes("a", b"1")
        for bad in ("", "/abs", "a/../b", "./a", "a//b", "a/", "x\x00y"):
            with pytest.raises(InvalidArgument):
                w.add_bytes(bad, b"")
        with pytest.raises(InvalidArgument, match="already added"):
            w.add_bytes("a", b"2")
        w.add_bytes("a/b", b"under a file")
        with pytest.raises(InvalidArgument, match="under the regular file"):
            w.commit({})
    with store.writer() as w, pytest.raises(InvalidArgument, match="JSON"):
        w.commit({"x": object()})
    with store.writer() as w, pytest.raises(NotFound):
        w.add_file("missing", tmp_path / "missing")
    assert store.list() == []
    assert os.listdir(store.ingest_dir) == []


def test_add_tree_rejects_symlinks_and_special_files(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok").write_bytes(b"ok")
    (src / "link").symlink_to(src / "ok")
    with store.writer() as w, pytest.raises(InvalidArgument, match="symlink"):
        w.add_tree("", src)
    (src / "link").unlink()
    os.mkfifo(src / "fifo")
    with store.writer() as w, pytest.raises(InvalidArgument, match="special file"):
        w.add_tree("", src)
    (src / "fifo").unlink()
    (tmp_path / "srclink").symlink_to(src)
    with store.writer() as w, pytest.raises(InvalidArgument):
        w.add_tree("", tmp_path / "srclink")
    with store.writer() as w, pytest.raises(InvalidArgument, match="symlink"):
        w.add_file("x", tmp_path / "srclink")


# -- ids ----------------------------------------------------------------------------------


def _colliding_manifests() -> tuple[bytes, bytes]:
    """Two manifests whose ids share their first six hex digits."""
    seen: dict[str, bytes] = {}
    for i in range(1_000_000):
        data = encode_manifest("2026-01-01T00:00:00Z", {"n": i}, [])
        head = hashlib.sha256(data).hexdigest()[:6]
        if head in seen:
            return seen[head], data
        seen[head] = data
    raise AssertionError("no collision")


def test_lookup_by_prefix(store: Store) -> None:
    rec = _commit_bytes(store, {"a": b"a"})
    hexid = rec.id.removeprefix("sha256:")
    for ref in (rec.id, hexid, hexid[:6], "sha256:" + hexid[:10], hexid[:8].upper()):
        assert store.get(ref).id == rec.id
    a, b = _colliding_manifests()
    ha = _write_manifest(store, None, raw=a)
    hb = _write_manifest(store, None, raw=b)
    assert store.get(ha).metadata != store.get(hb).metadata
    with pytest.raises(InvalidArgument, match="ambiguous"):
        store.get(ha[:6])
    for bad in ("", "abc", "xyz123", "sha512:" + hexid, "../../etc/passwd", hexid + "0", "sha256:", 7):
        with pytest.raises(InvalidArgument, match="malformed"):
            store.get(bad)  # type: ignore[arg-type]
    unknown = "0" * 64 if not hexid.startswith("0") else "f" * 64
    with pytest.raises(NotFound):
        store.get(unknown)
    with pytest.raises(NotFound):
        store.get(unknown[:7])
    with pytest.raises(NotFound):
        store.remove(unknown)
    with pytest.raises(InvalidArgument):
        store.blob_path("sha256:../../x")
    assert store.blob_path("sha256:" + hexid) == os.path.join(store.blobs.dir, hexid)


# -- corruption -------------------------------------------------------------------------


def test_corrupt_blob_detected_everywhere(small_store: Store, tmp_path: Path) -> None:
    data = os.urandom(5000)
    rec = _commit_bytes(small_store, {"dir/file": data, "ok": b"fine"})
    assert small_store.verify(rec.id) == []
    victim = rec.entry("dir/file").chunks[2]
    path = small_store.blob_path(victim.digest)
    blob = bytearray(Path(path).read_bytes())
    blob[10] ^= 0xFF
    Path(path).write_bytes(bytes(blob))

    bad = small_store.verify(rec.id)
    assert [(b.digest, b.paths) for b in bad] == [(victim.digest, ("dir/file",))]
    assert "digest mismatch" in bad[0].reason

    dest = tmp_path / "dest"
    (dest / "pre").mkdir(parents=True)
    with pytest.raises(DataLoss) as info:
        small_store.materialize(rec.id, dest)
    assert victim.digest in str(info.value) and "dir/file" in str(info.value) and rec.id in str(info.value)
    assert _tree(dest) == {"pre": ("dir", 0o777 & ~_umask(), None)}

    with small_store.open(rec.id, "dir/file") as fh:
        assert fh.read(1024) == data[:1024]  # chunk 0 is fine
        with pytest.raises(DataLoss, match=victim.digest):
            fh.pread(2000, 100)

    os.unlink(small_store.blob_path(rec.entry("ok").chunks[0].digest))
    Path(small_store.blob_path(rec.entry("dir/file").chunks[0].digest)).write_bytes(b"short")
    reasons = {b.paths: b.reason for b in small_store.verify(rec.id)}
    assert reasons[("ok",)] == "missing"
    assert reasons[("dir/file",)].startswith("size mismatch") or "digest mismatch" in reasons[("dir/file",)]
    assert len(small_store.verify(rec.id)) == 3


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# -- remove and leases ----------------------------------------------------------------------


def test_remove_keeps_shared_blobs(small_store: Store) -> None:
    shared = os.urandom(3000)
    a = _commit_bytes(small_store, {"shared": shared, "only-a": b"A" * 2000})
    b = _commit_bytes(small_store, {"shared": shared, "only-b": b"B" * 10})
    only_a = {c.digest for c in a.entry("only-a").chunks}
    small_store.remove(a.id[:20])
    assert [r.id for r in small_store.list()] == [b.id]
    assert small_store.verify(b.id) == []
    assert not any(os.path.exists(small_store.blob_path(d)) for d in only_a)
    with pytest.raises(NotFound):
        small_store.get(a.id)
    small_store.remove(b.id)
    assert _blob_files(small_store) == set()
    assert small_store.usage() == 0


def test_remove_spares_blobs_of_live_writer_in_thread(small_store: Store) -> None:
    shared = os.urandom(4000)
    a = _commit_bytes(small_store, {"f": shared})
    added = threading.Event()
    removed = threading.Event()
    result: list[CheckpointRecord] = []

    def write() -> None:
        with small_store.writer() as w:
            w.add_bytes("g", shared)  # deduplicated against a's blobs
            assert w.bytes_written == 0
            added.set()
            assert removed.wait(10)
            result.append(w.commit({}))

    t = threading.Thread(target=write, name="writer")
    t.start()
    assert added.wait(10)
    small_store.remove(a.id)
    removed.set()
    t.join(10)
    assert small_store.verify(result[0].id) == []
    assert small_store.recover().blobs_removed == ()


def _child_write(root: str, data: bytes, ready: Any, go: Any, out: Any) -> None:
    store = Store(root, chunk_size=1024)
    with store.writer() as w:
        w.add_bytes("g", data)
        ready.set()
        if not go.wait(20):
            raise SystemExit(2)
        out.put(w.commit({"child": True}).id)


def test_remove_spares_blobs_of_live_writer_in_process(small_store: Store) -> None:
    shared = os.urandom(4000)
    a = _commit_bytes(small_store, {"f": shared})
    ready, go, out = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    proc = SPAWN.Process(target=_child_write, args=(small_store.root, shared, ready, go, out), name="child-writer")
    proc.start()
    try:
        assert ready.wait(20)
        small_store.remove(a.id)
        assert small_store.recover().ingest_removed == ()  # the child's lease is live
        go.set()
        child_id = out.get(timeout=20)
    finally:
        proc.join(20)
    assert proc.exitcode == 0
    assert small_store.verify(child_id) == []
    assert small_store.get(child_id).metadata == {"child": True}


def test_concurrent_writers_and_removes(small_store: Store) -> None:
    common = os.urandom(3000)
    errors: list[BaseException] = []
    kept: list[str] = []
    lock = threading.Lock()

    def work(n: int) -> None:
        try:
            for i in range(4):
                rec = _commit_bytes(small_store, {"common": common, "own": os.urandom(1500), "n": str(n).encode()})
                if i % 2:
                    small_store.remove(rec.id)
                else:
                    with lock:
                        kept.append(rec.id)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,), name=f"w{n}") for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert sorted(r.id for r in small_store.list()) == sorted(kept)
    for cid in kept:
        assert small_store.verify(cid) == []
    assert small_store.recover().clean


# -- crashes ------------------------------------------------------------------------------


def _child_abandon(root: str, data: bytes) -> None:
    store = Store(root, chunk_size=1024)
    w = store.writer()
    w.add_bytes("f", data)
    os._exit(0)  # dies without commit or abort


def _child_die_before_publish(root: str, data: bytes) -> None:
    def die(*args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoints_mod._publish = die  # type: ignore[assignment]
    store = Store(root, chunk_size=1024)
    with store.writer() as w:
        w.add_bytes("f", data)
        w.commit({})


def _run_child(target: Any, *args: Any) -> int | None:
    proc = SPAWN.Process(target=target, args=args, name="child")
    proc.start()
    proc.join(30)
    return proc.exitcode


def test_abandoned_writer_is_cleaned_by_recover(small_store: Store) -> None:
    live = small_store.writer()
    live.add_bytes("x", b"live data")
    assert _run_child(_child_abandon, small_store.root, os.urandom(3000)) == 0
    assert small_store.list() == []
    assert len(os.listdir(small_store.ingest_dir)) == 2
    report = small_store.recover()
    assert len(report.ingest_removed) == 1 and report.blobs_removed == ()
    assert len(os.listdir(small_store.ingest_dir)) == 1  # the live writer's lease is kept
    rec = live.commit({})
    assert small_store.verify(rec.id) == []
    assert os.listdir(small_store.ingest_dir) == []


def test_killed_between_blob_rename_and_publish(small_store: Store) -> None:
    keep = _commit_bytes(small_store, {"k": b"keep me"})
    assert _run_child(_child_die_before_publish, small_store.root, os.urandom(3000)) == -signal.SIGKILL
    assert [r.id for r in small_store.list()] == [keep.id]
    assert len(_blob_files(small_store)) == 1 + 3  # orphans were renamed into place
    report = small_store.recover()
    assert len(report.ingest_removed) == 1 and len(report.blobs_removed) == 3
    assert report.bytes_freed == 3000
    assert _blob_files(small_store) == {keep.entry("k").chunks[0].digest.removeprefix("sha256:")}
    assert small_store.verify(keep.id) == []
    assert small_store.recover().clean


def test_blob_verified_before_it_becomes_visible(small_store: Store) -> None:
    with small_store.writer() as w:
        w.add_bytes("f", os.urandom(3000))
        (ingest,) = os.listdir(small_store.ingest_dir)
        chunk = sorted(Path(small_store.ingest_dir, ingest).glob("chunk-*"))[1]
        chunk.write_bytes(b"tampered")
        with pytest.raises(DataLoss, match="failed verification"):
            w.commit({})
    assert small_store.list() == [] and _blob_files(small_store) == set()
    assert os.listdir(small_store.ingest_dir) == []


def test_list_newest_first(store: Store) -> None:
    older = _write_manifest(store, _doc([], created="2026-01-01T00:00:00.5Z"))
    newer = _write_manifest(store, _doc([], created="2026-01-01T00:00:01Z"))
    oldest = _write_manifest(store, _doc([], created="2025-12-31T23:59:59Z"))
    assert [r.id for r in store.list()] == ["sha256:" + h for h in (newer, older, oldest)]


def test_abort_and_exception_leave_nothing(small_store: Store) -> None:
    with pytest.raises(RuntimeError), small_store.writer() as w:
        w.add_bytes("a", os.urandom(5000))
        raise RuntimeError("boom")
    with pytest.raises(FailedPrecondition):
        w.add_bytes("b", b"")
    with small_store.writer() as w2:
        w2.add_bytes("a", b"never committed")
    assert os.listdir(small_store.ingest_dir) == []
    assert _blob_files(small_store) == set() and small_store.list() == []


def test_recover_strays_and_quarantine(small_store: Store) -> None:
    rec = _commit_bytes(small_store, {"a": b"a"})
    Path(small_store.blobs.dir, ".tmp-123").write_bytes(b"junk")
    Path(small_store.ingest_dir, "stray").write_bytes(b"junk")
    Path(small_store.checkpoints_dir, "notes.txt").write_bytes(b"junk")
    bad_hex = "ab" * 32
    Path(small_store.manifest_path(bad_hex)).write_bytes(b"{not json")
    report = small_store.recover()
    assert sorted(report.strays_removed) == ["blobs/sha256/.tmp-123", "ingest/stray"]
    assert sorted(report.quarantined) == sorted(["notes.txt", bad_hex + ".json"])
    assert len(os.listdir(small_store.quarantine_dir)) == 2
    assert [r.id for r in small_store.list()] == [rec.id]
    assert small_store.recover().clean


# -- modes --------------------------------------------------------------------------------


def test_store_modes(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        root = tmp_path / "store"
        root.mkdir(mode=0o777)
        store = Store(root, chunk_size=1024)
        w = store.writer()
        w.add_bytes("f", os.urandom(3000), mode=0o777)
        seen = set()
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames:
                seen.add(stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode))
            for name in filenames:
                assert stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode) == 0o600, name
        assert seen == {0o700}
        rec = w.commit({})
    finally:
        os.umask(old)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            assert stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode) == 0o700
        for name in filenames:
            assert stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode) == 0o600
    assert rec.entry("f").mode == 0o777


# -- random access ----------------------------------------------------------------------------


def test_file_reader_random_access(small_store: Store) -> None:
    data = os.urandom(5 * 1024 + 321)
    rec = _commit_bytes(small_store, {"f": data, "empty": b""})
    with small_store.open(rec.id[:13], "empty") as fh:
        assert fh.size == 0 and fh.read() == b""
    with pytest.raises(InvalidArgument):
        small_store.open(rec.id, "../f")
    with pytest.raises(NotFound):
        small_store.open(rec.id, "g")
    reader = small_store.open(rec.id, "f")

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(offset=st.integers(0, len(data) + 50), length=st.integers(0, 3000))
    def check(offset: int, length: int) -> None:
        assert reader.pread(offset, length) == data[offset : offset + length]
        assert reader.seek(offset) == offset
        got = reader.read(length)
        assert got == data[offset : offset + length]
        assert reader.tell() == offset + len(got)

    with reader:
        check()
        reader.seek(-10, os.SEEK_END)
        assert reader.read() == data[-10:]
        reader.seek(0)
        assert reader.read() == data
        buf = bytearray(2000)
        reader.seek(900)
        assert reader.readinto(buf) == 2000 and bytes(buf) == data[900:2900]
    assert reader.closed
    with pytest.raises(ValueError):
        reader.pread(0, 1)


# -- hostile manifests ----------------------------------------------------------------------

_D = "sha256:" + "a" * 64
_F = {"path": "f", "type": "file", "mode": 420, "size": 3, "chunks": [{"digest": _D, "size": 3, "offset": 0}]}


def _file(**over: Any) -> dict[str, Any]:
    entry: dict[str, Any] = json.loads(json.dumps(_F))
    entry.update(over)
    return entry


HOSTILE: list[tuple[str, Any]] = [
    ("dotdot", _doc([_file(path="../etc/passwd")])),
    ("absolute", _doc([_file(path="/etc/passwd")])),
    ("dot", _doc([_file(path="a/./f")])),
    ("empty component", _doc([_file(path="a//f")])),
    ("nul", _doc([_file(path="a\x00b")])),
    ("duplicate", _doc([_file(), _file()])),
    ("file as dir", _doc([_file(), _file(path="f/g")])),
    ("symlink type", _doc([{"path": "l", "type": "symlink", "mode": 511}])),
    ("gap", _doc([_file(size=6, chunks=[{"digest": _D, "size": 3, "offset": 0}, {"digest": _D, "size": 3, "offset": 4}])])),
    ("sum", _doc([_file(size=4)])),
    ("bad digest", _doc([_file(chunks=[{"digest": "sha256:XYZ", "size": 3, "offset": 0}])])),
    ("bad alg", _doc([_file(chunks=[{"digest": "md5:" + "a" * 32, "size": 3, "offset": 0}])])),
    ("zero chunk", _doc([_file(size=0, chunks=[{"digest": _D, "size": 0, "offset": 0}])])),
    ("huge chunk", _doc([_file(size=1 << 40, chunks=[{"digest": _D, "size": 1 << 40, "offset": 0}])])),
    ("encoding", _doc([_file(chunks=[{"digest": _D, "size": 3, "offset": 0, "encoding": "zstd"}])])),
    ("bool mode", _doc([_file(mode=True)])),
    ("big mode", _doc([_file(mode=0o17777)])),
    ("string size", _doc([_file(size="3")])),
    ("extra key", _doc([_file(link="x")])),
    ("dir with chunks", _doc([{"path": "d", "type": "dir", "mode": 448, "chunks": []}])),
    ("version", _doc([], schemaVersion=2)),
    ("media type", _doc([], mediaType="application/json")),
    ("created", _doc([], created="yesterday")),
    ("metadata", _doc([], metadata=[1])),
    ("files", {**_doc([]), "files": {"a": 1}}),
    ("top extra", _doc([], extra=1)),
    ("top list", [1, 2]),
]


@pytest.mark.parametrize("name,doc", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_manifest_rejected(store: Store, name: str, doc: Any) -> None:
    hexid = _write_manifest(store, doc)
    with pytest.raises(DataLoss, match=hexid):
        store.get(hexid)
    assert store.list() == []


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b'{"a":1,"a":2}', b"\xff\xfe", b'{"x": NaN}', b"[" * 100000 + b"]" * 100000],
    ids=["syntax", "duplicate keys", "utf8", "nan", "deep"],
)
def test_hostile_manifest_bytes(store: Store, raw: bytes) -> None:
    hexid = _write_manifest(store, None, raw=raw)
    with pytest.raises(DataLoss):
        store.get(hexid)
    assert hexid + ".json" in store.recover().quarantined


def test_manifest_limits_and_names(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    ok = _doc([_file(path=f"f{i}") for i in range(4)])
    hexid = _write_manifest(store, ok)
    store.get(hexid)
    monkeypatch.setattr(manifest_mod, "MAX_ENTRIES", 3)
    with pytest.raises(DataLoss, match="limit of 3"):
        store.get(hexid)
    monkeypatch.undo()
    monkeypatch.setattr(checkpoints_mod, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(DataLoss, match="limit"):
        store.get(hexid)
    monkeypatch.undo()
    # content that does not hash to its name
    other = "cd" * 32
    os.rename(store.manifest_path(hexid), store.manifest_path(other))
    with pytest.raises(DataLoss, match="hashes to"):
        store.get(other)
    # a symlinked manifest is never followed
    os.symlink(store.manifest_path(other), store.manifest_path(hexid))
    with pytest.raises(DataLoss):
        store.get(hexid)


@settings(max_examples=100, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["path", "type", "mode", "size", "chunks", "digest", "offset", "files", "metadata"]), inner, max_size=5),
    max_leaves=20,
))
def test_decode_only_raises_dataloss(doc: Any) -> None:
    for candidate in (doc, _doc([doc]), _doc([_file(chunks=[doc])])):
        data = json.dumps(candidate).encode()
        try:
            manifest_mod.decode_manifest(data)
        except DataLoss:
            pass


def test_materialize_writes_only_inside_dest(store: Store, tmp_path: Path) -> None:
    rec = _commit_bytes(store, {"a/b/c": b"c", "d": b"d"})
    dest = tmp_path / "dest"
    dest.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    real_write = checkpoints_mod.Store._write_entries

    def swap_in_symlink(self: Store, record: CheckpointRecord, entries: Any, tree: Any) -> None:
        # a racing process replaces a directory with a symlink after the emptiness check
        (dest / "a").symlink_to(outside)
        real_write(self, record, entries, tree)

    checkpoints_mod.Store._write_entries = swap_in_symlink  # type: ignore[method-assign]
    try:
        with pytest.raises(FailedPrecondition, match="symlink"):
            store.materialize(rec.id, dest)
    finally:
        checkpoints_mod.Store._write_entries = real_write  # type: ignore[method-assign]
    assert list(outside.iterdir()) == []
    assert [p.name for p in dest.iterdir()] == ["a"] and (dest / "a").is_symlink()


def test_entries_have_file_entry_type(store: Store) -> None:
    rec = _commit_bytes(store, {"x": b"1"})
    assert all(isinstance(e, FileEntry) for e in rec.files)


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert leaked == []
