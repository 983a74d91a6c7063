"""Kept leases: an import that stops unpublished keeps what it brought until a time (store/kept.py).

Garbage collection is given its clock (`gc(now=...)`); nothing here sleeps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.errors import Unavailable
from node_agent.store import Store
from node_agent.store import kept

MiB = 1 << 20
MANIFEST = "sha256:" + "ab" * 32


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _stopped(store: Store, *blobs: bytes, keep_for: float = 600.0, manifest: str = MANIFEST) -> Path:
    """An import of ``blobs`` that stopped on a registry failure; its ingest directory."""
    with pytest.raises(Unavailable):
        with store.importer(keep_for=keep_for, manifest=manifest, reference="reg.example/ckpt@" + manifest) as imp:
            for data in blobs:
                imp.add_blob(_digest(data), len(data), [data])
            raise Unavailable("registry reg.example: connection reset")
    dirs = list(Path(store.ingest_dir).iterdir())
    assert len(dirs) == 1
    return dirs[0]


def _record(path: Path) -> dict[str, object]:
    doc = json.loads((path / kept.KEPT_NAME).read_bytes())
    assert isinstance(doc, dict)
    return doc


def test_a_stopped_import_keeps_its_blobs_until_its_time_then_gc_takes_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store(tmp_path / "store")
    a, b = os.urandom(1000), os.urandom(2000)
    with caplog.at_level(logging.INFO, logger="node_agent.store"):
        lease = _stopped(store, a, b)
    doc = _record(lease)
    assert (doc["manifest"], doc["reference"]) == (MANIFEST, "reg.example/ckpt@" + MANIFEST)
    assert doc["reason"] == "Unavailable: registry reg.example: connection reset"
    until = doc["until"]
    assert isinstance(until, float) and doc["until_utc"] == kept.iso(until)
    assert (lease / kept.KEPT_NAME).stat().st_size == kept.RECORD_BYTES
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("import of ")]
    assert said == [f"import of reg.example/ckpt@{MANIFEST} stopped; the 2 blob(s) it brought and the 0 it found "
                    f"stored are kept until {kept.iso(until)}, so that running it again resumes "
                    f"({lease / kept.KEPT_NAME})"]

    assert store.gc(now=until - 1).removed_blobs == ()
    report = Store(store.root).recover()  # a restart
    assert report.ingest_removed == () and report.blobs_removed == ()
    assert store.has_blob(_digest(a)) and store.has_blob(_digest(b)) and lease.is_dir()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="node_agent.store"):
        gone = store.gc(now=until + 1)
    assert set(gone.removed_blobs) == {_digest(a), _digest(b)} and not lease.exists()
    assert any(r.getMessage().startswith(f"the lease kept for the import of reg.example/ckpt@{MANIFEST} until ")
               for r in caplog.records)


def test_an_import_that_brought_nothing_or_keeps_for_no_time_keeps_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    with pytest.raises(Unavailable):
        with store.importer(keep_for=600, manifest=MANIFEST):
            raise Unavailable("down")
    assert os.listdir(store.ingest_dir) == []
    with pytest.raises(Unavailable):
        with store.importer(keep_for=0, manifest=MANIFEST) as imp:
            imp.add_blob(_digest(b"x"), 1, [b"x"])
            raise Unavailable("down")
    assert os.listdir(store.ingest_dir) == []
    assert store.gc().removed_blobs == (_digest(b"x"),)


def test_publishing_or_discarding_the_manifest_ends_the_leases_kept_for_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    other = "sha256:" + "cd" * 32
    mine = _stopped(store, b"first run")
    theirs_data = b"another pull"
    with pytest.raises(Unavailable):
        with store.importer(keep_for=600, manifest=other) as imp:
            imp.add_blob(_digest(theirs_data), len(theirs_data), [theirs_data])
            raise Unavailable("down")
    theirs = [p for p in Path(store.ingest_dir).iterdir() if p != mine]
    # A later run of the same pull, refused: it keeps nothing, nor does what the first run kept.
    with store.importer(keep_for=600, manifest=MANIFEST) as imp:
        imp.add_blob(_digest(b"second run"), 10, [b"second run"])
        removed = imp.discard()
    assert set(removed) == {_digest(b"first run"), _digest(b"second run")}
    assert not mine.exists() and [p for p in Path(store.ingest_dir).iterdir()] == theirs
    assert store.has_blob(_digest(theirs_data))


def test_a_record_that_does_not_read_whole_keeps_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    lease = _stopped(store, b"blob")
    (lease / kept.KEPT_NAME).write_bytes(b'{"until": 9e99, "manif')  # torn
    assert store.gc(now=0).removed_blobs == (_digest(b"blob"),) and not lease.exists()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    assert os.geteuid() == 0, "needs root to mount a tmpfs"
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_the_lease_is_kept_on_a_disk_that_is_full(small_fs: Path) -> None:
    store = Store(small_fs / "store")
    data = os.urandom(MiB)
    with pytest.raises(Exception) as info:
        with store.importer(keep_for=600, manifest=MANIFEST) as imp:
            imp.add_blob(_digest(data), len(data), [data])
            filler = os.open(small_fs / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                while True:
                    os.write(filler, os.urandom(64 << 10))
            finally:
                os.close(filler)
    assert isinstance(info.value, OSError) and store.free_bytes() < 64 << 10
    [lease] = list(Path(store.ingest_dir).iterdir())
    assert _record(lease)["until"] > 0
    assert store.gc().removed_blobs == () and store.has_blob(_digest(data))
