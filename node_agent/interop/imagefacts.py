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
framing is read by `criu_bridge.criuimg`, strict and bounded: it is hostile
input, and its errors are InvalidArgument here.

`file_locks` lists the file locks a checkpoint's processes hold, by the
path each locked file has in the container, from four images:
``filelocks.img`` (kind, type, range, and the owner's PID and fd),
``ids-<pid>.img`` (the owner's fd table id; older layouts keep it in
``core-<pid>.img``), ``fdinfo-<id>.img`` (fd -> file id) and ``files.img``
(file id -> path).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from criu_bridge import criuimg as img
from criu_bridge.errors import InvalidInput, LimitExceeded
from node_agent import errors

_FILE_ENTRY_REG = 3
_REG_NAME = 6
_REG_MODE = 10
_S_IFMT = 0o170000
_S_IFDIR = 0o040000
MAX_FILES_IMG = 64 << 20

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _agent_errors(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """The image parser's InvalidInput as InvalidArgument, with the same message."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except LimitExceeded as exc:
            raise errors.ResourceExhausted(str(exc)) from None
        except InvalidInput as exc:
            raise errors.InvalidArgument(str(exc)) from None

    return wrapper


def _relax_reg(buf: bytes, start: int, end: int) -> bytes | None:
    """The reg_file_entry without its mode if it is the root directory; None to keep it."""
    name: bytes | None = None
    mode: int | None = None
    for number, wire, a, b, _ in img.fields(buf, start, end):
        if number == _REG_NAME and wire == img.LENGTH:
            name = buf[a:b]
        elif number == _REG_MODE and wire == img.VARINT:
            mode = a
    if name != b"/" or mode is None or mode & _S_IFMT != _S_IFDIR:
        return None
    kept = bytearray()
    for number, wire, _a, b, raw in img.fields(buf, start, end):
        if number == _REG_MODE and wire == img.VARINT:
            continue
        kept += buf[raw:b]
    return bytes(kept)


@_agent_errors
def relax_root_dir_mode(data: bytes) -> tuple[bytes, int]:
    """files.img with the root directory's recorded mode dropped; (new image, entries changed)."""
    if len(data) > MAX_FILES_IMG:
        raise errors.ResourceExhausted(f"files.img of {len(data)} bytes is larger than {MAX_FILES_IMG}")
    if len(data) < 8:
        raise errors.InvalidArgument("files.img is truncated")
    if struct.unpack_from("<II", data, 0) != (img.IMG_COMMON_MAGIC, img.FILES_MAGIC):
        raise errors.InvalidArgument("files.img does not start with CRIU's files image magic")
    out = bytearray(data[:8])
    changed = 0
    for start, end in img.entries(data, "files.img"):
        pieces: list[bytes] = []
        touched = False
        for number, wire, a, b, raw in img.fields(data, start, end):
            if number == _FILE_ENTRY_REG and wire == img.LENGTH:
                reg = _relax_reg(data, a, b)
                if reg is not None:
                    key = img.encode_varint((_FILE_ENTRY_REG << 3) | img.LENGTH)
                    pieces.append(key + img.encode_varint(len(reg)) + reg)
                    touched = True
                    continue
            pieces.append(data[raw:b])
        if touched:
            out += img.entry_bytes(b"".join(pieces))
            changed += 1
        else:
            out += data[start - 4 : end]
    return bytes(out), changed


# ---- file locks -------------------------------------------------------------------

FL_POSIX, FL_FLOCK, FL_OFD, FL_LEASE = 1, 2, 4, 8
F_WRLCK = 1
LOCK_MAND = 32


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _files_id(images: str, pid: int) -> int | None:
    """The fd table id of task `pid`: ids-<pid>.img (task_kobj_ids_entry), or the ids inside core-<pid>.img."""
    data = img.read_image(images, f"ids-{pid}.img")
    if data is not None:
        for start, end in img.entries(data, magic=img.IDS_MAGIC, what=f"ids-{pid}.img"):
            ids = img.varints(data, start, end)
            if 2 in ids:  # files_id
                return ids[2]
    data = img.read_image(images, f"core-{pid}.img")
    if data is None:
        return None
    for start, end in img.entries(data, magic=img.CORE_MAGIC, what=f"core-{pid}.img"):
        for n, w, a, b, _r in img.fields(data, start, end):
            if n == 4 and w == 2:  # core_entry.ids (task_kobj_ids_entry)
                ids = img.varints(data, a, b)
                if 2 in ids:  # files_id
                    return ids[2]
    return None


def _fd_files(images: str, files_id: int) -> dict[int, int]:
    """fd -> file id, from fdinfo-<files_id>.img."""
    data = img.read_image(images, f"fdinfo-{files_id}.img")
    out: dict[int, int] = {}
    if data is None:
        return out
    for start, end in img.entries(data, magic=img.FDINFO_MAGIC, what=f"fdinfo-{files_id}.img"):
        f = img.varints(data, start, end)
        if 1 in f and 4 in f:
            out[f[4]] = f[1]
    return out


def _reg_paths(images: str) -> dict[int, str]:
    """file id -> path of every regular-file entry of files.img."""
    data = img.read_image(images, "files.img")
    out: dict[int, str] = {}
    if data is None:
        return out
    for start, end in img.entries(data, magic=img.FILES_MAGIC, what="files.img"):
        fid = None
        name = None
        for n, w, a, b, _r in img.fields(data, start, end):
            if n == 2 and w == 0:
                fid = a
            elif n == _FILE_ENTRY_REG and w == 2:
                for rn, rw, ra, rb, _rr in img.fields(data, a, b):
                    if rn == _REG_NAME and rw == 2:
                        name = data[ra:rb].decode("utf-8", "replace")
        if fid is not None and name is not None:
            out[fid] = name
    return out


@_agent_errors
def file_locks(images: str) -> list[dict[str, object]]:
    """The file locks the checkpoint's processes hold: path, kind, write, start, len, pid, fd."""
    data = img.read_image(images, "filelocks.img")
    if data is None:
        return []
    raw = []
    for start, end in img.entries(data, magic=img.FILE_LOCKS_MAGIC, what="filelocks.img"):
        f = img.varints(data, start, end)
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
