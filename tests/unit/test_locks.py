"""File locks a restore takes again: read from CRIU's images, tested against /proc/locks."""

from __future__ import annotations

import fcntl
import json
import os
import struct
from pathlib import Path

from criu_bridge import criuimg as img
from criu_bridge import locks
from node_agent.interop import imagefacts
from node_agent.restoring import plan_locks
from tests.unit.test_interop import _field as _f


def _img(magic: int, entries: list[bytes]) -> bytes:
    return struct.pack("<II", img.IMG_COMMON_MAGIC, magic) + b"".join(struct.pack("<I", len(e)) + e for e in entries)


def _images(d: Path) -> Path:
    """Two processes: pid 1 holds an flock on /vol/app.lock (fd 5), pid 7 a POSIX read lock on /db/x (fd 3)."""
    d.mkdir()
    (d / "filelocks.img").write_bytes(_img(img.FILE_LOCKS_MAGIC, [
        _f(1, imagefacts.FL_FLOCK) + _f(2, 1) + _f(3, 1) + _f(4, 5) + _f(5, 0) + _f(6, 0),
        _f(1, imagefacts.FL_POSIX) + _f(2, 0) + _f(3, 7) + _f(4, 3) + _f(5, 100) + _f(6, 10),
        _f(1, imagefacts.FL_LEASE) + _f(2, 1) + _f(3, 7) + _f(4, 3) + _f(5, 0) + _f(6, 0),
    ]))
    # CRIU 4.2 writes ids-<pid>.img; the ids may also sit inside core-<pid>.img.
    ids = _f(1, 1) + _f(2, 11) + _f(3, 1) + _f(4, 1)
    (d / "ids-1.img").write_bytes(_img(img.IDS_MAGIC, [ids]))
    ids = _f(1, 1) + _f(2, 12) + _f(3, 1) + _f(4, 1)
    (d / "core-7.img").write_bytes(_img(img.CORE_MAGIC, [_f(1, 1) + _f(4, ids)]))
    (d / "fdinfo-11.img").write_bytes(_img(img.FDINFO_MAGIC, [_f(1, 40) + _f(2, 0) + _f(3, 1) + _f(4, 5)]))
    (d / "fdinfo-12.img").write_bytes(_img(img.FDINFO_MAGIC, [_f(1, 41) + _f(2, 0) + _f(3, 1) + _f(4, 3)]))
    reg = lambda fid, name: _f(1, 1) + _f(2, fid) + _f(3, _f(1, fid) + _f(2, 0) + _f(3, 0) + _f(6, name))  # noqa: E731
    (d / "files.img").write_bytes(_img(img.FILES_MAGIC, [reg(40, b"/vol/app.lock"), reg(41, b"/db/x")]))
    return d


def test_file_locks_are_read_from_the_images(tmp_path: Path) -> None:
    got = imagefacts.file_locks(str(_images(tmp_path / "img")))
    assert got == [
        {"path": "/vol/app.lock", "kind": "flock", "write": True, "start": 0, "len": 0, "pid": 1, "fd": 5},
        {"path": "/db/x", "kind": "posix", "write": False, "start": 100, "len": 10, "pid": 7, "fd": 3},
    ]
    assert imagefacts.file_locks(str(tmp_path)) == []  # no filelocks.img: no locks


def test_only_locks_on_mounted_host_paths_get_a_host_path(tmp_path: Path) -> None:
    img = _images(tmp_path / "img")
    mounts = [{"container_path": "/vol", "host_path": "/srv/pods/u/volumes/v"}, {"container_path": "/v", "host_path": "/x"}]
    got = plan_locks(str(img), mounts)
    assert [(e["path"], e["host"]) for e in got] == [("/vol/app.lock", "/srv/pods/u/volumes/v/app.lock"), ("/db/x", "")]
    assert locks.check_entries(json.loads(json.dumps(got))) == got


def test_held_locks_parse_proc_locks_and_skip_waiters() -> None:
    text = ("1: POSIX  ADVISORY  WRITE 14223 fe:00:2146447 5 14\n"
            "1: -> POSIX  ADVISORY  WRITE 14224 fe:00:2146447 5 14\n"
            "2: FLOCK  ADVISORY  WRITE 14223 fe:00:2146446 0 EOF\n"
            "3: OFDLCK ADVISORY  READ  -1 08:01:77 0 EOF\n")
    held = locks.held_locks(text)
    assert [(h.kind, h.write, h.pid, h.dev, h.ino, h.start) for h in held] == [
        ("posix", True, 14223, (0xFE, 0), 2146447, 5), ("flock", True, 14223, (0xFE, 0), 2146446, 0),
        ("ofd", False, -1, (8, 1), 77, 0),
    ]


def test_conflicts_follow_the_kernels_rules(tmp_path: Path) -> None:
    f = tmp_path / "db"
    f.write_bytes(b"x" * 64)
    entry = {"path": "/db", "host": str(f), "kind": "posix", "write": True, "start": 10, "len": 5}
    with open(f, "r+b") as held:
        fcntl.lockf(held, fcntl.LOCK_SH, 4, 12)  # bytes 12..15, shared, by this process
        assert locks.conflicts([entry])  # a write lock over 10..14 meets it
        assert locks.conflicts([{**entry, "start": 0, "len": 0}])  # to the end of the file
        assert not locks.conflicts([{**entry, "start": 20, "len": 4}])  # no overlap
        assert not locks.conflicts([{**entry, "write": False}])  # two read locks share
        assert not locks.conflicts([{**entry, "kind": "flock"}])  # flock and record locks are independent
        assert not locks.conflicts([{**entry, "host": ""}])  # in the container's own rootfs
    assert not locks.conflicts([entry])
    with open(f, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_SH)
        assert not locks.conflicts([{**entry, "kind": "flock", "write": False}])
        msg = locks.conflicts([{**entry, "kind": "flock"}])
        assert len(msg) == 1 and str(f) in msg[0] and f"pid {os.getpid()}" in msg[0]
