"""A container checkpoint archive, read as hostile input, stored as a pod checkpoint.

The archive (plain, gzip or zstd, told apart by their magic bytes) is read
with `tarfmt.TarReader`. Every member name is checked (UTF-8, no NUL, not
absolute, no "..", bounded) and every kind: symlinks, device nodes and
FIFOs are refused, a hardlink is accepted only to a regular file earlier in
the same archive (it becomes a copy), duplicates and files used as
directories are refused, and the member count, each size and the total are
bounded (`ImportLimits`). Member content is written to flat, numbered files
(`m<n>`) in a private staging directory under the store's work area,
created with O_EXCL|O_NOFOLLOW relative to that directory's descriptor:
archive names never become filesystem paths. Every write into it is counted
first (`_Meter`): against the bounds, and against the filesystem's free
space, which must keep `min_free_bytes`. Then the staged files go into a
store writer under the store paths that `checkpointing.py` uses, and the
staging directory is removed.

Required members first (`_Pass`): until config.dump and spec.dump have come,
at most `max_staged_before_required` bytes are staged. An archive that puts
more in front of them (CRI-O and containerd put CRIU's images there) is
looked ahead in, headers only, nothing staged; it fails at its end if they
never come, and is read once more from the start, staging everything, when
they do. So a decompression bomb without them never reaches the disk.

Two kinds of archive:

- node-agent's own (`node-agent/manifest.json` present): the mapping of
  `exporting.py` is undone file for file, so every file comes back
  byte-identical, and the metadata is the export's, checked;
- another engine's (Podman, CRI-O, containerd): the CRI configs are built by
  `foreign.synthesize`, the CPU description is this node's, and the root
  directory's mode is dropped from CRIU's files.img (`criuimg`). containerd's
  own archives (CRI CheckpointContainer) carry the writable layer as an OCI
  image layer (gzip, with whiteout files): it becomes a plain tar plus
  deleted.files and opaque.dirs (`_layer_to_diff`), the form the restore
  applies; their status.dump is read, bounded, for the container's name.

Nested archives (`rootfs-diff.tar`, `devshm-checkpoint.tar`) stay archives:
they are scanned here so a bad one is refused early, and are applied only at
restore, by `criu_bridge.rootfs.apply_diff`, with its own checks.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import uuid
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import zstandard

from criu_bridge import tarstream
from criu_bridge.errors import InvalidInput, LimitExceeded
from node_agent import errors, hostaccess
from node_agent.checkpointing import METADATA_KIND, manifest_annotations, parse_options
from node_agent.interop import common as c
from node_agent.interop import criuimg, foreign, tarfmt
from node_agent.store import CheckpointRecord, Store

# Top-level members of other engines' archives that node-agent does not keep (nor stage):
# the source's container logs (`ctr.log` Podman, `container.log` containerd), containerd's
# internal `status` record, and the like. Their sizes still count against the bounds.
IGNORED_TOP = frozenset({
    "ctr.log", "container.log", "artifacts", c.NETWORK_STATUS, c.STATUS_DUMP, "bind.mounts",
    "pod.options", "pod.dump", "restore.log", "annotations.json", "status",
})
# Members of IGNORED_TOP that are staged all the same, to be read (bounded by max_json_bytes)
# though never stored: containerd's status.dump.
STAGED_DOCS = frozenset({c.STATUS_DUMP})
# Top-level members of a foreign archive that are kept as they are.
FOREIGN_KEEP = frozenset({c.SPEC_DUMP, c.ROOTFS_DIFF, c.DELETED_FILES, c.OPAQUE_DIRS, c.DUMP_LOG})
INTEROP_DIR = "interop"
_COPY = 1 << 20
_SMALL = 1 << 20
_ZSTD_MAX_WINDOW = 1 << 27
_XZ_MAGIC = b"\xfd7zXZ\x00"


@dataclass
class _Staged:
    kind: str  # tarfmt.FILE or tarfmt.DIR
    mode: int
    size: int
    name: str | None  # staging file; None for directories and content not kept; "" while looking ahead


class _Staging:
    """A private directory of flat, numbered files."""

    def __init__(self, parent: str) -> None:
        os.makedirs(parent, mode=0o700, exist_ok=True)
        self.root = os.path.join(parent, f"import-{secrets.token_hex(8)}")
        os.mkdir(self.root, 0o700)
        self.fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._n = 0

    def create(self) -> tuple[str, int]:
        self._n += 1
        name = f"m{self._n}"
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        return name, fd

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def read(self, name: str, limit: int, what: str) -> bytes:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise errors.ResourceExhausted(f"{what}: {size} bytes is more than the limit of {limit}")
            data = os.read(fd, size + 1)
            while len(data) < size:
                more = os.read(fd, size - len(data))
                if not more:
                    break
                data += more
            return data
        finally:
            os.close(fd)

    def reset(self) -> None:
        """Remove every staged file (the archive is read again from its start)."""
        for name in os.listdir(self.fd):
            os.unlink(name, dir_fd=self.fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        shutil.rmtree(self.root, ignore_errors=True)


def _free_bytes(fd: int) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `fd`."""
    st = os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize


class _Meter:
    """Every byte bound for staging, counted before it is written: against the bounds and the free space.

    The staging filesystem's free space is read (fstatvfs) at each member's
    header, and again before more than `free_check_bytes` have been written
    since the last look, so `min_free_bytes` stay free even while something
    else fills the disk.
    """

    def __init__(self, fd: int, where: str, limits: c.ImportLimits, bounds: c.StagingBounds) -> None:
        self._fd = fd
        self._where = where
        self._min_free = limits.min_free_bytes
        self._every = limits.free_check_bytes
        self._bounds = bounds
        self.staged = 0  # bytes in staging now
        self._credit = 0  # bytes that may be written before the free space is read again

    def reset(self) -> None:
        self.staged = 0
        self._credit = 0

    def _room(self) -> tuple[int, int]:
        free = _free_bytes(self._fd)
        return free, free - self._min_free

    def admit(self, shown: str, size: int) -> None:
        """Before a member's content: all of it must fit."""
        if not size:
            return
        if self.staged + size > self._bounds.total_bytes:
            raise errors.ResourceExhausted(
                f"tar member {shown}: staging its {size} bytes would pass the limit of "
                f"{self._bounds.total_bytes} ({self._bounds.total_name()})"
            )
        free, room = self._room()
        if room < size:
            raise errors.ResourceExhausted(
                f"tar member {shown}: staging its {size} bytes would leave less than "
                f"min_free_bytes={self._min_free} free under {self._where} ({free} bytes free)"
            )
        self._credit = min(room, self._every)

    def charge(self, shown: str, n: int, done: int, size: int) -> None:
        """Before `n` more bytes of a member of `size` bytes, `done` of them already staged."""
        if self.staged + n > self._bounds.total_bytes:
            raise errors.ResourceExhausted(
                f"tar member {shown}: staging more than {done} of its {size} bytes would pass the limit of "
                f"{self._bounds.total_bytes} ({self._bounds.total_name()})"
            )
        if n > self._credit:
            free, room = self._room()
            if room < n:
                raise errors.ResourceExhausted(
                    f"tar member {shown}: staging more than {done} of its {size} bytes would leave less than "
                    f"min_free_bytes={self._min_free} free under {self._where} ({free} bytes free)"
                )
            self._credit = min(room, max(self._every, n))
        self._credit -= n
        self.staged += n


class _Stream:
    """A decompressing reader whose format errors are InvalidArgument."""

    def __init__(self, inner: Any, what: str) -> None:
        self._inner = inner
        self._what = what

    def read(self, n: int = -1) -> bytes:
        try:
            data: bytes = self._inner.read(n)
            return data
        except (OSError, EOFError, zlib.error, zstandard.ZstdError) as exc:
            if isinstance(exc, OSError) and exc.errno is not None and not isinstance(exc, gzip.BadGzipFile):
                raise
            raise errors.InvalidArgument(f"the archive's {self._what} stream is corrupt: {exc}") from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._inner.close()


class _Archive:
    """The archive file, opened once; `reader()` reads it from its start, as often as the import needs."""

    def __init__(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise errors.NotFound(f"archive {path} not found") from exc
            raise errors.InvalidArgument(f"cannot open archive {path}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise errors.InvalidArgument(f"archive {path} is not a regular file")
            os.set_blocking(fd, True)
            raw = io.BufferedReader(io.FileIO(fd, "rb"), 1 << 20)
        except BaseException:
            os.close(fd)
            raise
        self._raw = raw
        self._stream: _Stream | None = None
        self.size = st.st_size  # never read past this, even if the file grows
        head = raw.peek(8)[:8]
        if head.startswith(b"\x1f\x8b"):
            self.compression = "gzip"
        elif head.startswith(b"\x28\xb5\x2f\xfd"):
            self.compression = "zstd"
        elif head.startswith(b"BZh") or head.startswith(_XZ_MAGIC):
            raw.close()
            raise errors.InvalidArgument(
                f"archive {path}: bzip2 and xz are not supported (use a plain, gzip or zstd tar)"
            )
        else:
            self.compression = "none"

    def reader(self, bounds: c.StagingBounds) -> tarfmt.TarReader:
        """A tar reader from the archive's first byte."""
        self._end_stream()
        source: tarstream.FileSource | _Stream
        if self.compression == "none":
            # Read by offset: what is skipped is not read at all.
            source = tarstream.FileSource(self._raw.fileno(), self.size)
            return tarfmt.TarReader(source, max_member_bytes=bounds.member_bytes, member_limit=bounds.member_name())
        self._raw.seek(0)
        if self.compression == "gzip":
            inner: Any = gzip.GzipFile(fileobj=self._raw, mode="rb")
        else:
            dctx = zstandard.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW)
            inner = dctx.stream_reader(self._raw, read_across_frames=True, closefd=False)
        self._stream = source = _Stream(inner, self.compression)
        return tarfmt.TarReader(source, max_member_bytes=bounds.member_bytes, member_limit=bounds.member_name())

    def _end_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def close(self) -> None:
        self._end_stream()
        self._raw.close()


def _normalize(raw: bytes, limits: c.ImportLimits, what: str = "tar member") -> str | None:
    """A member name as a relative store-style path; None for the archive root itself."""
    shown = repr(raw[:200].decode("utf-8", "backslashreplace"))
    if b"\0" in raw:
        raise errors.InvalidArgument(f"{what} {shown}: NUL byte in the name")
    if len(raw) > limits.max_path_bytes:
        raise errors.ResourceExhausted(f"{what} {shown}: name longer than {limits.max_path_bytes} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise errors.InvalidArgument(f"{what} {shown}: the name is not UTF-8") from None
    if text.startswith("/"):
        raise errors.InvalidArgument(f"{what} {shown}: absolute names are not allowed")
    parts = [p for p in text.split("/") if p not in ("", ".")]
    for part in parts:
        if part == "..":
            raise errors.InvalidArgument(f"{what} {shown}: '..' in the name")
        if len(part.encode("utf-8")) > 255:
            raise errors.InvalidArgument(f"{what} {shown}: a name component is longer than 255 bytes")
        if any(ord(ch) < 32 for ch in part):
            raise errors.InvalidArgument(f"{what} {shown}: control characters in the name")
    return "/".join(parts) or None


def _keep_member(path: str) -> bool:
    return path in STAGED_DOCS or path.split("/", 1)[0] not in IGNORED_TOP


# The small documents every archive must have, whatever its kind; node-agent's
# own (its manifest came) must have its pod config as well.
_REQUIRED = (c.CONFIG_DUMP, c.SPEC_DUMP)
_REQUIRED_OWN = (c.OWN_POD_CONFIG,)


def _fingerprint(m: tarfmt.Member) -> bytes:
    """What the second read of an archive must find again, member for member."""
    h = hashlib.blake2b(digest_size=16)
    for part in (m.name, m.kind.encode(), b"%d" % m.size, m.linkname):
        h.update(b"%d:" % len(part))
        h.update(part)
    return h.digest()


class _Pass:
    """One read of the archive: every header checked, content staged or, while looking ahead, skipped.

    `bounded`: until the required documents have come, at most
    `max_staged_before_required` bytes are staged; a member that would pass
    that stops the staging (what was staged is removed) and the pass looks
    ahead, reading headers only, until the documents have come (`again`:
    read the archive once more, staging all) or the archive ends without
    them (InvalidArgument). `expect`: the fingerprints the first pass took,
    which this one must find again.
    """

    def __init__(self, staging: _Staging, meter: _Meter, limits: c.ImportLimits, bounds: c.StagingBounds, *,
                 bounded: bool, expect: list[bytes] | None = None) -> None:
        self.staging = staging
        self.meter = meter
        self.limits = limits
        self.bounds = bounds
        self.expect = expect
        self.entries: dict[str, _Staged] = {}
        self.prints: list[bytes] = []  # fingerprints of the members read so far
        self.count = 0  # members read
        self.writing = True
        self.lifted = not bounded  # the required documents came while staging: no bound in front of them
        self.again = False

    def missing(self) -> list[str]:
        need = _REQUIRED + (_REQUIRED_OWN if c.OWN_MANIFEST in self.entries else ())
        return [p for p in need if not (p in self.entries and self.entries[p].kind == tarfmt.FILE)]

    def run(self, reader: tarfmt.TarReader) -> None:
        limits = self.limits
        entries = self.entries
        parents: set[str] = set()  # every directory some member lies in
        total = 0
        before = 0  # bytes staged while required documents were still to come
        while True:
            m = reader.next()
            if m is None:
                break
            self.count += 1
            count = self.count
            if count > limits.max_members:
                raise errors.ResourceExhausted(f"the archive has more than {limits.max_members} members (max_members)")
            fp = _fingerprint(m)
            if self.expect is not None:
                if count <= len(self.expect) and fp != self.expect[count - 1]:
                    raise errors.InvalidArgument(
                        "the archive changed while it was read (its members differ between two reads)"
                    )
            else:
                self.prints.append(fp)
            path = _normalize(m.name, limits)
            if path is None:
                if m.kind == tarfmt.DIR:
                    continue
                raise errors.InvalidArgument("tar member with an empty name")
            shown = repr(path[:200])
            if path in entries:
                raise errors.InvalidArgument(f"tar member {shown} appears twice")
            parts = path.split("/")
            for i in range(1, len(parts)):
                above = entries.get("/".join(parts[:i]))
                if above is not None and above.kind != tarfmt.DIR:
                    raise errors.InvalidArgument(f"tar member {shown} lies under a member that is not a directory")
            if m.kind != tarfmt.DIR and path in parents:
                raise errors.InvalidArgument(f"tar member {shown} is a {m.kind}, but earlier members lie inside it")
            if m.kind in (tarfmt.CHARDEV, tarfmt.BLOCKDEV, tarfmt.FIFO):
                raise errors.InvalidArgument(
                    f"tar member {shown} is a {m.kind}; device nodes and FIFOs are not allowed"
                )
            if m.kind == tarfmt.SYMLINK:
                target = m.linkname[:200].decode("utf-8", "backslashreplace")
                raise errors.InvalidArgument(
                    f"tar member {shown} is a symlink (to {target!r}); symlinks are not allowed"
                )
            for i in range(1, len(parts)):
                parents.add("/".join(parts[:i]))
            if m.kind == tarfmt.HARDLINK:
                target_path = _normalize(m.linkname, limits, f"hardlink target of {shown}")
                src = entries.get(target_path or "")
                if src is None or src.kind != tarfmt.FILE:
                    raise errors.InvalidArgument(
                        f"tar member {shown} is a hardlink to something other than a regular file earlier in "
                        "the archive"
                    )
                if src.name is None and _keep_member(path):
                    raise errors.InvalidArgument(f"tar member {shown} is a hardlink to a member that is not kept")
                entries[path] = _Staged(tarfmt.FILE, m.mode, src.size, src.name)
            elif m.kind == tarfmt.DIR:
                entries[path] = _Staged(tarfmt.DIR, m.mode, 0, None)
            else:
                total += m.size
                if total > self.bounds.total_bytes:
                    raise errors.ResourceExhausted(
                        f"tar member {shown}: the archive holds more than {self.bounds.total_bytes} bytes of files "
                        f"({self.bounds.total_name()})"
                    )
                if not _keep_member(path):
                    entries[path] = _Staged(tarfmt.FILE, m.mode, m.size, None)
                    continue
                if path in _REQUIRED + _REQUIRED_OWN + (c.OWN_MANIFEST,) + tuple(STAGED_DOCS) \
                        and m.size > limits.max_json_bytes:
                    raise errors.ResourceExhausted(
                        f"{path}: {m.size} bytes is more than the limit of {limits.max_json_bytes} (max_json_bytes)"
                    )
                if self.writing and not self.lifted and before + m.size > limits.max_staged_before_required:
                    # Bulk in front of the required documents: stage no more until they are known to come.
                    self.writing = False
                    self.staging.reset()
                    self.meter.reset()
                if self.writing:
                    before += m.size
                    entries[path] = _Staged(tarfmt.FILE, m.mode, m.size, self._stage(reader, shown, m.size))
                else:
                    # Looking ahead: the content is skipped by the next header read.
                    entries[path] = _Staged(tarfmt.FILE, m.mode, m.size, "")
            if not self.lifted and not self.missing():
                if not self.writing:
                    self.again = True
                    return
                self.lifted = True
        if self.expect is not None and self.count < len(self.expect):
            raise errors.InvalidArgument("the archive changed while it was read (it ended early on the second read)")
        if self.missing():
            missing = " and ".join(self.missing())
            raise errors.InvalidArgument(f"the archive has no {missing}")

    def _stage(self, reader: tarfmt.TarReader, shown: str, size: int) -> str:
        self.meter.admit(shown, size)
        name, fd = self.staging.create()
        try:
            done = 0
            while done < size:
                data = reader.read(min(_COPY, size - done))
                if not data:
                    raise errors.InvalidArgument(f"tar member {shown} is truncated")
                self.meter.charge(shown, len(data), done, size)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                done += len(data)
        finally:
            os.close(fd)
        return name


def _read_members(archive: _Archive, staging: _Staging, meter: _Meter, limits: c.ImportLimits,
                  bounds: c.StagingBounds) -> dict[str, _Staged]:
    """Every member checked, the kept ones staged; the archive read a second time only if its bulk comes first."""
    first = _Pass(staging, meter, limits, bounds, bounded=True)
    first.run(archive.reader(bounds))
    if not first.again:
        return first.entries
    second = _Pass(staging, meter, limits, bounds, bounded=False, expect=first.prints)
    second.run(archive.reader(bounds))
    return second.entries


def _check_nested_tar(staging: _Staging, name: str, what: str, limits: c.ImportLimits,
                      bounds: c.StagingBounds) -> None:
    """Scan an archive inside the archive: well-formed, bounded, no devices, no escaping names."""
    with open(staging.path(name), "rb") as fh:
        if not fh.read(1):
            return
        fh.seek(0)
        reader = tarfmt.TarReader(fh, max_member_bytes=bounds.member_bytes, member_limit=bounds.member_name())
        count = 0
        while True:
            m = reader.next()
            if m is None:
                return
            count += 1
            if count > limits.max_members:
                raise errors.ResourceExhausted(f"{what} has more than {limits.max_members} members")
            _normalize(m.name, limits, f"{what} member")
            if m.kind in (tarfmt.CHARDEV, tarfmt.BLOCKDEV):
                raise errors.InvalidArgument(f"{what} holds a {m.kind}, which a restore refuses")
            if m.kind == tarfmt.HARDLINK:
                _normalize(m.linkname, limits, f"{what} hardlink target")


# containerd's rootfs-diff.tar is an OCI image layer: deletions are empty files named
# ".wh.<name>", and ".wh..wh..opq" marks its directory opaque.
_WHITEOUT = ".wh."
_OPAQUE_MARK = ".wh..wh..opq"
_TYPEFLAG = {tarfmt.FILE: b"0", tarfmt.HARDLINK: b"1", tarfmt.SYMLINK: b"2", tarfmt.DIR: b"5", tarfmt.FIFO: b"6"}


@dataclass(frozen=True)
class _Layer:
    staged: str  # the plain tar, without whiteouts
    deleted: list[str]  # paths the layer whites out, relative to the rootfs
    opaque: list[str]  # directories it marks opaque


def _layer_headers(path: str, h: tarstream.Header, link: bytes) -> bytes:
    """The PAX and ustar headers of one kept layer member: its name, link, mode, owner, mtime and xattrs."""
    name = path.encode("utf-8") + (b"/" if h.kind == tarfmt.DIR else b"")
    uid, gid = h.owner()
    mtime_ns = max(0, h.mtime_ns())
    mtime, fraction = divmod(mtime_ns, 1_000_000_000)
    records = b""
    if len(name) > 100 or not name.isascii():
        records += tarstream.pax_record(b"path", name)
    if len(link) > 100 or not link.isascii():
        records += tarstream.pax_record(b"linkpath", link)
    if fraction:
        records += tarstream.pax_record(b"mtime", b"%d.%09d" % (mtime, fraction))
    size = h.size if h.kind == tarfmt.FILE else 0
    hsize = size
    if size >= 8**11:
        records += tarstream.pax_record(b"size", b"%d" % size)
        hsize = 0
    if uid >= 8**7 or gid >= 8**7:
        records += tarstream.pax_record(b"uid", b"%d" % uid) + tarstream.pax_record(b"gid", b"%d" % gid)
        uid = gid = 0
    for key, value in h.xattrs:
        records += tarstream.pax_record(b"SCHILY.xattr." + key, value)
    short = name[:100] if name.isascii() else b"././@LongName"
    short_link = link[:100] if link.isascii() else b""
    member = tarstream.ustar_header(short, h.mode(), hsize, mtime, _TYPEFLAG[h.kind], uid=uid, gid=gid,
                                    linkname=short_link)
    if not records:
        return member
    pax = tarstream.ustar_header(b"././@PaxHeader", 0o644, len(records), mtime, b"x")
    return pax + records + bytes(-len(records) % tarfmt.BLOCK) + member


class _LayerOut:
    """The plain tar a layer becomes: every write counted first, against one file's bound and the meter."""

    def __init__(self, fd: int, meter: _Meter, bounds: c.StagingBounds) -> None:
        self._fd = fd
        self._meter = meter
        self._bounds = bounds
        self.size = 0

    def write(self, data: bytes) -> None:
        n = len(data)
        if self.size + n > self._bounds.member_bytes:
            raise errors.ResourceExhausted(
                f"rootfs-diff.tar: the uncompressed layer is larger than {self._bounds.member_bytes} bytes "
                f"({self._bounds.member_name()})"
            )
        self._meter.charge("'rootfs-diff.tar' (uncompressed)", n, self.size, self.size + n)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        self.size += n


def _layer_to_diff(staging: _Staging, meter: _Meter, name: str, limits: c.ImportLimits,
                   bounds: c.StagingBounds) -> _Layer:
    """containerd's rootfs-diff.tar (an OCI layer; gzip, zstd or plain) as the restore applies a diff.

    Every header is checked as the restore's reader checks it (no devices,
    no escaping names, hardlinks only to files earlier in the layer); the
    whiteouts become the deleted and opaque lists, everything else is
    written again, without compression, into a new staged file, each byte
    counted before it is written, so a decompression bomb stops at the bounds.
    """
    what = "rootfs-diff.tar"
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=staging.fd)
    raw = io.BufferedReader(io.FileIO(fd, "rb"), _COPY)
    inner: Any = raw
    try:
        out_name, out_fd = staging.create()
    except BaseException:
        raw.close()
        raise
    out = _LayerOut(out_fd, meter, bounds)
    deleted: list[str] = []
    opaque: list[str] = []
    files: set[str] = set()  # regular files written so far: the only hardlink targets
    seen: dict[str, str] = {}
    try:
        head = raw.peek(4)[:4]
        if not head:
            return _Layer(out_name, [], [])
        if head.startswith(b"\x1f\x8b"):
            inner = _Stream(gzip.GzipFile(fileobj=raw, mode="rb"), f"{what} gzip")
        elif head.startswith(b"\x28\xb5\x2f\xfd"):
            dctx = zstandard.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW)
            inner = _Stream(dctx.stream_reader(raw, read_across_frames=True, closefd=False), f"{what} zstd")
        stream = tarstream.TarStream(tarstream.StreamSource(inner), pax_nul_ends=True, pax_text_keys=True)
        count = 0
        while True:
            h = stream.next()
            if h is None:
                break
            count += 1
            if count > limits.max_members:
                raise errors.ResourceExhausted(f"{what} has more than {limits.max_members} members (max_members)")
            path = _normalize(h.name, limits, f"{what} member")
            if path is None:
                continue  # the rootfs itself
            shown = repr(path[:200])
            parts = path.split("/")
            if any(part.startswith(_WHITEOUT) for part in parts[:-1]):
                raise errors.InvalidArgument(f"{what} member {shown} lies under a whiteout")
            base, parent = parts[-1], "/".join(parts[:-1])
            if base.startswith(_WHITEOUT):
                if h.kind != tarfmt.FILE:
                    raise errors.InvalidArgument(
                        f"{what} member {shown}: a whiteout that is not a regular file ({h.kind})"
                    )
                if base == _OPAQUE_MARK:
                    if not parent:
                        raise errors.InvalidArgument(f"{what} member {shown} marks the rootfs itself opaque")
                    opaque.append(parent)
                else:
                    gone = base[len(_WHITEOUT) :]
                    if gone in ("", ".", "..") or gone.startswith(_WHITEOUT):
                        raise errors.InvalidArgument(f"{what} member {shown}: a whiteout that names no file")
                    deleted.append(f"{parent}/{gone}" if parent else gone)
                continue
            previous = seen.get(path)
            if previous is not None and not (previous == tarfmt.DIR and h.kind == tarfmt.DIR):
                raise errors.InvalidArgument(f"{what} member {shown} appears twice")
            seen[path] = h.kind
            link = b""
            if h.kind == tarfmt.HARDLINK:
                target = _normalize(h.linkname, limits, f"{what} hardlink target of {shown}")
                if target is None or target not in files:
                    raise errors.InvalidArgument(
                        f"{what} member {shown} is a hardlink to something other than a regular file earlier in it"
                    )
                link = target.encode("utf-8")
            elif h.kind == tarfmt.SYMLINK:
                link = h.linkname
                if not link or b"\0" in link or len(link) > limits.max_path_bytes:
                    raise errors.InvalidArgument(f"{what} member {shown}: a symlink with a bad target")
            elif h.kind == tarfmt.FILE:
                if h.size > bounds.member_bytes:
                    raise errors.ResourceExhausted(
                        f"{what} member {shown}: {h.size} bytes is more than the limit of {bounds.member_bytes} "
                        f"({bounds.member_name()})"
                    )
                files.add(path)
            out.write(_layer_headers(path, h, link))
            left = h.size if h.kind == tarfmt.FILE else 0
            while left:
                data = stream.read(min(_COPY, left))
                if not data:
                    raise errors.InvalidArgument(f"{what} member {shown} is truncated")
                out.write(data)
                left -= len(data)
            if h.kind == tarfmt.FILE and h.size % tarfmt.BLOCK:
                out.write(bytes(-h.size % tarfmt.BLOCK))
        out.write(bytes(2 * tarfmt.BLOCK))
    except LimitExceeded as exc:
        raise errors.ResourceExhausted(f"{what}: {exc}") from None
    except InvalidInput as exc:
        raise errors.InvalidArgument(f"{what}: {exc}") from None
    finally:
        os.close(out_fd)
        if inner is not raw:
            inner.close()
        raw.close()
    return _Layer(out_name, _unique(deleted), _unique(opaque))


def _unique(paths: list[str]) -> list[str]:
    return list(dict.fromkeys(paths))


def _path_list(staging: _Staging, entry: _Out | None, what: str, limits: c.ImportLimits) -> list[str]:
    """A foreign archive's deleted.files or opaque.dirs: a JSON list of paths (empty when absent)."""
    if entry is None:
        return []
    if entry.is_dir or not entry.staged:
        raise errors.InvalidArgument(f"{what} is not a file")
    value = c.parse_json(staging.read(entry.staged, limits.max_json_bytes, what), what, limits.max_json_bytes)
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise errors.InvalidArgument(f"{what} is not a JSON list of paths")
    return value


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, indent=1).encode("utf-8")


def _read_json(staging: _Staging, entries: Mapping[str, _Staged], path: str, limits: c.ImportLimits) -> Any:
    entry = entries.get(path)
    if entry is None or entry.kind != tarfmt.FILE or entry.name is None:
        raise errors.InvalidArgument(f"the archive has no {path}")
    return c.parse_json(staging.read(entry.name, limits.max_json_bytes, path), path, limits.max_json_bytes)


def _check_pod_paths(pod_cfg: Mapping[str, Any], log_root: str | None) -> None:
    """The pod's log directory and cgroup parent: absolute, no '..'; the log directory under `log_root`."""
    linux = pod_cfg.get("linux")
    parent = linux.get("cgroup_parent") if isinstance(linux, Mapping) else None
    if parent not in (None, ""):
        text = c.bounded_str(parent, "pod cgroup_parent")
        if ".." in text.split("/"):
            raise errors.InvalidArgument(f"pod cgroup_parent {text!r} has a '..' component")
    value = pod_cfg.get("log_directory")
    if value in (None, ""):
        return
    path = c.bounded_str(value, "pod log_directory")
    parts = path.split("/")
    if not path.startswith("/") or ".." in parts:
        raise errors.InvalidArgument(f"pod log_directory {path!r} is not an absolute path without '..'")
    if log_root is not None:
        root = os.path.normpath(log_root)
        if os.path.dirname(os.path.normpath(path)) != root:
            raise errors.FailedPrecondition(f"pod log_directory {path!r} is not under {root}")


@dataclass(frozen=True)
class _Out:
    path: str
    mode: int
    staged: str | None = None
    data: bytes | None = None
    is_dir: bool = False


def _own_plan(
    staging: _Staging, entries: Mapping[str, _Staged], limits: c.ImportLimits, bounds: c.StagingBounds, *,
    namespace: str | None, name: str | None, log_root: str | None, allow_host_access: bool, kubelet_root: str,
    store_root: str,
) -> tuple[list[_Out], dict[str, Any]]:
    """Undo exporting.archive_path; metadata from node-agent/manifest.json."""
    doc = _read_json(staging, entries, c.OWN_MANIFEST, limits)
    if not isinstance(doc, Mapping) or doc.get("kind") != c.EXPORT_KIND or doc.get("version") != 1:
        raise errors.InvalidArgument(f"{c.OWN_MANIFEST} is not a node-agent export manifest of version 1")
    container = c.check_container_name(doc.get("container"), f"{c.OWN_MANIFEST} container")
    meta = doc.get("metadata")
    if not isinstance(meta, Mapping) or meta.get("kind") != METADATA_KIND:
        raise errors.InvalidArgument(f"{c.OWN_MANIFEST} carries no pod checkpoint metadata")
    pod = meta.get("pod")
    if not isinstance(pod, Mapping):
        raise errors.InvalidArgument(f"{c.OWN_MANIFEST}: metadata has no pod")
    ns = c.check_name(namespace if namespace else pod.get("namespace"), "pod namespace")
    pod_name = c.check_name(name if name else pod.get("name"), "pod name")
    listed = meta.get("containers")
    if not isinstance(listed, list) or len(listed) != 1 or not isinstance(listed[0], Mapping):
        raise errors.InvalidArgument(f"{c.OWN_MANIFEST}: metadata must list exactly the exported container")
    entry = dict(listed[0])
    if entry.get("name") != container:
        raise errors.InvalidArgument(f"{c.OWN_MANIFEST}: metadata lists {entry.get('name')!r}, not {container!r}")
    for key in ("image", "image_ref", "id"):
        c.bounded_str(entry.get(key, ""), f"container {key}", allow_empty=True)
    options = meta.get("options") or {}
    if not isinstance(options, Mapping):
        raise errors.InvalidArgument(f"{c.OWN_MANIFEST}: malformed options")
    flags = parse_options({str(k): str(v) for k, v in options.items()})
    source = doc.get("checkpoint")
    out_meta = dict(meta)
    out_meta["pod"] = {**pod, "namespace": ns, "name": pod_name}
    out_meta["containers"] = [entry]
    out_meta["options"] = flags.as_options()
    out_meta["imported"] = {
        "format": "node-agent",
        "checkpoint": source if isinstance(source, str) and c.CHECKPOINT_ID_RE.fullmatch(source) else "",
        "at": _now(),
    }

    base = f"containers/{container}"
    plan: list[_Out] = []
    for path, st in entries.items():
        if path == c.OWN_MANIFEST:
            continue
        if path == c.OWN_POD_DIR or path.startswith(c.OWN_POD_DIR + "/"):
            target: str | None = c.STORE_POD + path[len(c.OWN_POD_DIR) :]
        elif path == c.OWN_DIR or path.startswith(c.OWN_DIR + "/"):
            target = None
        elif path == c.DEVSHM_TAR:
            target = c.STORE_DEVSHM
        elif path == c.STATS_DUMP:
            # Some engines keep it in checkpoint/ as well; that copy wins.
            stats_inside = f"{c.CHECKPOINT_DIR}/{c.STATS_DUMP}" in entries
            target = None if stats_inside else f"{base}/{c.CHECKPOINT_DIR}/{c.STATS_DUMP}"
        elif path.split("/", 1)[0] in IGNORED_TOP:
            target = None
        else:
            target = f"{base}/{path}"
        if target is None:
            continue
        if st.kind == tarfmt.DIR:
            plan.append(_Out(target, st.mode & 0o777, is_dir=True))
        else:
            plan.append(_Out(target, st.mode & 0o777, staged=st.name))

    by_path = {o.path: o for o in plan}
    if len(by_path) != len(plan):
        raise errors.InvalidArgument("two archive members map to the same checkpoint file")
    for need in (f"{base}/{c.CONFIG_DUMP}", f"{base}/{c.SPEC_DUMP}", c.STORE_POD_CONFIG):
        if need not in by_path or by_path[need].is_dir:
            raise errors.InvalidArgument(f"the archive has no {need} (as node-agent stores it)")
    if not any(p.startswith(f"{base}/{c.CHECKPOINT_DIR}/") and not o.is_dir for p, o in by_path.items()):
        raise errors.InvalidArgument("the archive has no CRIU images (checkpoint/)")

    cfg = c.parse_json(staging.read(by_path[f"{base}/{c.CONFIG_DUMP}"].staged or "", limits.max_json_bytes, c.CONFIG_DUMP),
                       c.CONFIG_DUMP, limits.max_json_bytes)
    if not isinstance(cfg, Mapping) or not isinstance(cfg.get("config"), Mapping):
        raise errors.InvalidArgument("config.dump has no CRI container config")
    spec = c.parse_json(staging.read(by_path[f"{base}/{c.SPEC_DUMP}"].staged or "", limits.max_json_bytes, c.SPEC_DUMP),
                        c.SPEC_DUMP, limits.max_json_bytes)
    if not isinstance(spec, Mapping):
        raise errors.InvalidArgument("spec.dump is not a JSON object")
    pod_doc = c.parse_json(staging.read(by_path[c.STORE_POD_CONFIG].staged or "", limits.max_json_bytes, "pod config"),
                           "node-agent/pod/config.json", limits.max_json_bytes)
    if not isinstance(pod_doc, Mapping) or not isinstance(pod_doc.get("config"), Mapping):
        raise errors.InvalidArgument("node-agent/pod/config.json has no pod config")
    _check_pod_paths(pod_doc["config"], log_root)
    found = hostaccess.findings(pod_doc["config"], [(container, cfg["config"])], kubelet_root=kubelet_root,
                                agent_files=os.path.join(store_root, INTEROP_DIR))
    hostaccess.refuse(f"the archive of container {container}", found, allowed=allow_host_access)
    for nested, what in ((f"{base}/{c.ROOTFS_DIFF}", c.ROOTFS_DIFF), (c.STORE_DEVSHM, c.DEVSHM_TAR)):
        if nested in by_path and by_path[nested].staged:
            _check_nested_tar(staging, by_path[nested].staged or "", what, limits, bounds)
    return plan, out_meta


def _default_cpuinfo(criu: str, work: str) -> Callable[[str], None]:
    def dump(images_dir: str) -> None:
        log_dir = os.path.join(work, "cpuinfo-work")
        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        try:
            cp = subprocess.run(
                [criu, "cpuinfo", "dump", "-D", images_dir, "-W", log_dir, "-o", "cpuinfo-dump.log"],
                stdin=subprocess.DEVNULL, capture_output=True, timeout=60, check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise errors.FailedPrecondition(f"cannot run {criu} cpuinfo dump: {exc}") from exc
        if cp.returncode != 0:
            tail = (cp.stderr or cp.stdout).decode(errors="replace").strip()[-500:]
            raise errors.FailedPrecondition(f"{criu} cpuinfo dump failed ({cp.returncode}): {tail}")

    return dump


def _marker_files(store: Store, paths: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """An empty file for each marker mount, under <store>/interop/<token>/; (dir, container path -> file)."""
    top = os.path.join(store.root, INTEROP_DIR)
    os.makedirs(top, mode=0o700, exist_ok=True)
    directory = os.path.join(top, secrets.token_hex(8))
    os.mkdir(directory, 0o700)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    out: dict[str, str] = {}
    try:
        for i, dest in enumerate(paths):
            fname = f"{i}-{os.path.basename(dest).lstrip('.') or 'file'}"
            fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
            os.close(fd)
            out[dest] = os.path.join(directory, fname)
    finally:
        os.close(dfd)
    return directory, out


def _foreign_plan(
    store: Store, staging: _Staging, meter: _Meter, entries: Mapping[str, _Staged], limits: c.ImportLimits,
    bounds: c.StagingBounds, opts: foreign.ForeignOptions, options: Mapping[str, str], cpuinfo: Callable[[str], None],
    cleanup: list[str],
) -> tuple[list[_Out], dict[str, Any]]:
    cfg = _read_json(staging, entries, c.CONFIG_DUMP, limits)
    spec = _read_json(staging, entries, c.SPEC_DUMP, limits)
    if not isinstance(cfg, Mapping) or not isinstance(spec, Mapping):
        raise errors.InvalidArgument("config.dump and spec.dump must be JSON objects")
    if not any(p.startswith(c.CHECKPOINT_DIR + "/") and s.kind == tarfmt.FILE for p, s in entries.items()):
        raise errors.InvalidArgument("the archive has no CRIU images (checkpoint/)")
    flags = parse_options(options)
    uid = str(uuid.uuid4())
    native = foreign.engine_of(spec) == "containerd"  # containerd's CRI CheckpointContainer
    status_name = ""
    status = entries.get(c.STATUS_DUMP)
    if native and status is not None:
        if status.kind != tarfmt.FILE:
            raise errors.InvalidArgument(f"{c.STATUS_DUMP} is not a file")
        status_name = foreign.status_name(_read_json(staging, entries, c.STATUS_DUMP, limits), cfg)
    syn = foreign.synthesize(spec, cfg, opts, uid=uid, status_name=status_name)
    base = f"containers/{syn.container}"

    plan: list[_Out] = []
    for path, st in entries.items():
        top = path.split("/", 1)[0]
        if top == c.CHECKPOINT_DIR:
            target: str | None = f"{base}/{path}"
        elif path == c.STATS_DUMP:
            stats_inside = f"{c.CHECKPOINT_DIR}/{c.STATS_DUMP}" in entries
            target = None if stats_inside else f"{base}/{c.CHECKPOINT_DIR}/{c.STATS_DUMP}"
        elif path == c.DEVSHM_TAR:
            target = c.STORE_DEVSHM
        elif path in FOREIGN_KEEP:
            target = f"{base}/{path}"
        else:
            target = None
        if target is None:
            continue
        if st.kind == tarfmt.DIR:
            plan.append(_Out(target, (st.mode & 0o777) | 0o700, is_dir=True))
        else:
            plan.append(_Out(target, (st.mode & 0o777) | 0o600, staged=st.name))
    by_path = {o.path: o for o in plan}
    if len(by_path) != len(plan):
        raise errors.InvalidArgument("two archive members map to the same checkpoint file")

    files_img = f"{base}/{c.CHECKPOINT_DIR}/files.img"
    if files_img in by_path and by_path[files_img].staged:
        old = by_path[files_img]
        data = staging.read(old.staged or "", criuimg.MAX_FILES_IMG, "files.img")
        relaxed, _changed = criuimg.relax_root_dir_mode(data)
        plan[plan.index(old)] = _Out(files_img, old.mode, data=relaxed)
    deleted_path, opaque_path = f"{base}/{c.DELETED_FILES}", f"{base}/{c.OPAQUE_DIRS}"
    deleted = _path_list(staging, by_path.get(deleted_path), c.DELETED_FILES, limits)
    opaque = _path_list(staging, by_path.get(opaque_path), c.OPAQUE_DIRS, limits)
    diff_path = f"{base}/{c.ROOTFS_DIFF}"
    if native and diff_path in by_path and by_path[diff_path].staged:
        # An OCI layer: its whiteouts join the archive's own lists, the rest becomes a plain tar.
        old = by_path[diff_path]
        layer = _layer_to_diff(staging, meter, old.staged or "", limits, bounds)
        if not any(o.staged == old.staged for o in plan if o is not old):  # not shared by a hardlink
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old.staged or "", dir_fd=staging.fd)
                meter.staged -= entries[c.ROOTFS_DIFF].size
        plan[plan.index(old)] = by_path[diff_path] = _Out(diff_path, old.mode, staged=layer.staged)
        lists = {deleted_path: _unique(deleted + layer.deleted), opaque_path: _unique(opaque + layer.opaque)}
        if not lists[opaque_path]:
            del lists[opaque_path]
        if not lists[deleted_path] and opaque_path not in lists:
            del lists[deleted_path]  # the restore reads opaque.dirs only beside a deleted.files
        plan = [o for o in plan if o.path not in (deleted_path, opaque_path)]
        for target, paths in lists.items():
            data = _json_bytes(paths)
            if len(data) > limits.max_json_bytes:
                raise errors.ResourceExhausted(
                    f"{target.rsplit('/', 1)[-1]} of the layer's whiteouts: {len(data)} bytes is more than the "
                    f"limit of {limits.max_json_bytes} (max_json_bytes)"
                )
            plan.append(_Out(target, 0o600, data=data))
        by_path = {o.path: o for o in plan}
    for nested, what in ((f"{base}/{c.ROOTFS_DIFF}", c.ROOTFS_DIFF), (c.STORE_DEVSHM, c.DEVSHM_TAR)):
        if nested in by_path and by_path[nested].staged:
            _check_nested_tar(staging, by_path[nested].staged or "", what, limits, bounds)

    config_dump = syn.config_dump
    interop_dir = ""
    if syn.marker_mounts:
        interop_dir, files = _marker_files(store, syn.marker_mounts)
        cleanup.append(interop_dir)
        for dest in syn.marker_mounts:
            config_dump["config"]["mounts"].append({"container_path": dest, "host_path": files[dest]})
    plan.append(_Out(f"{base}/{c.CONFIG_DUMP}", 0o600, data=_json_bytes(config_dump)))
    plan.append(_Out(c.STORE_POD_CONFIG, 0o600, data=_json_bytes(syn.pod_doc)))
    cpu_dir = os.path.join(staging.root, "cpuinfo")
    os.mkdir(cpu_dir, 0o700)
    cpuinfo(cpu_dir)
    cpu_file = os.path.join(cpu_dir, "cpuinfo.img")
    if not os.path.isfile(cpu_file) or os.path.islink(cpu_file):
        raise errors.FailedPrecondition("the CPU description (cpuinfo.img) was not written")
    plan.append(_Out(c.STORE_CPUINFO, 0o600, staged="cpuinfo/cpuinfo.img"))

    meta: dict[str, Any] = {
        "kind": METADATA_KIND,
        "version": 1,
        "created": _now(),
        "node": socket.gethostname(),
        "pod": {"id": "", "name": syn.pod_name, "namespace": syn.namespace, "uid": uid,
                "runtime_handler": opts.runtime_handler},
        "containers": [{"name": syn.container, "id": syn.original_id, "image": syn.image,
                        "image_ref": config_dump["rootfsImageRef"], "dump_ms": 0.0}],
        "frozen_ms": 0.0,
        "options": flags.as_options(),
        "criu_version": "",
        "imported": {"format": syn.engine, "container_id": syn.original_id, "container_name": syn.original_name,
                     "files": interop_dir, "at": _now()},
    }
    return plan, meta


def _commit(store: Store, staging: _Staging, plan: list[_Out], meta: dict[str, Any]) -> CheckpointRecord:
    with store.writer() as w:
        for out in sorted(plan, key=lambda o: o.path):
            if out.is_dir:
                w.add_dir(out.path, mode=out.mode)
            elif out.data is not None:
                w.add_bytes(out.path, out.data, mode=out.mode)
            else:
                if out.staged is None:
                    raise errors.Internal(f"no content staged for {out.path}")
                w.add_file(out.path, staging.path(out.staged), mode=out.mode)
        return w.commit(meta, annotations=manifest_annotations(meta))


def import_archive(
    store: Store,
    path: str,
    *,
    namespace: str | None = None,
    name: str | None = None,
    container_name: str | None = None,
    image: str | None = None,
    cgroup_parent: str | None = None,
    log_root: str | None = None,
    runtime_handler: str = "",
    volumes: Mapping[str, str] | None = None,
    options: Mapping[str, str] | None = None,
    allow_host_access: bool = False,
    kubelet_root: str = "/var/lib/kubelet",
    criu: str = "criu",
    cpuinfo_dump: Callable[[str], None] | None = None,
    work_dir: str | None = None,
    limits: c.ImportLimits = c.ImportLimits(),
) -> CheckpointRecord:
    """Take a container checkpoint archive into the store as a one-container pod checkpoint.

    `namespace` and `name` set the pod's namespace and name (a foreign
    archive has none: "default" and the container's name are used).
    For foreign archives only: `container_name`, `image` (default: the
    archive's), `cgroup_parent` and `log_root` (parent of the pod's log
    directory, default /var/log/pods) of the pod to restore, `volumes`
    (container path -> host path for the container's own bind mounts),
    `options` (checkpoint options the restore needs, e.g. tcp-established),
    and `criu` or `cpuinfo_dump` to describe this node's CPU. For
    node-agent archives, `log_root` (when given) must hold the pod's log
    directory, and whatever in the configs reaches into the host
    (`node_agent.hostaccess`: mounts outside the pod's own volumes under
    `kubelet_root`, devices, privileged mode, ...) is refused unless
    `allow_host_access`.
    """
    if namespace is not None:
        c.check_name(namespace, "namespace")
    if name is not None:
        c.check_name(name, "pod name")
    work = work_dir or os.path.join(store.root, "work")
    cleanup: list[str] = []
    archive = _Archive(path)
    staging: _Staging | None = None
    try:
        try:
            staging = _Staging(work)
        except OSError as exc:
            raise errors.Internal(f"cannot make a staging directory under {work}: {exc.strerror}") from exc
        try:
            bounds = limits.bounds(_free_bytes(staging.fd))
            meter = _Meter(staging.fd, work, limits, bounds)
            entries = _read_members(archive, staging, meter, limits, bounds)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise errors.ResourceExhausted(f"no space to stage the archive under {work}") from exc
            raise errors.Internal(f"reading archive {path}: {exc}") from exc
        if c.OWN_MANIFEST in entries:
            plan, meta = _own_plan(
                staging, entries, limits, bounds, namespace=namespace, name=name, log_root=log_root,
                allow_host_access=allow_host_access, kubelet_root=kubelet_root, store_root=store.root,
            )
        else:
            opts = foreign.ForeignOptions(
                namespace=namespace, name=name, container_name=container_name, image=image,
                cgroup_parent=cgroup_parent, log_root=log_root, runtime_handler=runtime_handler,
                volumes=dict(volumes or {}),
            )
            plan, meta = _foreign_plan(
                store, staging, meter, entries, limits, bounds, opts, options or {},
                cpuinfo_dump or _default_cpuinfo(criu, staging.root), cleanup,
            )
        record = _commit(store, staging, plan, meta)
        cleanup.clear()
        return record
    finally:
        archive.close()
        if staging is not None:
            staging.close()
        for leftover in cleanup:
            shutil.rmtree(leftover, ignore_errors=True)
