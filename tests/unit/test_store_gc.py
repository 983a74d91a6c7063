"""Retention policies and garbage collection of the checkpoint store, including races with writers."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from node_agent.errors import InvalidArgument, NotFound
from node_agent.store import CheckpointRecord, RetentionPolicy, Store
from node_agent.store.manifest import CREATED_ANNOTATION

SPAWN = multiprocessing.get_context("spawn")
POD = "io.node-agent.pod"
T0 = datetime(2026, 3, 1, tzinfo=UTC).timestamp()


def _at(seconds: float) -> str:
    return datetime.fromtimestamp(T0 + seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store", chunk_size=256)


def _commit(store: Store, files: dict[str, bytes], *, at: float, pod: str | None = None) -> CheckpointRecord:
    notes = {CREATED_ANNOTATION: _at(at)}
    if pod is not None:
        notes[POD] = pod
    with store.writer() as w:
        for path, data in files.items():
            w.add_bytes(path, data)
        return w.commit({}, notes)


def _ids(store: Store) -> set[str]:
    return {r.id for r in store.list()}


def _blobs(store: Store) -> set[str]:
    return {"sha256:" + name for name in os.listdir(store.blobs.dir)}


def test_no_policy_only_sweeps(store: Store) -> None:
    a = _commit(store, {"f": os.urandom(3000)}, at=0, pod="ns/a")
    orphan = store.blob_path("sha256:" + "ab" * 32)
    Path(orphan).write_bytes(b"orphan")  # not named by anything
    report = store.gc()
    assert report.removed_checkpoints == () and report.kept == 1 and not report.dry_run
    assert report.removed_blobs == ("sha256:" + "ab" * 32,) and report.bytes_freed == 6
    assert store.verify(a.id) == []


def test_max_per_group_keeps_the_newest(store: Store) -> None:
    shared = os.urandom(4000)
    a1 = _commit(store, {"s": shared, "o": os.urandom(2000)}, at=10, pod="ns/a")
    a2 = _commit(store, {"s": shared, "o": os.urandom(2000)}, at=20, pod="ns/a")
    a3 = _commit(store, {"s": shared, "o": os.urandom(2000)}, at=30, pod="ns/a")
    b1 = _commit(store, {"o": os.urandom(2000)}, at=5, pod="ns/b")
    loose = _commit(store, {"o": os.urandom(2000)}, at=1)
    before = _blobs(store)
    policy = RetentionPolicy(max_per_group=1)

    dry = store.gc(policy, dry_run=True)
    assert dry.dry_run and dry.removed_checkpoints == (a1.id, a2.id) and dry.kept == 3
    assert dry.bytes_freed > 4000 and set(dry.removed_blobs) <= before
    assert _blobs(store) == before and _ids(store) == {a1.id, a2.id, a3.id, b1.id, loose.id}

    report = store.gc(policy)
    assert report.removed_checkpoints == dry.removed_checkpoints
    assert report.removed_blobs == dry.removed_blobs and report.bytes_freed == dry.bytes_freed
    assert _ids(store) == {a3.id, b1.id, loose.id}
    for rec in (a3, b1, loose):
        assert store.verify(rec.id) == []
    assert store.gc(policy).removed_checkpoints == ()
    assert store.gc(RetentionPolicy(max_per_group=0, group_annotation="other")).removed_checkpoints == ()
    assert store.gc(RetentionPolicy(max_per_group=0)).removed_checkpoints == (b1.id, a3.id)
    assert _ids(store) == {loose.id}


def test_max_total_bytes_drops_the_oldest(store: Store) -> None:
    recs = [_commit(store, {"f": os.urandom(10_000)}, at=i, pod=f"ns/p{i}") for i in range(5)]
    total = store.usage()
    each = total // 5
    report = store.gc(RetentionPolicy(max_total_bytes=total - each // 2), dry_run=True)
    assert report.removed_checkpoints == (recs[0].id,)
    report = store.gc(RetentionPolicy(max_total_bytes=int(each * 2.5)))
    assert report.removed_checkpoints == tuple(r.id for r in recs[:3])
    assert _ids(store) == {recs[3].id, recs[4].id}
    assert store.usage() <= int(each * 2.5)
    assert store.gc(RetentionPolicy(max_total_bytes=0)).kept == 0
    assert store.usage() == 0


def test_max_total_bytes_counts_shared_blobs_once(store: Store) -> None:
    shared = os.urandom(50_000)
    a = _commit(store, {"s": shared}, at=1)
    b = _commit(store, {"s": shared, "t": b"x"}, at=2)
    # dropping a frees almost nothing, so b alone does not fit a tight limit either
    report = store.gc(RetentionPolicy(max_total_bytes=store.usage() - 100), dry_run=True)
    assert report.removed_checkpoints == (a.id,)
    report = store.gc(RetentionPolicy(max_total_bytes=30_000), dry_run=True)
    assert report.removed_checkpoints == (a.id, b.id)


def test_max_age(store: Store) -> None:
    old = _commit(store, {"f": os.urandom(2000)}, at=0, pod="ns/a")
    mid = _commit(store, {"f": os.urandom(2000)}, at=3600, pod="ns/a")
    new = _commit(store, {"f": os.urandom(2000)}, at=7200)
    policy = RetentionPolicy(max_age_seconds=5000)
    assert store.gc(policy, now=T0 + 9000, dry_run=True).removed_checkpoints == (old.id, mid.id)
    assert store.gc(policy, now=T0 + 5500).removed_checkpoints == (old.id,)
    assert _ids(store) == {mid.id, new.id}
    combined = RetentionPolicy(max_age_seconds=10_000, max_per_group=0)
    assert store.gc(combined, now=T0 + 7300).removed_checkpoints == (mid.id,)
    assert _ids(store) == {new.id}


def test_policy_validation() -> None:
    for bad in (dict(max_per_group=-1), dict(max_total_bytes=1.5), dict(max_age_seconds=float("nan")),
                dict(max_per_group=True), dict(group_annotation="")):
        with pytest.raises(InvalidArgument):
            RetentionPolicy(**bad)  # type: ignore[arg-type]


def test_gc_removes_dead_ingest_dirs(store: Store) -> None:
    dead = Path(store.ingest_dir, "0" * 32)
    dead.mkdir()
    (dead / "lease").write_text("pid=1\n")
    (dead / "blob-x").write_bytes(b"junk")
    assert store.gc(dry_run=True).removed_blobs == () and dead.exists()
    store.gc()
    assert not dead.exists()


# -- holds: readers keep what they read ---------------------------------------------------------


def test_a_hold_keeps_a_removed_checkpoint_readable_until_it_ends(store: Store) -> None:
    data = os.urandom(5000)
    a = _commit(store, {"f": data}, at=0, pod="ns/a")
    blobs = _blobs(store)
    hold = store.hold(a.id)
    report = store.gc(RetentionPolicy(max_age_seconds=1))  # retention drops it meanwhile
    assert report.removed_checkpoints == (a.id,) and report.removed_blobs == ()
    assert _ids(store) == set() and _blobs(store) == blobs
    # A reader that holds it goes on reading, by the record it loaded or by id.
    with store.open(a, "f") as fh:
        assert fh.read(fh.size) == data
    assert store.held(a.id).files == a.files
    with pytest.raises(NotFound):
        store.get(a.id)
    hold.release()
    assert not os.listdir(store.ingest_dir)
    store.gc()
    assert _blobs(store) == set()


def test_a_hold_needs_a_published_checkpoint_unless_given_the_record(store: Store) -> None:
    a = _commit(store, {"f": os.urandom(3000)}, at=0)
    with store.hold(a.id) as first:
        store.remove(a.id)
        with pytest.raises(NotFound):
            store.hold(a.id)
        second = store.hold(a)  # the reader already holds it
        first.release()
        assert store.gc().removed_blobs == ()
        second.release()
    assert store.gc().removed_blobs != ()


def _hold_in_child(fd: int, go: Any, done: Any) -> None:
    go.wait(30)
    os.close(fd)
    done.set()


def test_a_hold_handed_to_a_child_lasts_as_long_as_the_child_keeps_it(store: Store) -> None:
    a = _commit(store, {"f": os.urandom(3000)}, at=0)
    hold = store.hold(a.id)
    ctx = multiprocessing.get_context("fork")
    go, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_in_child, args=(hold.lease_fd, go, done))
    child.start()
    try:
        hold.detach()  # the parent lets go; the child's inherited descriptor keeps the lease
        store.remove(a.id)
        assert store.gc().removed_blobs == () and os.listdir(store.ingest_dir)
        go.set()
        assert done.wait(30)
    finally:
        go.set()
        child.join(30)
    store.gc()
    assert _blobs(store) == set() and not os.listdir(store.ingest_dir)


def test_links_into_a_private_store_outlive_the_original(store: Store, tmp_path: Path) -> None:
    data = os.urandom(5000)
    a = _commit(store, {"f": data, "g": b"small"}, at=0)
    private = store.link_into(a, str(tmp_path / "private"))
    assert _blobs(private) == _blobs(store) and private.list() == []
    # A blob replaced by a symlink in the original is not followed into the copy.
    victim = a.files[0].chunks[0].digest if a.files[0].chunks else a.files[1].chunks[0].digest
    os.unlink(store.blob_path(victim))
    os.symlink("/etc/passwd", store.blob_path(victim))
    again = store.link_into(a, str(tmp_path / "again"))
    assert victim not in _blobs(again)
    with pytest.raises(FileExistsError):
        store.link_into(a, str(tmp_path / "again"))
    shutil.rmtree(store.root)
    record = private.held(a.id)
    with private.open(record, "f") as fh:
        assert fh.read(fh.size) == data


# -- races ------------------------------------------------------------------------------------


def test_gc_racing_writers_loses_nothing(store: Store) -> None:
    """Writers dedup against a checkpoint while gc drops it; every new checkpoint stays whole."""
    shared = os.urandom(20_000)
    errors: list[BaseException] = []
    made: list[str] = []
    stop = threading.Event()
    policy = RetentionPolicy(max_per_group=0, group_annotation="victim")

    def writer(n: int) -> None:
        try:
            for i in range(15):
                with store.writer() as w:
                    w.add_bytes("shared", shared)
                    w.add_bytes("own", os.urandom(500))
                    w.wait()
                    rec = w.commit({}, {"victim": "yes"} if i % 3 == 0 else {"n": str(n)})
                if i % 3:
                    made.append(rec.id)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def collector() -> None:
        try:
            while not stop.is_set():
                store.gc(policy)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,), name=f"writer-{n}") for n in range(3)]
    gc_thread = threading.Thread(target=collector, name="gc")
    gc_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    gc_thread.join(60)
    assert errors == []
    store.gc(policy)
    assert _ids(store) == set(made)
    for cid in made:
        assert store.verify(cid) == []
    assert store.recover().clean


def _child_dedup_writer(root: str, data: bytes, ready: Any, go: Any, out: Any) -> None:
    store = Store(root, chunk_size=256)
    with store.writer() as w:
        w.add_bytes("copy", data)
        w.wait()
        ready.set()
        if not go.wait(30):
            raise SystemExit(2)
        out.put(w.commit({"child": True}).id)


def test_gc_racing_a_writer_process(store: Store) -> None:
    data = os.urandom(30_000)
    victim = _commit(store, {"orig": data}, at=0, pod="ns/victim")
    config = store.descriptors(victim.id)[0].digest
    ready, go, out = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    proc = SPAWN.Process(target=_child_dedup_writer, args=(store.root, data, ready, go, out), name="child-writer")
    proc.start()
    try:
        assert ready.wait(30)
        report = store.gc(RetentionPolicy(max_per_group=0))
        assert report.removed_checkpoints == (victim.id,)
        # only the victim's own documents go: the chunks the child deduplicated against stay
        assert report.removed_blobs == tuple(sorted([victim.id, config]))
        assert all(store.has_blob(c.digest) for c in victim.entry("orig").chunks)
        go.set()
        child_id = out.get(timeout=30)
    finally:
        proc.join(30)
    assert proc.exitcode == 0
    assert store.verify(child_id) == []
    assert store.gc().removed_blobs == ()


pytestmark = pytest.mark.usefixtures("no_leaked_threads")
