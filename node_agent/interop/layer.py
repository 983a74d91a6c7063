"""containerd's writable layer (an OCI image layer) as the diff a restore applies.

containerd's own archives (CRI CheckpointContainer) carry the writable
layer as an OCI image layer (gzip, zstd or plain, with whiteout files). It
becomes a plain tar plus the deleted.files and opaque.dirs lists
(`layer_to_diff`). Every header is checked as the restore's reader checks
it, and every byte written again is counted first (`staging.Meter`), so a
decompression bomb stops at the bounds.
"""

from __future__ import annotations

import gzip
import io
import os
from dataclasses import dataclass
from typing import Any

import zstandard

from criu_bridge import tarstream, tarwrite
from criu_bridge.errors import InvalidInput, LimitExceeded
from node_agent import errors
from node_agent.interop import common as c
from node_agent.interop.archive import ZSTD_MAX_WINDOW, Stream, normalize
from node_agent.interop.landing import COPY, Meter, Staging

# containerd's rootfs-diff.tar is an OCI image layer: deletions are empty files named
# ".wh.<name>", and ".wh..wh..opq" marks its directory opaque.
_WHITEOUT = ".wh."
_OPAQUE_MARK = ".wh..wh..opq"


@dataclass(frozen=True)
class Layer:
    staged: str  # the plain tar, without whiteouts
    deleted: list[str]  # paths the layer whites out, relative to the rootfs
    opaque: list[str]  # directories it marks opaque


class _LayerOut:
    """The plain tar a layer becomes: every write counted first, against one file's bound and the meter."""

    def __init__(self, fd: int, meter: Meter, bounds: c.StagingBounds) -> None:
        self._fd = fd
        self._meter = meter
        self._bounds = bounds
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        n = len(data)
        if self.size + n > self._bounds.member_bytes:
            raise errors.ResourceExhausted(
                f"rootfs-diff.tar: the uncompressed layer is larger than {self._bounds.member_bytes} bytes "
                f"({self._bounds.member_name()})"
            )
        self._meter.charge("'rootfs-diff.tar' (uncompressed)", n, self.size, self.size + n)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        self.size += n
        return n


def layer_to_diff(staging: Staging, meter: Meter, name: str, limits: c.ImportLimits,
                   bounds: c.StagingBounds) -> Layer:
    """containerd's rootfs-diff.tar (an OCI layer; gzip, zstd or plain) as the restore applies a diff.

    Every header is checked as the restore's reader checks it (no devices,
    no escaping names, hardlinks only to files earlier in the layer); the
    whiteouts become the deleted and opaque lists, everything else is
    written again, without compression, into a new staged file, each byte
    counted before it is written, so a decompression bomb stops at the bounds.
    """
    what = "rootfs-diff.tar"
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=staging.fd)
    raw = io.BufferedReader(io.FileIO(fd, "rb"), COPY)
    inner: Any = raw
    try:
        out_name, out_fd = staging.create()
    except BaseException:
        raw.close()
        raise
    out = _LayerOut(out_fd, meter, bounds)
    tar = tarwrite.TarWriter(out)
    deleted: list[str] = []
    opaque: list[str] = []
    files: set[str] = set()  # regular files written so far: the only hardlink targets
    seen: dict[str, str] = {}
    try:
        head = raw.peek(4)[:4]
        if not head:
            return Layer(out_name, [], [])
        if head.startswith(b"\x1f\x8b"):
            inner = Stream(gzip.GzipFile(fileobj=raw, mode="rb"), f"{what} gzip")
        elif head.startswith(b"\x28\xb5\x2f\xfd"):
            dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
            inner = Stream(dctx.stream_reader(raw, read_across_frames=True, closefd=False), f"{what} zstd")
        stream = tarstream.TarStream(tarstream.StreamSource(inner), pax_nul_ends=True, pax_text_keys=True)
        count = 0
        while True:
            h = stream.next()
            if h is None:
                break
            count += 1
            if count > limits.max_members:
                raise errors.ResourceExhausted(f"{what} has more than {limits.max_members} members (max_members)")
            path = normalize(h.name, limits, f"{what} member")
            if path is None:
                continue  # the rootfs itself
            shown = repr(path[:200])
            parts = path.split("/")
            if any(part.startswith(_WHITEOUT) for part in parts[:-1]):
                raise errors.InvalidArgument(f"{what} member {shown} lies under a whiteout")
            base, parent = parts[-1], "/".join(parts[:-1])
            if base.startswith(_WHITEOUT):
                if h.kind != tarstream.FILE:
                    raise errors.InvalidArgument(
                        f"{what} member {shown}: a whiteout that is not a regular file ({h.kind})"
                    )
                if base == _OPAQUE_MARK:
                    if not parent:
                        raise errors.InvalidArgument(f"{what} member {shown} marks the rootfs itself opaque")
                    opaque.append(parent)
                else:
                    gone = base[len(_WHITEOUT) :]
                    if gone in ("", ".", "..") or gone.startswith(_WHITEOUT):
                        raise errors.InvalidArgument(f"{what} member {shown}: a whiteout that names no file")
                    deleted.append(f"{parent}/{gone}" if parent else gone)
                continue
            previous = seen.get(path)
            if previous is not None and not (previous == tarstream.DIR and h.kind == tarstream.DIR):
                raise errors.InvalidArgument(f"{what} member {shown} appears twice")
            seen[path] = h.kind
            link = b""
            if h.kind == tarstream.HARDLINK:
                target = normalize(h.linkname, limits, f"{what} hardlink target of {shown}")
                if target is None or target not in files:
                    raise errors.InvalidArgument(
                        f"{what} member {shown} is a hardlink to something other than a regular file earlier in it"
                    )
                link = target.encode("utf-8")
            elif h.kind == tarstream.SYMLINK:
                link = h.linkname
                if not link or b"\0" in link or len(link) > limits.max_path_bytes:
                    raise errors.InvalidArgument(f"{what} member {shown}: a symlink with a bad target")
            elif h.kind == tarstream.FILE:
                if h.size > bounds.member_bytes:
                    raise errors.ResourceExhausted(
                        f"{what} member {shown}: {h.size} bytes is more than the limit of {bounds.member_bytes} "
                        f"({bounds.member_name()})"
                    )
                files.add(path)
            # Kept as written: mode, owner, mtime (to the nanosecond), xattrs.
            uid, gid = h.owner()
            mtime_ns = max(0, h.mtime_ns())
            size = h.size if h.kind == tarstream.FILE else 0
            tar.member(path.encode("utf-8"), h.kind, h.mode(), size=size, mtime_ns=mtime_ns, uid=uid, gid=gid,
                       linkname=link, xattrs=h.xattrs)
            left = size
            while left:
                data = stream.read(min(COPY, left))
                if not data:
                    raise errors.InvalidArgument(f"{what} member {shown} is truncated")
                tar.write(data)
                left -= len(data)
            tar.pad(size)
        tar.close()
    except LimitExceeded as exc:
        raise errors.ResourceExhausted(f"{what}: {exc}") from None
    except InvalidInput as exc:
        raise errors.InvalidArgument(f"{what}: {exc}") from None
    finally:
        os.close(out_fd)
        if inner is not raw:
            inner.close()
        raw.close()
    return Layer(out_name, unique(deleted), unique(opaque))


def unique(paths: list[str]) -> list[str]:
    return list(dict.fromkeys(paths))
