"""Reading CRIU images: the root directory's mode, and the file locks a restore takes.

The one CRIU image edit a foreign checkpoint needs: the root directory's mode.

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

`file_locks` lists the file locks a checkpoint's processes hold, by the
path each locked file has in the container, from four images:
``filelocks.img`` (kind, type, range, and the owner's PID and fd),
``ids-<pid>.img`` (the owner's fd table id; older layouts keep it in
``core-<pid>.img``), ``fdinfo-<id>.img`` (fd -> file id) and ``files.img``
(file id -> path).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

from node_agent import errors

IMG_COMMON_MAGIC = 0x54564319
FILES_MAGIC = 0x56303138
FILE_LOCKS_MAGIC = 0x54323616
FDINFO_MAGIC = 0x56213732
CORE_MAGIC = 0x55053847
IDS_MAGIC = 0x54432030
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
            raise errors.InvalidArgument("CRIU image: malformed varint")
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
            raise errors.InvalidArgument("CRIU image: field number 0")
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield number, wire, value, pos, raw
        elif wire == 1 or wire == 5:
            width = 8 if wire == 1 else 4
            if pos + width > end:
                raise errors.InvalidArgument("CRIU image: truncated field")
            yield number, wire, pos, pos + width, raw
            pos += width
        elif wire == 2:
            length, pos = _varint(buf, pos, end)
            if pos + length > end:
                raise errors.InvalidArgument("CRIU image: truncated field")
            yield number, wire, pos, pos + length, raw
            pos += length
        else:
            raise errors.InvalidArgument(f"CRIU image: unsupported wire type {wire}")


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


# ---- file locks -------------------------------------------------------------------

FL_POSIX, FL_FLOCK, FL_OFD, FL_LEASE = 1, 2, 4, 8
F_WRLCK = 1
LOCK_MAND = 32
MAX_IMAGE = 64 << 20


def _entries(data: bytes, magic: int, what: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each protobuf entry of an image with the given magic."""
    if len(data) < 8:
        raise errors.InvalidArgument(f"{what} is truncated")
    magic1, magic2 = struct.unpack_from("<II", data, 0)
    if magic1 != IMG_COMMON_MAGIC or magic2 != magic:
        raise errors.InvalidArgument(f"{what} does not start with CRIU's magic for it")
    pos = 8
    while pos < len(data):
        if pos + 4 > len(data):
            raise errors.InvalidArgument(f"{what}: truncated entry length")
        (length,) = struct.unpack_from("<I", data, pos)
        start, end = pos + 4, pos + 4 + length
        if end > len(data):
            raise errors.InvalidArgument(f"{what}: truncated entry")
        yield start, end
        pos = end


def _ints(data: bytes, start: int, end: int) -> dict[int, int]:
    """The varint fields of one message (the last of each number wins, as protobuf reads it)."""
    return {n: v for n, w, v, _b, _r in _fields(data, start, end) if w == 0}


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _read(images: str, name: str) -> bytes | None:
    path = os.path.join(images, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise errors.InvalidArgument(f"cannot read {name}: {exc.strerror}") from exc
    try:
        if os.fstat(fd).st_size > MAX_IMAGE:
            raise errors.ResourceExhausted(f"{name} is larger than {MAX_IMAGE} bytes")
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _files_id(images: str, pid: int) -> int | None:
    """The fd table id of task `pid`: ids-<pid>.img (task_kobj_ids_entry), or the ids inside core-<pid>.img."""
    data = _read(images, f"ids-{pid}.img")
    if data is not None:
        for start, end in _entries(data, IDS_MAGIC, f"ids-{pid}.img"):
            ids = _ints(data, start, end)
            if 2 in ids:  # files_id
                return ids[2]
    data = _read(images, f"core-{pid}.img")
    if data is None:
        return None
    for start, end in _entries(data, CORE_MAGIC, f"core-{pid}.img"):
        for n, w, a, b, _r in _fields(data, start, end):
            if n == 4 and w == 2:  # core_entry.ids (task_kobj_ids_entry)
                ids = _ints(data, a, b)
                if 2 in ids:  # files_id
                    return ids[2]
    return None


def _fd_files(images: str, files_id: int) -> dict[int, int]:
    """fd -> file id, from fdinfo-<files_id>.img."""
    data = _read(images, f"fdinfo-{files_id}.img")
    out: dict[int, int] = {}
    if data is None:
        return out
    for start, end in _entries(data, FDINFO_MAGIC, f"fdinfo-{files_id}.img"):
        f = _ints(data, start, end)
        if 1 in f and 4 in f:
            out[f[4]] = f[1]
    return out


def _reg_paths(images: str) -> dict[int, str]:
    """file id -> path of every regular-file entry of files.img."""
    data = _read(images, "files.img")
    out: dict[int, str] = {}
    if data is None:
        return out
    for start, end in _entries(data, FILES_MAGIC, "files.img"):
        fid = None
        name = None
        for n, w, a, b, _r in _fields(data, start, end):
            if n == 2 and w == 0:
                fid = a
            elif n == _FILE_ENTRY_REG and w == 2:
                for rn, rw, ra, rb, _rr in _fields(data, a, b):
                    if rn == _REG_NAME and rw == 2:
                        name = data[ra:rb].decode("utf-8", "replace")
        if fid is not None and name is not None:
            out[fid] = name
    return out


def file_locks(images: str) -> list[dict[str, object]]:
    """The file locks the checkpoint's processes hold: path, kind, write, start, len, pid, fd."""
    data = _read(images, "filelocks.img")
    if data is None:
        return []
    raw = []
    for start, end in _entries(data, FILE_LOCKS_MAGIC, "filelocks.img"):
        f = _ints(data, start, end)
        flag, ltype = f.get(1, 0), f.get(2, 0)
        if flag & FL_LEASE or ltype & LOCK_MAND:
            continue  # leases break instead of blocking; mandatory flocks are gone from Linux
        kind = "flock" if flag & FL_FLOCK else "ofd" if flag & FL_OFD else "posix" if flag & FL_POSIX else ""
        if not kind or ltype not in (0, 1):
            continue
        raw.append((kind, ltype == F_WRLCK, _signed64(f.get(3, 0)), _signed64(f.get(4, 0)),
                    max(0, _signed64(f.get(5, 0))), max(0, _signed64(f.get(6, 0)))))
    if not raw:
        return []
    paths = _reg_paths(images)
    out: list[dict[str, object]] = []
    tables: dict[int, dict[int, int]] = {}
    for kind, write, pid, fd, start, length in raw:
        if pid not in tables:
            fid = _files_id(images, pid)
            tables[pid] = _fd_files(images, fid) if fid is not None else {}
        path = paths.get(tables[pid].get(fd, -1))
        if path:
            out.append({"path": path, "kind": kind, "write": write, "start": start, "len": length,
                        "pid": pid, "fd": fd})
    return out
