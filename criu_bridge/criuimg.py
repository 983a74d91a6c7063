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


def entry_bytes(payload: bytes) -> bytes:
    """One entry: the length prefix and the message."""
    return _U32.pack(len(payload)) + payload
