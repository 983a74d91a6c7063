"""Capture an overlay upperdir into the diff's files (see the package's docstring for the format)."""

from __future__ import annotations

import os
import stat

from criu_bridge import tarwrite
from criu_bridge.errors import BridgeError, InvalidInput, LimitExceeded
from criu_bridge.rootfs.common import CHUNK, DIR_FLAGS, Counter, DiffLimits, DiffStats, copy_blocks, keep_xattr
from criu_bridge.rootfs.common import opaque_dirs_path, oserror, show, split_path
from criu_bridge.tarstream import DIR, FIFO, FILE, HARDLINK, SYMLINK

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import BinaryIO

_SMALL_FILE = 256 << 10  # files up to this size are read into the write buffer
_NS = 1_000_000_000
_OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
_REFUSED_XATTRS = {
    "trusted.overlay.metacopy": "metacopy",
    "user.overlay.metacopy": "metacopy",
    "trusted.overlay.redirect": "redirect_dir",
    "user.overlay.redirect": "redirect_dir",
}


def _normalize_excludes(exclude: Iterable[str]) -> set[bytes]:
    limits = DiffLimits(max_path_len=1 << 16)
    result: set[bytes] = set()
    for item in exclude:
        raw = os.fsencode(item).strip(b"/")
        if not raw:
            raise InvalidInput(f"exclude: {item!r} would exclude the whole rootfs")
        result.add(b"/".join(split_path(raw, "exclude", limits)))
    return result


def _read_exact(fd: int, size: int, what: bytes) -> bytes:
    data = os.read(fd, size) if size else b""
    if len(data) < size:
        parts = [data]
        got = len(data)
        while got < size:
            more = os.read(fd, size - got)
            if not more:
                raise BridgeError(f"{show(what)} shrank while it was captured")
            parts.append(more)
            got += len(more)
        data = b"".join(parts)
    return data


def _send_exact(out_fd: int, src_fd: int, size: int, what: bytes) -> None:
    for n in copy_blocks(out_fd, src_fd, 0, size):
        if n == 0:
            raise BridgeError(f"{show(what)} shrank while it was captured")


def _xattr_names(fd: int) -> list[str]:
    try:
        return os.listxattr(fd)
    except OSError:
        return []


def _collect_xattrs(fd: int, names: list[str], rel: bytes, regular: bool) -> list[tuple[str, bytes]]:
    result: list[tuple[str, bytes]] = []
    for name in sorted(names):
        feature = _REFUSED_XATTRS.get(name)
        if feature is not None:
            raise BridgeError(
                f"{show(rel)} uses overlayfs {feature} ({name}); such upperdirs are not supported"
            )
        if keep_xattr(name, regular):
            try:
                result.append((name, os.getxattr(fd, name)))
            except OSError:
                continue
    return result


def _write_json_list(path: str, items: list[bytes]) -> None:
    import json

    data = json.dumps([os.fsdecode(p) for p in items]).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


class _Capture:
    """One walk of an upperdir into a tar stream: headers from each entry's stat, content read or sent."""

    def __init__(self, out: BinaryIO, limits: DiffLimits, exclude: set[bytes]) -> None:
        self.out = out
        self.tar = tarwrite.TarWriter(out)
        self.limits = limits
        self.exclude = exclude
        self.stats = Counter()
        self.entries = 0
        self.deleted: list[bytes] = []
        self.opaque: list[bytes] = []
        self.links: dict[tuple[int, int], bytes] = {}

    @staticmethod
    def _list(fd: int) -> list[tuple[bytes, os.DirEntry[str]]]:
        with os.scandir(fd) as it:
            entries = [(os.fsencode(e.name), e) for e in it]
        entries.sort(key=lambda item: item[0])
        return entries

    def run(self, root_fd: int) -> None:
        root_dev = os.fstat(root_fd).st_dev
        frames: list[tuple[int, bytes, list[tuple[bytes, os.DirEntry[str]]]]] = [
            (root_fd, b"", self._list(root_fd))
        ]
        positions = [0]
        try:
            while frames:
                dir_fd, prefix, entries = frames[-1]
                i = positions[-1]
                if i >= len(entries):
                    frames.pop()
                    positions.pop()
                    if dir_fd != root_fd:
                        os.close(dir_fd)
                    continue
                positions[-1] = i + 1
                name, entry = entries[i]
                rel = prefix + name
                if rel in self.exclude:
                    continue
                child = self._entry(dir_fd, name, rel, entry, root_dev)
                if child is not None:
                    try:
                        listing = self._list(child)
                    except BaseException:
                        os.close(child)
                        raise
                    frames.append((child, rel + b"/", listing))
                    positions.append(0)
        finally:
            for dir_fd, _, _ in frames:
                if dir_fd != root_fd:
                    os.close(dir_fd)

    def _header(
        self, rel: bytes, kind: str, st: os.stat_result, *, size: int = 0, linkname: bytes = b"",
        xattrs: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """A member with the entry's mode, numeric owner and whole-second mtime."""
        self.tar.member(
            rel, kind, stat.S_IMODE(st.st_mode), size=size, mtime_ns=st.st_mtime_ns // _NS * _NS,
            uid=st.st_uid, gid=st.st_gid, linkname=linkname,
            xattrs=[(name.encode(), value) for name, value in xattrs or ()],
        )

    def _content(self, src_fd: int, size: int, what: bytes) -> None:
        """Exactly `size` bytes of `src_fd` and the padding; large files go by sendfile."""
        if size <= _SMALL_FILE:
            self.tar.write(_read_exact(src_fd, size, what))
        else:
            self.out.flush()
            _send_exact(self.out.fileno(), src_fd, size, what)
        self.tar.pad(size)

    def _count(self, rel: bytes) -> None:
        self.entries += 1
        if self.entries > self.limits.max_entries:
            raise LimitExceeded(f"more than max_entries={self.limits.max_entries} entries at {show(rel)}")
        if len(rel) > self.limits.max_path_len:
            raise LimitExceeded(f"path longer than max_path_len={self.limits.max_path_len}: {show(rel)}")

    def _entry(self, dir_fd: int, name: bytes, rel: bytes, entry: os.DirEntry[str], root_dev: int) -> int | None:
        """Capture one entry; return an open fd if it is a directory to descend into."""
        self._count(rel)
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            return None
        mode = st.st_mode
        s = self.stats
        if stat.S_ISREG(mode):
            self._regular(dir_fd, name, rel, st)
        elif stat.S_ISDIR(mode):
            if st.st_dev != root_dev:
                s.skipped.append(f"{os.fsdecode(rel)}: mount point of another filesystem")
                return None
            fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
            try:
                names = _xattr_names(fd)
                xattrs = _collect_xattrs(fd, names, rel, regular=False)
                for opaque in _OPAQUE_XATTRS:
                    if opaque in names:
                        try:
                            value = os.getxattr(fd, opaque)
                        except OSError:
                            continue
                        if value == b"y":
                            self.opaque.append(rel)
                            s.opaque_dirs += 1
                            break
                self._header(rel, DIR, st, xattrs=xattrs)
            except BaseException:
                os.close(fd)
                raise
            s.dirs += 1
            return fd
        elif stat.S_ISLNK(mode):
            target = os.readlink(name, dir_fd=dir_fd)
            self._header(rel, SYMLINK, st, linkname=target)
            s.symlinks += 1
        elif stat.S_ISCHR(mode) and st.st_rdev == 0:
            self.deleted.append(rel)
            s.deleted += 1
        elif stat.S_ISFIFO(mode):
            self._header(rel, FIFO, st)
            s.fifos += 1
        elif stat.S_ISSOCK(mode):
            s.skipped.append(f"{os.fsdecode(rel)}: socket")
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            kind = "character" if stat.S_ISCHR(mode) else "block"
            s.skipped.append(
                f"{os.fsdecode(rel)}: {kind} device {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
            )
        else:
            s.skipped.append(f"{os.fsdecode(rel)}: unsupported file type {stat.S_IFMT(mode):o}")
        return None

    def _regular(self, dir_fd: int, name: bytes, rel: bytes, st: os.stat_result) -> None:
        s = self.stats
        limits = self.limits
        if st.st_nlink > 1:
            key = (st.st_dev, st.st_ino)
            first = self.links.get(key)
            if first is not None:
                self._header(rel, HARDLINK, st, linkname=first)
                s.hardlinks += 1
                return
            self.links[key] = rel
        size = st.st_size
        if size > limits.max_file_bytes:
            raise LimitExceeded(f"{show(rel)} is larger than max_file_bytes={limits.max_file_bytes}")
        if s.bytes + size > limits.max_total_bytes:
            raise LimitExceeded(f"max_total_bytes={limits.max_total_bytes} exceeded at {show(rel)}")
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOATIME, dir_fd=dir_fd)
        except PermissionError:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            xattrs = _collect_xattrs(fd, _xattr_names(fd), rel, regular=True)
            self._header(rel, FILE, st, size=size, xattrs=xattrs)
            self._content(fd, size, rel)
        finally:
            os.close(fd)
        s.files += 1
        s.bytes += size


def capture_diff(
    upperdir: str,
    tar_path: str,
    deleted_path: str,
    *,
    exclude: Iterable[str] = (),
    limits: DiffLimits = DiffLimits(),
) -> DiffStats:
    """Write the upperdir's diff: a tar at `tar_path`, deletions at `deleted_path`.

    Opaque directories go to `opaque_dirs_path(deleted_path)` when there are
    any (a stale file there is removed otherwise). Files are written under
    temporary names and renamed at the end; on error nothing is left behind.
    Nothing is fsynced: the caller syncs once the container runs again.
    """
    excluded = _normalize_excludes(exclude)
    opaque_path = opaque_dirs_path(deleted_path)
    suffix = f".tmp{os.getpid()}"
    written: list[str] = []
    try:
        root_fd = os.open(upperdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise oserror(f"cannot open upperdir {upperdir}", e) from e
    try:
        out_fd = os.open(
            tar_path + suffix, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
        )
        written.append(tar_path + suffix)
        with open(out_fd, "wb", buffering=CHUNK) as out:
            capture = _Capture(out, limits, excluded)
            capture.run(root_fd)
            capture.tar.close()
        _write_json_list(deleted_path + suffix, capture.deleted)
        written.append(deleted_path + suffix)
        renames = [(tar_path + suffix, tar_path), (deleted_path + suffix, deleted_path)]
        if capture.opaque:
            _write_json_list(opaque_path + suffix, capture.opaque)
            written.append(opaque_path + suffix)
            renames.append((opaque_path + suffix, opaque_path))
        for src, dst in renames:
            os.rename(src, dst)
            written[written.index(src)] = dst
        if not capture.opaque:
            try:
                os.unlink(opaque_path)
            except FileNotFoundError:
                pass
        return capture.stats.freeze()
    except BaseException as e:
        for path in written:
            try:
                os.unlink(path)
            except OSError:
                pass
        if isinstance(e, OSError):
            raise oserror(f"capturing {upperdir}", e) from e
        raise
    finally:
        os.close(root_fd)
