"""The archive of an import, read as hostile input: its compression, every member header, what is staged.

The archive (plain, gzip or zstd, told apart by their magic bytes) is read
with `criu_bridge.tarstream.MemberReader`, its errors the agent's
(`tar_errors`). Every member name is checked (UTF-8, no NUL, not
absolute, no "..", bounded) and every kind: symlinks, device nodes and
FIFOs are refused, a hardlink is accepted only to a regular file earlier in
the same archive (it becomes a copy), duplicates and files used as
directories are refused, and the member count, each size and the total are
bounded (`ImportLimits`). What is kept is staged (`staging`).

Required members first (`Pass`): until config.dump and spec.dump have come,
at most `max_staged_before_required` bytes are staged. An archive that puts
more in front of them (CRI-O and containerd put CRIU's images there) is
looked ahead in, headers only, nothing staged; it fails at its end if they
never come, and is read once more from the start, staging everything, when
they do. So a decompression bomb without them never reaches the disk.
Nested archives are scanned the same way (`check_nested_tar`), never unpacked.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import os
import stat
import zlib
from collections.abc import Iterator
from typing import Any

import zstandard

from criu_bridge import tarstream
from criu_bridge.errors import InvalidInput, LimitExceeded
from node_agent import errors
from node_agent.interop import common as c
from node_agent.interop.landing import COPY, Meter, Staged, Staging

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
ZSTD_MAX_WINDOW = 1 << 27
_XZ_MAGIC = b"\xfd7zXZ\x00"


@contextlib.contextmanager
def tar_errors(prefix: str = "") -> Iterator[None]:
    """The tar parser's errors as the agent's: a bound that was hit is RESOURCE_EXHAUSTED."""
    try:
        yield
    except LimitExceeded as exc:
        raise errors.ResourceExhausted(prefix + str(exc)) from None
    except InvalidInput as exc:
        raise errors.InvalidArgument(prefix + str(exc)) from None


class Stream:
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


class Archive:
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
        self._stream: Stream | None = None
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

    def reader(self, bounds: c.StagingBounds) -> tarstream.MemberReader:
        """A tar reader from the archive's first byte."""
        self._end_stream()
        source: tarstream.FileSource | Stream
        if self.compression == "none":
            # Read by offset: what is skipped is not read at all.
            source = tarstream.FileSource(self._raw.fileno(), self.size)
            return tarstream.MemberReader(source, max_member_bytes=bounds.member_bytes, member_limit=bounds.member_name())
        self._raw.seek(0)
        if self.compression == "gzip":
            inner: Any = gzip.GzipFile(fileobj=self._raw, mode="rb")
        else:
            dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
            inner = dctx.stream_reader(self._raw, read_across_frames=True, closefd=False)
        self._stream = source = Stream(inner, self.compression)
        return tarstream.MemberReader(source, max_member_bytes=bounds.member_bytes, member_limit=bounds.member_name())

    def _end_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def close(self) -> None:
        self._end_stream()
        self._raw.close()


def normalize(raw: bytes, limits: c.ImportLimits, what: str = "tar member") -> str | None:
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


def _fingerprint(m: tarstream.Member) -> bytes:
    """What the second read of an archive must find again, member for member."""
    h = hashlib.blake2b(digest_size=16)
    for part in (m.name, m.kind.encode(), b"%d" % m.size, m.linkname):
        h.update(b"%d:" % len(part))
        h.update(part)
    return h.digest()


class Pass:
    """One read of the archive: every header checked, content staged or, while looking ahead, skipped.

    `bounded`: until the required documents have come, at most
    `max_staged_before_required` bytes are staged; a member that would pass
    that stops the staging (what was staged is removed) and the pass looks
    ahead, reading headers only, until the documents have come (`again`:
    read the archive once more, staging all) or the archive ends without
    them (InvalidArgument). `expect`: the fingerprints the first pass took,
    which this one must find again.
    """

    def __init__(self, staging: Staging, meter: Meter, limits: c.ImportLimits, bounds: c.StagingBounds, *,
                 bounded: bool, expect: list[bytes] | None = None) -> None:
        self.staging = staging
        self.meter = meter
        self.limits = limits
        self.bounds = bounds
        self.expect = expect
        self.entries: dict[str, Staged] = {}
        self.prints: list[bytes] = []  # fingerprints of the members read so far
        self.count = 0  # members read
        self.writing = True
        self.lifted = not bounded  # the required documents came while staging: no bound in front of them
        self.again = False

    def missing(self) -> list[str]:
        need = _REQUIRED + (_REQUIRED_OWN if c.OWN_MANIFEST in self.entries else ())
        return [p for p in need if not (p in self.entries and self.entries[p].kind == tarstream.FILE)]

    def run(self, reader: tarstream.MemberReader) -> None:
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
            path = normalize(m.name, limits)
            if path is None:
                if m.kind == tarstream.DIR:
                    continue
                raise errors.InvalidArgument("tar member with an empty name")
            shown = repr(path[:200])
            if path in entries:
                raise errors.InvalidArgument(f"tar member {shown} appears twice")
            parts = path.split("/")
            for i in range(1, len(parts)):
                above = entries.get("/".join(parts[:i]))
                if above is not None and above.kind != tarstream.DIR:
                    raise errors.InvalidArgument(f"tar member {shown} lies under a member that is not a directory")
            if m.kind != tarstream.DIR and path in parents:
                raise errors.InvalidArgument(f"tar member {shown} is a {m.kind}, but earlier members lie inside it")
            if m.kind in (tarstream.CHARDEV, tarstream.BLOCKDEV, tarstream.FIFO):
                raise errors.InvalidArgument(
                    f"tar member {shown} is a {m.kind}; device nodes and FIFOs are not allowed"
                )
            if m.kind == tarstream.SYMLINK:
                target = m.linkname[:200].decode("utf-8", "backslashreplace")
                raise errors.InvalidArgument(
                    f"tar member {shown} is a symlink (to {target!r}); symlinks are not allowed"
                )
            for i in range(1, len(parts)):
                parents.add("/".join(parts[:i]))
            if m.kind == tarstream.HARDLINK:
                target_path = normalize(m.linkname, limits, f"hardlink target of {shown}")
                src = entries.get(target_path or "")
                if src is None or src.kind != tarstream.FILE:
                    raise errors.InvalidArgument(
                        f"tar member {shown} is a hardlink to something other than a regular file earlier in "
                        "the archive"
                    )
                if src.name is None and _keep_member(path):
                    raise errors.InvalidArgument(f"tar member {shown} is a hardlink to a member that is not kept")
                entries[path] = Staged(tarstream.FILE, m.mode, src.size, src.name)
            elif m.kind == tarstream.DIR:
                entries[path] = Staged(tarstream.DIR, m.mode, 0, None)
            else:
                total += m.size
                if total > self.bounds.total_bytes:
                    raise errors.ResourceExhausted(
                        f"tar member {shown}: the archive holds more than {self.bounds.total_bytes} bytes of files "
                        f"({self.bounds.total_name()})"
                    )
                if not _keep_member(path):
                    entries[path] = Staged(tarstream.FILE, m.mode, m.size, None)
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
                    entries[path] = Staged(tarstream.FILE, m.mode, m.size, self._stage(reader, shown, m.size))
                else:
                    # Looking ahead: the content is skipped by the next header read.
                    entries[path] = Staged(tarstream.FILE, m.mode, m.size, "")
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

    def _stage(self, reader: tarstream.MemberReader, shown: str, size: int) -> str:
        self.meter.admit(shown, size)
        name, fd = self.staging.create()
        try:
            done = 0
            while done < size:
                data = reader.read(min(COPY, size - done))
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


def read_members(archive: Archive, staging: Staging, meter: Meter, limits: c.ImportLimits,
                  bounds: c.StagingBounds) -> dict[str, Staged]:
    """Every member checked, the kept ones staged; the archive read a second time only if its bulk comes first."""
    first = Pass(staging, meter, limits, bounds, bounded=True)
    with tar_errors():
        first.run(archive.reader(bounds))
    if not first.again:
        return first.entries
    second = Pass(staging, meter, limits, bounds, bounded=False, expect=first.prints)
    with tar_errors():
        second.run(archive.reader(bounds))
    return second.entries


def check_nested_tar(staging: Staging, name: str, what: str, limits: c.ImportLimits,
                      bounds: c.StagingBounds) -> None:
    """Scan an archive inside the archive: well-formed, bounded, no devices, no escaping names."""
    with open(staging.path(name), "rb") as fh, tar_errors():
        if not fh.read(1):
            return
        fh.seek(0)
        reader = tarstream.MemberReader(fh, max_member_bytes=bounds.member_bytes, member_limit=bounds.member_name())
        count = 0
        while True:
            m = reader.next()
            if m is None:
                return
            count += 1
            if count > limits.max_members:
                raise errors.ResourceExhausted(f"{what} has more than {limits.max_members} members")
            normalize(m.name, limits, f"{what} member")
            if m.kind in (tarstream.CHARDEV, tarstream.BLOCKDEV):
                raise errors.InvalidArgument(f"{what} holds a {m.kind}, which a restore refuses")
            if m.kind == tarstream.HARDLINK:
                normalize(m.linkname, limits, f"{what} hardlink target")
