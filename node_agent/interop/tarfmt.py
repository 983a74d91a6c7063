"""A strict, streaming tar reader and a small PAX tar writer.

The reader takes a binary stream (a file or a decompressor) and yields one
member header at a time; the caller reads or skips the member's content
before asking for the next one. It checks every header checksum, merges PAX
and GNU long-name headers, refuses sparse files, bounds every extended
header, and reports member kinds without judging them: the importer decides
what is allowed. It never touches the filesystem.

The writer emits ustar headers with PAX records for what does not fit
(long or non-ASCII names, large sizes) and streams content from readers.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Protocol

from node_agent import errors

BLOCK = 512
_ZERO = bytes(BLOCK)
_MAX_META_BYTES = 1 << 20  # one PAX header or GNU long name
_MAX_META_HEADERS = 8  # extended headers in front of one member
_MAX_GLOBAL_HEADERS = 64
_COPY = 1 << 20

# Member kinds.
FILE = "file"
DIR = "dir"
SYMLINK = "symlink"
HARDLINK = "hardlink"
CHARDEV = "character device"
BLOCKDEV = "block device"
FIFO = "fifo"

_KINDS = {
    b"0": FILE,
    b"\0": FILE,
    b"7": FILE,  # contiguous file: a regular file everywhere that matters
    b"1": HARDLINK,
    b"2": SYMLINK,
    b"3": CHARDEV,
    b"4": BLOCKDEV,
    b"5": DIR,
    b"6": FIFO,
}
_UNSUPPORTED = {
    b"S": "GNU sparse file",
    b"V": "GNU volume header",
    b"M": "GNU multi-volume continuation",
    b"D": "GNU dump directory",
    b"N": "GNU old long name",
}


@dataclass(frozen=True)
class Member:
    """One member, extended headers merged in. `name` and `linkname` are raw bytes."""

    name: bytes
    kind: str
    size: int
    mode: int
    mtime: int
    linkname: bytes


def _show(raw: bytes) -> str:
    return repr(raw[:200].decode("utf-8", "backslashreplace"))


def _number(field: bytes, what: str) -> int:
    """A numeric header field: octal text or GNU base-256."""
    if field and field[0] & 0x80:
        if field[0] == 0xFF:
            raise errors.InvalidArgument(f"tar header: negative {what}")
        value = field[0] & 0x7F
        for b in field[1:]:
            value = (value << 8) | b
        return value
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if text.translate(None, b"01234567"):
        raise errors.InvalidArgument(f"tar header: {what} field is not octal: {_show(field)}")
    return int(text, 8)


def _pax_records(data: bytes) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 24)
        if space < 0:
            raise errors.InvalidArgument("tar: malformed PAX record (no length)")
        digits = data[pos:space]
        if not digits.isdigit():
            raise errors.InvalidArgument("tar: malformed PAX record length")
        length = int(digits)
        end = pos + length
        if length <= space - pos + 1 or end > len(data) or data[end - 1 : end] != b"\n":
            raise errors.InvalidArgument("tar: malformed PAX record")
        key, eq, value = data[space + 1 : end - 1].partition(b"=")
        if not eq or not key:
            raise errors.InvalidArgument("tar: malformed PAX record (no key)")
        out.append((key, value))
        pos = end
    return out


def _pax_int(value: bytes, what: str, limit: int) -> int:
    if not value.isdigit() or len(value) > 20:
        raise errors.InvalidArgument(f"tar: PAX {what} {_show(value)} is not a non-negative integer")
    n = int(value)
    if n > limit:
        raise errors.InvalidArgument(f"tar: PAX {what} {n} is out of range")
    return n


class Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class Writable(Protocol):
    def write(self, data: memoryview, /) -> int | None: ...


class TarReader:
    """Reads members from a stream; `next()` skips whatever content was left unread."""

    def __init__(self, stream: Readable, *, max_member_bytes: int) -> None:
        self._stream = stream
        self._max_member = max_member_bytes
        self._remaining = 0  # content bytes of the current member not read yet
        self._pad = 0  # padding after the current member's content
        self._globals = 0
        self._done = False
        self.consumed = 0  # bytes of the tar stream read so far

    def _read_exact(self, n: int) -> bytes:
        parts: list[bytes] = []
        got = 0
        while got < n:
            chunk = self._stream.read(n - got)
            if not chunk:
                raise errors.InvalidArgument("tar archive is truncated")
            parts.append(chunk)
            got += len(chunk)
        self.consumed += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _read_upto(self, n: int) -> bytes:
        """`n` bytes, or fewer only at the end of the stream."""
        parts: list[bytes] = []
        got = 0
        while got < n:
            chunk = self._stream.read(n - got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def _skip(self, n: int) -> None:
        while n:
            step = min(n, _COPY)
            self._read_exact(step)
            n -= step

    def read(self, n: int) -> bytes:
        """Up to `n` bytes of the current member's content (b"" at its end)."""
        n = min(n, self._remaining)
        if n <= 0:
            return b""
        data = self._read_exact(n)
        self._remaining -= n
        return data

    def _finish_member(self) -> None:
        self._skip(self._remaining + self._pad)
        self._remaining = self._pad = 0

    def _data(self, size: int) -> bytes:
        data = self._read_exact(size)
        self._skip(-size % BLOCK)
        return data

    def next(self) -> Member | None:
        """The next member, or None at the end of the archive."""
        if self._done:
            return None
        self._finish_member()
        pax: dict[bytes, bytes] = {}
        long_name: bytes | None = None
        long_link: bytes | None = None
        meta = 0
        while True:
            block = self._read_upto(BLOCK)
            if not block:
                # A stream that ends without the zero blocks: accept it at a member boundary.
                self._done = True
                return None
            if len(block) != BLOCK:
                raise errors.InvalidArgument("tar archive is truncated")
            self.consumed += BLOCK
            if block == _ZERO:
                self._done = True
                return None
            stored = _number(block[148:156], "checksum")
            unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
            signed = unsigned - 256 * sum(1 for b in block[:148] + block[156:] if b >= 128)
            if stored not in (unsigned, signed):
                raise errors.InvalidArgument("tar header checksum mismatch (not a tar archive, or corrupt)")
            typeflag = block[156:157]
            size = _number(block[124:136], "size")
            if typeflag in (b"x", b"g", b"L", b"K"):
                meta += 1
                if meta > _MAX_META_HEADERS:
                    raise errors.InvalidArgument("tar: too many extended headers for one member")
                if size > _MAX_META_BYTES:
                    raise errors.ResourceExhausted(f"tar: extended header of {size} bytes is too large")
                data = self._data(size)
                if typeflag == b"x":
                    for key, value in _pax_records(data):
                        if key.startswith(b"GNU.sparse."):
                            raise errors.InvalidArgument("tar: sparse members are not supported")
                        if value:
                            pax[key] = value
                        else:
                            pax.pop(key, None)
                elif typeflag == b"g":
                    self._globals += 1
                    if self._globals > _MAX_GLOBAL_HEADERS:
                        raise errors.InvalidArgument("tar: too many global PAX headers")
                elif typeflag == b"L":
                    long_name = data.split(b"\0", 1)[0]
                else:
                    long_link = data.split(b"\0", 1)[0]
                continue
            return self._member(block, typeflag, size, pax, long_name, long_link)

    def _member(
        self, block: bytes, typeflag: bytes, size: int, pax: dict[bytes, bytes],
        long_name: bytes | None, long_link: bytes | None,
    ) -> Member:
        name = block[0:100].split(b"\0", 1)[0]
        if block[257:263] == b"ustar\0":
            prefix = block[345:500].split(b"\0", 1)[0]
            if prefix:
                name = prefix + b"/" + name
        if long_name is not None:
            name = long_name
        name = pax.get(b"path", name)
        link = pax.get(b"linkpath", long_link if long_link is not None else block[157:257].split(b"\0", 1)[0])
        if typeflag in _UNSUPPORTED:
            raise errors.InvalidArgument(f"tar member {_show(name)}: {_UNSUPPORTED[typeflag]} members are not supported")
        kind = _KINDS.get(typeflag)
        if kind is None:
            raise errors.InvalidArgument(f"tar member {_show(name)}: unknown member type {typeflag!r}")
        if typeflag == b"\0" and name.endswith(b"/"):
            kind = DIR  # old tars mark directories by the trailing slash
        if b"size" in pax:
            size = _pax_int(pax[b"size"], "size", 1 << 62)
        if kind in (FILE,):
            if size > self._max_member:
                raise errors.ResourceExhausted(
                    f"tar member {_show(name)}: {size} bytes is more than the limit of {self._max_member}"
                )
        elif size and kind != DIR:
            # Links, devices and FIFOs carry no data; refuse rather than guess.
            raise errors.InvalidArgument(f"tar member {_show(name)}: a {kind} member with {size} bytes of data")
        elif kind == DIR and size:
            raise errors.InvalidArgument(f"tar member {_show(name)}: a directory member with data")
        mode = _number(block[100:108], "mode") & 0o7777
        if b"mtime" in pax:
            whole = pax[b"mtime"].split(b".", 1)[0]
            mtime = _pax_int(whole, "mtime", 1 << 40) if whole else 0
        else:
            mtime = _number(block[136:148], "mtime")
        self._remaining = size
        self._pad = -size % BLOCK
        return Member(name=name, kind=kind, size=size, mode=mode, mtime=mtime, linkname=link)


def _pax_record(key: bytes, value: bytes) -> bytes:
    body = len(key) + len(value) + 3
    digits = len(str(body))
    length = body + digits
    if len(str(length)) != digits:
        length += 1
    return b"%d %s=%s\n" % (length, key, value)


def _header(name: bytes, mode: int, size: int, mtime: int, typeflag: bytes) -> bytes:
    h = bytearray(BLOCK)
    h[0 : len(name)] = name
    h[100:108] = b"%07o\0" % mode
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[124:136] = b"%011o\0" % size
    h[136:148] = b"%011o\0" % mtime
    h[148:156] = b"        "
    h[156:157] = typeflag
    h[257:265] = b"ustar\x0000"
    h[265:269] = b"root"
    h[297:301] = b"root"
    h[329:337] = b"0000000\0"
    h[337:345] = b"0000000\0"
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


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
            records += _pax_record(b"path", raw)
            name = raw[:100] if raw.isascii() else b"././@LongName"
        else:
            name = raw
        hsize = size
        if size >= 8**11:
            records += _pax_record(b"size", b"%d" % size)
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
