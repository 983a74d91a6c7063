"""A pull cut off half-way resumes: its blobs are kept for `registry.partial-pull-ttl` (docker-registry 2.8).

The registry is really killed (SIGKILL) in the middle of a blob; the blobs
that arrived whole stay under a lease kept in the store (`ingest/<id>/kept`),
through garbage collection and a restart's repair, until the time it names
passes: the clock garbage collection is given decides, no test sleeps. A
re-run then fetches only the rest. A pull that does not fit is refused
before it starts, on a real small filesystem; one refused on trust grounds
keeps nothing, not even what an earlier run kept; a pull killed outright
(SIGKILL) writes no kept lease, and the store's start-up repair clears it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from node_agent.config.schema import RegistrySettings
from node_agent.errors import NotFound, PermissionDenied, ResourceExhausted, Unavailable
from node_agent.registry import Admission, Credentials, Progress, pull, push
from node_agent.store import CheckpointRecord, Store

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests/unit is not a package: make the repository's tests/ importable
    sys.path.insert(0, str(REPO))

from testbed.faults import killed_outright  # noqa: E402
from testbed.registry import Registry  # noqa: E402

MiB = 1 << 20
PLAIN = Credentials(plain_http=True)
TTL = 3600.0
# One lane: a pull cut off after a byte count stops inside a known blob, with the ones before it whole.
SETTINGS = RegistrySettings(partial_pull_ttl=TTL, connections=1)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with Registry(tmp_path / "registry") as r:
        yield r


@pytest.fixture
def pushed(tmp_path: Path, registry: Registry) -> tuple[Store, str, list[tuple[str, int]]]:
    """A checkpoint of 16 MiB of memory in 4 MiB chunks, in the registry; its blobs (config first)."""
    src = Store(tmp_path / "source-store", chunk_size=4 * MiB)
    with src.writer() as w:
        w.add_bytes("containers/app/checkpoint/pages-1.img", random.Random(16).randbytes(16 * MiB))  # the same chunk edges every run
        w.add_bytes("containers/app/config.dump", b'{"id": "abc"}')
        cid = w.commit({"kind": "test", "pod": {"namespace": "ns", "name": "web"}},
                       annotations={"io.node-agent.pod": "ns/web"}).id
    push(src, cid, registry.ref("ckpt/web:v1"), PLAIN)
    blobs: dict[str, int] = {}
    for d in src.descriptors(cid):
        blobs.setdefault(d.digest, d.size)
    assert len(blobs) >= 4 and all(size > MiB for _, size in list(blobs.items())[1:3])
    return src, cid, list(blobs.items())


def _killer(registry: Registry, after: int) -> Callable[[Progress], None]:
    """A progress callback that kills the registry once ``after`` bytes have come (inside a blob)."""
    def progress(p: Progress) -> None:
        if p.phase == "blobs" and p.bytes_done >= after:
            registry.kill()
    return progress


def _cut_off(dst: Store, registry: Registry, blobs: list[tuple[str, int]], **kw: Any) -> int:
    """Pull until the registry dies one byte into the third blob; how many blobs came whole, in order.

    At least the first two, and not the last (what the socket held of the
    third when the registry died may still complete it).
    """
    after = blobs[0][1] + blobs[1][1] + 1
    with pytest.raises(Unavailable, match=registry.host):
        pull(dst, registry.ref("ckpt/web:v1"), PLAIN, progress=_killer(registry, after), **kw)
    registry.restart()
    came = next(i for i, (d, _) in enumerate(blobs) if not dst.has_blob(d))
    assert came >= 2 and _stored(dst) == {d for d, _ in blobs[:came]}
    return came


def _stored(store: Store) -> set[str]:
    return {"sha256:" + name for name in os.listdir(store.blobs.dir)}


def _kept(store: Store) -> list[dict[str, Any]]:
    """The kept records in the store's ingest area."""
    out = []
    for name in os.listdir(store.ingest_dir):
        path = Path(store.ingest_dir, name, "kept")
        if path.exists():
            out.append({**json.loads(path.read_bytes()), "dir": name})
    return out


def test_a_pull_cut_off_keeps_its_blobs_through_gc_and_a_restart_and_resumes(
        tmp_path: Path, registry: Registry, pushed: tuple[Store, str, list[tuple[str, int]]]) -> None:
    src, cid, blobs = pushed
    dst = Store(tmp_path / "dest-store")
    came = _cut_off(dst, registry, blobs, settings=SETTINGS)
    brought = {d for d, _ in blobs[:came]}
    assert _stored(dst) == brought
    [kept] = _kept(dst)
    assert kept["manifest"] == cid and kept["reference"] == registry.ref(f"ckpt/web@{cid}")
    assert kept["reason"].startswith("Unavailable: ") and registry.host in kept["reason"]
    until = kept["until"]
    assert until > 1e9 and kept["until_utc"].endswith("Z")

    # Until the lease's time, neither garbage collection nor a restart's repair takes them.
    assert dst.gc(now=until - 1).removed_blobs == ()
    again = Store(dst.root)
    report = again.recover()
    assert report.blobs_removed == () and report.ingest_removed == ()
    assert _stored(again) == brought and len(_kept(again)) == 1

    # The re-run fetches only the rest, and its success ends the kept lease.
    result = pull(again, registry.ref("ckpt/web:v1"), PLAIN, settings=SETTINGS)
    assert result.blobs_skipped == came
    assert result.bytes_downloaded == sum(size for _, size in blobs[came:])
    assert _kept(again) == [] and os.listdir(again.ingest_dir) == []
    assert again.verify(cid) == [] and again.manifest_bytes(cid) == src.manifest_bytes(cid)


def test_the_kept_blobs_go_once_the_lease_has_passed(
        tmp_path: Path, registry: Registry, pushed: tuple[Store, str, list[tuple[str, int]]]) -> None:
    _, cid, blobs = pushed
    dst = Store(tmp_path / "dest-store")
    came = _cut_off(dst, registry, blobs, settings=SETTINGS)
    [kept] = _kept(dst)
    assert dst.gc(dry_run=True, now=kept["until"] + 1).removed_blobs == tuple(sorted(d for d, _ in blobs[:came]))
    assert _stored(dst) == {d for d, _ in blobs[:came]}  # a dry run
    report = dst.gc(now=kept["until"] + 1)
    assert set(report.removed_blobs) == {d for d, _ in blobs[:came]}
    assert _stored(dst) == set() and os.listdir(dst.ingest_dir) == []
    # So a re-run now starts over.
    assert pull(dst, registry.ref("ckpt/web:v1"), PLAIN, settings=SETTINGS).blobs_skipped == 0
    assert dst.verify(cid) == []


def test_with_no_ttl_a_cut_off_pull_keeps_its_blobs_only_until_the_next_gc(
        tmp_path: Path, registry: Registry, pushed: tuple[Store, str, list[tuple[str, int]]]) -> None:
    _, _, blobs = pushed
    dst = Store(tmp_path / "dest-store")
    came = _cut_off(dst, registry, blobs, settings=RegistrySettings(partial_pull_ttl=0, connections=1))
    assert _kept(dst) == [] and os.listdir(dst.ingest_dir) == []
    assert len(dst.gc().removed_blobs) == came and _stored(dst) == set()


def test_a_refused_pull_keeps_nothing_not_even_what_an_earlier_run_kept(
        tmp_path: Path, registry: Registry, pushed: tuple[Store, str, list[tuple[str, int]]]) -> None:
    _, cid, blobs = pushed
    dst = Store(tmp_path / "dest-store")
    _cut_off(dst, registry, blobs, settings=SETTINGS)
    assert len(_kept(dst)) == 1

    def refuse(admission: Admission[CheckpointRecord]) -> None:
        raise PermissionDenied(f"{admission.record.id} is not trusted here")

    with pytest.raises(PermissionDenied, match="is not trusted here"):
        pull(dst, registry.ref("ckpt/web:v1"), PLAIN, settings=SETTINGS, admit=refuse)
    assert _stored(dst) == set() and os.listdir(dst.ingest_dir) == [] and dst.list() == []
    with pytest.raises(NotFound):
        dst.get(cid)


def test_a_pull_that_does_not_fit_is_refused_before_it_starts(
        tmp_path: Path, registry: Registry, pushed: tuple[Store, str, list[tuple[str, int]]]) -> None:
    assert os.geteuid() == 0, "needs root to mount a tmpfs"
    _, _, blobs = pushed
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        dst = Store(mnt / "store")
        free = dst.free_bytes()
        need = sum(size for _, size in blobs)
        with pytest.raises(ResourceExhausted) as info:
            pull(dst, registry.ref("ckpt/web:v1"), PLAIN, settings=SETTINGS, min_free_bytes=MiB)
        assert str(info.value) == (
            f"pull of {registry.ref('ckpt/web:v1')}: the checkpoint needs {need} more bytes in the store "
            f"({need} of the {need} it brings are not there yet, 0 written), but {free} bytes are free under "
            f"{dst.root} and min-free-bytes ({MiB} bytes) must stay free"
        )
        assert _stored(dst) == set() and os.listdir(dst.ingest_dir) == [] and dst.free_bytes() == free
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


_CHILD = r"""
import sys
import time
from node_agent.config.schema import RegistrySettings
from node_agent.registry import Credentials, pull
from node_agent.store import Store

def progress(p):
    if p.phase == "blobs" and p.bytes_done >= int(sys.argv[3]):
        # The blobs received so far are linked by the import's link threads, which go on meanwhile.
        blobs, deadline = Store(sys.argv[1]).blobs, time.monotonic() + 60
        while any(blobs.size_of(d) is None for d in sys.argv[4:]) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("stopped", p.blobs_done, flush=True)
        sys.stdin.read()  # held here until killed

pull(Store(sys.argv[1]), sys.argv[2], Credentials(plain_http=True), progress=progress,
     settings=RegistrySettings(partial_pull_ttl=3600, connections=1))
"""


def test_a_pull_killed_outright_is_cleared_by_the_start_up_repair(
        tmp_path: Path, registry: Registry, pushed: tuple[Store, str, list[tuple[str, int]]]) -> None:
    _, _, blobs = pushed
    root = tmp_path / "dest-store"
    Store(root)
    after = blobs[0][1] + blobs[1][1] + 1
    with killed_outright(_CHILD, str(root), registry.ref("ckpt/web:v1"), str(after),
                         *(d for d, _ in blobs[:2])) as proc:
        assert proc.stdout is not None and proc.stdout.readline().startswith("stopped 2")
    dst = Store(root)
    assert len(os.listdir(dst.ingest_dir)) == 1 and _kept(dst)[0]["until"] == 0  # reserved, never kept
    report = dst.recover()
    assert len(report.ingest_removed) == 1 and set(report.blobs_removed) == {d for d, _ in blobs[:2]}
    assert os.listdir(dst.ingest_dir) == [] and _stored(dst) == set()


def test_the_setting_is_a_day_by_default_zero_allowed_negative_refused() -> None:
    from node_agent.config.loading import from_mapping
    from node_agent.errors import InvalidArgument

    assert from_mapping({}).registry.partial_pull_ttl == 86400
    assert from_mapping({"registry": {"partial-pull-ttl": 0}}).registry.partial_pull_ttl == 0
    with pytest.raises(InvalidArgument, match="registry.partial-pull-ttl"):
        from_mapping({"registry": {"partial-pull-ttl": -1}})
