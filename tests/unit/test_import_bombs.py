"""Decompression bombs, free space and the order of required members on import (docs/interop.md).

The bombs are built streaming: a tar header declaring GiBs, then zeros fed
to the compressor a MiB at a time, so the inflated archive never exists in
memory or on disk. What the import stages is measured independently of its
own accounting: the os module the importer sees is wrapped, and every write
it makes is followed by a walk of the work directory; more than 64 MiB there
fails the test at once (so an unfixed importer fails fast instead of
filling the disk).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import tarfile
import types
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from node_agent import errors, interop
from node_agent.interop import archive, archive_import, common, landing, layer, plans
from node_agent.interop.common import ImportLimits
from tests.unit.test_interop import (
    Env,
    Tar,
    files_img,
    make_checkpoint,
    podman_spec,
    small_tar,
    stored_files,
    _reg,
)

MiB = 1 << 20
GiB = 1 << 30
ZEROS = bytes(MiB)
STAGING_CAP = 64 * MiB  # the most a stopped bomb may ever have staged


# -- measuring what is staged -------------------------------------------------------------


class Watch:
    """The os module as the import's modules see it: every write measured, the free space faked at will."""

    def __init__(self, work: Path, cap: int = STAGING_CAP) -> None:
        self.work = work
        self.cap = cap
        self.peak = 0  # most bytes ever under the work directory, right after a write
        self.writes = 0
        self.statvfs_calls = 0
        self.free: Callable[[int], int] | None = None  # bytes staged now -> bytes free to report

    def staged(self) -> int:
        total = 0
        for dirpath, _dirs, names in os.walk(self.work):
            for n in names:
                with contextlib.suppress(FileNotFoundError):
                    total += os.lstat(os.path.join(dirpath, n)).st_size
        return total

    def write(self, fd: int, data: Any) -> int:
        n = os.write(fd, data)
        self.writes += 1
        now = self.staged()
        self.peak = max(self.peak, now)
        if now > self.cap:
            raise AssertionError(f"{now} bytes staged under {self.work}, more than {self.cap}")
        return n

    def fstatvfs(self, fd: int) -> Any:
        self.statvfs_calls += 1
        real = os.fstatvfs(fd)
        if self.free is None:
            return real
        free = max(0, self.free(self.staged()))
        return types.SimpleNamespace(f_bavail=free // real.f_frsize, f_frsize=real.f_frsize)

    def statvfs(self, path: str) -> Any:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return self.fstatvfs(fd)
        finally:
            os.close(fd)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    e = Env(tmp_path)
    monkeypatch.chdir(e.cwd)
    yield e


@pytest.fixture
def watch(env: Env, monkeypatch: pytest.MonkeyPatch) -> Watch:
    w = Watch(env.root / "store" / "work")
    proxy = types.ModuleType("os")
    proxy.__dict__["__getattr__"] = lambda name: getattr(os, name)
    proxy.write = w.write  # type: ignore[attr-defined]
    proxy.fstatvfs = w.fstatvfs  # type: ignore[attr-defined]
    proxy.statvfs = w.statvfs  # type: ignore[attr-defined]
    for module in (archive_import, archive, landing, layer, plans):
        monkeypatch.setattr(module, "os", proxy)
    return w


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How often the import started reading the archive from its start."""
    calls: list[int] = []
    original = archive.Archive.reader

    def counting(self: Any, bounds: Any) -> Any:
        calls.append(1)
        return original(self, bounds)

    monkeypatch.setattr(archive.Archive, "reader", counting)
    return calls


# -- building archives -----------------------------------------------------------------------


def header(name: str, size: int) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mode = 0o600
    return ti.tobuf(tarfile.PAX_FORMAT)


def members(files: dict[str, bytes]) -> bytes:
    """Tar members without the end blocks."""
    return b"".join(header(n, len(d)) + d + bytes(-len(d) % 512) for n, d in files.items())


def cfg_doc() -> bytes:
    return json.dumps({"id": "c1a9", "name": "bomb", "rootfsImageName": "localhost/busybox:1"}).encode()


def docs() -> dict[str, bytes]:
    return {"config.dump": cfg_doc(), "spec.dump": json.dumps(podman_spec()).encode()}


def write_bomb(path: Path, compression: str, size: int, *, name: str = "checkpoint/pages-1.img",
               head: dict[str, bytes] | None = None, tail: dict[str, bytes] | None = None) -> int:
    """A tar whose member `name` is `size` zeros (whole MiBs), compressed while it is written; its size on disk."""
    assert size % MiB == 0
    prefix = members(head or {}) + header(name, size)
    suffix = members(tail or {}) + bytes(1024)
    with open(path, "wb") as raw:
        if compression == "zstd":
            with zstandard.ZstdCompressor(level=1).stream_writer(raw, closefd=False) as w:
                w.write(prefix)
                for _ in range(size // MiB):
                    w.write(ZEROS)
                w.write(suffix)
        elif compression == "gzip":
            # After a full flush deflate starts afresh, so every MiB of zeros compresses to the same block.
            raw.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\x03")
            co = zlib.compressobj(9, zlib.DEFLATED, -15)
            raw.write(co.compress(prefix) + co.flush(zlib.Z_FULL_FLUSH))
            block = co.compress(ZEROS) + co.flush(zlib.Z_FULL_FLUSH)
            crc = zlib.crc32(prefix)
            for _ in range(size // MiB):
                raw.write(block)
                crc = zlib.crc32(ZEROS, crc)
            raw.write(co.compress(suffix) + co.flush(zlib.Z_FINISH))
            crc = zlib.crc32(suffix, crc)
            raw.write(struct.pack("<II", crc, (len(prefix) + size + len(suffix)) & 0xFFFFFFFF))
        else:
            raise AssertionError(compression)
    return path.stat().st_size


def compress(data: bytes, compression: str) -> bytes:
    if compression == "zstd":
        return zstandard.ZstdCompressor(level=1).compress(data)
    if compression == "gzip":
        import gzip

        return gzip.compress(data, 1)
    return data


def work_is_empty(env: Env) -> bool:
    work = env.root / "store" / "work"
    return not work.exists() or os.listdir(work) == []


# -- bombs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("compression,size", [("zstd", 6 * GiB), ("gzip", 2 * GiB)])
def test_bomb_without_config_dump_is_stopped_before_it_is_staged(
    env: Env, watch: Watch, compression: str, size: int
) -> None:
    path = env.root / "archives" / f"bomb.tar.{compression}"
    on_disk = write_bomb(path, compression, size)
    assert on_disk < 4 * MiB  # zstd: ~200 KB for 6 GiB; gzip: ~2 MB for 2 GiB
    before = env.outside()
    with pytest.raises((errors.InvalidArgument, errors.ResourceExhausted)) as exc:
        interop.import_archive(env.store, str(path))
    if isinstance(exc.value, errors.InvalidArgument):
        assert "no config.dump" in str(exc.value)
    assert watch.peak <= STAGING_CAP
    assert watch.peak == 0  # the member was larger than the bound in front of the documents: none of it staged
    env.assert_clean(before)


@pytest.mark.parametrize("compression", ["zstd", "gzip"])
def test_bomb_behind_a_podman_prelude_is_stopped(env: Env, watch: Watch, compression: str) -> None:
    # What Podman writes in front of config.dump, then the bomb in place of the documents.
    path = env.root / "archives" / "bomb.tar"
    write_bomb(path, compression, 1 * GiB, name="rootfs-diff.tar",
               head={"devshm-checkpoint.tar": small_tar({"x": b"1"}), "stats-dump": b"stats"})
    before = env.outside()
    with pytest.raises(errors.InvalidArgument, match="no config.dump and spec.dump"):
        interop.import_archive(env.store, str(path))
    assert watch.peak <= STAGING_CAP
    env.assert_clean(before)


def test_required_document_over_max_json_bytes_is_refused_at_its_header(env: Env, watch: Watch) -> None:
    path = env.root / "archives" / "bomb.tar.zst"
    write_bomb(path, "zstd", 2 * GiB, name="config.dump")
    with pytest.raises(errors.ResourceExhausted, match=r"config\.dump: 2147483648 bytes .*max_json_bytes"):
        interop.import_archive(env.store, str(path))
    assert watch.peak == 0
    assert work_is_empty(env)


def test_bomb_behind_the_documents_is_bounded_by_the_free_space(env: Env, watch: Watch) -> None:
    # The documents first lift the bound in front of them; the free space is what bounds the rest.
    # The filesystem has 40 MiB beyond min_free_bytes: the 4 GiB member cannot fit and is refused at its header.
    limits = ImportLimits()
    watch.free = lambda staged: limits.min_free_bytes + 40 * MiB - staged
    path = env.root / "archives" / "bomb.tar.zst"
    write_bomb(path, "zstd", 4 * GiB, head=docs())
    before = env.outside()
    with pytest.raises(errors.ResourceExhausted) as exc:
        interop.import_archive(env.store, str(path), limits=limits)
    msg = str(exc.value)
    # The bounds on one file and on all of them are both that room; the one on a file is met first.
    assert re.search(r"'checkpoint/pages-1.img': .*limit of 41943040 \((max_member_bytes|max_total_bytes): "
                     r"by default what the staging filesystem had free", msg), msg
    assert watch.peak < MiB  # the two documents
    env.assert_clean(before)


def test_free_space_is_enforced_in_the_middle_of_a_member(env: Env, watch: Watch) -> None:
    # Plenty of room when the member starts; after 24 MiB something else takes the disk.
    limits = ImportLimits()
    watch.free = lambda staged: 100 * GiB if staged < 24 * MiB else limits.min_free_bytes - MiB
    path = env.root / "archives" / "bomb.tar.zst"
    write_bomb(path, "zstd", 4 * GiB, head=docs())
    before = env.outside()
    with pytest.raises(errors.ResourceExhausted) as exc:
        interop.import_archive(env.store, str(path), limits=limits)
    msg = str(exc.value)
    assert "'checkpoint/pages-1.img'" in msg and f"min_free_bytes={limits.min_free_bytes}" in msg, msg
    done = int(re.search(r"more than (\d+) of its 4294967296 bytes", msg).group(1))  # type: ignore[union-attr]
    # Stopped mid-member, within one check interval (and one write) of the point the disk filled.
    assert 24 * MiB <= done <= 24 * MiB + limits.free_check_bytes + MiB
    assert watch.peak <= done + MiB
    # The free space is read every few MiB, not at every write.
    assert 2 <= watch.statvfs_calls <= 5 + watch.peak // limits.free_check_bytes < watch.writes
    env.assert_clean(before)


def test_member_larger_than_the_filesystem_is_refused_at_its_header(env: Env, watch: Watch) -> None:
    # 1 PiB declared, nothing behind it: the header alone decides (the real free space, default limits).
    data = members(docs()) + header("checkpoint/pages-1.img", 1 << 50) + ZEROS[:4096]
    before = env.outside()
    pattern = r"'checkpoint/pages-1.img': 1125899906842624 bytes .*\((max_member_bytes|max_total_bytes)"
    with pytest.raises(errors.ResourceExhausted, match=pattern):
        env.import_(data)
    assert watch.peak < MiB
    env.assert_clean(before)


# -- real archives: where the required documents come ------------------------------------------------


def _foreign_files(bulk: int) -> dict[str, bytes]:
    return {
        "stats-dump": b"@Y\x10stats",
        "dump.log": b"(00.000) dump\n",
        "checkpoint/inventory.img": b"inventory",
        "checkpoint/files.img": files_img([_reg(b"/bin/busybox", 0o100755, 1), _reg(b"/", 0o40555, 2)]),
        "checkpoint/pages-1.img": os.urandom(bulk),
        "config.dump": cfg_doc(),
        "spec.dump": json.dumps(podman_spec()).encode(),
        "rootfs-diff.tar": small_tar({"data/c.log": b"1\n2\n"}),
        "devshm-checkpoint.tar": small_tar({"x.count": b"1"}),
    }


ORDERS = {
    # CRI-O: stats-dump, dump.log, checkpoint/, config.dump, spec.dump, then the rest.
    "cri-o": ["stats-dump", "dump.log", "checkpoint/", "checkpoint/inventory.img", "checkpoint/files.img",
              "checkpoint/pages-1.img", "config.dump", "spec.dump", "rootfs-diff.tar", "devshm-checkpoint.tar"],
    # containerd: the checkpoint directory walked in name order.
    "containerd": ["checkpoint/", "checkpoint/files.img", "checkpoint/inventory.img", "checkpoint/pages-1.img",
                   "config.dump", "devshm-checkpoint.tar", "dump.log", "rootfs-diff.tar", "spec.dump",
                   "stats-dump"],
    # Podman with a large /dev/shm: artifacts/ and devshm-checkpoint.tar in front of config.dump.
    "podman-large-shm": ["artifacts/", "devshm-checkpoint.tar", "config.dump", "spec.dump", "stats-dump",
                         "checkpoint/", "checkpoint/inventory.img", "checkpoint/files.img",
                         "checkpoint/pages-1.img", "rootfs-diff.tar"],
}


def _ordered(order: list[str], files: dict[str, bytes]) -> bytes:
    t = Tar()
    for name in order:
        if name.endswith("/"):
            t.dir(name)
        else:
            t.file(name, files[name])
    return t.bytes()


@pytest.mark.parametrize("compression", ["none", "gzip", "zstd"])
@pytest.mark.parametrize("layout", sorted(ORDERS))
def test_real_archives_with_bulk_before_the_documents_import_by_looking_ahead(
    env: Env, watch: Watch, reads: list[int], layout: str, compression: str
) -> None:
    limits = ImportLimits(max_staged_before_required=MiB)
    files = _foreign_files(3 * MiB)
    if layout == "podman-large-shm":
        files["devshm-checkpoint.tar"] = small_tar({"big.shm": os.urandom(2 * MiB)})
    data = compress(_ordered(ORDERS[layout], files), compression)
    rec = env.import_(data, limits=limits)
    assert len(reads) == 2  # looked ahead past the bulk, found the documents, read again staging all
    got = stored_files(env.store, rec)
    base = "containers/bomb"
    assert got[f"{base}/checkpoint/pages-1.img"] == files["checkpoint/pages-1.img"]
    assert got["pod/devshm.tar"] == files["devshm-checkpoint.tar"]
    assert got[f"{base}/spec.dump"] == files["spec.dump"]
    assert work_is_empty(env)
    # The same archive with the default bound (16 MiB) needs no second read.
    reads.clear()
    env.import_(data)
    assert len(reads) == 1


def test_cri_o_archive_with_more_than_the_default_bound_in_front_imports(
    env: Env, watch: Watch, reads: list[int]
) -> None:
    files = _foreign_files(ImportLimits().max_staged_before_required + MiB)
    watch.cap = 1 << 62  # a real import: nothing to stop
    rec = env.import_(_ordered(ORDERS["cri-o"], files))
    assert len(reads) == 2
    assert stored_files(env.store, rec)["containers/bomb/checkpoint/pages-1.img"] == files["checkpoint/pages-1.img"]
    assert watch.peak <= 3 * MiB + len(files["checkpoint/pages-1.img"])
    assert work_is_empty(env)


def test_missing_documents_behind_bulk_are_found_missing_without_staging(env: Env, watch: Watch) -> None:
    files = _foreign_files(3 * MiB)
    del files["spec.dump"]
    order = [n for n in ORDERS["cri-o"] if n != "spec.dump"]
    before = env.outside()
    with pytest.raises(errors.InvalidArgument, match="the archive has no spec.dump"):
        env.import_(_ordered(order, files), limits=ImportLimits(max_staged_before_required=MiB))
    assert watch.peak <= MiB
    env.assert_clean(before)


def test_an_archive_that_changes_between_its_two_reads_is_refused(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _foreign_files(3 * MiB)
    first = _ordered(ORDERS["cri-o"], files)
    files["checkpoint/pages-2.img"] = files.pop("checkpoint/pages-1.img")  # same length, another name
    second = _ordered([n.replace("pages-1", "pages-2") for n in ORDERS["cri-o"]], files)
    assert len(first) == len(second) and first != second
    path = env.write(first)
    original = archive.Archive.reader
    calls: list[int] = []

    def swapping(self: Any, bounds: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            with open(path, "r+b") as fh:
                fh.write(second)
        return original(self, bounds)

    monkeypatch.setattr(archive.Archive, "reader", swapping)
    before = env.outside()
    with pytest.raises(errors.InvalidArgument, match="changed while it was read"):
        interop.import_archive(env.store, path, limits=ImportLimits(max_staged_before_required=MiB),
                               cpuinfo_dump=lambda d: Path(d, "cpuinfo.img").write_bytes(b"c"))
    env.assert_clean(before)


# -- node-agent's own archives ---------------------------------------------------------------------


def test_export_writes_the_required_documents_first_and_imports_in_one_read(
    env: Env, watch: Watch, reads: list[int]
) -> None:
    big = os.urandom(20 * MiB)
    rec, files = make_checkpoint(env.store, extra={"containers/app/checkpoint/pages-2.img": big})
    out = env.root / "archives" / "app.tar.zst"
    interop.export_container(env.store, rec.id, "app", str(out))
    with open(out, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as zr, \
            tarfile.open(fileobj=zr, mode="r|") as tf:
        names = [m.name for m in tf]
    assert names[:4] == ["node-agent/manifest.json", "config.dump", "spec.dump", "node-agent/pod/config.json"]
    assert names.index("checkpoint") < names.index("checkpoint/pages-2.img")
    watch.cap = 1 << 62
    back = interop.import_archive(env.store, str(out))
    assert len(reads) == 1
    assert stored_files(env.store, back) == {p: d for p, d in files.items()}
    assert work_is_empty(env)


def test_earlier_exports_with_the_images_first_still_import(env: Env, watch: Watch, reads: list[int]) -> None:
    # node-agent's earlier exporter sorted every member by name: checkpoint/ first, the manifest among the rest.
    rec, files = make_checkpoint(env.store)
    out = env.root / "a.tar"
    interop.export_container(env.store, rec.id, "app", str(out))
    t = Tar()
    with tarfile.open(out) as tf:
        for m in sorted(tf.getmembers(), key=lambda m: m.name.split("/")):
            if m.isdir():
                t.dir(m.name)
            else:
                t.file(m.name, tf.extractfile(m).read(), mode=m.mode)  # type: ignore[union-attr]
    data = t.bytes()
    back = env.import_(compress(data, "zstd"), limits=ImportLimits(max_staged_before_required=MiB))
    assert len(reads) == 2
    assert stored_files(env.store, back) == files
    assert work_is_empty(env)


def test_own_archive_without_its_pod_config_is_refused_before_the_bulk(env: Env, watch: Watch) -> None:
    rec, _ = make_checkpoint(env.store, extra={"containers/app/checkpoint/pages-2.img": os.urandom(3 * MiB)})
    out = env.root / "a.tar"
    interop.export_container(env.store, rec.id, "app", str(out))
    t = Tar()
    with tarfile.open(out) as tf:
        for m in tf.getmembers():
            if m.name == "node-agent/pod/config.json":
                continue
            if m.isdir():
                t.dir(m.name)
            else:
                t.file(m.name, tf.extractfile(m).read(), mode=m.mode)  # type: ignore[union-attr]
    env.store.remove(rec.id)
    before = env.outside()
    with pytest.raises(errors.InvalidArgument, match="no node-agent/pod/config.json"):
        env.import_(t.bytes(), limits=ImportLimits(max_staged_before_required=MiB))
    assert watch.peak <= MiB
    env.assert_clean(before)


# -- the limits themselves --------------------------------------------------------------------------


def test_import_limits_default_to_the_free_space() -> None:
    limits = ImportLimits()
    assert limits.max_total_bytes is None and limits.max_member_bytes is None
    assert limits.min_free_bytes == 256 * MiB and limits.free_check_bytes == 4 * MiB
    assert limits.max_staged_before_required == 16 * MiB
    b = limits.bounds(10 * GiB)
    assert b.total_bytes == b.member_bytes == 10 * GiB - 256 * MiB and b.total_derived and b.member_derived
    assert limits.bounds(100 * MiB).total_bytes == 0
    b = ImportLimits(max_total_bytes=5, max_member_bytes=3, min_free_bytes=0).bounds(10 * GiB)
    assert (b.total_bytes, b.member_bytes, b.total_derived, b.member_derived) == (5, 3, False, False)
    b = ImportLimits(max_total_bytes=5).bounds(GiB)
    assert (b.total_bytes, b.member_bytes) == (5, GiB - 256 * MiB)
    for bad in ({"min_free_bytes": -1}, {"max_total_bytes": -1}, {"max_staged_before_required": 1.5},
                {"max_members": None}, {"free_check_bytes": "4"}):
        with pytest.raises(errors.InvalidArgument):
            ImportLimits(**bad)  # type: ignore[arg-type]
    assert isinstance(common.ImportLimits(), interop.ImportLimits)


def test_the_caller_min_free_bytes_is_kept(env: Env, watch: Watch) -> None:
    # 1 GiB free: with min_free_bytes=1 GiB nothing fits, not even Podman's small archive.
    watch.free = lambda staged: GiB - staged
    from tests.unit.test_interop import podman_archive

    before = env.outside()
    with pytest.raises(errors.ResourceExhausted, match=r"limit of 0 \(max_(member|total)_bytes: by default"):
        env.import_(podman_archive(), limits=ImportLimits(min_free_bytes=GiB))
    env.assert_clean(before)
    assert env.import_(podman_archive(), limits=ImportLimits(min_free_bytes=GiB - 8 * MiB)).id


def test_staged_bytes_count_against_max_total_bytes(env: Env, watch: Watch) -> None:
    # The staging meter itself, below the declared-size check: every write is counted.
    limits = ImportLimits(max_total_bytes=10 * MiB, min_free_bytes=0)
    bounds = limits.bounds(GiB)
    area = landing.Staging(str(env.root / "store" / "work"))
    try:
        meter = landing.Meter(area.fd, "work", limits, bounds)
        meter.admit("'m'", 8 * MiB)
        for i in range(8):
            meter.charge("'m'", MiB, i * MiB, 8 * MiB)
        with pytest.raises(errors.ResourceExhausted,
                           match=r"'m': staging more than 8388608 .*limit of 10485760 \(max_total_bytes\)"):
            meter.charge("'m'", 3 * MiB, 8 * MiB, 11 * MiB)
        pattern = r"'n': staging its 3145728 bytes would pass the limit of 10485760 \(max_total_bytes\)"
        with pytest.raises(errors.ResourceExhausted, match=pattern):
            meter.admit("'n'", 3 * MiB)
    finally:
        area.close()
