"""A strict, streaming tar reader and a small PAX tar writer.

The reader takes a binary stream (a file or a decompressor), or a regular
file read by offset (`tarstream.FileSource`), and yields one member header
at a time; the caller reads or skips the member's content before asking
for the next one. The headers are parsed by
`criu_bridge.tarstream` (checksums, PAX and GNU long names, no sparse files,
every extended header bounded); this adds the member size limit and raises
the agent's errors. Member kinds are reported without judging them: the
importer decides what is allowed. It never touches the filesystem.

The writer emits ustar headers with PAX records for what does not fit
(long or non-ASCII names, large sizes) and streams content from readers.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Protocol

from criu_bridge import tarstream
from criu_bridge.errors import InvalidInput, LimitExceeded
from node_agent import errors

BLOCK = tarstream.BLOCK
_ZERO = tarstream.ZERO_BLOCK
_COPY = 1 << 20

# Member kinds.
FILE = tarstream.FILE
DIR = tarstream.DIR
SYMLINK = tarstream.SYMLINK
HARDLINK = tarstream.HARDLINK
CHARDEV = tarstream.CHARDEV
BLOCKDEV = tarstream.BLOCKDEV
FIFO = tarstream.FIFO


@dataclass(frozen=True)
class Member:
    """One member, extended headers merged in. `name` and `linkname` are raw bytes."""

    name: bytes
    kind: str
    size: int
    mode: int
    mtime: int
    linkname: bytes


class Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class Writable(Protocol):
    def write(self, data: memoryview, /) -> int | None: ...


def _agent_error(e: InvalidInput) -> errors.AgentError:
    """The parser's error as the agent's: a bound that was hit is RESOURCE_EXHAUSTED."""
    if isinstance(e, LimitExceeded):
        return errors.ResourceExhausted(str(e))
    return errors.InvalidArgument(str(e))


def _mtime(h: tarstream.Header) -> int:
    """Whole seconds; the fraction of a PAX mtime is dropped unread."""
    value = h.pax.get(b"mtime")
    if value is None:
        return h.field(136, 148, "mtime")
    whole = value.split(b".", 1)[0]
    return tarstream.pax_int(whole, "mtime", 1 << 40) if whole else 0


class TarReader:
    """Reads members from a stream; `next()` skips whatever content was left unread.

    A stream that ends without the two zero blocks, at a member boundary,
    ends the archive. Device members are returned: the importer decides.
    """

    def __init__(self, stream: Readable | tarstream.FileSource, *, max_member_bytes: int,
                 member_limit: str = "max_member_bytes") -> None:
        # A regular file read by offset skips what is left unread without reading it.
        self._source: tarstream.FileSource | tarstream.StreamSource = (
            stream if isinstance(stream, tarstream.FileSource) else tarstream.StreamSource(stream)
        )
        self._headers = tarstream.TarStream(
            self._source,
            eof_ends_archive=True,
            devices=True,
            slash_dirs_only=False,
            max_pax_size=1 << 62,
            pax_length_digits=23,
        )
        self._max_member = max_member_bytes
        self._member_limit = member_limit  # how messages name the bound

    @property
    def consumed(self) -> int:
        """Bytes of the tar stream read (or, from a file, skipped) so far."""
        src = self._source
        return src.pos if isinstance(src, tarstream.FileSource) else src.consumed

    def read(self, n: int) -> bytes:
        """Up to `n` bytes of the current member's content (b"" at its end)."""
        try:
            return self._headers.read(n)
        except InvalidInput as e:
            raise _agent_error(e) from None

    def next(self) -> Member | None:
        """The next member, or None at the end of the archive."""
        try:
            h = self._headers.next()
            if h is None:
                return None
            if h.kind == FILE and h.size > self._max_member:
                raise LimitExceeded(
                    f"tar member {h.shown}: {h.size} bytes is more than the limit of {self._max_member}"
                    f" ({self._member_limit})"
                )
            return Member(name=h.name, kind=h.kind, size=h.size, mode=h.mode(), mtime=_mtime(h), linkname=h.linkname)
        except InvalidInput as e:
            raise _agent_error(e) from None


def _header(name: bytes, mode: int, size: int, mtime: int, typeflag: bytes) -> bytes:
    return tarstream.ustar_header(name, mode, size, mtime, typeflag, uname=b"root", gname=b"root")


class TarWriter:
    """Writes PAX tar members to a binary stream; root-owned, fixed mtime."""

    def __init__(self, out: Writable, *, mtime: int = 0) -> None:
        self._out = out
        self._mtime = max(0, min(mtime, 8**11 - 1))
        self.members = 0
        self.content_bytes = 0

    def _write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            n = self._out.write(view)
            if n is None:
                raise OSError("non-blocking write on an archive stream")
            view = view[n:]

    def _head(self, path: str, mode: int, size: int, typeflag: bytes) -> None:
        raw = path.encode("utf-8")
        if typeflag == b"5" and not raw.endswith(b"/"):
            raw += b"/"
        records = b""
        if len(raw) > 100 or not raw.isascii():
            records += tarstream.pax_record(b"path", raw)
            name = raw[:100] if raw.isascii() else b"././@LongName"
        else:
            name = raw
        hsize = size
        if size >= 8**11:
            records += tarstream.pax_record(b"size", b"%d" % size)
            hsize = 0
        if records:
            self._write(_header(b"././@PaxHeader", 0o644, len(records), self._mtime, b"x"))
            self._write(records + bytes(-len(records) % BLOCK))
        self._write(_header(name, mode & 0o7777, hsize, self._mtime, typeflag))
        self.members += 1

    def add_dir(self, path: str, mode: int) -> None:
        self._head(path, mode, 0, b"5")

    def add_file(self, path: str, mode: int, size: int, src: Readable) -> None:
        """A regular file of exactly `size` bytes read from `src`."""
        self._head(path, mode, size, b"0")
        left = size
        while left:
            data = src.read(min(_COPY, left))
            if not data:
                raise errors.DataLoss(f"{path}: the source ended {left} bytes early")
            self._write(data)
            left -= len(data)
        self._write(bytes(-size % BLOCK))
        self.content_bytes += size

    def add_bytes(self, path: str, mode: int, data: bytes) -> None:
        self.add_file(path, mode, len(data), io.BytesIO(data))

    def close(self) -> None:
        self._write(_ZERO * 2)
