"""A pull admitted before it is published, and bounded (docker-registry 2.8 on 127.0.0.1).

The admission callback sees the checkpoint whole (its files readable, its
signatures verifiable) while nothing lists it; a refusal leaves the store as
it was: no record, no referrer, no blob the pull brought, while blobs that
were there before stay. A pull killed inside the callback is cleaned up by
the store's start-up repair. Every pull is bounded by
`registry.max-pull-bytes` and by `min-free-bytes`, before a byte is written
and again while bytes arrive; a lazy pull's chunks fetched later are still
checked against their descriptors.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node_agent import signing
from node_agent.config.loading import from_mapping
from node_agent.config.schema import RegistrySettings
from node_agent.errors import DataLoss, NotFound, PermissionDenied, ResourceExhausted
from node_agent.registry import Admission, Credentials, pull, push
from node_agent.registry.budget import CHECK_EVERY, PullBudget
from node_agent.store import CheckpointRecord, RetentionPolicy, Store

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests/unit is not a package: make the repository's tests/ importable
    sys.path.insert(0, str(REPO))

from testbed.registry import Registry  # noqa: E402

MiB = 1 << 20
PLAIN = Credentials(plain_http=True)
PAGES = os.urandom(6 * MiB)
CONFIG_DUMP = b'{"id": "abc"}'


class Refused(PermissionDenied):
    """What the test's admission callback raises."""


def _make(store: Store, note: str, pages: bytes = PAGES) -> CheckpointRecord:
    """A checkpoint of namespace "ns"; two with the same ``pages`` share their chunk blobs."""
    with store.writer() as w:
        w.add_bytes("containers/app/checkpoint/pages-1.img", pages)
        w.add_bytes("containers/app/checkpoint/core.img", note.encode() * 100)
        w.add_bytes("containers/app/config.dump", CONFIG_DUMP)
        return w.commit({"kind": "test", "pod": {"namespace": "ns", "name": "web"}},
                        annotations={"io.node-agent.pod": "ns/web", "io.node-agent.test": note})


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with Registry(tmp_path / "registry") as r:
        yield r


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture
def source(tmp_path: Path, key: Ed25519PrivateKey) -> Store:
    return Store(tmp_path / "source-store", chunk_size=1 * MiB)


def _signed(tmp_path: Path, store: Store, record: CheckpointRecord, key: Ed25519PrivateKey) -> None:
    path = tmp_path / "signer.pem"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    signing.Signer(str(path)).sign_into(store, record.id)


def _blobs(store: Store) -> set[str]:
    return {"sha256:" + name for name in os.listdir(store.blobs.dir)}


def _index(store: Store) -> list[dict[str, Any]]:
    return list(json.loads(Path(store.index_path).read_bytes())["manifests"])


def _left_as_it_was(store: Store, blobs: set[str], index: list[dict[str, Any]]) -> None:
    assert _blobs(store) == blobs
    assert _index(store) == index
    assert os.listdir(store.ingest_dir) == [] and os.listdir(store.origins.dir) == []


def _bring(store: Store, ref: str, **kw: Any) -> Any:
    return pull(store, ref, PLAIN, **kw)


# -- admission before publishing ----------------------------------------------------------


def test_the_callback_sees_the_whole_checkpoint_before_anything_lists_it(
    tmp_path: Path, registry: Registry, source: Store, key: Ed25519PrivateKey,
) -> None:
    record = _make(source, "one")
    _signed(tmp_path, source, record, key)
    push(source, record.id, registry.ref("ckpt/web:v1"), PLAIN)
    dst = Store(tmp_path / "dest-store")
    trust = from_mapping({"restore": {"require-signature": True, "trusted-keys": {
        "ns": ["ed25519:" + base64.b64encode(signing.raw_public(key.public_key())).decode()]}}})
    seen: list[Admission[CheckpointRecord]] = []

    def admit(admission: Admission[CheckpointRecord]) -> None:
        seen.append(admission)
        assert admission.reference == registry.ref(f"ckpt/web@{record.id}")
        assert admission.record.id == record.id and admission.record.metadata["pod"]["namespace"] == "ns"
        assert (admission.record.provenance, admission.record.received) == ("pulled", "")  # not received yet
        with dst.open(admission.record, "containers/app/config.dump") as fh:
            assert fh.read() == CONFIG_DUMP
        assert signing.require_trusted(admission, admission.record, trust, "ns") == signing.key_id(key.public_key())
        with pytest.raises(PermissionDenied, match="not trusted for namespace 'other'"):
            signing.require_trusted(admission, admission.record, trust, "other")
        # Listed nowhere, and invisible to retention, which keeps its blobs.
        assert dst.list() == [] and _index(dst) == []
        with pytest.raises(NotFound):
            dst.get(record.id)
        assert dst.gc(RetentionPolicy(max_total_bytes=0)).removed_blobs == ()

    report = _bring(dst, registry.ref("ckpt/web:v1"), admit=admit)
    assert len(seen) == 1 and report.checkpoint_id == record.id
    assert [r.id for r in dst.list()] == [record.id] and dst.verify(record.id) == []
    assert dst.get(record.id).provenance == "pulled"
    assert signing.require_trusted(dst, dst.get(record.id), trust, "ns")  # the signature is attached after


def test_a_refused_pull_leaves_nothing(tmp_path: Path, registry: Registry, source: Store, key: Ed25519PrivateKey) -> None:
    record = _make(source, "one")
    _signed(tmp_path, source, record, key)
    push(source, record.id, registry.ref("ckpt/web:v1"), PLAIN)
    dst = Store(tmp_path / "dest-store")
    blobs, index = _blobs(dst), _index(dst)
    refusal = Refused("checkpoint of another namespace")

    def admit(admission: Admission[CheckpointRecord]) -> None:
        assert dst.has_blob(admission.record.id)  # it is all there, staged
        raise refusal

    with pytest.raises(Refused) as info:
        _bring(dst, registry.ref("ckpt/web:v1"), admit=admit)
    assert info.value is refusal  # unchanged
    _left_as_it_was(dst, blobs, index)
    assert dst.recover().clean
    # Nothing was taken for the next pull either: it brings every blob again.
    report = _bring(dst, registry.ref("ckpt/web:v1"))
    assert report.blobs_skipped == 0 and [r.id for r in dst.list()] == [record.id]
    assert len(dst.referrers(record.id)) == 1


def test_a_refused_pull_keeps_what_was_there_before(tmp_path: Path, registry: Registry, source: Store) -> None:
    kept = _make(source, "kept")
    refused = _make(source, "refused")  # shares its pages' chunks with `kept`
    push(source, kept.id, registry.ref("ckpt/web:kept"), PLAIN)
    push(source, refused.id, registry.ref("ckpt/web:refused"), PLAIN)
    dst = Store(tmp_path / "dest-store")
    _bring(dst, registry.ref("ckpt/web:kept"))
    # Blobs of a pull that stopped before (garbage until the next collection) stay as well.
    stray = dst.blob_path("sha256:" + "ab" * 32)
    Path(stray).write_bytes(b"an earlier import's blob")
    blobs, index = _blobs(dst), _index(dst)
    shared = {c.digest for f in refused.files for c in f.chunks} & {c.digest for f in kept.files for c in f.chunks}
    assert shared and shared <= blobs

    def admit(admission: Admission[CheckpointRecord]) -> None:
        raise Refused("no")

    with pytest.raises(Refused):
        _bring(dst, registry.ref("ckpt/web:refused"), admit=admit)
    _left_as_it_was(dst, blobs, index)
    assert dst.verify(kept.id) == []

    # A checkpoint that was published already stays so, even when a later pull of it is refused.
    with pytest.raises(Refused):
        _bring(dst, registry.ref("ckpt/web:kept"), admit=admit)
    _left_as_it_was(dst, blobs, index)


def test_a_refused_lazy_pull_leaves_no_origin(tmp_path: Path, registry: Registry, source: Store) -> None:
    from node_agent.lazy.remote import memory_chunks

    record = _make(source, "lazy")
    push(source, record.id, registry.ref("ckpt/web:v1"), PLAIN)
    dst = Store(tmp_path / "dest-store")
    blobs, index = _blobs(dst), _index(dst)

    def admit(admission: Admission[CheckpointRecord]) -> None:
        assert dst.origins.get(admission.record.id) is not None
        raise Refused("no")

    with pytest.raises(Refused):
        _bring(dst, registry.ref("ckpt/web:v1"), defer=functools.partial(memory_chunks, dst), admit=admit)
    _left_as_it_was(dst, blobs, index)


_CHILD = r"""
import sys
from node_agent.registry import Credentials, pull
from node_agent.store import Store

def admit(admission):
    print("admitting", admission.record.id, flush=True)
    sys.stdin.read()  # held here until killed

pull(Store(sys.argv[1]), sys.argv[2], Credentials(plain_http=True), admit=admit)
print("finished", flush=True)
"""


def test_a_pull_killed_in_its_admission_is_repaired_at_start_up(tmp_path: Path, registry: Registry, source: Store) -> None:
    record = _make(source, "killed")
    push(source, record.id, registry.ref("ckpt/web:v1"), PLAIN)
    root = tmp_path / "dest-store"
    blobs, index = _blobs(Store(root)), _index(Store(root))
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(root), registry.ref("ckpt/web:v1")], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    guard = threading.Timer(120, proc.kill)
    guard.start()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.split() == ["admitting", record.id], (line, proc.stderr.read() if proc.stderr else "")
        dst = Store(root)
        assert dst.list() == [] and dst.has_blob(record.id)  # staged, held by the child's lease
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    report = dst.recover()
    assert report.ingest_removed and record.id in report.blobs_removed
    _left_as_it_was(dst, blobs, index)


# -- bounds ---------------------------------------------------------------------------------


def _total(store: Store, cid: str) -> int:
    return sum(size for size in {d.digest: d.size for d in store.descriptors(cid)}.values())


def test_max_pull_bytes_refuses_before_a_byte_is_written(tmp_path: Path, registry: Registry, source: Store) -> None:
    record = _make(source, "big")
    push(source, record.id, registry.ref("ckpt/web:v1"), PLAIN)
    total = _total(source, record.id)
    dst = Store(tmp_path / "dest-store")
    blobs, index = _blobs(dst), _index(dst)
    tight = RegistrySettings(max_pull_bytes=total - 1)
    with pytest.raises(ResourceExhausted) as info:
        _bring(dst, registry.ref("ckpt/web:v1"), settings=tight)
    assert str(info.value).startswith(
        f"pull of {registry.ref('ckpt/web:v1')}: the checkpoint is {total} bytes ")
    assert f"more than registry.max-pull-bytes ({total - 1} bytes)" in str(info.value)
    _left_as_it_was(dst, blobs, index)
    assert _bring(dst, registry.ref("ckpt/web:v1"), settings=RegistrySettings(max_pull_bytes=total)).checkpoint_id \
        == record.id


def test_a_lazy_pull_is_bounded_by_the_whole_checkpoint_and_needs_room_for_what_it_brings_now(
    tmp_path: Path, registry: Registry, source: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    from node_agent.lazy.remote import memory_chunks
    from node_agent.registry.fetching import RemoteBlobs

    record = _make(source, "lazy")
    push(source, record.id, registry.ref("ckpt/web:v1"), PLAIN)
    total = _total(source, record.id)
    dst = Store(tmp_path / "dest-store")
    free = 1 << 40
    monkeypatch.setattr(dst, "free_bytes", lambda: free)
    defer = functools.partial(memory_chunks, dst)
    # What it leaves in the registry comes once a restore reads it: max-pull-bytes counts it.
    blobs, index = _blobs(dst), _index(dst)
    with pytest.raises(ResourceExhausted, match=rf"the checkpoint is {total} bytes .*max-pull-bytes"):
        _bring(dst, registry.ref("ckpt/web:v1"), settings=RegistrySettings(max_pull_bytes=total - 1), defer=defer)
    _left_as_it_was(dst, blobs, index)
    # The store's free space need only hold what it brings now (the rest is kept while there is room).
    room_for_now = free - (total - len(PAGES) + 1)
    with pytest.raises(ResourceExhausted, match="the checkpoint needs"):
        _bring(dst, registry.ref("ckpt/web:v1"), min_free_bytes=room_for_now)
    report = _bring(dst, registry.ref("ckpt/web:v1"), settings=RegistrySettings(max_pull_bytes=total), defer=defer,
                    min_free_bytes=room_for_now)
    assert report.bytes_downloaded < len(PAGES)
    missing = dst.origins.missing(dst.get(record.id))
    assert missing
    first, victim = missing[0], missing[-1]
    origin = dst.origins.get(record.id) or {}
    # Fetched where the store may not keep it: verified, handed over, not kept; the checkpoint stays lazy.
    short = RemoteBlobs(dst, min_free=free + 1)
    try:
        got = short(origin, first)
        assert got is not None and hashlib.sha256(got).hexdigest() == first.digest.split(":")[1]
        assert short.not_kept == 1 and not dst.has_blob(first.digest)
        short.drain()
        assert not dst.has_blob(first.digest) and dst.origins.get(record.id) == origin
    finally:
        short.close()
    # A chunk fetched later is checked against its descriptor, kept or not: the registry's copy, altered, is
    # refused.
    data = registry.blob_data(victim.digest)
    data.write_bytes(bytes([data.read_bytes()[0] ^ 1]) + data.read_bytes()[1:])
    for min_free in (0, free + 1):
        fetcher = RemoteBlobs(dst, min_free=min_free)
        try:
            with pytest.raises(DataLoss, match=victim.digest):
                fetcher(origin, victim)
        finally:
            fetcher.close()
        assert not dst.has_blob(victim.digest)


def test_free_space_counts_only_the_blobs_the_store_lacks(tmp_path: Path, registry: Registry, source: Store,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    first = _make(source, "first")
    second = _make(source, "second")  # the same pages: only its config, manifest and one chunk are new
    push(source, first.id, registry.ref("ckpt/web:first"), PLAIN)
    push(source, second.id, registry.ref("ckpt/web:second"), PLAIN)
    dst = Store(tmp_path / "dest-store")
    free = 1 << 40
    monkeypatch.setattr(dst, "free_bytes", lambda: free)
    min_free = free - _total(source, first.id) + 1  # one byte short of the whole first checkpoint
    blobs, index = _blobs(dst), _index(dst)
    with pytest.raises(ResourceExhausted) as info:
        _bring(dst, registry.ref("ckpt/web:first"), min_free_bytes=min_free)
    text = str(info.value)
    assert text.startswith(f"pull of {registry.ref('ckpt/web:first')}: the checkpoint needs "
                           f"{_total(source, first.id)} more bytes in the store")
    assert f"{free} bytes are free under {dst.root} and min-free-bytes ({min_free} bytes) must stay free" in text
    _left_as_it_was(dst, blobs, index)
    _bring(dst, registry.ref("ckpt/web:first"), min_free_bytes=min_free - 1)
    # The second one needs only what the first did not bring, however large it is.
    lacking = sum(d.size for d in source.descriptors(second.id) if not dst.has_blob(d.digest))
    lacking += len(source.manifest_bytes(second.id))
    assert lacking < _total(source, second.id) - len(PAGES) // 2
    _bring(dst, registry.ref("ckpt/web:second"), min_free_bytes=free - lacking)


def test_free_space_taken_while_pulling_stops_the_pull(tmp_path: Path, registry: Registry, source: Store,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    record = _make(source, "squeezed")
    push(source, record.id, registry.ref("ckpt/web:v1"), PLAIN)
    total = _total(source, record.id)
    dst = Store(tmp_path / "dest-store")
    looks: list[int] = []

    def free_bytes() -> int:  # enough at first; then something else fills the disk
        looks.append(1)
        return total + 2 * MiB if len(looks) == 1 else total // 2

    monkeypatch.setattr(dst, "free_bytes", free_bytes)
    with pytest.raises(ResourceExhausted, match="must stay free"):
        _bring(dst, registry.ref("ckpt/web:v1"), min_free_bytes=MiB)
    # The second look stopped it; a lane that charged its piece at the same moment may have looked too.
    assert len(looks) >= 2 and dst.list() == []


class _Space:
    root = "/store"

    def __init__(self, free: int, present: Collection[str] = ()) -> None:
        self.free = free
        self.present = set(present)

    def has_blob(self, digest: str) -> bool:
        return digest in self.present

    def free_bytes(self) -> int:
        return self.free


def test_the_budget_counts_every_byte_as_it_arrives() -> None:
    space = _Space(10 * CHECK_EVERY)
    budget = PullBudget(space, "reg/ckpt:v1", max_bytes=3 * CHECK_EVERY, min_free=CHECK_EVERY)
    budget.plan([("sha256:" + "a" * 64, CHECK_EVERY), ("sha256:" + "b" * 64, CHECK_EVERY)], "the checkpoint")
    assert (budget.planned, budget.missing) == (2 * CHECK_EVERY, 2 * CHECK_EVERY)
    budget.charge(CHECK_EVERY)
    space.free -= CHECK_EVERY
    # Bytes past what the manifest said (a blob damaged in the store, fetched again) are counted too.
    budget.charge(2 * CHECK_EVERY)
    with pytest.raises(ResourceExhausted, match=r"more than registry.max-pull-bytes \(201326592 bytes\) received"):
        budget.charge(1)
    # The free space is read again within CHECK_EVERY bytes: what else took it counts.
    other = PullBudget(space, "reg/ckpt:v1", max_bytes=10 * CHECK_EVERY, min_free=CHECK_EVERY)
    other.plan([("sha256:" + "c" * 64, 4 * CHECK_EVERY)], "the checkpoint")
    other.charge(CHECK_EVERY)
    space.free = 3 * CHECK_EVERY
    with pytest.raises(ResourceExhausted, match="the rest needs 201326591 more bytes"):
        other.charge(1)
    present = PullBudget(_Space(CHECK_EVERY, {"sha256:" + "d" * 64}), "r", max_bytes=10 * CHECK_EVERY, min_free=0)
    present.plan([("sha256:" + "d" * 64, 5 * CHECK_EVERY)], "the checkpoint")
    assert (present.planned, present.missing) == (5 * CHECK_EVERY, 0)
