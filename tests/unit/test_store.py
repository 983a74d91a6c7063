"""Tests of the checkpoint store (node_agent.store): layout, chunking, integrity, leases, crashes."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import signal
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node_agent.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from node_agent.oci import ARTIFACT_TYPE, EMPTY_BLOB, EMPTY_DIGEST, OCI_INDEX_MEDIA_TYPE, OCI_MANIFEST_MEDIA_TYPE
from node_agent.store import (
    CHUNK_MEDIA_TYPE,
    CHUNK_ZSTD_MEDIA_TYPE,
    CONFIG_MEDIA_TYPE,
    CheckpointRecord,
    FileEntry,
    Store,
)
from node_agent.store import checkpoints as checkpoints_mod
from node_agent.store import index as index_mod
from node_agent.store import documents as manifest_mod
from node_agent.store import pipeline as pipeline_mod
from node_agent.store.chunking import Chunker
from node_agent.store.documents import CREATED_ANNOTATION, canonical_json

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


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


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
    return Store(tmp_path / "store")


@pytest.fixture
def small_store(tmp_path: Path) -> Store:
    """Chunks of 64 to 1024 bytes (256 on average)."""
    return Store(tmp_path / "store", chunk_size=256)


def _commit_bytes(
    store: Store, files: dict[str, bytes], meta: dict[str, Any] | None = None, annotations: dict[str, str] | None = None
) -> CheckpointRecord:
    with store.writer() as w:
        for path, data in files.items():
            w.add_bytes(path, data)
        return w.commit(meta or {}, annotations)


def _index(store: Store) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(Path(store.index_path).read_bytes())
    return doc


def _put_blob(store: Store, data: bytes) -> str:
    digest = _sha(data)
    path = Path(store.blob_path(digest))
    if not path.exists():
        path.write_bytes(data)
    return digest


def _publish_raw(store: Store, manifest: bytes, *blobs: bytes, annotations: dict[str, str] | None = None) -> str:
    """Store blobs and a manifest as they are and list the manifest in index.json (no validation)."""
    for blob in blobs:
        _put_blob(store, blob)
    digest = _put_blob(store, manifest)
    doc = _index(store)
    doc["manifests"].append({
        "mediaType": OCI_MANIFEST_MEDIA_TYPE, "digest": digest, "size": len(manifest),
        "artifactType": ARTIFACT_TYPE, "annotations": annotations or {},
    })
    Path(store.index_path).write_bytes(canonical_json(doc))
    return digest


def _config_doc(files: list[Any], **over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"metadata": {}, "files": files}
    doc.update(over)
    return doc


def _manifest_doc(config: bytes, layers: list[Any], **over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST_MEDIA_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": _sha(config), "size": len(config)},
        "layers": layers,
        "annotations": {CREATED_ANNOTATION: "2026-01-01T00:00:00Z"},
    }
    doc.update(over)
    return doc


_EMPTY_LAYER = {"mediaType": "application/vnd.oci.empty.v1+json", "digest": EMPTY_DIGEST, "size": 2}


def _publish_docs(store: Store, config_doc: Any, manifest_over: dict[str, Any] | None = None,
                  layers: list[Any] | None = None, *blobs: bytes) -> str:
    config = json.dumps(config_doc).encode()
    doc = _manifest_doc(config, layers if layers is not None else [_EMPTY_LAYER])
    doc.update(manifest_over or {})
    manifest = json.dumps(doc).encode()
    return _publish_raw(store, manifest, config, EMPTY_BLOB, *blobs)


# -- round trip, layout, ids -------------------------------------------------------------


def test_round_trip_tree(store: Store, tmp_path: Path) -> None:
    src = _make_source(tmp_path)
    with store.writer() as w:
        w.add_tree("pod", src)
        w.add_bytes("extra/note.txt", b"hello", mode=0o644)
        w.add_file("extra/copy.img", src / "containers" / "side" / "checkpoint" / "core.img", mode=0o400)
        rec = w.commit({"pod": {"name": "web"}, "n": 1}, {"io.node-agent.pod": "default/web"})
    assert rec.metadata == {"pod": {"name": "web"}, "n": 1}
    assert rec.annotations["io.node-agent.pod"] == "default/web"
    assert store.get(rec.id) == rec
    assert [r.id for r in store.list()] == [rec.id]
    big = rec.entry("pod/containers/app/checkpoint/pages-1.img")
    assert big.size == 20 * MiB + 4 and len(big.chunks) > 20 * MiB // store.chunker.max_size
    assert all(store.chunker.min_size <= c.size <= store.chunker.max_size for c in big.chunks[:-1])
    assert rec.entry("pod/containers/app/checkpoint/empty.img").chunks == ()
    # the zeros compress to almost nothing; the side file and its copy share a blob
    assert 12 * MiB < rec.stored_size < 13 * MiB

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


def test_layout_is_an_oci_image_layout(store: Store) -> None:
    data = os.urandom(3 * MiB) + b"compress me " * 100_000
    rec = _commit_bytes(store, {"d/a": data, "b": b"", "c": b"x"}, {"k": "v"}, {"io.node-agent.pod": "ns/p"})
    assert json.loads(Path(store.layout_path).read_bytes()) == {"imageLayoutVersion": "1.0.0"}
    index = _index(store)
    assert index["schemaVersion"] == 2 and index["mediaType"] == OCI_INDEX_MEDIA_TYPE
    (entry,) = index["manifests"]
    manifest = Path(rec.manifest_path).read_bytes()
    assert entry == {
        "mediaType": OCI_MANIFEST_MEDIA_TYPE, "digest": rec.id, "size": len(manifest),
        "artifactType": ARTIFACT_TYPE,
        # The manifest's annotations, and the store's own record of when and how it got the checkpoint.
        "annotations": {**rec.annotations, "io.node-agent.store.received": rec.received,
                        "io.node-agent.store.provenance": "local"},
    }
    assert rec.provenance == "local" and rec.received >= rec.created
    assert rec.manifest_path == store.blob_path(rec.id)
    doc = json.loads(manifest)
    assert manifest == canonical_json(doc)
    assert doc["schemaVersion"] == 2 and doc["mediaType"] == OCI_MANIFEST_MEDIA_TYPE
    assert doc["artifactType"] == ARTIFACT_TYPE
    assert doc["annotations"]["io.node-agent.pod"] == "ns/p"
    assert doc["annotations"][CREATED_ANNOTATION] == rec.created and rec.created.endswith("Z")
    assert doc["config"]["mediaType"] == CONFIG_MEDIA_TYPE
    config = Path(store.blob_path(doc["config"]["digest"])).read_bytes()
    assert _sha(config) == doc["config"]["digest"] and len(config) == doc["config"]["size"]
    cdoc = json.loads(config)
    assert set(cdoc) == {"metadata", "files"} and cdoc["metadata"] == {"k": "v"}
    assert [f["path"] for f in cdoc["files"]] == ["b", "c", "d/a"]
    chunks = [c for f in cdoc["files"] if f["type"] == "file" for c in f["chunks"]]
    assert {c["encoding"] for c in chunks} == {"zstd", "identity"}
    by_digest = {c["digest"]: c for c in chunks}
    assert [layer["digest"] for layer in doc["layers"]] == list(by_digest)
    for layer in doc["layers"]:
        chunk = by_digest[layer["digest"]]
        assert set(layer) == {"mediaType", "digest", "size"}
        assert layer["size"] == chunk["stored_size"]
        assert layer["mediaType"] == (CHUNK_ZSTD_MEDIA_TYPE if chunk["encoding"] == "zstd" else CHUNK_MEDIA_TYPE)
        blob = Path(store.blob_path(layer["digest"])).read_bytes()
        assert _sha(blob) == layer["digest"] and len(blob) == layer["size"]
    for name in _blob_files(store):
        assert "sha256:" + name == _sha(Path(store.blobs.dir, name).read_bytes())
    assert store.usage() == sum(p.stat().st_size for p in Path(store.blobs.dir).iterdir())


def test_checkpoint_without_content_has_the_empty_layer(store: Store) -> None:
    rec = _commit_bytes(store, {"empty": b""})
    doc = json.loads(Path(rec.manifest_path).read_bytes())
    assert doc["layers"] == [_EMPTY_LAYER]
    assert Path(store.blob_path(EMPTY_DIGEST)).read_bytes() == b"{}"
    assert rec.stored_size == 0 and store.verify(rec.id) == []


def test_checkpoint_id_is_sha256_of_manifest(store: Store) -> None:
    rec = _commit_bytes(store, {"a": b"x" * 5000, "b/c": b""}, {"k": "v"})
    data = Path(rec.manifest_path).read_bytes()
    assert rec.id == _sha(data)
    assert store.manifest_bytes(rec.id[:15]) == data


def test_created_and_annotations_are_checked(store: Store) -> None:
    rec = _commit_bytes(store, {"a": b"1"}, annotations={CREATED_ANNOTATION: "2020-01-02T03:04:05Z", "k": "v"})
    assert rec.created == "2020-01-02T03:04:05Z"
    for bad in ({CREATED_ANNOTATION: "yesterday"}, {"k": 1}, {"": "v"}):
        with store.writer() as w, pytest.raises(InvalidArgument):
            w.commit({}, bad)  # type: ignore[arg-type]


# -- dedup, chunking, compression -----------------------------------------------------------


def test_unchanged_tree_adds_nothing(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "pages.img").write_bytes(os.urandom(24 * MiB))
    (src / "a" / "b" / "mixed.img").write_bytes((os.urandom(1000) + bytes(3000)) * 2000)
    for i in range(40):
        (src / "a" / "b" / f"small-{i}").write_bytes(os.urandom(random.randint(0, 20000)))
    with store.writer() as w:
        w.add_tree("", src)
        first = w.commit({"n": 1})
        assert w.bytes_total == first.size and first.size > 30 * MiB
        assert 24 * MiB < w.bytes_written < first.size
    used = store.usage()
    with store.writer() as w:
        w.add_tree("", src)
        second = w.commit({"n": 2})
        assert w.bytes_written == 0 and w.bytes_total == first.size
    assert second.files == first.files
    growth = store.usage() - used
    assert growth == os.path.getsize(second.manifest_path) + store.descriptors(second.id)[0].size
    assert growth < 64 << 10


def test_insertion_near_the_start_shares_most_chunks(store: Store, tmp_path: Path) -> None:
    data = random.Random(24).randbytes(24 * MiB)  # seeded: which chunks the insertion touches depends on the bytes
    edited = data[:1000] + b"inserted" + data[1000:]
    a = _commit_bytes(store, {"f": data})
    with store.writer() as w:
        w.add_bytes("f", edited)
        b = w.commit({})
        new = w.bytes_written
    old = {c.digest for c in a.entry("f").chunks}
    shared = [c for c in b.entry("f").chunks if c.digest in old]
    assert len(shared) >= len(b.entry("f").chunks) - 2
    assert new < 6 * MiB


def test_shifted_regions_in_two_files_share_chunks(store: Store) -> None:
    # Seeded: how many chunk edges the two files share depends on the bytes, so the bytes are fixed.
    body = random.Random(8).randbytes(8 * MiB)
    rec = _commit_bytes(store, {"one": b"head" + body, "two": random.Random(777).randbytes(777) + body + b"tail"})
    one = {c.digest for c in rec.entry("one").chunks}
    two = {c.digest for c in rec.entry("two").chunks}
    assert len(one & two) >= len(one) - 2


def test_compressible_data_is_stored_compressed(store: Store, tmp_path: Path) -> None:
    text = b"".join(b"line %d of a very regular log\n" % (i % 977) for i in range(400_000))
    noise = os.urandom(4 * MiB)
    zero_bytes = 2 * store.chunker.max_size + MiB  # runs of zeros as long as the longest chunk, and a rest
    rec = _commit_bytes(store, {"text": text, "noise": noise, "zeros": bytes(zero_bytes)})
    for chunk in rec.entry("text").chunks:
        assert chunk.encoding == "zstd" and chunk.stored_size < chunk.size // 4
    for chunk in rec.entry("noise").chunks:
        assert chunk.encoding == "identity" and chunk.stored_size == chunk.size
    zeros = rec.entry("zeros").chunks
    assert len({c.digest for c in zeros[:-1]}) == 1 and zeros[0].size == store.chunker.max_size
    assert rec.stored_size < len(noise) + len(text) // 4
    dest = tmp_path / "dest"
    dest.mkdir()
    store.materialize(rec.id, dest)
    assert (dest / "text").read_bytes() == text and (dest / "zeros").read_bytes() == bytes(zero_bytes)


def test_a_compressible_stretch_inside_a_large_chunk_is_found() -> None:
    from node_agent.store import codec

    n = 4 * MiB
    noise = random.Random(9).randbytes(n)
    assert codec.encode(noise)[1] == "identity"
    offsets = codec.probe_offsets(n)
    assert offsets[0] == 0 and offsets[-1] == n - codec.PROBE
    assert max(b - a for a, b in zip(offsets, offsets[1:])) <= codec.PROBE_STRIDE
    # Zero pages where neither the start, the middle nor the end of the chunk lie: found all the same.
    mixed = noise[: 5 * MiB // 2] + bytes(MiB) + noise[7 * MiB // 2 :]
    stored, encoding = codec.encode(mixed)
    assert encoding == "zstd" and len(stored) < n - MiB + MiB // 8
    assert codec.decode(bytes(stored), encoding, n) == mixed


def test_a_chunk_is_kept_compressed_only_when_that_saves_an_eighth() -> None:
    """Weights shrink by a few percent and decode slowly: stored as they are. Half-precision ones shrink more."""
    from node_agent.store import codec

    noise = random.Random(11).randbytes(MiB)
    # float32 weights as the model server's: the top byte holds the sign and 3 random bits of the exponent.
    weights = bytes(b if i % 4 != 3 else (b & 0x80) | (0x38 + (b & 0x07)) for i, b in enumerate(noise))
    # Half-precision ones: every other byte a sign and an exponent near 0x3c.
    half = bytes(b if i % 2 == 0 else (b & 0x80) | (0x3A + (b & 0x03)) for i, b in enumerate(noise))
    zstd = codec._compressor().compress
    assert len(zstd(weights)) < MiB  # zstd would shrink it, by less than an eighth
    assert len(zstd(weights)) > MiB * codec.KEEP_RATIO
    stored, encoding = codec.encode(weights)
    assert encoding == "identity" and stored is weights
    stored, encoding = codec.encode(half)
    assert encoding == "zstd" and len(stored) <= MiB * codec.KEEP_RATIO
    assert codec.decode(bytes(stored), encoding, MiB) == half


def test_encoding_is_deterministic(tmp_path: Path) -> None:
    data = (b"abc" * 300_000) + os.urandom(2 * MiB) + bytes(MiB)
    a = _commit_bytes(Store(tmp_path / "a"), {"f": data})
    b = _commit_bytes(Store(tmp_path / "b", workers=1), {"g": data})
    assert [(c.digest, c.stored_size) for c in a.entry("f").chunks] == [
        (c.digest, c.stored_size) for c in b.entry("g").chunks
    ]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    size=st.integers(0, 40_000),
    segments=st.lists(st.integers(1, 5000), min_size=1, max_size=40),
)
def test_cutting_in_segments_equals_cutting_whole(seed: int, size: int, segments: list[int]) -> None:
    data = random.Random(seed).randbytes(size)
    chunker = Chunker(256)
    whole, _ = chunker.cut(memoryview(data), final=True)
    got: list[tuple[int, int]] = []
    pos, carry, i = 0, b"", 0
    while True:
        step = segments[i % len(segments)]
        i += 1
        piece = data[pos + len(carry) : pos + len(carry) + step]
        buf = carry + piece
        final = pos + len(buf) >= size
        cuts, consumed = chunker.cut(memoryview(buf), final=final)
        got += [(pos + s, n) for s, n in cuts]
        carry = buf[consumed:]
        pos += consumed
        if final:
            break
    assert got == whole


def test_files_read_in_segments_chunk_like_buffers(small_store: Store, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline_mod, "SEGMENT_SIZE", 1500)
    data = os.urandom(50_000) + bytes(20_000) + os.urandom(30_000)
    (tmp_path / "f").write_bytes(data)
    with small_store.writer() as w:
        w.add_file("f", tmp_path / "f")
        w.add_bytes("g", data)
        rec = w.commit({})
    assert [(c.offset, c.size, c.digest) for c in rec.entry("f").chunks] == [
        (c.offset, c.size, c.digest) for c in rec.entry("g").chunks
    ]
    with small_store.open(rec.id, "f") as fh:
        assert fh.read() == data


def test_progress_is_reported(store: Store, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_bytes(os.urandom(20 * MiB))
    (tmp_path / "src" / "b").write_bytes(os.urandom(1000))
    seen: list[tuple[int, int]] = []
    with store.writer(progress=lambda done, total: seen.append((done, total))) as w:
        w.add_tree("", tmp_path / "src")
        rec = w.commit({})
    total = 20 * MiB + 1000
    assert seen[0][1] == total and seen[-1] == (total, total)
    assert all(d <= t for d, t in seen) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert rec.size == total


# -- writer input ------------------------------------------------------------------------------


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
    with pytest.raises(InvalidArgument):
        Store(tmp_path / "s2", chunk_size=100)
    with pytest.raises(InvalidArgument):
        Store(tmp_path / "s2", chunk_size=8 * MiB)
    assert store.list() == []
    assert os.listdir(store.ingest_dir) == []


def test_add_tree_rejects_symlinks_and_special_files(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok").write_bytes(b"ok")
    (src / "link").symlink_to(src / "ok")
    with store.writer() as w, pytest.raises(InvalidArgument, match="symlink"):
        w.add_tree("", src)
    with store.writer() as w:
        with pytest.raises(InvalidArgument):
            w.add_tree("", src)
        with pytest.raises(FailedPrecondition, match="failed"):
            w.commit({})  # a writer that failed half-way only aborts
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
    assert os.listdir(store.ingest_dir) == []


def test_wide_trees_do_not_exhaust_fds(small_store: Store, tmp_path: Path) -> None:
    import resource

    src = tmp_path / "src"
    for i in range(400):
        (src / f"d{i:03}" / "sub").mkdir(parents=True)
        (src / f"d{i:03}" / "sub" / "f").write_bytes(b"%d" % i)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    try:
        with small_store.writer() as w:
            w.add_tree("t", src)
            rec = w.commit({})
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(rec.files) == 1 + 400 * 3
    with small_store.open(rec.id, "t/d399/sub/f") as fh:
        assert fh.read() == b"399"


# -- ids ----------------------------------------------------------------------------------


def _colliding_manifests(config: bytes) -> tuple[bytes, bytes]:
    """Two manifests whose ids share their first six hex digits."""
    seen: dict[str, bytes] = {}
    for i in range(1_000_000):
        doc = _manifest_doc(config, [_EMPTY_LAYER])
        doc["annotations"]["n"] = str(i)
        data = canonical_json(doc)
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
    config = canonical_json(_config_doc([]))
    a, b = _colliding_manifests(config)
    ha = _publish_raw(store, a, config, EMPTY_BLOB)
    hb = _publish_raw(store, b, config, EMPTY_BLOB)
    assert store.get(ha).annotations != store.get(hb).annotations
    with pytest.raises(InvalidArgument, match="ambiguous"):
        store.get(ha.removeprefix("sha256:")[:6])
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
    # a blob that is not a published manifest is no checkpoint
    with pytest.raises(NotFound):
        store.get(rec.entry("a").chunks[0].digest)
    with pytest.raises(InvalidArgument):
        store.blob_path("sha256:../../x")
    assert store.blob_path("sha256:" + hexid) == os.path.join(store.blobs.dir, hexid)


# -- corruption -------------------------------------------------------------------------


def test_corrupt_blob_detected_everywhere(small_store: Store, tmp_path: Path) -> None:
    data = os.urandom(5000)
    rec = _commit_bytes(small_store, {"dir/file": data, "ok": b"fine"})
    assert small_store.verify(rec.id) == []
    chunks = rec.entry("dir/file").chunks
    victim = chunks[2]
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
        assert fh.read(chunks[0].size) == data[: chunks[0].size]  # chunk 0 is fine
        with pytest.raises(DataLoss, match=victim.digest):
            fh.pread(victim.offset + 1, 10)

    os.unlink(small_store.blob_path(rec.entry("ok").chunks[0].digest))
    Path(small_store.blob_path(chunks[0].digest)).write_bytes(b"short")
    reasons = {b.digest: (b.paths, b.reason) for b in small_store.verify(rec.id)}
    assert reasons[rec.entry("ok").chunks[0].digest] == (("ok",), "missing")
    assert reasons[chunks[0].digest][1].startswith("size mismatch")
    assert len(reasons) == 3


def test_documents_are_decoded_once_while_their_files_stay_the_same(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _commit_bytes(store, {"a": os.urandom(3000), "b": b"bee"}, {"pod": "ns/p", "containers": [{"name": "c"}]})
    decoded: list[str] = []
    real = index_mod.decode_manifest
    monkeypatch.setattr(index_mod, "decode_manifest", lambda *a, **k: decoded.append("m") or real(*a, **k))
    first = store.get(rec.id)
    again = store.get(rec.id)
    assert decoded == ["m"] and again.files == first.files and again.metadata == first.metadata
    # Each caller gets its own metadata: changing one's nested values changes no other's.
    first.metadata["containers"][0]["name"] = "changed"
    assert store.get(rec.id).metadata["containers"][0]["name"] == "c"
    assert decoded == ["m"]

    # A blob written in place is read (and refused) again; one restored is decoded again.
    path = Path(store.blob_path(rec.id))
    good = path.read_bytes()
    path.write_bytes(good[:-1] + b" ")  # the same size
    with pytest.raises(DataLoss, match="hashes to"):
        store.get(rec.id)
    path.write_bytes(good)
    assert store.get(rec.id).metadata["pod"] == "ns/p" and decoded == ["m", "m"]
    config = store.descriptors(rec.id)[0]
    os.unlink(store.blob_path(config.digest))
    with pytest.raises(DataLoss, match="config"):
        store.get(rec.id)


def test_corrupt_compressed_blob_and_missing_config(store: Store, tmp_path: Path) -> None:
    text = b"all work and no play " * 200_000
    rec = _commit_bytes(store, {"t": text})
    chunk = rec.entry("t").chunks[0]
    assert chunk.encoding == "zstd"
    Path(store.blob_path(chunk.digest)).write_bytes(b"\x28\xb5\x2f\xfd garbage")
    (bad,) = store.verify(rec.id)
    assert bad.digest == chunk.digest and bad.paths == ("t",)
    with pytest.raises(DataLoss, match="t"), store.open(rec.id, "t") as fh:
        fh.read(10)
    config = store.descriptors(rec.id)[0]
    os.unlink(store.blob_path(config.digest))
    with pytest.raises(DataLoss, match="config"):
        store.get(rec.id)
    assert store.list() == []


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# -- remove and leases ----------------------------------------------------------------------


def test_remove_keeps_shared_blobs(small_store: Store) -> None:
    shared = os.urandom(3000)
    a = _commit_bytes(small_store, {"shared": shared, "only-a": os.urandom(2000)})
    b = _commit_bytes(small_store, {"shared": shared, "only-b": b"B" * 10})
    only_a = {c.digest for c in a.entry("only-a").chunks}
    report = small_store.remove(a.id[:20])
    assert report.removed_checkpoints == (a.id,) and report.kept == 1
    assert a.id in report.removed_blobs and only_a <= set(report.removed_blobs)
    assert [r.id for r in small_store.list()] == [b.id]
    assert small_store.verify(b.id) == []
    assert not any(os.path.exists(small_store.blob_path(d)) for d in only_a)
    with pytest.raises(NotFound):
        small_store.get(a.id)
    small_store.remove(b.id)
    assert _blob_files(small_store) == set()
    assert small_store.usage() == 0
    assert _index(small_store)["manifests"] == []


def test_remove_spares_blobs_of_live_writer_in_thread(small_store: Store) -> None:
    shared = os.urandom(4000)
    a = _commit_bytes(small_store, {"f": shared})
    added = threading.Event()
    removed = threading.Event()
    result: list[CheckpointRecord] = []

    def write() -> None:
        with small_store.writer() as w:
            w.add_bytes("g", shared)  # deduplicated against a's blobs
            w.wait()
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
    store = Store(root, chunk_size=256)
    with store.writer() as w:
        w.add_bytes("g", data)
        w.wait()
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
        assert ready.wait(30)
        small_store.remove(a.id)
        assert small_store.recover().ingest_removed == ()  # the child's lease is live
        go.set()
        child_id = out.get(timeout=30)
    finally:
        proc.join(30)
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
        t.join(60)
    assert errors == []
    assert sorted(r.id for r in small_store.list()) == sorted(kept)
    for cid in kept:
        assert small_store.verify(cid) == []
    assert small_store.recover().clean


# -- crashes ------------------------------------------------------------------------------


def _child_abandon(root: str, data: bytes) -> None:
    store = Store(root, chunk_size=256)
    w = store.writer()
    w.add_bytes("f", data)
    w.wait()
    os._exit(0)  # dies without commit or abort


def _child_die_before_publish(root: str, data: bytes) -> None:
    def die(*args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    index_mod.Index.publish = die  # type: ignore[method-assign]
    store = Store(root, chunk_size=256)
    with store.writer() as w:
        w.add_bytes("f", data)
        w.commit({})


def _run_child(target: Any, *args: Any) -> int | None:
    proc = SPAWN.Process(target=target, args=args, name="child")
    proc.start()
    proc.join(60)
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


def test_killed_between_blob_link_and_publish(small_store: Store) -> None:
    keep = _commit_bytes(small_store, {"k": b"keep me"})
    kept_blobs = _blob_files(small_store)
    assert _run_child(_child_die_before_publish, small_store.root, os.urandom(3000)) == -signal.SIGKILL
    assert [r.id for r in small_store.list()] == [keep.id]
    orphans = _blob_files(small_store) - kept_blobs
    assert len(orphans) >= 4  # chunks, config and manifest were linked into place
    report = small_store.recover()
    assert len(report.ingest_removed) == 1 and len(report.blobs_removed) == len(orphans)
    assert report.bytes_freed > 3000
    assert _blob_files(small_store) == kept_blobs
    assert small_store.verify(keep.id) == []
    assert small_store.recover().clean


def test_blob_verified_before_it_becomes_visible(small_store: Store) -> None:
    with small_store.writer() as w:
        w.add_bytes("f", os.urandom(3000))
        w.wait()
        (ingest,) = os.listdir(small_store.ingest_dir)
        blob = sorted(Path(small_store.ingest_dir, ingest).glob("blob-*"))[1]
        blob.write_bytes(b"tampered")
        with pytest.raises(DataLoss, match="failed verification"):
            w.commit({})
    assert small_store.list() == [] and _blob_files(small_store) == set()
    assert os.listdir(small_store.ingest_dir) == []


def test_list_newest_first(store: Store) -> None:
    older = _commit_bytes(store, {"a": b"1"}, annotations={CREATED_ANNOTATION: "2026-01-01T00:00:00.5Z"})
    newer = _commit_bytes(store, {"a": b"2"}, annotations={CREATED_ANNOTATION: "2026-01-01T00:00:01Z"})
    oldest = _commit_bytes(store, {"a": b"3"}, annotations={CREATED_ANNOTATION: "2025-12-31T23:59:59Z"})
    assert [r.id for r in store.list()] == [newer.id, older.id, oldest.id]


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
    hostile = _publish_docs(small_store, _config_doc([{"path": "../x", "type": "dir", "mode": 448}]))
    missing = "sha256:" + "ab" * 32
    doc = _index(small_store)
    doc["manifests"].append({"mediaType": OCI_MANIFEST_MEDIA_TYPE, "digest": missing, "size": 10,
                             "artifactType": ARTIFACT_TYPE})
    Path(small_store.index_path).write_bytes(canonical_json(doc))
    assert [r.id for r in small_store.list()] == [rec.id]
    report = small_store.recover()
    assert sorted(report.strays_removed) == ["blobs/sha256/.tmp-123", "ingest/stray"]
    assert sorted(report.quarantined) == sorted([hostile, missing])
    assert len(os.listdir(small_store.quarantine_dir)) == 2
    assert [e["digest"] for e in _index(small_store)["manifests"]] == [rec.id]
    # the quarantined manifest's blobs are kept while its copy is in the quarantine
    assert os.path.exists(small_store.blob_path(hostile))
    assert small_store.recover().clean
    for name in os.listdir(small_store.quarantine_dir):
        os.unlink(os.path.join(small_store.quarantine_dir, name))
    assert hostile in small_store.recover().blobs_removed
    assert small_store.verify(rec.id) == []


def test_recover_rebuilds_a_damaged_index(small_store: Store) -> None:
    a = _commit_bytes(small_store, {"a": os.urandom(2000)}, annotations={"io.node-agent.pod": "ns/a"})
    b = _commit_bytes(small_store, {"b": b"b" * 3000})
    blobs = _blob_files(small_store)
    Path(small_store.index_path).write_bytes(b'{"schemaVersion": 2, "manifests": [')
    with pytest.raises(DataLoss, match="index"):
        small_store.list()
    with pytest.raises(DataLoss, match="index"):
        small_store.gc()  # never collects against an unreadable index
    assert _blob_files(small_store) == blobs
    report = small_store.recover()
    assert report.index_rebuilt and report.quarantined == ("index.json",) and report.blobs_removed == ()
    assert sorted(r.id for r in small_store.list()) == sorted([a.id, b.id])
    assert small_store.get(a.id).annotations["io.node-agent.pod"] == "ns/a"
    assert small_store.verify(a.id) == [] and small_store.verify(b.id) == []


def test_foreign_index_entries_are_kept(store: Store) -> None:
    rec = _commit_bytes(store, {"a": b"a"})
    layer = _put_blob(store, b"some layer")
    config = _put_blob(store, b"{}")
    image = canonical_json({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config, "size": 2},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer, "size": 10}],
    })
    digest = _put_blob(store, image)
    doc = _index(store)
    doc["manifests"].append({"mediaType": OCI_MANIFEST_MEDIA_TYPE, "digest": digest, "size": len(image),
                             "annotations": {"org.opencontainers.image.ref.name": "v1"}})
    Path(store.index_path).write_bytes(canonical_json(doc))
    assert [r.id for r in store.list()] == [rec.id]
    assert store.recover().clean
    store.remove(rec.id)
    assert [e["digest"] for e in _index(store)["manifests"]] == [digest]
    assert _blob_files(store) == {d.removeprefix("sha256:") for d in (layer, config, digest)}


# -- modes --------------------------------------------------------------------------------


def test_store_modes(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        root = tmp_path / "store"
        root.mkdir(mode=0o777)
        store = Store(root, chunk_size=256)
        w = store.writer()
        w.add_bytes("f", os.urandom(3000), mode=0o777)
        w.wait()
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
    data = os.urandom(6000) + b"z" * 5000 + os.urandom(3000) + bytes(2500)
    rec = _commit_bytes(small_store, {"f": data, "empty": b""})
    chunks = rec.entry("f").chunks
    assert len(chunks) > 15 and {c.encoding for c in chunks} == {"zstd", "identity"}
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
        for c in chunks:  # every boundary, from both sides
            start = max(0, c.offset - 3)
            assert reader.pread(start, 7) == data[start : start + 7]
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


# -- hostile documents ----------------------------------------------------------------------

_CHUNK_DATA = b"abc"
_D = _sha(_CHUNK_DATA)
_LAYER = {"mediaType": CHUNK_MEDIA_TYPE, "digest": _D, "size": 3}
_F = {"path": "f", "type": "file", "mode": 420, "size": 3,
      "chunks": [{"digest": _D, "offset": 0, "size": 3, "stored_size": 3, "encoding": "identity"}]}


def _file(**over: Any) -> dict[str, Any]:
    entry: dict[str, Any] = json.loads(json.dumps(_F))
    entry.update(over)
    return entry


def _chunk(**over: Any) -> dict[str, Any]:
    c: dict[str, Any] = dict(_F["chunks"][0])  # type: ignore[index]
    c.update(over)
    return c


HOSTILE_CONFIGS: list[tuple[str, Any]] = [
    ("dotdot", _config_doc([_file(path="../etc/passwd")])),
    ("absolute", _config_doc([_file(path="/etc/passwd")])),
    ("dot", _config_doc([_file(path="a/./f")])),
    ("empty component", _config_doc([_file(path="a//f")])),
    ("nul", _config_doc([_file(path="a\x00b")])),
    ("duplicate", _config_doc([_file(), _file()])),
    ("file as dir", _config_doc([_file(), _file(path="f/g")])),
    ("symlink type", _config_doc([{"path": "l", "type": "symlink", "mode": 511}])),
    ("gap", _config_doc([_file(size=6, chunks=[_chunk(), _chunk(offset=4)])])),
    ("sum", _config_doc([_file(size=4)])),
    ("bad digest", _config_doc([_file(chunks=[_chunk(digest="sha256:XYZ")])])),
    ("bad alg", _config_doc([_file(chunks=[_chunk(digest="md5:" + "a" * 32)])])),
    ("zero chunk", _config_doc([_file(size=0, chunks=[_chunk(size=0, stored_size=0)])])),
    ("huge chunk", _config_doc([_file(size=1 << 40, chunks=[_chunk(size=1 << 40, stored_size=1 << 40)])])),
    ("huge stored", _config_doc([_file(chunks=[_chunk(stored_size=1 << 40, encoding="zstd")])])),
    ("identity sizes", _config_doc([_file(chunks=[_chunk(stored_size=2)])])),
    ("encoding", _config_doc([_file(chunks=[_chunk(encoding="gzip")])])),
    ("no stored size", _config_doc([_file(chunks=[{k: v for k, v in _chunk().items() if k != "stored_size"}])])),
    ("inconsistent blob", _config_doc([_file(), _file(path="g", chunks=[_chunk(stored_size=2, encoding="zstd")])])),
    ("bool mode", _config_doc([_file(mode=True)])),
    ("big mode", _config_doc([_file(mode=0o17777)])),
    ("string size", _config_doc([_file(size="3")])),
    ("extra key", _config_doc([_file(link="x")])),
    ("dir with chunks", _config_doc([{"path": "d", "type": "dir", "mode": 448, "chunks": []}])),
    ("metadata", _config_doc([], metadata=[1])),
    ("files", _config_doc({"a": 1})),  # type: ignore[arg-type]
    ("top extra", _config_doc([], extra=1)),
    ("top list", [1, 2]),
]

HOSTILE_MANIFESTS: list[tuple[str, dict[str, Any]]] = [
    ("version", {"schemaVersion": 1}),
    ("media type", {"mediaType": "application/json"}),
    ("artifact type", {"artifactType": "application/vnd.other"}),
    ("config type", {"config": {"mediaType": "application/json", "digest": _D, "size": 3}}),
    ("config size", {"config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": _D, "size": 1 << 40}}),
    ("no created", {"annotations": {}}),
    ("bad created", {"annotations": {CREATED_ANNOTATION: "yesterday"}}),
    ("non-string annotation", {"annotations": {CREATED_ANNOTATION: "2026-01-01T00:00:00Z", "n": 1}}),
    ("no layers", {"layers": []}),
    ("extra layer", {"layers": [_LAYER, _EMPTY_LAYER]}),
    ("wrong layer type", {"layers": [{**_LAYER, "mediaType": CHUNK_ZSTD_MEDIA_TYPE}]}),
    ("wrong layer size", {"layers": [{**_LAYER, "size": 4}]}),
    ("layer annotations", {"layers": [{**_LAYER, "annotations": {}}]}),
    ("top extra", {"subject": _LAYER}),
]


@pytest.mark.parametrize("name,doc", HOSTILE_CONFIGS, ids=[h[0] for h in HOSTILE_CONFIGS])
def test_hostile_config_rejected(store: Store, name: str, doc: Any) -> None:
    cid = _publish_docs(store, doc, None, [_LAYER], _CHUNK_DATA)
    with pytest.raises(DataLoss, match=cid):
        store.get(cid)
    assert store.list() == []
    assert cid in store.recover().quarantined


@pytest.mark.parametrize("name,over", HOSTILE_MANIFESTS, ids=[h[0] for h in HOSTILE_MANIFESTS])
def test_hostile_manifest_rejected(store: Store, name: str, over: dict[str, Any]) -> None:
    cid = _publish_docs(store, _config_doc([_F]), over, over.get("layers", [_LAYER]), _CHUNK_DATA)
    with pytest.raises(DataLoss, match=cid):
        store.get(cid)
    assert store.list() == []


def test_the_hostile_baseline_is_valid(store: Store) -> None:
    cid = _publish_docs(store, _config_doc([_F]), None, [_LAYER], _CHUNK_DATA)
    assert store.get(cid).entry("f").size == 3
    with store.open(cid, "f") as fh:
        assert fh.read() == _CHUNK_DATA


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b'{"a":1,"a":2}', b"\xff\xfe", b'{"x": NaN}', b"[" * 100000 + b"]" * 100000],
    ids=["syntax", "duplicate keys", "utf8", "nan", "deep"],
)
def test_hostile_document_bytes(store: Store, raw: bytes) -> None:
    manifest = _publish_raw(store, raw)
    with pytest.raises(DataLoss):
        store.get(manifest)
    config = _publish_raw(store, canonical_json(_manifest_doc(raw, [_EMPTY_LAYER])), raw, EMPTY_BLOB)
    with pytest.raises(DataLoss):
        store.get(config)
    assert set(store.recover().quarantined) == {manifest, config}


def test_document_limits(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    cid = _publish_docs(store, _config_doc([_file(path=f"f{i}") for i in range(4)]), None, [_LAYER], _CHUNK_DATA)
    store.get(cid)
    # Each limit as another agent built with it would load the checkpoint (a store decodes a checkpoint once).
    monkeypatch.setattr(manifest_mod, "MAX_ENTRIES", 3)
    with pytest.raises(DataLoss, match="limit of 3"):
        Store(store.root).get(cid)
    monkeypatch.undo()
    monkeypatch.setattr(manifest_mod, "MAX_CONFIG_BYTES", 100)
    with pytest.raises(DataLoss, match="limit"):
        Store(store.root).get(cid)
    monkeypatch.undo()
    monkeypatch.setattr(index_mod, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(DataLoss, match="limit"):
        Store(store.root).get(cid)
    monkeypatch.undo()
    # a manifest blob that does not hash to its name
    path = Path(store.blob_path(cid))
    path.write_bytes(path.read_bytes() + b" ")
    with pytest.raises(DataLoss, match="hashes to"):
        store.get(cid)
    # a symlinked manifest blob is never followed
    path.unlink()
    path.symlink_to(store.index_path)
    with pytest.raises(DataLoss):
        store.get(cid)


@pytest.mark.parametrize("raw", [
    b"[]", b'{"schemaVersion": 2, "manifests": {}}', b'{"schemaVersion": 3, "manifests": []}',
    b'{"schemaVersion": 2, "manifests": [{"digest": "sha256:x", "size": 1, "mediaType": "a/b"}]}',
    b'{"schemaVersion": 2, "manifests": [], "extra": 1}',
], ids=["list", "manifests", "version", "digest", "extra"])
def test_hostile_index_rejected(store: Store, raw: bytes) -> None:
    Path(store.index_path).write_bytes(raw)
    with pytest.raises(DataLoss, match="index"):
        store.list()
    assert store.recover().index_rebuilt


@settings(max_examples=100, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["path", "type", "mode", "size", "chunks", "digest", "offset", "files", "metadata", "stored_size",
         "encoding", "mediaType", "layers", "config", "annotations", "manifests", "schemaVersion"]), inner, max_size=5),
    max_leaves=20,
))
def test_decoders_only_raise_dataloss(doc: Any) -> None:
    for candidate in (doc, _config_doc([doc]), _config_doc([_file(chunks=[doc])]), _manifest_doc(b"{}", [doc]),
                      {"schemaVersion": 2, "manifests": [doc]}):
        data = json.dumps(candidate).encode()
        for decode in (manifest_mod.decode_manifest, manifest_mod.decode_config, manifest_mod.decode_index):
            try:
                decode(data)
            except DataLoss:
                pass


# -- materialize safety ----------------------------------------------------------------------------


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


def test_materialize_prefixes_into_one_dest(store: Store, tmp_path: Path) -> None:
    rec = _commit_bytes(store, {"a/x": b"x", "b/y": b"y", "c": b"c"})
    dest = tmp_path / "dest"
    dest.mkdir()
    store.materialize(rec.id, dest, prefix="a")
    store.materialize(rec.id, dest, prefix="c")
    store.materialize(rec.id, dest, prefix="b/y")
    assert {k: v[2] for k, v in _tree(dest).items()} == {"a": None, "a/x": b"x", "b": None, "b/y": b"y", "c": b"c"}
    for prefix, match in (("a", "'a/x' is not a directory"), ("c", "'c' is not a directory"),
                          ("b/y", "'b/y' is not a directory")):
        with pytest.raises(FailedPrecondition, match=match):
            store.materialize(rec.id, dest, prefix=prefix)
    (dest / "c").unlink()
    (dest / "c").symlink_to(tmp_path)
    with pytest.raises(FailedPrecondition):
        store.materialize(rec.id, dest, prefix="c")


def test_materialize_many_files(small_store: Store, tmp_path: Path) -> None:
    files = {f"d{i % 7}/f{i}": os.urandom(random.randint(0, 3000)) for i in range(300)}
    rec = _commit_bytes(small_store, files)
    dest = tmp_path / "dest"
    dest.mkdir()
    small_store.materialize(rec.id, dest)
    assert {k: v[2] for k, v in _tree(dest).items() if v[0] == "file"} == files


def test_materialize_writes_only_inside_dest(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _commit_bytes(store, {"a/b/c": b"c", "d": b"d"})
    dest = tmp_path / "dest"
    dest.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    real_write = checkpoints_mod.write_entries

    def swap_in_symlink(*args: Any) -> None:
        # a racing process replaces a directory with a symlink after the emptiness check
        (dest / "a").symlink_to(outside)
        real_write(*args)

    monkeypatch.setattr(checkpoints_mod, "write_entries", swap_in_symlink)
    with pytest.raises(FailedPrecondition, match="symlink"):
        store.materialize(rec.id, dest)
    monkeypatch.undo()
    assert list(outside.iterdir()) == []
    assert [p.name for p in dest.iterdir()] == ["a"] and (dest / "a").is_symlink()


def test_entries_have_file_entry_type(store: Store) -> None:
    rec = _commit_bytes(store, {"x": b"1"})
    assert all(isinstance(e, FileEntry) for e in rec.files)


pytestmark = pytest.mark.usefixtures("no_leaked_threads")
