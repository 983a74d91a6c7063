"""The one tar writer: ustar headers, PAX records for what ustar cannot hold.

`member_header` builds the header blocks of one member and `TarWriter`
writes members to a binary stream: header, content, padding, and the two
zero blocks that end the archive. The rootfs capture, the container
archive export and the import's rewrite of an image layer all write
through it, so every tar the project writes follows the same rules:

- a name goes into ustar's name field, or its prefix and name fields, when
  it is ASCII and fits; otherwise into a PAX `path` record, with its first
  100 bytes in the name field if it is ASCII and `././@LongName` if not;
- a link target that is not ASCII or is longer than 100 bytes goes into a
  PAX `linkpath` record; `hdrcharset=BINARY` comes first when the name or
  the link target is not UTF-8;
- a uid or gid from 8**7, a size from 8**11, and an mtime with a fraction
  of a second or outside 0 to 8**11 seconds go into PAX records too; each
  xattr is a `SCHILY.xattr.<name>` record;
- directory names end in "/"; modes keep their setuid, setgid and sticky
  bits and nothing above them.

Standard library only; it never touches the filesystem.
"""

from __future__ import annotations

import io

from .tarstream import BLOCK, BLOCKDEV, CHARDEV, DIR, FIFO, FILE, HARDLINK, SYMLINK, ZERO_BLOCK

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Protocol

    class Readable(Protocol):
        def read(self, n: int = -1, /) -> bytes: ...

    class Writable(Protocol):
        def write(self, data: memoryview, /) -> int | None: ...


END = ZERO_BLOCK * 2  # what ends an archive
TYPEFLAGS = {FILE: b"0", HARDLINK: b"1", SYMLINK: b"2", CHARDEV: b"3", BLOCKDEV: b"4", DIR: b"5", FIFO: b"6"}
_COPY = 1 << 20
_ID_MAX = 8**7  # uid and gid fields: 7 octal digits
_NUMBER_MAX = 8**11  # size and mtime fields: 11 octal digits
_NS = 1_000_000_000


def pax_record(key: bytes, value: bytes) -> bytes:
    """One PAX record, its length field counting itself."""
    body = len(key) + len(value) + 3  # " ", "=", "\n"
    digits = len(str(body))
    length = body + digits
    if len(str(length)) != digits:
        length += 1
    return b"%d %s=%s\n" % (length, key, value)


def ustar_header(name: bytes, mode: int, size: int, mtime: int, typeflag: bytes, *, uid: int = 0, gid: int = 0,
                 linkname: bytes = b"", prefix: bytes = b"", uname: bytes = b"", gname: bytes = b"") -> bytes:
    """One ustar header block; the caller has made every field fit (longer values go in PAX records)."""
    h = bytearray(BLOCK)
    h[0 : len(name)] = name
    h[100:108] = b"%07o\0" % mode
    h[108:116] = b"%07o\0" % uid
    h[116:124] = b"%07o\0" % gid
    h[124:136] = b"%011o\0" % size
    h[136:148] = b"%011o\0" % mtime
    h[148:156] = b"        "
    h[156:157] = typeflag
    h[157 : 157 + len(linkname)] = linkname
    h[257:265] = b"ustar\x0000"
    h[265 : 265 + len(uname)] = uname
    h[297 : 297 + len(gname)] = gname
    h[329:337] = b"0000000\0"
    h[337:345] = b"0000000\0"
    h[345 : 345 + len(prefix)] = prefix
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def padding(size: int) -> bytes:
    """The zero bytes that fill a member's content up to a whole block."""
    return bytes(-size % BLOCK)


def split_ustar_name(path: bytes) -> tuple[bytes, bytes] | None:
    """(prefix, name) for the ustar fields, or None if the path does not fit."""
    if len(path) <= 100:
        return b"", path
    i = path.find(b"/", max(0, len(path) - 101))
    while 0 <= i <= 155:
        if 0 < i and len(path) - i - 1 <= 100 and i + 1 < len(path):
            return path[:i], path[i + 1 :]
        i = path.find(b"/", i + 1)
    return None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _pax_time(ns: int) -> bytes:
    """A PAX time: "[-]seconds[.nanoseconds]"."""
    sign = b"-" if ns < 0 else b""
    seconds, fraction = divmod(abs(ns), _NS)
    return sign + (b"%d.%09d" % (seconds, fraction) if fraction else b"%d" % seconds)


def member_header(
    name: bytes,
    kind: str,
    mode: int,
    *,
    size: int = 0,
    mtime_ns: int = 0,
    uid: int = 0,
    gid: int = 0,
    linkname: bytes = b"",
    xattrs: Iterable[tuple[bytes, bytes]] = (),
    uname: bytes = b"",
    gname: bytes = b"",
) -> bytes:
    """The header blocks of one member (see the module's rules); its content and padding follow."""
    if kind == DIR and not name.endswith(b"/"):
        name += b"/"
    records: list[bytes] = []
    split = split_ustar_name(name) if name.isascii() else None
    if split is None:
        records.append(pax_record(b"path", name))
        prefix, short = b"", name[:100] if name.isascii() else b"././@LongName"
    else:
        prefix, short = split
    short_link = linkname
    if len(linkname) > 100 or not linkname.isascii():
        records.append(pax_record(b"linkpath", linkname))
        short_link = linkname[:100] if linkname.isascii() else b""
    if not (_is_utf8(name) and _is_utf8(linkname)):
        records.insert(0, pax_record(b"hdrcharset", b"BINARY"))
    if uid >= _ID_MAX:
        records.append(pax_record(b"uid", b"%d" % uid))
        uid = 0
    if gid >= _ID_MAX:
        records.append(pax_record(b"gid", b"%d" % gid))
        gid = 0
    hsize = size
    if size >= _NUMBER_MAX:
        records.append(pax_record(b"size", b"%d" % size))
        hsize = 0
    mtime, fraction = divmod(mtime_ns, _NS)
    if fraction or not 0 <= mtime < _NUMBER_MAX:
        records.append(pax_record(b"mtime", _pax_time(mtime_ns)))
        if not 0 <= mtime < _NUMBER_MAX:
            mtime = 0
    for xname, value in xattrs:
        records.append(pax_record(b"SCHILY.xattr." + xname, value))
    member = ustar_header(short, mode & 0o7777, hsize, mtime, TYPEFLAGS[kind], uid=uid, gid=gid,
                          linkname=short_link, prefix=prefix, uname=uname, gname=gname)
    if not records:
        return member
    data = b"".join(records)
    pax = ustar_header(b"././@PaxHeader", 0o644, len(data), mtime, b"x", uname=uname, gname=gname)
    return pax + data + padding(len(data)) + member


class TarWriter:
    """Writes members to a binary stream; `close()` ends the archive and leaves the stream open.

    A member is `member()` and then exactly its size in content: from
    `write()` calls followed by `pad()`, or from a reader with
    `add_file()`. `uname`, `gname` and `mtime_ns` are the defaults of every
    member. `members` and `content_bytes` count what was written.
    """

    def __init__(self, out: Writable, *, mtime_ns: int = 0, uname: bytes = b"", gname: bytes = b"") -> None:
        self._out = out
        self._mtime_ns = mtime_ns
        self._uname = uname
        self._gname = gname
        self.members = 0
        self.content_bytes = 0

    def _write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            n = self._out.write(view)
            if n is None:
                raise OSError("non-blocking write on an archive stream")
            view = view[n:]

    def member(
        self,
        name: bytes,
        kind: str,
        mode: int,
        *,
        size: int = 0,
        mtime_ns: int | None = None,
        uid: int = 0,
        gid: int = 0,
        linkname: bytes = b"",
        xattrs: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        """The headers of one member."""
        self._write(member_header(
            name, kind, mode, size=size, mtime_ns=self._mtime_ns if mtime_ns is None else mtime_ns, uid=uid,
            gid=gid, linkname=linkname, xattrs=xattrs, uname=self._uname, gname=self._gname,
        ))
        self.members += 1

    def write(self, data: bytes | memoryview) -> None:
        """Content of the current member."""
        self._write(data)
        self.content_bytes += len(data)

    def pad(self, size: int) -> None:
        """The padding after a member's `size` bytes of content."""
        if size % BLOCK:
            self._write(padding(size))

    def add_file(self, name: bytes, mode: int, size: int, src: Readable) -> None:
        """A regular file of exactly `size` bytes read from `src`; EOFError if it ends early."""
        self.member(name, FILE, mode, size=size)
        left = size
        while left:
            data = src.read(min(_COPY, left))
            if not data:
                raise EOFError(f"{name.decode('utf-8', 'backslashreplace')}: the source ended {left} bytes early")
            self.write(data)
            left -= len(data)
        self.pad(size)

    def add_bytes(self, name: bytes, mode: int, data: bytes) -> None:
        """A regular file holding `data`."""
        self.add_file(name, mode, len(data), io.BytesIO(data))

    def close(self) -> None:
        self._write(END)
