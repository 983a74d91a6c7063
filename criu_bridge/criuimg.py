"""CRIU image framing: magics, length-prefixed entries, protobuf fields and varints.

A CRIU image is two little-endian u32 magics (the common one, then the
image's own), then entries, each a little-endian u32 length and one
protobuf message. Images come out of checkpoints, so they are hostile
input: every read is bounded by the entry it is in, a varint is at most
ten bytes, and wire types 3 and 4 (groups) and 6 and 7 are refused. Errors
are InvalidInput; the readers above (the interop import, the lazy
pagemaps) say what they mean to their callers.

Standard library only.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from criu_bridge.errors import InvalidInput, LimitExceeded

IMG_COMMON_MAGIC = 0x54564319
FILES_MAGIC = 0x56303138
FILE_LOCKS_MAGIC = 0x54323616
FDINFO_MAGIC = 0x56213732
CORE_MAGIC = 0x55053847
IDS_MAGIC = 0x54432030

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5  # the wire types an image may hold

_U32 = struct.Struct("<I")
_MAGICS = struct.Struct("<II")


def read_varint(buf: bytes, pos: int, end: int, what: str = "CRIU image") -> tuple[int, int]:
    """(value, position after it) of the varint at `pos`, which must end before `end`."""
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise InvalidInput(f"{what}: malformed varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def encode_varint(value: int) -> bytes:
    """A non-negative integer as a protobuf varint."""
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def fields(buf: bytes, start: int, end: int, what: str = "CRIU image") -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, a, b, raw start) for each field of the message in buf[start:end].

    For a varint `a` is its value and `b` where it ends; for the other wire
    types buf[a:b] is the payload. buf[raw start:b] is the whole field.
    """
    pos = start
    while pos < end:
        raw = pos
        key, pos = read_varint(buf, pos, end, what)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise InvalidInput(f"{what}: field number 0")
        if wire == VARINT:
            value, pos = read_varint(buf, pos, end, what)
            yield number, wire, value, pos, raw
        elif wire == FIXED64 or wire == FIXED32:
            width = 8 if wire == FIXED64 else 4
            if pos + width > end:
                raise InvalidInput(f"{what}: truncated field")
            yield number, wire, pos, pos + width, raw
            pos += width
        elif wire == LENGTH:
            length, pos = read_varint(buf, pos, end, what)
            if pos + length > end:
                raise InvalidInput(f"{what}: truncated field")
            yield number, wire, pos, pos + length, raw
            pos += length
        else:
            raise InvalidInput(f"{what}: unsupported wire type {wire}")


def varints(buf: bytes, start: int, end: int, what: str = "CRIU image") -> dict[int, int]:
    """The varint fields of one message (the last of each number wins, as protobuf reads it)."""
    return {n: v for n, w, v, _b, _r in fields(buf, start, end, what) if w == VARINT}


def entries(
    data: bytes, what: str, *, magic: int | None = None, max_entry: int | None = None
) -> Iterator[tuple[int, int]]:
    """(start, end) of each entry of an image.

    `magic`: the image's own magic, checked with the common one (None: the
    magics are skipped unread). `max_entry`: the largest entry allowed.
    """
    if len(data) < 8:
        raise InvalidInput(f"{what} is truncated")
    if magic is not None and _MAGICS.unpack_from(data, 0) != (IMG_COMMON_MAGIC, magic):
        raise InvalidInput(f"{what} does not start with CRIU's magic for it")
    pos = 8
    while pos < len(data):
        if pos + 4 > len(data):
            raise InvalidInput(f"{what}: truncated entry length")
        (length,) = _U32.unpack_from(data, pos)
        if max_entry is not None and length > max_entry:
            raise LimitExceeded(f"{what}: entry of {length} bytes at {pos} is out of bounds")
        start, end = pos + 4, pos + 4 + length
        if end > len(data):
            raise InvalidInput(f"{what}: truncated entry")
        yield start, end
        pos = end


MAX_IMAGE = 64 << 20


def read_image(directory: str, name: str, limit: int = MAX_IMAGE) -> bytes | None:
    """The bytes of image `name` in `directory`, at most `limit` of them; None when it is not there.

    Never follows a symbolic link; LimitExceeded past `limit` (counted as it
    is read, not trusted from the file's size), InvalidInput when it cannot
    be read.
    """
    import os

    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InvalidInput(f"cannot read {name}: {exc.strerror}") from exc
    try:
        chunks = []
        total = 0
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            total += len(b)
            if total > limit:
                raise LimitExceeded(f"{name} is larger than {limit} bytes")
            chunks.append(b)
        return b"".join(chunks)
    except OSError as exc:
        raise InvalidInput(f"cannot read {name}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def entry_bytes(payload: bytes) -> bytes:
    """One entry: the length prefix and the message."""
    return _U32.pack(len(payload)) + payload


_U32_MASK = (1 << 32) - 1
_U64_MASK = (1 << 64) - 1


class Message:
    """One protobuf message of an image, its fields by number, read as CRIU's protobuf-c reads them.

    A scalar's last occurrence wins, and an integer keeps only the bits of
    its declared width (protobuf-c reads the varint 2**32 as the uint32 0); a
    repeated scalar may come packed or one value at a time. A singular
    message field that occurs twice is refused: protobuf-c merges such
    occurrences, and a reader of hostile images must not guess how. A field
    of the wrong wire type is refused too, as protobuf-c refuses it.
    """

    def __init__(self, buf: bytes, start: int, end: int, what: str) -> None:
        self.buf = buf
        self.what = what
        self._fields: dict[int, list[tuple[int, int, int]]] = {}
        for number, wire, a, b, _raw in fields(buf, start, end, what):
            self._fields.setdefault(number, []).append((wire, a, b))

    def has(self, number: int) -> bool:
        return number in self._fields

    def _last(self, number: int, wire: int) -> tuple[int, int] | None:
        found = self._fields.get(number)
        if not found:
            return None
        for w, _a, _b in found:
            if w != wire:
                raise InvalidInput(f"{self.what}: field {number} has wire type {w}, not {wire}")
        return found[-1][1], found[-1][2]

    def uint32(self, number: int) -> int | None:
        got = self._last(number, VARINT)
        return None if got is None else got[0] & _U32_MASK

    def uint64(self, number: int) -> int | None:
        got = self._last(number, VARINT)
        return None if got is None else got[0] & _U64_MASK

    def int32(self, number: int) -> int | None:
        value = self.uint32(number)
        return None if value is None else value - (1 << 32) if value >> 31 else value

    def sint32(self, number: int) -> int | None:
        value = self.uint32(number)
        return None if value is None else (value >> 1) ^ -(value & 1)

    def boolean(self, number: int) -> bool | None:
        got = self._last(number, VARINT)
        return None if got is None else got[0] != 0

    def uint32s(self, number: int) -> list[int]:
        """Every value of a repeated uint32, packed or not."""
        out: list[int] = []
        for wire, a, b in self._fields.get(number, ()):
            if wire == VARINT:
                out.append(a & _U32_MASK)
            elif wire == LENGTH:
                pos = a
                while pos < b:
                    value, pos = read_varint(self.buf, pos, b, self.what)
                    out.append(value & _U32_MASK)
            else:
                raise InvalidInput(f"{self.what}: field {number} has wire type {wire}")
        return out

    def data(self, number: int) -> bytes | None:
        got = self._last(number, LENGTH)
        return None if got is None else bytes(self.buf[got[0] : got[1]])

    def text(self, number: int) -> str | None:
        raw = self.data(number)
        if raw is None:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput(f"{self.what}: field {number} is not UTF-8") from None

    def message(self, number: int, what: str = "") -> Message | None:
        """The singular message field `number` (None when absent)."""
        found = self._fields.get(number)
        if not found:
            return None
        if len(found) > 1:
            raise InvalidInput(f"{self.what}: message field {number} occurs {len(found)} times")
        return self.messages(number, what)[0]

    def messages(self, number: int, what: str = "") -> list[Message]:
        out = []
        for wire, a, b in self._fields.get(number, ()):
            if wire != LENGTH:
                raise InvalidInput(f"{self.what}: field {number} has wire type {wire}, not {LENGTH}")
            out.append(Message(self.buf, a, b, what or f"{self.what} field {number}"))
        return out


def read_messages(
    data: bytes, what: str, magic: int, *, first_only: bool = False, service: bool = False, max_entry: int | None = None
) -> list[Message]:
    """The entries of an image as messages, after checking its magics as CRIU does.

    `service`: an image with only its own magic (inventory.img). `first_only`:
    an image CRIU reads one entry of (a core, ids, creds or inventory image);
    anything after that entry is never read by CRIU, and not here either.
    """
    if service:
        if len(data) < 4 or _U32.unpack_from(data, 0)[0] != magic:
            raise InvalidInput(f"{what} does not start with CRIU's magic for it")
        data = b"\0" * 4 + data  # one magic less: align with the two-magic framing below
        pairs = entries(data, what, max_entry=max_entry)
    else:
        pairs = entries(data, what, magic=magic, max_entry=max_entry)
    out = []
    for start, end in pairs:
        out.append(Message(data, start, end, what))
        if first_only:
            break
    return out
