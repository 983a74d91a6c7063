"""Moving checkpoints between stores: descriptors, raw blobs, the importer."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import multiprocessing
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from node_agent.errors import DataLoss, FailedPrecondition, Internal, InvalidArgument, NotFound
from node_agent.oci import Descriptor
from node_agent.store import CheckpointRecord, Store
from node_agent.store.documents import CONFIG_MEDIA_TYPE, CREATED_ANNOTATION, canonical_json

MiB = 1 << 20
SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def src(tmp_path: Path) -> Store:
    return Store(tmp_path / "src", chunk_size=64 << 10)


@pytest.fixture
def dst(tmp_path: Path) -> Store:
    return Store(tmp_path / "dst", chunk_size=64 << 10)


def _checkpoint(store: Store) -> CheckpointRecord:
    with store.writer() as w:
        w.add_bytes("pages.img", os.urandom(2 * MiB) + bytes(MiB) + b"text " * 100_000)
        w.add_bytes("dir/small", b"small")
        w.add_dir("empty")
        return w.commit({"kind": "test"}, {"io.node-agent.pod": "ns/p"})


def _copy(src: Store, dst: Store, cid: str, descs: list[Descriptor] | None = None) -> CheckpointRecord:
    with dst.importer() as imp:
        for desc in descs if descs is not None else src.descriptors(cid):
            with src.open_blob(desc.digest) as fh:
                imp.add_blob(desc.digest, desc.size, fh)
        return imp.commit(src.manifest_bytes(cid))


def test_round_trip_between_stores(src: Store, dst: Store, tmp_path: Path) -> None:
    rec = _checkpoint(src)
    descs = src.descriptors(rec.id)
    assert descs[0].media_type == CONFIG_MEDIA_TYPE
    assert len(descs) == 1 + len({c.digest for e in rec.files for c in e.chunks})
    copied = _copy(src, dst, rec.id)
    assert copied == dst.get(rec.id)
    assert copied.id == rec.id and copied.files == rec.files and copied.metadata == rec.metadata
    assert copied.annotations == rec.annotations and copied.created == rec.created
    assert dst.manifest_bytes(rec.id) == src.manifest_bytes(rec.id)
    assert dst.verify(rec.id) == []
    assert dst.recover().clean
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    src.materialize(rec.id, a)
    dst.materialize(rec.id, b)
    assert (a / "pages.img").read_bytes() == (b / "pages.img").read_bytes()
    # committing again is idempotent
    again = _copy(src, dst, rec.id)
    assert again == copied and [r.id for r in dst.list()] == [rec.id]


def test_add_blob_from_iterables_and_threads(src: Store, dst: Store) -> None:
    rec = _checkpoint(src)
    descs = src.descriptors(rec.id)

    def pieces(digest: str) -> Iterator[bytes]:
        data = Path(src.blob_path(digest)).read_bytes()
        for i in range(0, len(data), 7777):
            yield data[i : i + 7777]

    with dst.importer() as imp, ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda d: imp.add_blob(d.digest, d.size, pieces(d.digest)), descs))
        imp.wait_linked()
        assert imp.blobs_added == len(descs)
        imp.commit(src.manifest_bytes(rec.id))
    assert dst.verify(rec.id) == []


def test_interrupted_import_is_resumed(src: Store, dst: Store) -> None:
    rec = _checkpoint(src)
    descs = src.descriptors(rec.id)
    half = len(descs) // 2
    with dst.importer() as imp:
        for desc in descs[:half]:
            with src.open_blob(desc.digest) as fh:
                imp.add_blob(desc.digest, desc.size, fh)
        with pytest.raises(FailedPrecondition, match="missing"):
            imp.commit(src.manifest_bytes(rec.id))
    assert dst.list() == [] and os.listdir(dst.ingest_dir) == []
    # verified blobs stay (until garbage collection), so a second run skips them
    assert all(dst.has_blob(d.digest) for d in descs[:half])
    fetched: list[str] = []
    with dst.importer() as imp:
        for desc in descs:
            if dst.has_blob(desc.digest):
                continue
            fetched.append(desc.digest)
            with src.open_blob(desc.digest) as fh:
                imp.add_blob(desc.digest, desc.size, fh)
        imp.commit(src.manifest_bytes(rec.id))
    assert fetched == [d.digest for d in descs[half:]]
    assert dst.verify(rec.id) == []


def test_add_blob_skips_present_blobs_without_reading(src: Store, dst: Store) -> None:
    rec = _checkpoint(src)
    _copy(src, dst, rec.id)

    class Exploding(io.RawIOBase):
        def readinto(self, buffer: Any) -> int:
            raise AssertionError("read")

    with dst.importer() as imp:
        for desc in src.descriptors(rec.id):
            imp.add_blob(desc.digest, desc.size, Exploding())  # type: ignore[arg-type]
        assert imp.blobs_skipped == len(src.descriptors(rec.id)) and imp.blobs_added == 0
        imp.commit(src.manifest_bytes(rec.id))


def test_a_blob_is_linked_only_once_durable_and_its_adder_does_not_wait_for_the_disk(
    src: Store, dst: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """add_blob returns once the bytes are verified; the link threads fsync and then link; the staging waits."""
    rec = _checkpoint(src)
    descs = src.descriptors(rec.id)
    disk = threading.Event()
    synced: list[int] = []
    real_fsync = os.fsync

    def held_fsync(fd: int) -> None:  # (os.fsync of every module: the link threads' are the ones held)
        if threading.current_thread().name.startswith("import-link"):
            assert disk.wait(30), "the disk was never let go"
            synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr("node_agent.store.blob_import.os.fsync", held_fsync)
    with dst.importer() as imp:
        for desc in descs:  # none of them waits for its fsync
            with src.open_blob(desc.digest) as fh:
                imp.add_blob(desc.digest, desc.size, fh)
        assert synced == [] and not any(dst.has_blob(d.digest) for d in descs)  # nothing linked before durable
        disk.set()
        record = imp.commit(src.manifest_bytes(rec.id))  # the staging waits for every link
        assert len(synced) == len(descs) and all(dst.has_blob(d.digest) for d in descs)
    assert record.id == rec.id and dst.verify(rec.id) == []


def test_a_blob_that_cannot_be_made_durable_fails_the_import_and_is_not_linked(
    src: Store, dst: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = _checkpoint(src)
    descs = src.descriptors(rec.id)
    bad = descs[1].digest
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(bad.split(":")[1]):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr("node_agent.store.blob_import.os.fsync", failing_fsync)
    with dst.importer() as imp:
        for desc in descs:
            with src.open_blob(desc.digest) as fh:
                imp.add_blob(desc.digest, desc.size, fh)
        with pytest.raises(Internal, match=f"importing blob {bad}: Input/output error"):
            imp.wait_linked()
        with pytest.raises(Internal, match=f"importing blob {bad}: Input/output error"):
            imp.commit(src.manifest_bytes(rec.id))
    assert dst.list() == [] and not dst.has_blob(bad) and os.listdir(dst.ingest_dir) == []
    assert all(dst.has_blob(d.digest) for d in descs if d.digest != bad)  # verified and durable: kept for a re-run


def test_bad_blobs_are_refused(dst: Store) -> None:
    data = os.urandom(5000)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with dst.importer() as imp:
        with pytest.raises(DataLoss, match="hash"):
            imp.add_blob(digest, len(data), io.BytesIO(data[:-1] + bytes([data[-1] ^ 1])))
        with pytest.raises(DataLoss, match="received 4999 bytes"):
            imp.add_blob(digest, len(data), io.BytesIO(data[:-1]))
        with pytest.raises(DataLoss, match="more than"):
            imp.add_blob(digest, len(data) - 1, io.BytesIO(data))
        with pytest.raises(InvalidArgument):
            imp.add_blob("sha256:../../x", 1, io.BytesIO(b"x"))
        with pytest.raises(InvalidArgument):
            imp.add_blob(digest, -1, io.BytesIO(b"x"))
        assert not dst.has_blob(digest)
        imp.add_blob(digest, len(data), io.BytesIO(data))  # a retry after a failure works
        imp.wait_linked()
        assert dst.has_blob(digest)
    with pytest.raises(FailedPrecondition):
        imp.add_blob(digest, len(data), io.BytesIO(data))


def test_hostile_manifests_are_refused(src: Store, dst: Store) -> None:
    rec = _checkpoint(src)
    descs = src.descriptors(rec.id)
    good = src.manifest_bytes(rec.id)
    doc = json.loads(good)
    bad_layers = dict(doc, layers=doc["layers"][1:])
    bad_created = dict(doc, annotations={CREATED_ANNOTATION: "soon"})
    hostile_config = canonical_json({"metadata": {}, "files": [{"path": "../x", "type": "dir", "mode": 448}]})
    bad_config = dict(doc, config={"mediaType": CONFIG_MEDIA_TYPE, "digest": "sha256:" + hashlib.sha256(
        hostile_config).hexdigest(), "size": len(hostile_config)})
    cases = ((b"{", "JSON"), (canonical_json(bad_layers), "layers"),
             (canonical_json(bad_created), "created"), (canonical_json(bad_config), "config"))
    for bad, match in cases:
        with dst.importer() as imp:
            for desc in descs:
                with src.open_blob(desc.digest) as fh:
                    imp.add_blob(desc.digest, desc.size, fh)
            imp.add_blob(bad_config["config"]["digest"], len(hostile_config), [hostile_config])
            with pytest.raises(InvalidArgument, match=match):
                imp.commit(bad)
            with pytest.raises(FailedPrecondition):
                imp.commit(good)  # a failed commit aborts the importer
    assert dst.list() == []


def test_undecodable_chunk_is_caught_by_verify(dst: Store) -> None:
    garbage = b"\x28\xb5\x2f\xfd" + os.urandom(100)
    digest = "sha256:" + hashlib.sha256(garbage).hexdigest()
    config = canonical_json({"metadata": {}, "files": [{"path": "f", "type": "file", "mode": 420, "size": 1000,
        "chunks": [{"digest": digest, "offset": 0, "size": 1000, "stored_size": len(garbage), "encoding": "zstd"}]}]})
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    manifest = canonical_json({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": "application/vnd.node-agent.checkpoint.v1",
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": "application/vnd.node-agent.chunk.v1+zstd", "digest": digest, "size": len(garbage)}],
        "annotations": {CREATED_ANNOTATION: "2026-01-01T00:00:00Z"},
    })
    with dst.importer() as imp:
        imp.add_blob(digest, len(garbage), [garbage])
        imp.add_blob(config_digest, len(config), [config])
        rec = imp.commit(manifest)
    (bad,) = dst.verify(rec.id)
    assert bad.digest == digest and bad.paths == ("f",) and "undecodable" in bad.reason
    with pytest.raises(DataLoss), dst.open(rec.id, "f") as fh:
        fh.read()


def test_open_blob_verifies_while_streaming(src: Store) -> None:
    rec = _checkpoint(src)
    desc = src.descriptors(rec.id)[1]
    with src.open_blob(desc.digest) as fh:
        assert hashlib.sha256(fh.read()).hexdigest() == desc.digest.removeprefix("sha256:")
    path = Path(src.blob_path(desc.digest))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with src.open_blob(desc.digest) as fh, pytest.raises(DataLoss, match=desc.digest):
        while fh.read(4096):
            pass
    with pytest.raises(NotFound):
        src.open_blob("sha256:" + "0" * 64)
    assert not src.has_blob("sha256:" + "0" * 64)


def _child_import_and_die(src_root: str, dst_root: str, cid: str, n: int) -> None:
    src, dst = Store(src_root, chunk_size=64 << 10), Store(dst_root, chunk_size=64 << 10)
    imp = dst.importer()
    for desc in src.descriptors(cid)[:n]:
        with src.open_blob(desc.digest) as fh:
            imp.add_blob(desc.digest, desc.size, fh)
    imp.wait_linked()  # durable and linked: then killed before it ends
    os._exit(0)


def test_killed_import_leaves_only_garbage(src: Store, dst: Store) -> None:
    rec = _checkpoint(src)
    proc = SPAWN.Process(target=_child_import_and_die, args=(src.root, dst.root, rec.id, 3), name="importer")
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert dst.list() == [] and len(os.listdir(dst.ingest_dir)) == 1
    kept = [d.digest for d in src.descriptors(rec.id)[:3]]
    assert all(dst.has_blob(d) for d in kept)
    # a pull resumed before any gc skips what arrived; recover/gc remove the rest
    report = dst.recover()
    assert len(report.ingest_removed) == 1 and sorted(report.blobs_removed) == sorted(kept)
    assert dst.recover().clean and os.listdir(dst.blobs.dir) == []


pytestmark = pytest.mark.usefixtures("no_leaked_threads")
