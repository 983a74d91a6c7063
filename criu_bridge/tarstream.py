"""One strict tar header parser for hostile archives.

`TarStream` reads ustar, PAX and GNU long-name headers from a `Source` (a
regular file read by offset, `FileSource`, or any binary stream,
`StreamSource`) and returns one `Header` at a time; the caller reads or
skips the member's content before asking for the next one. It checks every
header checksum (unsigned and the old signed sums), reads octal and GNU
base-256 numbers, merges PAX records and GNU long names into the member,
refuses sparse and other GNU special members, and bounds every extended
header. Device members are refused unless the reader asks for them.

The numeric metadata of a member (mode, owner, mtime) is read on demand
through `Header`'s methods, so that each reader checks those fields and its
own size limit in the order it documents. Errors are `InvalidInput`, and
`LimitExceeded` for a bound that was hit; those about one member name it.

`MemberReader` is the reader for archives whose members are judged by
the caller: it reports every kind (devices included), takes the end of the
source for the end of the archive, and bounds the size of a regular file.

Writing is `tarwrite`'s. Standard library only; it never touches the filesystem.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from .errors import InvalidInput, LimitExceeded

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Protocol

    class Source(Protocol):
        """Where the archive's bytes come from."""

        def read_upto(self, n: int, /) -> bytes:
            """`n` bytes, or fewer only at the end of the archive."""
            ...

        def skip(self, n: int, /) -> None:
            """Move `n` bytes on."""
            ...

    class Readable(Protocol):
        def read(self, n: int = -1, /) -> bytes: ...


BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
MAX_META_BYTES = 1 << 20  # one PAX header or GNU long name
MAX_META_HEADERS = 8  # extended headers in front of one member
MAX_GLOBAL_HEADERS = 64  # global PAX headers in one archive
_COPY = 1 << 20
_HIGH_BYTES = bytes(range(128, 256))
_XATTR = b"SCHILY.xattr."

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
_EXTENDED = (b"x", b"g", b"L", b"K")

_ID_LIMIT = 2**32 - 1  # uids and gids stay below (u32)-1
_MTIME_LIMIT = 1 << 33  # seconds; mtimes stay below


def show(raw: bytes) -> str:
    """A name or value for messages: decoded, quoted, cut at 200 bytes."""
    return repr(raw[:200].decode("utf-8", "backslashreplace"))


def truncated() -> InvalidInput:
    return InvalidInput("tar archive is truncated")


def number(field: bytes, what: str) -> int:
    """A numeric header field: octal text or GNU base-256."""
    if field and field[0] & 0x80:
        if field[0] == 0xFF:
            raise InvalidInput(f"tar header: negative {what}")
        value = field[0] & 0x7F
        for b in field[1:]:
            value = (value << 8) | b
        return value
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if text.translate(None, b"01234567"):
        raise InvalidInput(f"tar header: {what} field is not octal: {show(field)}")
    return int(text, 8)


def checksum_ok(block: bytes) -> bool:
    """Whether the stored checksum is the unsigned or the (old) signed byte sum."""
    stored = number(block[148:156], "checksum")
    unsigned = sum(block) - sum(block[148:156]) + 8 * 32
    if stored == unsigned:
        return True
    rest = block[:148] + block[156:]
    high = len(rest) - len(rest.translate(None, _HIGH_BYTES))
    return stored == unsigned - 256 * high


def parse_pax(
    data: bytes, *, length_digits: int = 20, nul_ends: bool = False, text_keys: bool = False
) -> list[tuple[bytes, bytes]]:
    """The records of one PAX header, in order.

    `length_digits` bounds the length field, `nul_ends` lets a NUL where a
    record would start end the list, `text_keys` refuses keys that are not UTF-8.
    """
    out: list[tuple[bytes, bytes]] = []
    pos = 0
    end = len(data)
    while pos < end:
        if nul_ends and data[pos] == 0:
            break
        space = data.find(b" ", pos, pos + length_digits + 1)
        if space < 0:
            raise InvalidInput("tar: malformed PAX record (no length)")
        digits = data[pos:space]
        if not digits.isdigit():
            raise InvalidInput("tar: malformed PAX record length")
        stop = pos + int(digits)
        if stop <= space + 1 or stop > end or data[stop - 1] != 0x0A:
            raise InvalidInput("tar: malformed PAX record")
        key, eq, value = data[space + 1 : stop - 1].partition(b"=")
        if not eq or not key:
            raise InvalidInput("tar: malformed PAX record (no key)")
        if text_keys:
            try:
                key.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidInput("tar: PAX record key is not UTF-8") from None
        out.append((key, value))
        pos = stop
    return out


def pax_int(value: bytes, what: str, maximum: int) -> int:
    """A PAX decimal record of at most 20 digits, no more than `maximum`."""
    if not value.isdigit() or len(value) > 20:
        raise InvalidInput(f"tar: PAX {what} {show(value)} is not a non-negative integer")
    n = int(value)
    if n > maximum:
        raise InvalidInput(f"tar: PAX {what} {n} is out of range")
    return n


def pax_mtime_ns(value: bytes) -> int:
    """A PAX mtime ("[-]seconds[.fraction]") in nanoseconds, below 2**33 seconds."""
    text = value
    sign = 1
    if text.startswith(b"-"):
        sign, text = -1, text[1:]
    whole, dot, frac = text.partition(b".")
    if not whole.isdigit() or len(whole) > 11 or (dot and frac and not frac.isdigit()):
        raise InvalidInput(f"tar: PAX mtime {show(value)} is not a time")
    if int(whole) >= _MTIME_LIMIT:
        raise InvalidInput(f"tar: PAX mtime {show(value)} is out of range")
    ns = int(whole) * 1_000_000_000 + (int((frac[:9] or b"0").ljust(9, b"0")) if dot else 0)
    return sign * ns


class FileSource:
    """A regular file read by offset: `pos` is where the next read starts."""

    __slots__ = ("fd", "size", "pos")

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size  # never read past this, even if the file grows
        self.pos = 0

    def read_upto(self, n: int) -> bytes:
        n = max(0, min(n, self.size - self.pos))
        parts: list[bytes] = []
        while n:
            data = os.pread(self.fd, n, self.pos)
            if not data:
                break
            parts.append(data)
            self.pos += len(data)
            n -= len(data)
        return b"".join(parts)

    def skip(self, n: int) -> None:
        # Past the end is truncation, as for a stream: a reader that takes the
        # end of the source for the end of the archive must not take a member
        # cut short for one.
        if self.pos + n > self.size:
            self.pos = self.size
            raise truncated()
        self.pos += n


class StreamSource:
    """A binary stream (a file, a decompressor); `consumed` counts the bytes taken from it."""

    __slots__ = ("stream", "consumed")

    def __init__(self, stream: Readable) -> None:
        self.stream = stream
        self.consumed = 0

    def read_upto(self, n: int) -> bytes:
        parts: list[bytes] = []
        got = 0
        while got < n:
            chunk = self.stream.read(n - got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        self.consumed += got
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def skip(self, n: int) -> None:
        while n:
            step = min(n, _COPY)
            if len(self.read_upto(step)) != step:
                raise truncated()
            n -= step


class Header:
    """One member, its extended headers merged in. `name` and `linkname` are raw bytes.

    `pax` holds the member's non-empty PAX records but its xattrs, which are
    in `xattrs` as (name after "SCHILY.xattr.", value), in archive order.
    """

    __slots__ = ("name", "linkname", "kind", "size", "shown", "block", "pax", "xattrs")

    def __init__(
        self, name: bytes, linkname: bytes, kind: str, size: int, block: bytes,
        pax: dict[bytes, bytes], xattrs: list[tuple[bytes, bytes]],
    ) -> None:
        self.name = name
        self.linkname = linkname
        self.kind = kind
        self.size = size
        self.shown = show(name)  # for messages about this member
        self.block = block
        self.pax = pax
        self.xattrs = xattrs

    def field(self, start: int, stop: int, what: str) -> int:
        """A numeric field of the member's own header block."""
        return number(self.block[start:stop], what)

    def mode(self) -> int:
        """Permission bits, setuid/setgid/sticky included."""
        return self.field(100, 108, "mode") & 0o7777

    def owner(self) -> tuple[int, int]:
        """Numeric (uid, gid), from PAX records or the header; each below 2**32 - 1."""
        uid = pax_int(self.pax[b"uid"], "uid", _ID_LIMIT - 1) if b"uid" in self.pax else self.field(108, 116, "uid")
        gid = pax_int(self.pax[b"gid"], "gid", _ID_LIMIT - 1) if b"gid" in self.pax else self.field(116, 124, "gid")
        if uid >= _ID_LIMIT or gid >= _ID_LIMIT:
            raise InvalidInput(f"tar member {self.shown}: uid/gid out of range")
        return uid, gid

    def mtime_ns(self) -> int:
        """The modification time in nanoseconds (PAX precision kept), below 2**33 seconds."""
        value = self.pax.get(b"mtime")
        if value is not None:
            return pax_mtime_ns(value)
        mtime = self.field(136, 148, "mtime")
        if mtime >= _MTIME_LIMIT:
            raise InvalidInput(f"tar member {self.shown}: mtime out of range")
        return mtime * 1_000_000_000


class TarStream:
    """Headers from a `Source`; `next()` skips whatever content was left unread.

    The reader's choices, all keyword-only:
    - `eof_ends_archive`: a source that ends at a member boundary, without
      the zero blocks, ends the archive (else it is truncated);
    - `devices`: character and block device members are returned (else refused);
    - `slash_dirs_only`: a name ending in "/" must be a directory;
    - `max_pax_size`: the largest size a PAX record may give;
    - `pax_length_digits`, `pax_nul_ends`, `pax_text_keys`: see `parse_pax`.
    """

    def __init__(
        self,
        source: Source,
        *,
        eof_ends_archive: bool = False,
        devices: bool = False,
        slash_dirs_only: bool = True,
        max_pax_size: int = (1 << 63) - 1,
        pax_length_digits: int = 20,
        pax_nul_ends: bool = False,
        pax_text_keys: bool = False,
    ) -> None:
        self.source = source
        self._eof_ends = eof_ends_archive
        self._devices = devices
        self._slash_dirs_only = slash_dirs_only
        self._max_pax_size = max_pax_size
        self._pax_length_digits = pax_length_digits
        self._pax_nul_ends = pax_nul_ends
        self._pax_text_keys = pax_text_keys
        self._remaining = 0  # content bytes of the current member not read yet
        self._pad = 0  # padding after the current member's content
        self._globals = 0
        self._done = False

    def _read_exact(self, n: int) -> bytes:
        data = self.source.read_upto(n)
        if len(data) != n:
            raise truncated()
        return data

    def _block(self) -> bytes | None:
        """The next header block; None where the source may end and does."""
        if not self._eof_ends:
            return self._read_exact(BLOCK)
        block = self.source.read_upto(BLOCK)
        if not block:
            return None
        if len(block) != BLOCK:
            raise truncated()
        return block

    def read(self, n: int) -> bytes:
        """Up to `n` bytes of the current member's content (b"" at its end)."""
        n = min(n, self._remaining)
        if n <= 0:
            return b""
        data = self._read_exact(n)
        self._remaining -= n
        return data

    def next(self) -> Header | None:
        """The next member, or None at the end of the archive."""
        if self._done:
            return None
        self.source.skip(self._remaining + self._pad)
        self._remaining = self._pad = 0
        pax: dict[bytes, bytes] = {}
        xattrs: list[tuple[bytes, bytes]] = []
        long_name: bytes | None = None
        long_link: bytes | None = None
        meta = 0
        while True:
            block = self._block()
            if block is None or block == ZERO_BLOCK:
                self._done = True
                return None
            if not checksum_ok(block):
                raise InvalidInput("tar header checksum mismatch (not a tar archive, or corrupt)")
            typeflag = block[156:157]
            size = number(block[124:136], "size")
            if typeflag not in _EXTENDED:
                return self._member(block, typeflag, size, pax, xattrs, long_name, long_link)
            meta += 1
            if meta > MAX_META_HEADERS:
                raise InvalidInput("tar: too many extended headers for one member")
            if size > MAX_META_BYTES:
                raise LimitExceeded(f"tar: extended header of {size} bytes is too large")
            data = self._read_exact(size)
            self.source.skip(-size % BLOCK)
            if typeflag == b"x":
                self._merge_pax(data, pax, xattrs)
            elif typeflag == b"g":
                self._globals += 1
                if self._globals > MAX_GLOBAL_HEADERS:
                    raise InvalidInput("tar: too many global PAX headers")
            elif typeflag == b"L":
                long_name = data.split(b"\0", 1)[0]
            else:
                long_link = data.split(b"\0", 1)[0]

    def _merge_pax(self, data: bytes, pax: dict[bytes, bytes], xattrs: list[tuple[bytes, bytes]]) -> None:
        records = parse_pax(
            data, length_digits=self._pax_length_digits, nul_ends=self._pax_nul_ends, text_keys=self._pax_text_keys
        )
        for key, value in records:
            if key.startswith(_XATTR):
                xattrs.append((key[len(_XATTR) :], value))
            elif key.startswith(b"GNU.sparse."):
                raise InvalidInput("tar: sparse members are not supported")
            elif value:
                pax[key] = value
            else:
                pax.pop(key, None)  # an empty record removes the key

    def _member(
        self, block: bytes, typeflag: bytes, size: int, pax: dict[bytes, bytes],
        xattrs: list[tuple[bytes, bytes]], long_name: bytes | None, long_link: bytes | None,
    ) -> Header:
        name = block[0:100].split(b"\0", 1)[0]
        if block[257:263] == b"ustar\0":
            prefix = block[345:500].split(b"\0", 1)[0]
            if prefix:
                name = prefix + b"/" + name
        if long_name is not None:
            name = long_name
        name = pax.get(b"path", name)
        link = pax.get(b"linkpath", long_link if long_link is not None else block[157:257].split(b"\0", 1)[0])
        shown = show(name)
        if typeflag in _UNSUPPORTED:
            raise InvalidInput(f"tar member {shown}: {_UNSUPPORTED[typeflag]} members are not supported")
        kind = _KINDS.get(typeflag)
        if kind is None:
            raise InvalidInput(f"tar member {shown}: unknown member type {typeflag!r}")
        if kind in (CHARDEV, BLOCKDEV) and not self._devices:
            raise InvalidInput(f"tar member {shown}: {kind} members are not allowed")
        if name.endswith(b"/"):
            if typeflag == b"\0":
                kind = DIR  # old tars mark directories by the trailing slash
            elif kind != DIR and self._slash_dirs_only:
                raise InvalidInput(f"tar member {shown}: trailing slash on a non-directory")
        if b"size" in pax:
            size = pax_int(pax[b"size"], "size", self._max_pax_size)
        if kind != FILE and size:
            # Directories, links, devices and FIFOs carry no data; refuse rather than guess.
            raise InvalidInput(f"tar member {shown}: a {kind} member with {size} bytes of data")
        self._remaining = size
        self._pad = -size % BLOCK
        return Header(name, link, kind, size, block, pax, xattrs)


class Member(NamedTuple):
    """One member as `MemberReader` reports it. `name` and `linkname` are raw bytes, `mtime` whole seconds."""

    name: bytes
    kind: str
    size: int
    mode: int
    mtime: int
    linkname: bytes


def _whole_seconds(h: Header) -> int:
    """The mtime in whole seconds; the fraction of a PAX mtime is dropped unread."""
    value = h.pax.get(b"mtime")
    if value is None:
        return h.field(136, 148, "mtime")
    whole = value.split(b".", 1)[0]
    return pax_int(whole, "mtime", 1 << 40) if whole else 0


class MemberReader:
    """Members of a stream, or of a regular file read by offset; `next()` skips content left unread.

    A source that ends without the two zero blocks, at a member boundary,
    ends the archive. Every kind is reported, devices included: the caller
    decides what it allows. A regular file larger than `max_member_bytes`
    is LimitExceeded, its message naming the bound as `member_limit`.
    """

    def __init__(self, stream: Readable | FileSource, *, max_member_bytes: int,
                 member_limit: str = "max_member_bytes") -> None:
        # A regular file read by offset skips what is left unread without reading it.
        source: FileSource | StreamSource = stream if isinstance(stream, FileSource) else StreamSource(stream)
        self._headers = TarStream(
            source,
            eof_ends_archive=True,
            devices=True,
            slash_dirs_only=False,
            max_pax_size=1 << 62,
            pax_length_digits=23,
        )
        self._max_member = max_member_bytes
        self._member_limit = member_limit

    def read(self, n: int) -> bytes:
        """Up to `n` bytes of the current member's content (b"" at its end)."""
        return self._headers.read(n)

    def next(self) -> Member | None:
        """The next member, or None at the end of the archive."""
        h = self._headers.next()
        if h is None:
            return None
        if h.kind == FILE and h.size > self._max_member:
            raise LimitExceeded(
                f"tar member {h.shown}: {h.size} bytes is more than the limit of {self._max_member}"
                f" ({self._member_limit})"
            )
        return Member(h.name, h.kind, h.size, h.mode(), _whole_seconds(h), h.linkname)
