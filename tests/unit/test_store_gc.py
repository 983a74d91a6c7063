"""Retention policies and garbage collection of the checkpoint store, including races with writers."""

from __future__ import annotations

import hashlib
import json
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
from node_agent.store.documents import CREATED_ANNOTATION
from node_agent.store.records import PROVENANCE_ANNOTATION, RECEIVED_ANNOTATION
from node_agent.store.sealing import SealKey

SPAWN = multiprocessing.get_context("spawn")
POD = "io.node-agent.pod"
T0 = datetime(2026, 3, 1, tzinfo=UTC).timestamp()


def _at(seconds: float) -> str:
    return datetime.fromtimestamp(T0 + seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store", chunk_size=256)


def _stamp(store: Store, cid: str, *, received: float | None = None, provenance: str | None = None,
           drop: bool = False) -> CheckpointRecord:
    """Set what the store recorded about a checkpoint in its index record (or, with ``drop``, remove it)."""
    with store.index.locked(exclusive=True):
        entries = store.index.read()
        (entry,) = [e for e in entries if e["digest"] == cid]
        notes = entry["annotations"]
        if received is not None:
            notes[RECEIVED_ANNOTATION] = _at(received)
        if provenance is not None:
            notes[PROVENANCE_ANNOTATION] = provenance
        if drop:
            notes.pop(RECEIVED_ANNOTATION)
            notes.pop(PROVENANCE_ANNOTATION)
        store.index.write(entries)
    return store.get(cid)


def _commit(store: Store, files: dict[str, bytes], *, at: float, pod: str | None = None,
            received: float | None = None) -> CheckpointRecord:
    """A local checkpoint created at ``at`` and received then too (or at ``received``)."""
    notes = {CREATED_ANNOTATION: _at(at)}
    if pod is not None:
        notes[POD] = pod
    with store.writer() as w:
        for path, data in files.items():
            w.add_bytes(path, data)
        record = w.commit({}, notes)
    return _stamp(store, record.id, received=at if received is None else received)


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


# -- retention by what the store recorded: receipt time, and the node's own first ---------------


def _pulled(store: Store, tmp: Path, files: dict[str, bytes], *, created: str, pod: str,
            received: float) -> CheckpointRecord:
    """A checkpoint made elsewhere (its maker chose ``created`` and ``pod``), imported as a pull does."""
    maker = Store(tmp / f"maker-{len(os.listdir(tmp))}", chunk_size=256)
    with maker.writer() as w:
        for path, data in files.items():
            w.add_bytes(path, data)
        made = w.commit({}, {CREATED_ANNOTATION: created, POD: pod})
    with store.importer() as importer:
        for d in maker.descriptors(made.id):
            with maker.open_blob(d.digest) as fh:
                importer.add_blob(d.digest, d.size, fh)
        record = importer.commit(maker.manifest_bytes(made.id))
    assert record.provenance == "pulled" and not record.local
    return _stamp(store, record.id, received=received)


FAR_FUTURE = "2999-01-01T00:00:00Z"
FAR_PAST = "1970-01-01T00:00:01Z"


def test_max_age_counts_from_receipt_not_from_created(store: Store, tmp_path: Path) -> None:
    # Created long ago, received lately: young. Created in the far future, received long ago: old.
    young = _commit(store, {"f": os.urandom(2000)}, at=0, received=8000, pod="ns/a")
    old = _pulled(store, tmp_path, {"f": os.urandom(2000)}, created=FAR_FUTURE, pod="ns/a", received=1000)
    past = _pulled(store, tmp_path, {"f": os.urandom(2000)}, created=FAR_PAST, pod="ns/a", received=7000)
    policy = RetentionPolicy(max_age_seconds=5000)
    assert store.gc(policy, now=T0 + 9000).removed_checkpoints == (old.id,)
    assert _ids(store) == {young.id, past.id}


def test_max_per_group_counts_pulled_checkpoints_apart(store: Store, tmp_path: Path) -> None:
    l1 = _commit(store, {"f": os.urandom(2000)}, at=10, pod="ns/a")
    l2 = _commit(store, {"f": os.urandom(2000)}, at=20, pod="ns/a")
    p1 = _pulled(store, tmp_path, {"f": os.urandom(2000)}, created=_at(90), pod="ns/a", received=30)
    p2 = _pulled(store, tmp_path, {"f": os.urandom(2000)}, created=_at(5), pod="ns/a", received=40)
    p3 = _pulled(store, tmp_path, {"f": os.urandom(2000)}, created=_at(1), pod="ns/a", received=50)
    report = store.gc(RetentionPolicy(max_per_group=1))
    # The newest received of the node's own, and of the pulled ones; `created` plays no part.
    assert report.removed_checkpoints == (l1.id, p1.id, p2.id)
    assert _ids(store) == {l2.id, p3.id}


def test_max_total_bytes_drops_pulled_checkpoints_first(store: Store, tmp_path: Path) -> None:
    l1 = _commit(store, {"f": os.urandom(10_000)}, at=0, pod="ns/l1")
    l2 = _commit(store, {"f": os.urandom(10_000)}, at=10, pod="ns/l2")
    p1 = _pulled(store, tmp_path, {"f": os.urandom(10_000)}, created=FAR_PAST, pod="ns/p1", received=20)
    p2 = _pulled(store, tmp_path, {"f": os.urandom(10_000)}, created=FAR_FUTURE, pod="ns/p2", received=30)
    each = store.usage() // 4
    # Room for three: the oldest pulled one goes, though every local one is older.
    assert store.gc(RetentionPolicy(max_total_bytes=3 * each + each // 2), dry_run=True).removed_checkpoints == (p1.id,)
    # Room for two: both pulled ones go, the node's own stay.
    report = store.gc(RetentionPolicy(max_total_bytes=2 * each + each // 2))
    assert set(report.removed_checkpoints) == {p1.id, p2.id} and _ids(store) == {l1.id, l2.id}
    # Only then the node's own, oldest received first.
    assert store.gc(RetentionPolicy(max_total_bytes=each + each // 2)).removed_checkpoints == (l1.id,)


@pytest.mark.parametrize("created", [FAR_FUTURE, FAR_PAST])
def test_forged_pulled_checkpoints_cannot_evict_a_local_one(store: Store, tmp_path: Path, created: str) -> None:
    """Pulls claiming the local pod's group, with a far-future or far-past `created`, received after it."""
    local = _commit(store, {"f": os.urandom(10_000)}, at=0, pod="ns/web")
    own = store.usage()  # room for the local one alone
    forged = [_pulled(store, tmp_path, {"f": os.urandom(10_000)}, created=created, pod="ns/web", received=100 + i)
              for i in range(3)]
    for policy in (RetentionPolicy(max_per_group=1), RetentionPolicy(max_per_group=0, group_annotation="nothing"),
                   RetentionPolicy(max_total_bytes=own), RetentionPolicy(max_age_seconds=3600)):
        store.gc(policy, now=T0 + 1000)
        assert local.id in _ids(store), policy
    assert _ids(store) == {local.id}
    assert store.verify(local.id) == []
    # Pulled ones that come later are judged among themselves again; the local one still stays.
    late = _pulled(store, tmp_path, {"f": os.urandom(10_000)}, created=created, pod="ns/web", received=2000)
    assert store.gc(RetentionPolicy(max_per_group=1), now=T0 + 2001).removed_checkpoints == ()
    assert _ids(store) == {local.id, late.id} and forged


def test_what_the_store_records_and_how_old_records_read(store: Store, tmp_path: Path) -> None:
    made = _commit(store, {"f": os.urandom(2000)}, at=0, pod="ns/a")
    assert made.provenance == "local" and made.local
    pulled = _pulled(store, tmp_path, {"f": os.urandom(2000)}, created=FAR_FUTURE, pod="ns/a", received=5)
    with store.writer() as w:
        w.add_bytes("f", os.urandom(2000))
        imported = w.commit({"imported": {"format": "podman"}}, {CREATED_ANNOTATION: _at(7)}, provenance="imported")
    assert imported.provenance == "imported" and not imported.local
    # A copy (a rekey) keeps where its source came from, and is received now.
    copy = store.copy(pulled, seal=SealKey("ns-1", bytes(32), "ns"))
    assert copy.id != pulled.id and copy.provenance == "pulled" and copy.received != _at(5)
    assert copy.created == FAR_FUTURE
    store.remove(copy.id)
    # Records written before the store kept these (no annotations): received at `created`, and local unless
    # an origin is recorded (a lazy pull) or the metadata says `imported`.
    for cid in (made.id, pulled.id, imported.id):
        _stamp(store, cid, drop=True)
    assert (store.get(made.id).received, store.get(made.id).provenance) == (_at(0), "local")
    assert store.get(pulled.id).provenance == "local"
    assert store.get(imported.id).provenance == "imported"
    store.origins.remember(pulled.id, {"reference": "reg.example/ckpt@" + pulled.id})
    assert (store.get(pulled.id).received, store.get(pulled.id).provenance) == (FAR_FUTURE, "pulled")
    assert {r.id: r.provenance for r in store.list()} == {made.id: "local", pulled.id: "pulled", imported.id: "imported"}


def test_no_manifest_may_carry_what_the_store_records(store: Store, tmp_path: Path) -> None:
    for notes in ({PROVENANCE_ANNOTATION: "local"}, {RECEIVED_ANNOTATION: _at(0)}):
        with pytest.raises(InvalidArgument, match="the store's own record"):
            with store.writer() as w:
                w.add_bytes("f", b"x")
                w.commit({}, notes)
    # One made by a store that did not refuse them yet: refused on import, and its record's say ignored.
    maker = Store(tmp_path / "maker", chunk_size=256)
    with maker.writer() as w:
        w.add_bytes("f", b"forged")
        made = w.commit({}, {POD: "ns/a"})
    doc = json.loads(maker.manifest_bytes(made.id))
    doc["annotations"][PROVENANCE_ANNOTATION] = "local"
    forged = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    with store.importer() as importer:
        for d in maker.descriptors(made.id):
            with maker.open_blob(d.digest) as fh:
                importer.add_blob(d.digest, d.size, fh)
        with pytest.raises(InvalidArgument, match=f"annotation {PROVENANCE_ANNOTATION} is the store's own"):
            importer.commit(forged)
    assert store.list() == []
    # Such a manifest published by an older store, whose record copied the manifest's annotations: what
    # the record says is the maker's word, so it counts as a record from before (received at `created`).
    doc["annotations"].update({RECEIVED_ANNOTATION: FAR_FUTURE, CREATED_ANNOTATION: _at(3)})
    old = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    cid = "sha256:" + hashlib.sha256(old).hexdigest()
    for d in maker.descriptors(made.id):
        shutil.copyfile(maker.blob_path(d.digest), store.blob_path(d.digest))
    Path(store.blob_path(cid)).write_bytes(old)
    with store.index.locked(exclusive=True):
        store.index.write([{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": cid,
                            "size": len(old), "artifactType": "application/vnd.node-agent.checkpoint.v1",
                            "annotations": doc["annotations"]}])
    record = store.get(cid)
    assert (record.received, record.provenance) == (_at(3), "local")


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
