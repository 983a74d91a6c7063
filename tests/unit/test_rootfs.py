"""Tests for criu_bridge.rootfs: capture and apply of a writable-layer diff."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from criu_bridge.errors import BridgeError, InvalidInput, LimitExceeded
from criu_bridge.rootfs.apply import apply_diff
from criu_bridge.rootfs.capture import capture_diff
from criu_bridge.rootfs.common import DiffLimits, DiffStats, opaque_dirs_path

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, chown, trusted xattrs)")

MTIME = 1_700_000_000
# security.capability v2: cap_net_raw (13) permitted + effective.
CAP_NET_RAW = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)


# ---------------------------------------------------------------------------
# helpers


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry below root (root excluded): type, mode, owner, mtime, data, link group."""
    result: dict[str, tuple[Any, ...]] = {}
    inodes: dict[int, list[str]] = {}
    base = os.fsencode(root)

    def walk(rel: bytes) -> None:
        full = os.path.join(base, rel) if rel else base
        for name in sorted(os.listdir(full)):
            child_rel = os.path.join(rel, name) if rel else name
            path = os.path.join(base, child_rel)
            st_ = os.lstat(path)
            key = os.fsdecode(child_rel)
            common = (st_.st_uid, st_.st_gid, int(st_.st_mtime))
            if stat.S_ISDIR(st_.st_mode):
                result[key] = ("d", stat.S_IMODE(st_.st_mode), *common, user_xattrs(path))
                walk(child_rel)
            elif stat.S_ISREG(st_.st_mode):
                with open(path, "rb") as f:
                    data = f.read()
                result[key] = ("f", stat.S_IMODE(st_.st_mode), *common, data, user_xattrs(path))
                if st_.st_nlink > 1:
                    inodes.setdefault(st_.st_ino, []).append(key)
            elif stat.S_ISLNK(st_.st_mode):
                result[key] = ("l", st_.st_uid, st_.st_gid, int(st_.st_mtime), os.readlink(path))
            elif stat.S_ISFIFO(st_.st_mode):
                result[key] = ("p", stat.S_IMODE(st_.st_mode), *common)
            else:
                result[key] = ("?", st_.st_mode, st_.st_rdev)

    walk(b"")
    for group in inodes.values():
        for key in group:
            result[key] = result[key] + (tuple(sorted(group)),)
    return result


def user_xattrs(path: bytes) -> tuple[tuple[str, bytes], ...]:
    names = sorted(n for n in os.listxattr(path, follow_symlinks=False) if not n.startswith("trusted."))
    return tuple((n, os.getxattr(path, n, follow_symlinks=False)) for n in names)


def merge(lower: dict[str, tuple[Any, ...]], upper: dict[str, tuple[Any, ...]],
          deleted: list[str], opaque: list[str]) -> dict[str, tuple[Any, ...]]:
    """What an overlay mount shows for lower + upper (independent reference)."""
    result = dict(lower)

    def drop(path: str, keep_self: bool) -> None:
        for key in list(result):
            if key.startswith(path + "/") or (key == path and not keep_self):
                del result[key]

    for path in opaque:
        drop(path, keep_self=True)
    for path in deleted:
        drop(path, keep_self=False)
    for path, value in upper.items():
        if path in result and not (value[0] == "d" and result[path][0] == "d"):
            drop(path, keep_self=False)
        result[path] = value
    return result


def write(path: Path, data: bytes = b"", mode: int = 0o644, uid: int = 0, gid: int = 0,
          mtime: int = MTIME) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chown(path, uid, gid)
    os.chmod(path, mode)
    os.utime(path, (mtime, mtime))
    return path


def set_dir_times(root: Path, mtime: int = MTIME) -> None:
    for dirpath, dirnames, _ in os.walk(root):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                os.utime(p, (mtime, mtime))


def listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def make_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]],
             fmt: int = tarfile.PAX_FORMAT) -> Path:
    with tarfile.open(path, "w", format=fmt) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def ti(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", **kw: Any) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mtime = MTIME
    info.mode = kw.pop("mode", 0o644)
    for k, v in kw.items():
        setattr(info, k, v)
    if kind in (tarfile.REGTYPE, tarfile.AREGTYPE):
        info.size = len(data)
        return info, data
    return info, None


@pytest.fixture
def box(tmp_path: Path) -> dict[str, Path]:
    """A sentinel directory holding rootfs/, outside/ (with a victim file) and work/."""
    sentinel = tmp_path / "sentinel"
    rootfs = sentinel / "rootfs"
    outside = sentinel / "outside"
    work = tmp_path / "work"
    for d in (rootfs, outside, work):
        d.mkdir(parents=True)
    (outside / "victim").write_text("keep me")
    return {"sentinel": sentinel, "rootfs": rootfs, "outside": outside, "work": work}


def assert_outside_untouched(box: dict[str, Path]) -> None:
    assert sorted(os.listdir(box["sentinel"])) == ["outside", "rootfs"]
    assert listing(box["outside"]) == ["victim"]
    assert (box["outside"] / "victim").read_text() == "keep me"


# ---------------------------------------------------------------------------
# round trip


ODD_NAMES = ["with space", "new\nline", "\u00fcn\u00efc\u00f8d\u00e9-\u6587\u4ef6", "tab\there", "x" * 200]


def build_upper(upper: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(upper / "etc/app.conf", b"new=1\n", mode=0o640, uid=1000, gid=1001)
    write(upper / "etc/hosts", b"mount point\n")  # excluded below
    os.mknod(upper / "etc/motd", stat.S_IFCHR, os.makedev(0, 0))  # whiteout
    write(upper / "opt/data/new.txt", b"fresh")
    os.setxattr(upper / "opt/data", "trusted.overlay.opaque", b"y")
    write(upper / "bin/su2", b"\x7fELF", mode=0o4755)
    write(upper / "bin/sg", b"\x7fELF", mode=0o2711, gid=50)
    write(upper / "bin/ping2", b"\x7fELF", mode=0o755)
    os.setxattr(upper / "bin/ping2", "security.capability", CAP_NET_RAW)
    os.setxattr(upper / "bin/ping2", "user.note", b"v\x00\n1")
    write(upper / "usr/lib/x/y/z/deep.txt", b"deep")
    write(upper / "empty")
    write(upper / "big.bin", os.urandom(2_500_000))
    write(upper / "mid.bin", os.urandom(300_000), mode=0o600)
    os.symlink("/etc/passwd", upper / "link-abs")
    os.symlink("../usr", upper / "usr/lib/link-rel")
    os.symlink("nowhere", upper / "dangle")
    write(upper / "hl/a", b"shared", mode=0o600)
    os.link(upper / "hl/a", upper / "hl/b")
    (upper / "run").mkdir()
    os.mkfifo(upper / "run/fifo")
    os.chmod(upper / "run/fifo", 0o620)
    os.utime(upper / "run/fifo", (MTIME, MTIME))
    for name in ODD_NAMES:
        write(upper / "odd" / name, name.encode())
    write(Path(os.fsdecode(os.path.join(os.fsencode(upper), b"odd", b"\xff\xfe-latin1"))), b"bytes")
    deep = upper / "long" / ("d" * 120) / ("e" * 120) / ("f" * 120)
    write(deep / "file-with-a-long-path", b"long")
    # A lower symlink replaced by a directory, a lower file by a directory,
    # a lower directory by a file.
    write(upper / "lib/x", b"real dir now")
    os.setxattr(upper / "lib", "trusted.overlay.opaque", b"y")
    write(upper / "conflict/inside", b"dir now")
    write(upper / "was-dir", b"file now")
    # Not captured: a socket and a device.
    monkeypatch.chdir(upper / "run")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind("app.sock")
    sock.close()
    os.mknod(upper / "run/null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    set_dir_times(upper)
    os.chmod(upper / "usr/lib/x", 0o750)
    os.chown(upper / "usr/lib/x", 7, 8)


def build_lower(lower: Path) -> None:
    write(lower / "etc/motd", b"welcome")
    write(lower / "etc/keep", b"kept")
    write(lower / "etc/app.conf", b"old=1\n")
    write(lower / "etc/hosts", b"image hosts\n")
    write(lower / "opt/data/old1", b"gone")
    write(lower / "opt/data/sub/old2", b"gone")
    write(lower / "usr/lib/libc.so", b"libc")
    os.symlink("usr/lib", lower / "lib")
    write(lower / "conflict", b"file before")
    write(lower / "was-dir/child/grandchild", b"dir before")
    (lower / "run").mkdir()
    set_dir_times(lower)


@needs_root
def test_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    upper, lower, out = tmp_path / "upper", tmp_path / "lower", tmp_path / "out"
    for d in (upper, lower, out):
        d.mkdir()
    build_upper(upper, monkeypatch)
    build_lower(lower)
    monkeypatch.chdir(tmp_path)

    tar_path, deleted_path = out / "rootfs-diff.tar", out / "deleted.files"
    stats = capture_diff(str(upper), str(tar_path), str(deleted_path), exclude=["/etc/hosts/"])
    assert sorted(os.listdir(out)) == ["deleted.files", "opaque.dirs", "rootfs-diff.tar"]
    assert json.loads(deleted_path.read_text()) == ["etc/motd"]
    assert json.loads(Path(opaque_dirs_path(str(deleted_path))).read_text()) == ["lib", "opt/data"]
    assert stats.deleted == 1 and stats.opaque_dirs == 2
    assert stats.hardlinks == 1 and stats.fifos == 1
    assert stats.symlinks == 3
    assert sorted(stats.skipped) == ["run/app.sock: socket", "run/null: character device 1:3"]
    assert stats.bytes == sum(
        os.lstat(p).st_size for p in upper.rglob("*")
        if p.is_file() and not p.is_symlink() and p.name not in ("b", "hosts")
    )

    before = snapshot(lower)
    upper_snap = {
        k: v for k, v in snapshot(upper).items()
        if v[0] != "?" and k != "etc/hosts"
    }
    expected = merge(before, upper_snap, ["etc/motd"], ["lib", "opt/data"])
    applied = apply_diff(str(lower), str(tar_path), str(deleted_path))
    assert applied.files == stats.files and applied.hardlinks == 1 and applied.dirs == stats.dirs
    assert applied.deleted == 1 and applied.opaque_dirs == 2 and applied.bytes == stats.bytes
    result = snapshot(lower)
    assert result == expected

    # Spot checks that the reference itself cannot get wrong.
    assert not (lower / "etc/motd").exists()
    assert (lower / "etc/keep").read_bytes() == b"kept"
    assert (lower / "etc/hosts").read_bytes() == b"image hosts\n"
    assert sorted(os.listdir(lower / "opt/data")) == ["new.txt"]
    assert stat.S_IMODE(os.stat(lower / "bin/su2").st_mode) == 0o4755
    assert stat.S_IMODE(os.stat(lower / "bin/sg").st_mode) == 0o2711
    assert os.getxattr(lower / "bin/ping2", "security.capability") == CAP_NET_RAW
    assert os.stat(lower / "hl/a").st_ino == os.stat(lower / "hl/b").st_ino
    assert stat.S_ISFIFO(os.lstat(lower / "run/fifo").st_mode)
    assert not (lower / "lib").is_symlink() and (lower / "lib/x").read_bytes() == b"real dir now"
    assert (lower / "was-dir").read_bytes() == b"file now"
    assert (lower / "conflict/inside").read_bytes() == b"dir now"
    assert os.stat(lower / "etc/app.conf")[4:6] == (1000, 1001)
    for name in ODD_NAMES:
        assert (lower / "odd" / name).read_bytes() == name.encode()
    assert os.path.exists(os.path.join(os.fsencode(lower), b"odd", b"\xff\xfe-latin1"))


@needs_root
def test_capture_is_deterministic_and_readable_by_tarfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    build_upper(upper, monkeypatch)
    monkeypatch.chdir(tmp_path)
    capture_diff(str(upper), str(tmp_path / "a.tar"), str(tmp_path / "a.deleted"))
    capture_diff(str(upper), str(tmp_path / "b.tar"), str(tmp_path / "b.deleted"))
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()

    with tarfile.open(tmp_path / "a.tar", encoding="utf-8", errors="surrogateescape") as tf:
        members = tf.getmembers()
        names = [m.name for m in members]
        by_name = {m.name: m for m in members}
        assert tf.extractfile(by_name["big.bin"]).read() == (upper / "big.bin").read_bytes()  # type: ignore[union-attr]
        assert tf.extractfile(by_name["mid.bin"]).read() == (upper / "mid.bin").read_bytes()  # type: ignore[union-attr]
    assert all(not n.startswith(("/", "./")) for n in names)
    # Depth first, names sorted bytewise, parents before children.
    assert names.index("big.bin") < names.index("bin") < names.index("bin/ping2") < names.index("conflict")
    assert by_name["hl/b"].islnk() and by_name["hl/b"].linkname == "hl/a"
    assert by_name["link-abs"].issym() and by_name["link-abs"].linkname == "/etc/passwd"
    assert by_name["run/fifo"].isfifo() and by_name["run/fifo"].mode == 0o620
    assert by_name["bin/su2"].mode == 0o4755
    assert by_name["etc/app.conf"].uid == 1000 and by_name["etc/app.conf"].gid == 1001
    assert by_name["etc/app.conf"].mtime == MTIME
    assert by_name["bin/ping2"].pax_headers["SCHILY.xattr.security.capability"]
    assert "etc/motd" not in by_name and "run/app.sock" not in by_name and "run/null" not in by_name
    assert not any(k.startswith("SCHILY.xattr.trusted") for m in members for k in m.pax_headers)
    assert "odd/new\nline" in by_name and os.fsdecode(b"odd/\xff\xfe-latin1") in by_name
    long_names = [n for n in names if n.endswith("file-with-a-long-path")]
    assert len(long_names) == 1 and len(long_names[0]) > 360


def test_capture_limits_clean_up(tmp_path: Path) -> None:
    upper, out = tmp_path / "upper", tmp_path / "out"
    out.mkdir()
    write(upper / "a/one", b"1" * 100)
    write(upper / "a/two", b"2" * 100)
    write(upper / ("n" * 50), b"x")
    for limits, word in [
        (DiffLimits(max_file_bytes=99), "max_file_bytes"),
        (DiffLimits(max_total_bytes=150), "max_total_bytes"),
        (DiffLimits(max_entries=3), "max_entries"),
        (DiffLimits(max_path_len=20), "max_path_len"),
    ]:
        with pytest.raises(LimitExceeded, match=word):
            capture_diff(str(upper), str(out / "d.tar"), str(out / "deleted.files"), limits=limits)
        assert os.listdir(out) == []


def test_capture_exclude_and_stale_opaque(tmp_path: Path) -> None:
    upper, out = tmp_path / "upper", tmp_path / "out"
    out.mkdir()
    write(upper / "proc/self/x", b"x")
    write(upper / "etc/resolv.conf", b"x")
    write(upper / "etc/keep", b"x")
    (out / "opaque.dirs").write_text('["stale"]')
    stats = capture_diff(str(upper), str(out / "t.tar"), str(out / "deleted.files"),
                         exclude=["proc", "./etc/resolv.conf"])
    with tarfile.open(out / "t.tar") as tf:
        assert tf.getnames() == ["etc", "etc/keep"]
    assert stats.files == 1 and stats.dirs == 1
    assert sorted(os.listdir(out)) == ["deleted.files", "t.tar"]
    assert json.loads((out / "deleted.files").read_text()) == []
    with pytest.raises(InvalidInput):
        capture_diff(str(upper), str(out / "t.tar"), str(out / "deleted.files"), exclude=["../x"])


@needs_root
def test_capture_refuses_metacopy(tmp_path: Path) -> None:
    upper, out = tmp_path / "upper", tmp_path / "out"
    out.mkdir()
    write(upper / "data", b"")
    os.setxattr(upper / "data", "trusted.overlay.metacopy", b"")
    with pytest.raises(BridgeError, match="metacopy"):
        capture_diff(str(upper), str(out / "t.tar"), str(out / "deleted.files"))
    assert os.listdir(out) == []


def test_capture_missing_upperdir(tmp_path: Path) -> None:
    with pytest.raises(BridgeError):
        capture_diff(str(tmp_path / "nope"), str(tmp_path / "t.tar"), str(tmp_path / "d"))


@needs_root
def test_round_trip_through_real_overlay(tmp_path: Path) -> None:
    """Changes made through a real overlayfs mount come back identical."""
    lower, upper, work, merged = (tmp_path / n for n in ("lower", "upper", "work", "merged"))
    for d in (upper, work, merged):
        d.mkdir()
    build_lower(lower)
    write(lower / "srv/www/index.html", b"<html>")
    write(lower / "srv/www/old/page", b"old")
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    try:
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(merged)],
                       check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount overlayfs here: {e}")
    try:
        m = merged
        os.unlink(m / "etc/motd")
        (m / "etc/app.conf").write_bytes(b"changed")
        shutil.rmtree(m / "opt/data")
        (m / "opt/data").mkdir()
        (m / "opt/data/new").write_bytes(b"new")
        shutil.rmtree(m / "srv/www/old")
        os.unlink(m / "lib")
        (m / "lib").mkdir()
        (m / "lib/libfoo.so").write_bytes(b"foo")
        os.unlink(m / "conflict")
        (m / "conflict").mkdir()
        shutil.rmtree(m / "was-dir")
        (m / "was-dir").write_bytes(b"file now")
        (m / "hl").mkdir()
        (m / "hl/a").write_bytes(b"linked")
        os.link(m / "hl/a", m / "hl/b")
        os.symlink("../etc/keep", m / "run/keep-link")
        os.mkfifo(m / "run/fifo")
        os.chmod(m / "etc/keep", 0o600)  # metadata-only copy-up
        os.chown(m / "usr/lib/libc.so", 12, 34)
        expected = snapshot(merged)
    finally:
        subprocess.run(["umount", str(merged)], check=True)

    out = tmp_path / "out"
    out.mkdir()
    capture_diff(str(upper), str(out / "rootfs-diff.tar"), str(out / "deleted.files"))
    target = tmp_path / "target"
    subprocess.run(["cp", "-a", str(lower), str(target)], check=True)
    apply_diff(str(target), str(out / "rootfs-diff.tar"), str(out / "deleted.files"))
    assert snapshot(target) == expected


# ---------------------------------------------------------------------------
# hostile archives


TRAVERSALS = ["../x", "/etc/x", "a/../../x", "a/b/../../../x", "..", "/"]


@pytest.mark.parametrize("name", TRAVERSALS)
def test_traversal_names_rejected(box: dict[str, Path], name: str) -> None:
    tar = make_tar(box["work"] / "t.tar", [ti(name, data=b"pwned")])
    with pytest.raises(InvalidInput):
        apply_diff(str(box["rootfs"]), str(tar), None)
    assert_outside_untouched(box)
    assert listing(box["rootfs"]) == []


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_long_traversal_names_rejected(box: dict[str, Path], fmt: int) -> None:
    name = "a/" * 80 + "../" * 81 + "outside/pwned"
    tar = make_tar(box["work"] / "t.tar", [ti(name, data=b"pwned")], fmt=fmt)
    with pytest.raises(InvalidInput):
        apply_diff(str(box["rootfs"]), str(tar), None)
    assert_outside_untouched(box)


def test_symlink_then_member_through_it(box: dict[str, Path]) -> None:
    outside = str(box["outside"])
    for members in (
        [ti("a", tarfile.SYMTYPE, linkname=outside), ti("a/pwned", data=b"x")],
        [ti("a", tarfile.SYMTYPE, linkname="../outside"), ti("a/pwned", data=b"x")],
        [ti("d", tarfile.DIRTYPE), ti("d/s", tarfile.SYMTYPE, linkname="../.."), ti("d/s/outside/pwned", data=b"x")],
        [ti("a", tarfile.SYMTYPE, linkname=outside), ti("a", tarfile.DIRTYPE), ti("a/pwned", data=b"x")],
        [ti("a", tarfile.SYMTYPE, linkname=outside), ti("a/sub", tarfile.DIRTYPE)],
        [ti("a", tarfile.SYMTYPE, linkname=outside + "/victim"), ti("b", tarfile.LNKTYPE, linkname="a")],
    ):
        tar = make_tar(box["work"] / "t.tar", members)
        with pytest.raises(InvalidInput):
            apply_diff(str(box["rootfs"]), str(tar), None)
        assert_outside_untouched(box)
        shutil.rmtree(box["rootfs"])
        box["rootfs"].mkdir()


def test_existing_symlink_in_rootfs_never_followed(box: dict[str, Path]) -> None:
    rootfs = box["rootfs"]
    os.symlink(str(box["outside"]), rootfs / "a")
    os.symlink(str(box["outside"] / "victim"), rootfs / "v")
    tar = make_tar(box["work"] / "t.tar", [ti("a/pwned", data=b"x")])
    with pytest.raises(InvalidInput, match="symlink"):
        apply_diff(str(rootfs), str(tar), None)
    assert_outside_untouched(box)
    # A directory member replaces the symlink (overlay semantics), then fills it.
    tar = make_tar(box["work"] / "t.tar", [ti("a", tarfile.DIRTYPE), ti("a/pwned", data=b"x"),
                                          ti("v", data=b"replaced")])
    apply_diff(str(rootfs), str(tar), None)
    assert (rootfs / "a").is_dir() and not (rootfs / "a").is_symlink()
    assert (rootfs / "a/pwned").read_bytes() == b"x"
    assert not (rootfs / "v").is_symlink() and (rootfs / "v").read_bytes() == b"replaced"
    assert_outside_untouched(box)


def test_hardlinks_rejected(box: dict[str, Path]) -> None:
    rootfs = box["rootfs"]
    write(rootfs / "etc/passwd", b"root:x:0:0")
    for link in ["/etc/passwd", "etc/passwd", "../outside/victim", "missing", "d"]:
        tar = make_tar(box["work"] / "t.tar", [ti("d", tarfile.DIRTYPE), ti("h", tarfile.LNKTYPE, linkname=link)])
        with pytest.raises(InvalidInput):
            apply_diff(str(rootfs), str(tar), None)
        assert_outside_untouched(box)
        assert not (rootfs / "h").exists()
    # A hardlink to a regular file from the same archive is fine.
    tar = make_tar(box["work"] / "t.tar", [ti("d/f", data=b"same"), ti("h", tarfile.LNKTYPE, linkname="d/f")])
    stats = apply_diff(str(rootfs), str(tar), None)
    assert stats.hardlinks == 1
    assert os.stat(rootfs / "h").st_ino == os.stat(rootfs / "d/f").st_ino


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, b"D", b"S", b"V", b"Z"])
def test_device_and_unknown_members_rejected(box: dict[str, Path], kind: bytes) -> None:
    info, _ = ti("dev/sda", kind)
    info.devmajor, info.devminor = 8, 0
    tar = make_tar(box["work"] / "t.tar", [(info, None)], fmt=tarfile.GNU_FORMAT)
    with pytest.raises(InvalidInput):
        apply_diff(str(box["rootfs"]), str(tar), None)
    assert listing(box["rootfs"]) == []


def test_size_and_count_limits(box: dict[str, Path]) -> None:
    rootfs, work = str(box["rootfs"]), box["work"]
    tar = make_tar(work / "t.tar", [ti("big", data=b"x" * 5000)])
    with pytest.raises(LimitExceeded, match="max_file_bytes"):
        apply_diff(rootfs, str(tar), None, limits=DiffLimits(max_file_bytes=4999))
    tar = make_tar(work / "t.tar", [ti("a", data=b"x" * 3000), ti("b", data=b"x" * 3000)])
    with pytest.raises(LimitExceeded, match="max_total_bytes"):
        apply_diff(rootfs, str(tar), None, limits=DiffLimits(max_total_bytes=5000))
    tar = make_tar(work / "t.tar", [ti(f"f{i}") for i in range(11)])
    with pytest.raises(LimitExceeded, match="max_entries"):
        apply_diff(rootfs, str(tar), None, limits=DiffLimits(max_entries=10))
    tar = make_tar(work / "t.tar", [ti("d" * 30 + "/" + "e" * 30)])
    with pytest.raises(LimitExceeded, match="max_path_len"):
        apply_diff(rootfs, str(tar), None, limits=DiffLimits(max_path_len=60))
    assert_outside_untouched(box)


def test_declared_size_larger_than_archive(box: dict[str, Path]) -> None:
    tar = make_tar(box["work"] / "t.tar", [ti("f", data=b"abc")])
    raw = bytearray(tar.read_bytes())
    # Patch the size field to 10 GiB in base-256 and fix the checksum.
    raw[124:136] = b"\x80" + (10 * 2**30).to_bytes(11, "big")
    raw[148:156] = b"        "
    raw[148:156] = b"%06o\0 " % sum(raw[:512])
    tar.write_bytes(bytes(raw))
    with pytest.raises(LimitExceeded):
        apply_diff(str(box["rootfs"]), str(tar), None)
    with pytest.raises(InvalidInput, match="past the end|truncated"):
        apply_diff(str(box["rootfs"]), str(tar), None, limits=DiffLimits(max_file_bytes=2**40, max_total_bytes=2**40))


def test_truncated_and_corrupt_archives(box: dict[str, Path]) -> None:
    tar = make_tar(box["work"] / "t.tar", [ti("f", data=b"x" * 2000), ti("g", data=b"y")])
    raw = tar.read_bytes()
    cut = box["work"] / "cut.tar"
    cut.write_bytes(raw[:1500])
    with pytest.raises(InvalidInput, match="truncated|past the end"):
        apply_diff(str(box["rootfs"]), str(cut), None)
    bad = bytearray(raw)
    bad[0] ^= 0x01
    cut.write_bytes(bytes(bad))
    with pytest.raises(InvalidInput, match="checksum"):
        apply_diff(str(box["rootfs"]), str(cut), None)
    cut.write_bytes(b"")
    assert apply_diff(str(box["rootfs"]), str(cut), None).files == 0


def test_pax_abuse(box: dict[str, Path]) -> None:
    work = box["work"]
    info, data = ti("ok", data=b"1")
    info.pax_headers = {"path": "a\x00b"}
    with pytest.raises(InvalidInput, match="NUL"):
        apply_diff(str(box["rootfs"]), str(make_tar(work / "t.tar", [(info, data)])), None)
    info, data = ti("ok", data=b"1")
    info.pax_headers = {"GNU.sparse.map": "0,1"}
    with pytest.raises(InvalidInput, match="sparse"):
        apply_diff(str(box["rootfs"]), str(make_tar(work / "t.tar", [(info, data)])), None)
    info, data = ti("ok", data=b"1")
    info.pax_headers = {"comment": "x" * (2 << 20)}
    with pytest.raises(LimitExceeded):
        apply_diff(str(box["rootfs"]), str(make_tar(work / "t.tar", [(info, data)])), None)
    info, data = ti("ok", data=b"1")
    info.pax_headers = {"path": "../../outside/pwned"}
    with pytest.raises(InvalidInput):
        apply_diff(str(box["rootfs"]), str(make_tar(work / "t.tar", [(info, data)])), None)
    info, data = ti("ok", data=b"1")
    info.pax_headers = {"uid": "4294967295"}
    with pytest.raises(InvalidInput):
        apply_diff(str(box["rootfs"]), str(make_tar(work / "t.tar", [(info, data)])), None)
    assert_outside_untouched(box)


def test_conflicting_duplicates(box: dict[str, Path]) -> None:
    for members in (
        [ti("x", data=b"1"), ti("x", data=b"2")],
        [ti("x", data=b"1"), ti("x", tarfile.DIRTYPE)],
        [ti("x/y", data=b"1"), ti("x", data=b"2")],
        [ti("x", tarfile.SYMTYPE, linkname="y"), ti("x", data=b"2")],
    ):
        tar = make_tar(box["work"] / "t.tar", members)
        with pytest.raises(InvalidInput, match="duplicate"):
            apply_diff(str(box["rootfs"]), str(tar), None)
        shutil.rmtree(box["rootfs"])
        box["rootfs"].mkdir()
    # Repeated directories are fine; the last metadata wins.
    tar = make_tar(box["work"] / "t.tar", [ti("d", tarfile.DIRTYPE, mode=0o700), ti("d/f", data=b"1"),
                                          ti("d", tarfile.DIRTYPE, mode=0o751)])
    apply_diff(str(box["rootfs"]), str(tar), None)
    assert stat.S_IMODE(os.stat(box["rootfs"] / "d").st_mode) == 0o751


@needs_root
@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_foreign_archives(box: dict[str, Path], fmt: int) -> None:
    """Archives written by tarfile (as other engines would) apply with metadata."""
    long_dir = "p" * 90 + "/" + "q" * 60
    members = [
        ti("./", tarfile.DIRTYPE),
        ti("./etc", tarfile.DIRTYPE, mode=0o755, mtime=MTIME - 5),
        ti("./etc/shadow", data=b"s", mode=0o640, uid=0, gid=42, mtime=MTIME - 7),
        ti("bin/tool", data=b"t" * 70000, mode=0o4750, uid=3, gid=4),
        ti(long_dir + "/file", data=b"deep"),
        ti("fifo", tarfile.FIFOTYPE, mode=0o600),
        ti("rel", tarfile.SYMTYPE, linkname="../../../../etc/shadow", uid=5, gid=6),
        ti("etc/shadow-", tarfile.LNKTYPE, linkname="./etc/shadow"),
    ]
    if fmt != tarfile.USTAR_FORMAT:
        members.append(ti("\u00e9t\u00e9/" + "z" * 120, data=b"u"))
    tar = make_tar(box["work"] / "t.tar", members, fmt=fmt)
    stats = apply_diff(str(box["rootfs"]), str(tar), None)
    r = box["rootfs"]
    assert stats.hardlinks == 1 and stats.fifos == 1 and stats.symlinks == 1
    assert (r / "etc/shadow").read_bytes() == b"s"
    st_ = os.stat(r / "etc/shadow")
    assert (stat.S_IMODE(st_.st_mode), st_.st_uid, st_.st_gid, int(st_.st_mtime)) == (0o640, 0, 42, MTIME - 7)
    st_ = os.stat(r / "bin/tool")
    assert (stat.S_IMODE(st_.st_mode), st_.st_uid, st_.st_gid) == (0o4750, 3, 4)
    assert int(os.stat(r / "etc").st_mtime) == MTIME - 5
    assert os.readlink(r / "rel") == "../../../../etc/shadow"
    assert os.lstat(r / "rel")[4:6] == (5, 6)
    assert (r / long_dir / "file").read_bytes() == b"deep"
    assert os.stat(r / "etc/shadow-").st_ino == os.stat(r / "etc/shadow").st_ino
    assert_outside_untouched(box)


# ---------------------------------------------------------------------------
# hostile deletion lists


def write_list(path: Path, value: object) -> str:
    path.write_text(json.dumps(value))
    return str(path)


def test_deleted_files_traversal(box: dict[str, Path]) -> None:
    rootfs = box["rootfs"]
    write(rootfs / "etc/motd", b"x")
    for bad in (["../../outside/victim"], ["etc/../../outside/victim"], ["a\x00b"], [""], ["/"], ["."]):
        path = write_list(box["work"] / "deleted.files", bad)
        with pytest.raises(InvalidInput):
            apply_diff(str(rootfs), None, path)
        assert_outside_untouched(box)
    assert (rootfs / "etc/motd").exists()
    # CRI-O/Podman spell the paths with a leading slash.
    path = write_list(box["work"] / "deleted.files", ["/etc/motd", "does/not/exist"])
    assert apply_diff(str(rootfs), None, path).deleted == 1
    assert not (rootfs / "etc/motd").exists()


def test_deleted_files_symlinks_not_followed(box: dict[str, Path]) -> None:
    rootfs = box["rootfs"]
    os.symlink(str(box["outside"]), rootfs / "a")
    os.symlink("../outside", rootfs / "b")
    os.symlink(str(box["outside"]), rootfs / "gone-link")
    path = write_list(box["work"] / "deleted.files", ["a/victim", "b/victim", "gone-link"])
    stats = apply_diff(str(rootfs), None, path)
    assert_outside_untouched(box)
    assert not os.path.lexists(rootfs / "gone-link")
    assert sorted(stats.skipped) == [
        "a/victim: parent is a symlink or not a directory",
        "b/victim: parent is a symlink or not a directory",
    ]
    # Removing a tree never descends through symlinks inside it.
    write(rootfs / "tree/sub/f", b"x")
    os.symlink(str(box["outside"]), rootfs / "tree/sub/out")
    os.symlink(str(box["outside"]), rootfs / "tree/out")
    path = write_list(box["work"] / "deleted.files", ["tree"])
    apply_diff(str(rootfs), None, path)
    assert not os.path.lexists(rootfs / "tree")
    assert_outside_untouched(box)


def test_opaque_dirs(box: dict[str, Path]) -> None:
    rootfs, work = box["rootfs"], box["work"]
    write(rootfs / "o/old", b"x")
    write(rootfs / "o/sub/old", b"x")
    os.symlink(str(box["outside"]), rootfs / "o/link")
    os.symlink(str(box["outside"]), rootfs / "p")
    write(rootfs / "q", b"file")
    deleted = write_list(work / "deleted.files", [])
    write_list(work / "opaque.dirs", ["o", "p", "q", "missing"])
    stats = apply_diff(str(rootfs), None, deleted)
    assert stats.opaque_dirs == 3
    assert os.listdir(rootfs / "o") == []
    assert not os.path.lexists(rootfs / "p") and not os.path.lexists(rootfs / "q")
    assert_outside_untouched(box)
    write_list(work / "opaque.dirs", ["../outside"])
    with pytest.raises(InvalidInput):
        apply_diff(str(rootfs), None, deleted)
    assert_outside_untouched(box)


@pytest.mark.parametrize(
    "content",
    [
        '{"a": 1}',
        '"etc/motd"',
        "[1, 2]",
        '[["a"]]',
        "not json",
        "[" * 100_000 + "]" * 100_000,
        '["\\ud800"]',
    ],
)
def test_deleted_files_malformed(box: dict[str, Path], content: str) -> None:
    path = box["work"] / "deleted.files"
    path.write_text(content)
    with pytest.raises(InvalidInput):
        apply_diff(str(box["rootfs"]), None, str(path))


def test_deleted_files_bounds(box: dict[str, Path]) -> None:
    path = box["work"] / "deleted.files"
    path.write_text(json.dumps([f"f{i}" for i in range(11)]))
    with pytest.raises(LimitExceeded):
        apply_diff(str(box["rootfs"]), None, str(path), limits=DiffLimits(max_entries=10))
    path.write_text('["' + "a" * (17 << 20) + '"]')
    with pytest.raises(LimitExceeded):
        apply_diff(str(box["rootfs"]), None, str(path))
    with pytest.raises(BridgeError):
        apply_diff(str(box["rootfs"]), None, str(box["work"] / "missing"))


# ---------------------------------------------------------------------------
# property: nothing is ever created outside the rootfs

# Mostly harmless components, so that many archives get applied and the
# symlink cases are reached; "..", "" and a leading "/" now and then.
COMPONENTS = ["a", "b", "outside", "victim", "c d", "\u00e9", "."] * 4 + ["..", ""]
path_strategy = st.builds(
    lambda lead, parts: lead + "/".join(parts),
    st.sampled_from([""] * 9 + ["/"]),
    st.lists(st.sampled_from(COMPONENTS), min_size=1, max_size=4),
)
link_strategy = path_strategy | st.sampled_from(
    ["..", "../..", "../outside", "/", "../../outside/victim", "/etc/passwd"]
)
member_strategy = st.tuples(
    st.sampled_from(["file", "dir", "symlink", "symlink", "hardlink", "fifo"]),
    path_strategy,
    link_strategy,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(members=st.lists(member_strategy, min_size=1, max_size=8),
       deleted=st.lists(path_strategy, max_size=2),
       preexisting=st.booleans())
def test_nothing_escapes_rootfs(members: list[tuple[str, str, str]], deleted: list[str], preexisting: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sentinel = Path(tmp) / "sentinel"
        rootfs, outside, work = sentinel / "rootfs", sentinel / "outside", Path(tmp) / "work"
        for d in (rootfs, outside, work):
            d.mkdir(parents=True)
        (outside / "victim").write_text("keep me")
        if preexisting:
            os.symlink(str(outside), rootfs / "a")
            os.symlink("../outside", rootfs / "b")
        kinds = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                 "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE}
        entries = [
            ti(name, kinds[kind], data=b"pwned", linkname=link if kind in ("symlink", "hardlink") else "")
            for kind, name, link in members
        ]
        tar = make_tar(work / "t.tar", entries)
        deleted_path = write_list(work / "deleted.files", deleted)
        try:
            apply_diff(str(rootfs), str(tar), deleted_path)
        except InvalidInput:
            pass
        assert sorted(os.listdir(sentinel)) == ["outside", "rootfs"]
        assert os.listdir(outside) == ["victim"]
        assert (outside / "victim").read_text() == "keep me"
        assert sorted(os.listdir(tmp)) == ["sentinel", "work"]
        assert sorted(os.listdir(work)) == ["deleted.files", "t.tar"]


# ---------------------------------------------------------------------------
# records


def test_records_are_frozen_values() -> None:
    limits = DiffLimits(max_entries=5)
    assert limits == DiffLimits(8 * 2**30, 5, 4096, 4 * 2**30)
    assert hash(limits) == hash(DiffLimits(max_entries=5))
    assert limits.replace(max_entries=6).max_entries == 6
    with pytest.raises(AttributeError):
        setattr(limits, "max_entries", 1)
    with pytest.raises(ValueError):
        DiffLimits(max_entries=-1)
    stats = DiffStats(1, 2, 3, 4, 5, 6, 7, ("x: socket",))
    assert stats.fifos == 0 and stats.skipped == ("x: socket",)
    assert "files=1" in repr(stats)
    import pickle

    assert pickle.loads(pickle.dumps(stats)) == stats
    assert stats.as_dict()["bytes"] == 7
