"""The one CRIU image edit a foreign checkpoint needs: the root directory's mode.

CRIU records the mode of every open file, directories included, and refuses
to restore when it differs. A container's root directory is one of them (it
is each task's root and often its cwd). Its permission bits come from the
container engine's storage, not from the image: containers/storage (Podman,
CRI-O) makes the root of a layer that has no "./" entry 0555, containerd's
snapshotter makes it 0755. So a Podman checkpoint restored under containerd
fails with "File . has bad mode 040755 (expect 040555)".

`relax_root_dir_mode` drops the recorded mode from the regular-file entries
of files.img that name the root directory ("/"), so CRIU does not compare
it; every other entry, and every other byte of the image, stays as it was.

files.img is a CRIU image: two little-endian u32 magics, then entries, each
a little-endian u32 length and a protobuf `file_entry` (field 3, `reg`, a
`reg_file_entry` whose field 6 is the path and field 10 the mode). The
parser is strict and bounded: it is hostile input.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from node_agent import errors

IMG_COMMON_MAGIC = 0x54564319
FILES_MAGIC = 0x56303138
_FILE_ENTRY_REG = 3
_REG_NAME = 6
_REG_MODE = 10
_S_IFMT = 0o170000
_S_IFDIR = 0o040000
MAX_FILES_IMG = 64 << 20


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise errors.InvalidArgument("files.img: malformed varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, value or payload start, payload end, raw start) per field."""
    pos = start
    while pos < end:
        raw = pos
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise errors.InvalidArgument("files.img: field number 0")
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield number, wire, value, pos, raw
        elif wire == 1 or wire == 5:
            width = 8 if wire == 1 else 4
            if pos + width > end:
                raise errors.InvalidArgument("files.img: truncated field")
            yield number, wire, pos, pos + width, raw
            pos += width
        elif wire == 2:
            length, pos = _varint(buf, pos, end)
            if pos + length > end:
                raise errors.InvalidArgument("files.img: truncated field")
            yield number, wire, pos, pos + length, raw
            pos += length
        else:
            raise errors.InvalidArgument(f"files.img: unsupported wire type {wire}")


def _relax_reg(buf: bytes, start: int, end: int) -> bytes | None:
    """The reg_file_entry without its mode if it is the root directory; None to keep it."""
    name: bytes | None = None
    mode: int | None = None
    for number, wire, a, b, _ in _fields(buf, start, end):
        if number == _REG_NAME and wire == 2:
            name = buf[a:b]
        elif number == _REG_MODE and wire == 0:
            mode = a
    if name != b"/" or mode is None or mode & _S_IFMT != _S_IFDIR:
        return None
    kept = bytearray()
    for number, wire, _a, b, raw in _fields(buf, start, end):
        if number == _REG_MODE and wire == 0:
            continue
        kept += buf[raw:b]
    return bytes(kept)


def relax_root_dir_mode(data: bytes) -> tuple[bytes, int]:
    """files.img with the root directory's recorded mode dropped; (new image, entries changed)."""
    if len(data) > MAX_FILES_IMG:
        raise errors.ResourceExhausted(f"files.img of {len(data)} bytes is larger than {MAX_FILES_IMG}")
    if len(data) < 8:
        raise errors.InvalidArgument("files.img is truncated")
    magic1, magic2 = struct.unpack_from("<II", data, 0)
    if magic1 != IMG_COMMON_MAGIC or magic2 != FILES_MAGIC:
        raise errors.InvalidArgument("files.img does not start with CRIU's files image magic")
    out = bytearray(data[:8])
    pos = 8
    changed = 0
    while pos < len(data):
        if pos + 4 > len(data):
            raise errors.InvalidArgument("files.img: truncated entry length")
        (length,) = struct.unpack_from("<I", data, pos)
        start, end = pos + 4, pos + 4 + length
        if end > len(data):
            raise errors.InvalidArgument("files.img: truncated entry")
        pieces: list[bytes] = []
        touched = False
        for number, wire, a, b, raw in _fields(data, start, end):
            if number == _FILE_ENTRY_REG and wire == 2:
                reg = _relax_reg(data, a, b)
                if reg is not None:
                    pieces.append(_encode_varint((_FILE_ENTRY_REG << 3) | 2) + _encode_varint(len(reg)) + reg)
                    touched = True
                    continue
            pieces.append(data[raw:b])
        if touched:
            entry = b"".join(pieces)
            out += struct.pack("<I", len(entry)) + entry
            changed += 1
        else:
            out += data[pos:end]
        pos = end
    return bytes(out), changed
