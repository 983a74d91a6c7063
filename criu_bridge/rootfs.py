"""Capture and apply a container's writable-layer diff.

The writable layer of a CRI container is the upperdir of its overlayfs root.
`capture_diff` turns it, while the container is frozen, into the files of the
container checkpoint archive:

- `rootfs-diff.tar`: an uncompressed POSIX (PAX) tar of the regular files,
  directories, symlinks, hardlinks and FIFOs of the upperdir, in a fixed order
  (depth first, names sorted bytewise), with relative member names, mode
  (setuid/setgid/sticky included), numeric uid/gid and whole-second mtime.
  Extended attributes `security.capability` and `user.*` (except
  `user.overlay.*`) travel as `SCHILY.xattr.*` PAX records.
- `deleted.files`: a JSON list of the paths that the upperdir whites out
  (character device 0:0), relative to the container root ("etc/motd"). This
  is the list CRI-O, Podman and checkpointctl use; `apply_diff` also accepts
  their "/etc/motd" spelling. Names that are not UTF-8 are written with
  Python's surrogate escapes.
- `opaque.dirs`: a JSON list, in the same format, of the directories marked
  opaque (xattr `trusted.overlay.opaque` or `user.overlay.opaque` = "y"):
  everything the lower layers hold inside them is gone. The file lies next
  to `deleted.files` (see `opaque_dirs_path`) and is only written when the
  list is not empty, so `deleted.files` stays a plain list that other tools
  read unchanged, and tools that do not know `opaque.dirs` ignore it.

Sockets and device files other than whiteouts are not captured; they are
reported in `DiffStats.skipped`. Upperdirs that use overlayfs metacopy or
redirect_dir are refused, since their data or names live in the lower layers.

`apply_diff` treats the tar and both lists as hostile. It resolves every
parent directory one component at a time from a descriptor of the rootfs
with O_NOFOLLOW, creates entries relative to that descriptor, never follows
a symlink in a path, never crosses into another filesystem, and rejects
(InvalidInput) absolute names, "..", NUL bytes, devices, hardlinks to
anything but a regular file extracted from the same archive, conflicting
duplicates and every bound of `DiffLimits`. It reads the tar with the strict
parser of `tarstream` (ustar, PAX and GNU long names) rather than tarfile.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator

from . import tarstream
from .errors import BridgeError, InvalidInput, LimitExceeded

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any, Self, TypeVar

    _T = TypeVar("_T")

OPAQUE_DIRS_NAME = "opaque.dirs"

_BLOCK = tarstream.BLOCK
_ZERO_BLOCK = tarstream.ZERO_BLOCK
_CHUNK = 1 << 20  # copy unit for file content
_SMALL_FILE = 256 << 10  # files up to this size are read into the write buffer
_MAX_LIST_BYTES = 16 << 20  # deleted.files / opaque.dirs
_MAX_XATTR_VALUE = 64 << 10
_NAME_MAX = 255

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

_OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
_REFUSED_XATTRS = {
    "trusted.overlay.metacopy": "metacopy",
    "user.overlay.metacopy": "metacopy",
    "trusted.overlay.redirect": "redirect_dir",
    "user.overlay.redirect": "redirect_dir",
}

# Member kinds.
_FILE, _DIR, _SYMLINK, _HARDLINK, _FIFO = (
    tarstream.FILE, tarstream.DIR, tarstream.SYMLINK, tarstream.HARDLINK, tarstream.FIFO
)
_IMPLICIT_DIR = "implicit"


class _Frozen:
    """Small immutable record: equality, hash, repr, replace()."""

    __slots__: tuple[str, ...] = ()

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _Frozen)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self).__name__,) + self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"{type(self).__name__}({fields})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self._values())

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields changed."""
        values = {name: getattr(self, name) for name in self.__slots__}
        values.update(changes)
        return type(self)(**values)

    def as_dict(self) -> dict[str, object]:
        """The fields as a dict."""
        return {name: getattr(self, name) for name in self.__slots__}


class DiffLimits(_Frozen):
    """Bounds for capturing and applying a diff (bytes, entries, path length)."""

    __slots__ = ("max_total_bytes", "max_entries", "max_path_len", "max_file_bytes")
    __match_args__ = ("max_total_bytes", "max_entries", "max_path_len", "max_file_bytes")
    max_total_bytes: int
    max_entries: int
    max_path_len: int
    max_file_bytes: int

    def __init__(
        self,
        max_total_bytes: int = 8 * 2**30,
        max_entries: int = 200_000,
        max_path_len: int = 4096,
        max_file_bytes: int = 4 * 2**30,
    ) -> None:
        for name, value in (
            ("max_total_bytes", max_total_bytes),
            ("max_entries", max_entries),
            ("max_path_len", max_path_len),
            ("max_file_bytes", max_file_bytes),
        ):
            if type(value) is not int or value < 0:
                raise ValueError(f"DiffLimits.{name} must be a non-negative int, not {value!r}")
            object.__setattr__(self, name, value)


class DiffStats(_Frozen):
    """What a capture or an apply did; `skipped` holds "path: reason" strings."""

    __slots__ = (
        "files",
        "dirs",
        "symlinks",
        "hardlinks",
        "deleted",
        "opaque_dirs",
        "bytes",
        "skipped",
        "fifos",
    )
    __match_args__ = (
        "files",
        "dirs",
        "symlinks",
        "hardlinks",
        "deleted",
        "opaque_dirs",
        "bytes",
        "skipped",
        "fifos",
    )
    files: int
    dirs: int
    symlinks: int
    hardlinks: int
    deleted: int
    opaque_dirs: int
    bytes: int
    skipped: tuple[str, ...]
    fifos: int

    def __init__(
        self,
        files: int,
        dirs: int,
        symlinks: int,
        hardlinks: int,
        deleted: int,
        opaque_dirs: int,
        bytes: int,
        skipped: tuple[str, ...],
        fifos: int = 0,
    ) -> None:
        for name, value in (
            ("files", files),
            ("dirs", dirs),
            ("symlinks", symlinks),
            ("hardlinks", hardlinks),
            ("deleted", deleted),
            ("opaque_dirs", opaque_dirs),
            ("bytes", bytes),
            ("skipped", tuple(skipped)),
            ("fifos", fifos),
        ):
            object.__setattr__(self, name, value)


class _Counter:
    """Mutable counters behind a DiffStats."""

    def __init__(self) -> None:
        self.files = self.dirs = self.symlinks = self.hardlinks = 0
        self.deleted = self.opaque_dirs = self.bytes = self.fifos = 0
        self.skipped: list[str] = []

    def freeze(self) -> DiffStats:
        return DiffStats(
            files=self.files,
            dirs=self.dirs,
            symlinks=self.symlinks,
            hardlinks=self.hardlinks,
            deleted=self.deleted,
            opaque_dirs=self.opaque_dirs,
            bytes=self.bytes,
            skipped=tuple(self.skipped),
            fifos=self.fifos,
        )


def opaque_dirs_path(deleted_path: str) -> str:
    """Where the opaque-directory list lives: `opaque.dirs` next to deleted.files."""
    return os.path.join(os.path.dirname(deleted_path), OPAQUE_DIRS_NAME)


def _show(path: bytes) -> str:
    """A path for messages: decoded, quoted, control characters escaped."""
    return repr(path.decode("utf-8", "backslashreplace"))


def _oserror(what: str, e: OSError) -> BridgeError:
    detail = e.strerror or str(e)
    name = e.filename
    if isinstance(name, bytes):
        detail += f" ({_show(name)})"
    elif isinstance(name, str):
        detail += f" ({name!r})"
    return BridgeError(f"{what}: {detail}")


# --------------------------------------------------------------------------
# Mount table


def _unescape_mountinfo(field: str) -> str:
    """Undo the kernel's octal escapes (\\040 for space, \\054 for comma...)."""
    if "\\" not in field:
        return field
    out: list[str] = []
    i = 0
    n = len(field)
    while i < n:
        c = field[i]
        if c == "\\" and i + 3 < n and all(ch in "01234567" for ch in field[i + 1 : i + 4]):
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(c)
            i += 1
    return "".join(out)


def parse_root_upperdir(mountinfo: str) -> str:
    """The upperdir of the mount at "/" in a mountinfo text; BridgeError if not overlayfs."""
    root: tuple[str, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) < 9:
            continue
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 3 or _unescape_mountinfo(fields[4]) != "/":
            continue
        # The last mount at "/" is the one on top.
        root = (_unescape_mountinfo(fields[sep + 1]), fields[sep + 3] if len(fields) > sep + 3 else "")
    if root is None:
        raise BridgeError("no mount at / in the mount table")
    fstype, options = root
    if fstype != "overlay":
        raise BridgeError(f"the root filesystem is {fstype}, not overlayfs")
    for option in options.split(","):
        key, eq, value = option.partition("=")
        if key == "upperdir" and eq:
            upper = _unescape_mountinfo(value)
            if upper:
                return upper
    raise BridgeError("the overlayfs root has no upperdir")


def upperdir_of(pid: int) -> str:
    """The overlay upperdir of the root mount of process `pid`."""
    try:
        with open(f"/proc/{int(pid)}/mountinfo", "rb") as f:
            data = f.read()
    except OSError as e:
        raise _oserror(f"cannot read the mount table of pid {pid}", e) from e
    return parse_root_upperdir(data.decode("utf-8", "surrogateescape"))


# --------------------------------------------------------------------------
# Paths from hostile input


def _split_path(raw: bytes, what: str, limits: DiffLimits) -> tuple[bytes, ...]:
    """Validate a relative path; return its components ("." and empty ones dropped)."""
    if not raw:
        raise InvalidInput(f"{what}: empty path")
    if b"\0" in raw:
        raise InvalidInput(f"{what}: NUL byte in path {_show(raw)}")
    if len(raw) > limits.max_path_len:
        raise LimitExceeded(f"{what}: path longer than max_path_len={limits.max_path_len}: {_show(raw[:200])}...")
    if raw.startswith(b"/"):
        raise InvalidInput(f"{what}: absolute path {_show(raw)}")
    parts: list[bytes] = []
    for comp in raw.split(b"/"):
        if comp == b"" or comp == b".":
            continue
        if comp == b"..":
            raise InvalidInput(f"{what}: '..' in path {_show(raw)}")
        if len(comp) > _NAME_MAX:
            raise InvalidInput(f"{what}: name longer than {_NAME_MAX} bytes in {_show(raw)}")
        parts.append(comp)
    return tuple(parts)


def _normalize_excludes(exclude: Iterable[str]) -> set[bytes]:
    limits = DiffLimits(max_path_len=1 << 16)
    result: set[bytes] = set()
    for item in exclude:
        raw = os.fsencode(item).strip(b"/")
        if not raw:
            raise InvalidInput(f"exclude: {item!r} would exclude the whole rootfs")
        result.add(b"/".join(_split_path(raw, "exclude", limits)))
    return result


# --------------------------------------------------------------------------
# Tar writing


def _is_ascii(data: bytes) -> bool:
    return data.isascii()


def _split_ustar_name(path: bytes) -> tuple[bytes, bytes] | None:
    """(prefix, name) for the ustar fields, or None if the path does not fit."""
    if len(path) <= 100:
        return b"", path
    i = path.find(b"/", max(0, len(path) - 101))
    while 0 <= i <= 155:
        if 0 < i and len(path) - i - 1 <= 100 and i + 1 < len(path):
            return path[:i], path[i + 1 :]
        i = path.find(b"/", i + 1)
    return None


def _padding(size: int) -> bytes:
    rest = size % _BLOCK
    return bytes(_BLOCK - rest) if rest else b""


class _TarWriter:
    """Writes PAX tar members to a file descriptor through a buffer."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()

    def flush(self) -> None:
        view = memoryview(self.buf)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        view.release()
        del self.buf[:]

    def header(
        self,
        path: bytes,
        typeflag: bytes,
        st: os.stat_result,
        *,
        size: int = 0,
        linkname: bytes = b"",
        xattrs: list[tuple[str, bytes]] | None = None,
    ) -> None:
        records: list[bytes] = []
        binary = False
        split = _split_ustar_name(path) if _is_ascii(path) else None
        if split is None:
            records.append(tarstream.pax_record(b"path", path))
            binary = not _is_utf8(path)
            prefix, name = b"", path[:100]
        else:
            prefix, name = split
        if len(linkname) > 100 or not _is_ascii(linkname):
            records.append(tarstream.pax_record(b"linkpath", linkname))
            binary = binary or not _is_utf8(linkname)
            linkname = linkname[:100]
        uid, gid = st.st_uid, st.st_gid
        if uid >= 8**7:
            records.append(tarstream.pax_record(b"uid", b"%d" % uid))
            uid = 0
        if gid >= 8**7:
            records.append(tarstream.pax_record(b"gid", b"%d" % gid))
            gid = 0
        if size >= 8**11:
            records.append(tarstream.pax_record(b"size", b"%d" % size))
            hsize = 0
        else:
            hsize = size
        mtime = st.st_mtime_ns // 1_000_000_000
        if not 0 <= mtime < 8**11:
            records.append(tarstream.pax_record(b"mtime", b"%d" % mtime))
            mtime = 0
        for xname, value in xattrs or ():
            records.append(tarstream.pax_record(b"SCHILY.xattr." + xname.encode(), value))
        if records:
            if binary:
                records.insert(0, tarstream.pax_record(b"hdrcharset", b"BINARY"))
            data = b"".join(records)
            self.buf += tarstream.ustar_header(b"././@PaxHeader", 0o644, len(data), 0, b"x")
            self.buf += data
            self.buf += _padding(len(data))
        self.buf += tarstream.ustar_header(
            name, stat.S_IMODE(st.st_mode), hsize, mtime, typeflag, uid=uid, gid=gid, linkname=linkname, prefix=prefix
        )

    def content(self, src_fd: int, size: int, what: bytes) -> None:
        """Append exactly `size` bytes of `src_fd` and the block padding."""
        if size <= _SMALL_FILE:
            data = _read_exact(src_fd, size, what)
            self.buf += data
        else:
            self.flush()
            _send_exact(self.fd, src_fd, size, what)
        self.buf += _padding(size)
        if len(self.buf) >= _CHUNK:
            self.flush()

    def close(self) -> None:
        self.buf += _ZERO_BLOCK * 2
        self.flush()


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _read_exact(fd: int, size: int, what: bytes) -> bytes:
    data = os.read(fd, size) if size else b""
    if len(data) < size:
        parts = [data]
        got = len(data)
        while got < size:
            more = os.read(fd, size - got)
            if not more:
                raise BridgeError(f"{_show(what)} shrank while it was captured")
            parts.append(more)
            got += len(more)
        data = b"".join(parts)
    return data


def _copy_blocks(out_fd: int, src_fd: int, offset: int, size: int) -> Iterator[int]:
    """Copy ``size`` bytes of ``src_fd`` from ``offset`` to ``out_fd`` in blocks of up to 1 MiB.

    Uses sendfile, falling back to pread and write where the files do not
    allow it. Yields each block's length; a 0 means the source ended early
    (the caller says what that means) and ends the copy.
    """
    end = offset + size
    use_sendfile = True
    while offset < end:
        count = min(_CHUNK, end - offset)
        if use_sendfile:
            try:
                n = os.sendfile(out_fd, src_fd, offset, count)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                use_sendfile = False
                continue
        else:
            data = os.pread(src_fd, count, offset)
            n = len(data)
            view = memoryview(data)
            while view:
                view = view[os.write(out_fd, view) :]
        yield n
        if n == 0:
            return
        offset += n


def _send_exact(out_fd: int, src_fd: int, size: int, what: bytes) -> None:
    for n in _copy_blocks(out_fd, src_fd, 0, size):
        if n == 0:
            raise BridgeError(f"{_show(what)} shrank while it was captured")


# --------------------------------------------------------------------------
# Capture


def _xattr_names(fd: int) -> list[str]:
    try:
        return os.listxattr(fd)
    except OSError:
        return []


def _keep_xattr(name: str, regular: bool) -> bool:
    if name.startswith("user."):
        return not name.startswith("user.overlay.")
    return regular and name == "security.capability"


def _collect_xattrs(fd: int, names: list[str], rel: bytes, regular: bool) -> list[tuple[str, bytes]]:
    result: list[tuple[str, bytes]] = []
    for name in sorted(names):
        feature = _REFUSED_XATTRS.get(name)
        if feature is not None:
            raise BridgeError(
                f"{_show(rel)} uses overlayfs {feature} ({name}); such upperdirs are not supported"
            )
        if _keep_xattr(name, regular):
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
    """One walk of an upperdir into a tar writer."""

    def __init__(self, writer: _TarWriter, limits: DiffLimits, exclude: set[bytes]) -> None:
        self.w = writer
        self.limits = limits
        self.exclude = exclude
        self.stats = _Counter()
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

    def _count(self, rel: bytes) -> None:
        self.entries += 1
        if self.entries > self.limits.max_entries:
            raise LimitExceeded(f"more than max_entries={self.limits.max_entries} entries at {_show(rel)}")
        if len(rel) > self.limits.max_path_len:
            raise LimitExceeded(f"path longer than max_path_len={self.limits.max_path_len}: {_show(rel)}")

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
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
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
                self.w.header(rel + b"/", b"5", st, xattrs=xattrs)
            except BaseException:
                os.close(fd)
                raise
            s.dirs += 1
            return fd
        elif stat.S_ISLNK(mode):
            target = os.readlink(name, dir_fd=dir_fd)
            self.w.header(rel, b"2", st, linkname=target)
            s.symlinks += 1
        elif stat.S_ISCHR(mode) and st.st_rdev == 0:
            self.deleted.append(rel)
            s.deleted += 1
        elif stat.S_ISFIFO(mode):
            self.w.header(rel, b"6", st)
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
                self.w.header(rel, b"1", st, linkname=first)
                s.hardlinks += 1
                return
            self.links[key] = rel
        size = st.st_size
        if size > limits.max_file_bytes:
            raise LimitExceeded(f"{_show(rel)} is larger than max_file_bytes={limits.max_file_bytes}")
        if s.bytes + size > limits.max_total_bytes:
            raise LimitExceeded(f"max_total_bytes={limits.max_total_bytes} exceeded at {_show(rel)}")
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOATIME, dir_fd=dir_fd)
        except PermissionError:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            xattrs = _collect_xattrs(fd, _xattr_names(fd), rel, regular=True)
            self.w.header(rel, b"0", st, size=size, xattrs=xattrs)
            self.w.content(fd, size, rel)
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
        raise _oserror(f"cannot open upperdir {upperdir}", e) from e
    try:
        out_fd = os.open(
            tar_path + suffix, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
        )
        written.append(tar_path + suffix)
        try:
            writer = _TarWriter(out_fd)
            capture = _Capture(writer, limits, excluded)
            capture.run(root_fd)
            writer.close()
        finally:
            os.close(out_fd)
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
            raise _oserror(f"capturing {upperdir}", e) from e
        raise
    finally:
        os.close(root_fd)


# --------------------------------------------------------------------------
# Tar reading (hostile input)


class _Member:
    """One tar member after its extended headers were merged in."""

    __slots__ = ("name", "kind", "mode", "uid", "gid", "size", "mtime_ns", "linkname", "xattrs", "offset")

    def __init__(self) -> None:
        self.name = b""
        self.kind = ""
        self.mode = 0
        self.uid = 0
        self.gid = 0
        self.size = 0
        self.mtime_ns = 0
        self.linkname = b""
        self.xattrs: list[tuple[str, bytes]] = []
        self.offset = 0


class _TarReader:
    """Members of a regular-file tar read by offset; content stays in place for sendfile.

    `tarstream` checks every header (its defaults refuse devices and a
    trailing slash on anything but a directory); this then reads mode,
    owner and mtime, checks max_file_bytes, and that the content lies
    inside the file, in that order.
    """

    def __init__(self, fd: int, size: int, limits: DiffLimits) -> None:
        self.source = tarstream.FileSource(fd, size)
        self.limits = limits
        self.headers = tarstream.TarStream(self.source, pax_nul_ends=True, pax_text_keys=True)

    def next(self) -> _Member | None:
        h = self.headers.next()
        if h is None:
            return None
        m = _Member()
        m.name = h.name
        m.kind = h.kind
        m.linkname = h.linkname
        m.mode = h.mode()
        m.uid, m.gid = h.owner()
        m.mtime_ns = h.mtime_ns()
        m.xattrs = [(name.decode("utf-8"), value) for name, value in h.xattrs]
        if h.kind == _FILE:
            if h.size > self.limits.max_file_bytes:
                raise LimitExceeded(f"tar member {h.shown}: larger than max_file_bytes={self.limits.max_file_bytes}")
            m.size = h.size
            m.offset = self.source.pos
            if m.offset + h.size > self.source.size:
                raise InvalidInput(f"tar member {h.shown}: content runs past the end of the archive")
        return m


# --------------------------------------------------------------------------
# Apply


def _read_path_list(path: str, what: str, limits: DiffLimits) -> list[tuple[bytes, ...]]:
    """A JSON list of paths (deleted.files or opaque.dirs), validated."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise _oserror(f"cannot open {what} {path}", e) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInput(f"{what} is not a regular file")
        if st.st_size > _MAX_LIST_BYTES:
            raise LimitExceeded(f"{what} is larger than {_MAX_LIST_BYTES} bytes")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, _CHUNK)
            if not chunk:
                break
            total += len(chunk)
            if total > _MAX_LIST_BYTES:
                raise LimitExceeded(f"{what} is larger than {_MAX_LIST_BYTES} bytes")
            chunks.append(chunk)
    finally:
        os.close(fd)
    import json

    try:
        value = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):
        raise InvalidInput(f"{what} is not valid JSON") from None
    if not isinstance(value, list):
        raise InvalidInput(f"{what} is not a JSON list")
    if len(value) > limits.max_entries:
        raise LimitExceeded(f"{what} has more than max_entries={limits.max_entries} paths")
    result: list[tuple[bytes, ...]] = []
    for item in value:
        if not isinstance(item, str):
            raise InvalidInput(f"{what}: {item!r:.80} is not a string")
        try:
            raw = os.fsencode(item)
        except UnicodeEncodeError:
            raise InvalidInput(f"{what}: {item!r:.80} cannot be encoded") from None
        # CRI-O and Podman write "/etc/motd"; the path is relative to the rootfs either way.
        parts = _split_path(raw.lstrip(b"/") or raw, what, limits)
        if not parts:
            raise InvalidInput(f"{what}: {item!r:.80} names the rootfs itself")
        result.append(parts)
    return result


class _NotDir(Exception):
    """A path component is a symlink or not a directory."""


class _Applier:
    """Applies deletions and tar members below one rootfs descriptor."""

    def __init__(self, root_fd: int, limits: DiffLimits) -> None:
        self.root_fd = root_fd
        self.root_dev = os.fstat(root_fd).st_dev
        self.limits = limits
        self.stats = _Counter()
        self.chain: list[tuple[bytes, int]] = []  # open directories of the last parent path
        self.seen: dict[bytes, str] = {}
        self.extracted: set[bytes] = set()
        self.dir_meta: dict[bytes, tuple[tuple[bytes, ...], _Member]] = {}
        self.entries = 0
        self.total = 0
        self.record_parents = False

    # -- directory descriptors

    def close(self) -> None:
        self._truncate(0)

    def _truncate(self, depth: int) -> None:
        while len(self.chain) > depth:
            os.close(self.chain.pop()[1])

    def _open_dir(self, parent_fd: int, name: bytes) -> int:
        """Open a child directory without following symlinks or leaving the filesystem."""
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except (NotADirectoryError, OSError) as e:
            if isinstance(e, NotADirectoryError) or e.errno == errno.ELOOP:
                raise _NotDir() from None
            raise
        if os.fstat(fd).st_dev != self.root_dev:
            os.close(fd)
            raise BridgeError(f"{_show(name)} is a mount point; refusing to cross it")
        return fd

    def _dir_fd(self, parts: tuple[bytes, ...], create: bool) -> int | None:
        """The fd of directory `parts` below the root; None if missing (create=False).

        Raises _NotDir when a component is a symlink or not a directory.
        """
        common = 0
        limit = min(len(self.chain), len(parts))
        while common < limit and self.chain[common][0] == parts[common]:
            common += 1
        self._truncate(common)
        fd = self.chain[-1][1] if self.chain else self.root_fd
        for depth in range(common, len(parts)):
            name = parts[depth]
            try:
                child = self._open_dir(fd, name)
            except FileNotFoundError:
                if not create:
                    return None
                os.mkdir(name, 0o755, dir_fd=fd)
                child = self._open_dir(fd, name)
            self.chain.append((name, child))
            if self.record_parents:
                self.seen.setdefault(b"/".join(parts[: depth + 1]), _IMPLICIT_DIR)
            fd = child
        return fd

    def _forget_below(self, parts: tuple[bytes, ...], keep_self: bool) -> None:
        """Drop cached descriptors at or under `parts` before it is changed."""
        n = len(parts)
        if len(self.chain) >= n and all(self.chain[i][0] == parts[i] for i in range(n)):
            self._truncate(n if keep_self else n - 1)

    # -- removal

    def _empty_dir(self, fd: int) -> None:
        """Remove everything inside the directory `fd`, never following symlinks."""
        stack: list[tuple[int, list[tuple[str, bool]], str | None]] = [(fd, self._list(fd), None)]
        try:
            while stack:
                cur, names, name_in_parent = stack[-1]
                if names:
                    name, is_dir = names.pop()
                    if is_dir:
                        try:
                            child = self._open_dir(cur, os.fsencode(name))
                        except _NotDir:
                            os.unlink(name, dir_fd=cur)
                            continue
                        except FileNotFoundError:
                            continue
                        try:
                            listing = self._list(child)
                        except BaseException:
                            os.close(child)
                            raise
                        stack.append((child, listing, name))
                    else:
                        try:
                            os.unlink(name, dir_fd=cur)
                        except FileNotFoundError:
                            pass
                    continue
                stack.pop()
                if name_in_parent is not None:
                    os.close(cur)
                    os.rmdir(name_in_parent, dir_fd=stack[-1][0])
        finally:
            for cur, _, name_in_parent in stack:
                if name_in_parent is not None:
                    os.close(cur)

    @staticmethod
    def _list(fd: int) -> list[tuple[str, bool]]:
        with os.scandir(fd) as it:
            return [(e.name, e.is_dir(follow_symlinks=False)) for e in it]

    def _remove(self, parent_fd: int, name: bytes, st: os.stat_result) -> None:
        """Remove an entry; a directory with everything inside it."""
        if stat.S_ISDIR(st.st_mode):
            try:
                fd = self._open_dir(parent_fd, name)
            except _NotDir:
                os.unlink(name, dir_fd=parent_fd)
                return
            try:
                self._empty_dir(fd)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=parent_fd)
        else:
            os.unlink(name, dir_fd=parent_fd)

    def _lstat(self, parent_fd: int, name: bytes) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    # -- deletions

    def apply_list(self, paths: list[tuple[bytes, ...]], opaque: bool) -> None:
        s = self.stats
        for parts in paths:
            key = b"/".join(parts)
            try:
                parent = self._dir_fd(parts[:-1], create=False)
            except _NotDir:
                s.skipped.append(f"{os.fsdecode(key)}: parent is a symlink or not a directory")
                continue
            if parent is None:
                continue
            name = parts[-1]
            st = self._lstat(parent, name)
            if st is None:
                continue
            if opaque:
                self._forget_below(parts, keep_self=True)
                if stat.S_ISDIR(st.st_mode):
                    try:
                        fd = self._open_dir(parent, name)
                    except _NotDir:
                        continue
                    try:
                        self._empty_dir(fd)
                    finally:
                        os.close(fd)
                else:
                    os.unlink(name, dir_fd=parent)
                s.opaque_dirs += 1
            else:
                self._forget_below(parts, keep_self=False)
                self._remove(parent, name, st)
                s.deleted += 1

    # -- extraction

    def extract(self, tar_path: str) -> None:
        try:
            fd = os.open(tar_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise _oserror(f"cannot open {tar_path}", e) from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidInput(f"{tar_path} is not a regular file")
            if st.st_size == 0:
                return
            reader = _TarReader(fd, st.st_size, self.limits)
            self.record_parents = True
            self._truncate(0)
            while True:
                member = reader.next()
                if member is None:
                    break
                self._member(member, fd)
            self._truncate(0)
            self._finish_dirs()
        finally:
            self._truncate(0)
            os.close(fd)

    def _member(self, m: _Member, tar_fd: int) -> None:
        limits = self.limits
        parts = _split_path(m.name, "tar member", limits)
        if not parts:
            if m.kind == _DIR:
                return  # the rootfs itself ("./")
            raise InvalidInput(f"tar member {_show(m.name)}: empty name")
        key = b"/".join(parts)
        shown = _show(key)
        self.entries += 1
        if self.entries > limits.max_entries:
            raise LimitExceeded(f"tar has more than max_entries={limits.max_entries} members at {shown}")
        previous = self.seen.get(key)
        if previous is not None and not (m.kind == _DIR and previous in (_DIR, _IMPLICIT_DIR)):
            raise InvalidInput(f"tar member {shown}: duplicate of an earlier {previous} member")
        target: tuple[bytes, ...] = ()
        if m.kind == _HARDLINK:
            target = _split_path(m.linkname, f"tar member {shown} link target", limits)
            if b"/".join(target) not in self.extracted or target == parts:
                raise InvalidInput(
                    f"tar member {shown}: hardlink target {_show(m.linkname)} is not a regular file "
                    "extracted from this archive"
                )
        elif m.kind == _SYMLINK:
            if not m.linkname or b"\0" in m.linkname or len(m.linkname) > limits.max_path_len:
                raise InvalidInput(f"tar member {shown}: bad symlink target")
        elif m.kind == _FILE:
            if m.size > limits.max_file_bytes:
                raise LimitExceeded(f"tar member {shown}: larger than max_file_bytes={limits.max_file_bytes}")
            if self.total + m.size > limits.max_total_bytes:
                raise LimitExceeded(f"tar member {shown}: max_total_bytes={limits.max_total_bytes} exceeded")
        for xname, value in m.xattrs:
            if len(value) > _MAX_XATTR_VALUE:
                raise LimitExceeded(f"tar member {shown}: xattr {xname} is too large")
        self.seen[key] = m.kind
        try:
            try:
                parent = self._dir_fd(parts[:-1], create=True)
            except _NotDir:
                raise InvalidInput(
                    f"tar member {shown}: a parent directory is a symlink or not a directory"
                ) from None
            assert parent is not None
            self._create(m, parts, key, parent, target, tar_fd)
        except OSError as e:
            raise _oserror(f"tar member {shown}", e) from e

    def _clear(self, parent: int, name: bytes, keep_dir: bool) -> bool:
        """Make room for a new entry; return True if an existing directory is kept."""
        st = self._lstat(parent, name)
        if st is None:
            return False
        if keep_dir and stat.S_ISDIR(st.st_mode):
            return True
        self._remove(parent, name, st)
        return False

    def _make(self, parent: int, name: bytes, make: Callable[[], _T]) -> _T:
        """Create an entry; if something is in the way, remove it and retry once."""
        try:
            return make()
        except FileExistsError:
            self._clear(parent, name, keep_dir=False)
            return make()

    def _create(
        self,
        m: _Member,
        parts: tuple[bytes, ...],
        key: bytes,
        parent: int,
        target: tuple[bytes, ...],
        tar_fd: int,
    ) -> None:
        s = self.stats
        name = parts[-1]
        mtime = (m.mtime_ns, m.mtime_ns)
        if m.kind == _DIR:
            try:
                os.mkdir(name, 0o700, dir_fd=parent)
            except FileExistsError:
                if not self._clear(parent, name, keep_dir=True):
                    os.mkdir(name, 0o700, dir_fd=parent)
            if key not in self.dir_meta:
                s.dirs += 1
            self.dir_meta[key] = (parts, m)
        elif m.kind == _FILE:
            fd = self._make(parent, name, lambda: os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=parent))
            try:
                self._copy(tar_fd, fd, m, key)
                self._set_meta(fd, m, regular=True)
            finally:
                os.close(fd)
            self.extracted.add(key)
            s.files += 1
        elif m.kind == _SYMLINK:
            self._make(parent, name, lambda: os.symlink(m.linkname, name, dir_fd=parent))
            os.chown(name, m.uid, m.gid, dir_fd=parent, follow_symlinks=False)
            os.utime(name, ns=mtime, dir_fd=parent, follow_symlinks=False)
            s.symlinks += 1
        elif m.kind == _HARDLINK:
            src_parent = self._open_path(target[:-1])
            try:
                self._make(
                    parent,
                    name,
                    lambda: os.link(
                        target[-1], name, src_dir_fd=src_parent, dst_dir_fd=parent, follow_symlinks=False
                    ),
                )
            finally:
                if src_parent != self.root_fd:
                    os.close(src_parent)
            self.extracted.add(key)
            s.hardlinks += 1
        elif m.kind == _FIFO:
            self._make(parent, name, lambda: os.mkfifo(name, 0o600, dir_fd=parent))
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
            try:
                if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                    raise BridgeError(f"{_show(key)} changed while it was created")
                self._set_meta(fd, m)
            finally:
                os.close(fd)
            s.fifos += 1

    def _open_path(self, parts: tuple[bytes, ...]) -> int:
        """A fresh fd of an existing directory (no creation, no symlinks)."""
        fd = self.root_fd
        try:
            for name in parts:
                child = self._open_dir(fd, name)
                if fd != self.root_fd:
                    os.close(fd)
                fd = child
        except _NotDir:
            if fd != self.root_fd:
                os.close(fd)
            raise InvalidInput(f"path {_show(b'/'.join(parts))} goes through a symlink") from None
        except BaseException:
            if fd != self.root_fd:
                os.close(fd)
            raise
        return fd

    def _copy(self, tar_fd: int, out_fd: int, m: _Member, key: bytes) -> None:
        """Stream the member's content in 1 MiB blocks, enforcing the bounds."""
        limits = self.limits
        copied = 0
        for n in _copy_blocks(out_fd, tar_fd, m.offset, m.size):
            if n == 0:
                raise InvalidInput(f"tar member {_show(key)}: archive is truncated")
            copied += n
            self.total += n
            if copied > limits.max_file_bytes:
                raise LimitExceeded(f"tar member {_show(key)}: larger than max_file_bytes={limits.max_file_bytes}")
            if self.total > limits.max_total_bytes:
                raise LimitExceeded(
                    f"tar member {_show(key)}: max_total_bytes={limits.max_total_bytes} exceeded"
                )
        self.stats.bytes += copied

    @staticmethod
    def _set_meta(fd: int, m: _Member, regular: bool = False) -> None:
        """Owner, then mode (chown clears setuid), xattrs and mtime on an open fd."""
        os.chown(fd, m.uid, m.gid)
        os.chmod(fd, m.mode)
        for name, value in m.xattrs:
            if _keep_xattr(name, regular):
                os.setxattr(fd, name, value)
        os.utime(fd, ns=(m.mtime_ns, m.mtime_ns))

    def _finish_dirs(self) -> None:
        """Set directory metadata after their content, deepest last-seen first."""
        for parts, m in reversed(self.dir_meta.values()):
            try:
                parent = self._dir_fd(parts[:-1], create=False)
                if parent is None:
                    raise InvalidInput(f"directory {_show(b'/'.join(parts))} vanished")
                fd = self._open_dir(parent, parts[-1])
            except _NotDir:
                raise InvalidInput(f"directory {_show(b'/'.join(parts))} was replaced") from None
            except OSError as e:
                raise _oserror(f"directory {_show(b'/'.join(parts))}", e) from e
            try:
                self._set_meta(fd, m)
            except OSError as e:
                raise _oserror(f"directory {_show(b'/'.join(parts))}", e) from e
            finally:
                os.close(fd)


def apply_diff(
    rootfs: str,
    tar_path: str | None,
    deleted_path: str | None,
    *,
    limits: DiffLimits = DiffLimits(),
) -> DiffStats:
    """Apply a captured diff onto the mounted rootfs of a new container.

    Opaque directories (from `opaque_dirs_path(deleted_path)`, if that file
    exists) are emptied, then the paths in deleted.files removed, then the tar
    extracted. Every input is hostile; on error the rootfs is left partly
    changed (the caller discards the container) but nothing outside it is.
    `DiffStats.skipped` lists deletions whose parent is not a directory.
    """
    try:
        root_fd = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise _oserror(f"cannot open rootfs {rootfs}", e) from e
    applier = _Applier(root_fd, limits)
    try:
        if deleted_path is not None:
            deleted = _read_path_list(deleted_path, "deleted.files", limits)
            opaque_path = opaque_dirs_path(deleted_path)
            opaque: list[tuple[bytes, ...]] = []
            if os.path.lexists(opaque_path):
                opaque = _read_path_list(opaque_path, OPAQUE_DIRS_NAME, limits)
            try:
                applier.apply_list(sorted(opaque), opaque=True)
                applier.apply_list(deleted, opaque=False)
            except OSError as e:
                raise _oserror("applying deletions", e) from e
            finally:
                applier.close()
        if tar_path is not None:
            applier.extract(tar_path)
        return applier.stats.freeze()
    finally:
        applier.close()
        os.close(root_fd)
