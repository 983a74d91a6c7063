"""OCI images as `ctr images import` takes them: deterministic layers and image-layout archives.

A layer is a tar with every entry root-owned and dated 0; an archive is an
OCI image layout (oci-layout, index.json, blobs) as one tar stream, built in
memory from gzip layers, or streamed from and to files with uncompressed ones.

Rule: standard library only (see testbed/host.py).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import struct
import tarfile
from typing import Any

from testbed.host import PATH_ENV, TestbedError, run

def elf_is_static(path: str) -> bool:
    """True for an ELF executable without a program interpreter."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF":
            return False
        is64 = head[4] == 2
        end = "<" if head[5] == 1 else ">"
        if is64:
            phoff, = struct.unpack_from(end + "Q", head, 32)
            phentsize, phnum = struct.unpack_from(end + "HH", head, 54)
        else:
            phoff, = struct.unpack_from(end + "I", head, 28)
            phentsize, phnum = struct.unpack_from(end + "HH", head, 42)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            ptype, = struct.unpack(end + "I", f.read(4))
            if ptype == 3:  # PT_INTERP
                return False
    return True


def oci_platform() -> dict[str, str]:
    try:
        arch = run(["dpkg", "--print-architecture"]).stdout.decode().strip()
    except TestbedError:
        arch = os.uname().machine
    table = {
        "amd64": ("amd64", None), "x86_64": ("amd64", None),
        "arm64": ("arm64", None), "aarch64": ("arm64", None),
        "armhf": ("arm", "v7"), "i386": ("386", None),
        "ppc64el": ("ppc64le", None), "s390x": ("s390x", None), "riscv64": ("riscv64", None),
    }
    if arch not in table:
        raise TestbedError(f"unsupported architecture {arch}")
    goarch, variant = table[arch]
    platform = {"architecture": goarch, "os": "linux"}
    if variant:
        platform["variant"] = variant
    return platform


class Layer:
    """A deterministic tar layer (all entries root-owned, mtime 0)."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.GNU_FORMAT)
        self.dirs: set[str] = set()

    def _info(self, path: str, kind: bytes, mode: int) -> tarfile.TarInfo:
        info = tarfile.TarInfo(path.strip("/"))
        info.type = kind
        info.mode = mode
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mtime = 0
        return info

    def dir(self, path: str, mode: int = 0o755) -> None:
        path = path.strip("/")
        if not path or path in self.dirs:
            return
        self.dir(os.path.dirname(path))
        self.dirs.add(path)
        self.tar.addfile(self._info(path, tarfile.DIRTYPE, mode))

    def file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.dir(os.path.dirname(path.strip("/")))
        info = self._info(path, tarfile.REGTYPE, mode)
        info.size = len(data)
        self.tar.addfile(info, io.BytesIO(data))

    def symlink(self, path: str, target: str) -> None:
        self.dir(os.path.dirname(path.strip("/")))
        info = self._info(path, tarfile.SYMTYPE, 0o777)
        info.linkname = target
        self.tar.addfile(info)

    def finish(self) -> bytes:
        self.tar.close()
        return self.buf.getvalue()


def _json(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _blob(blobs: dict[str, bytes], data: bytes) -> tuple[str, int]:
    """Adds `data` to `blobs` by digest; returns its digest and size."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return digest, len(data)


def _documents(name: str, cmd: list[str], platform: dict[str, str], diff_ids: list[str],
               layer_descs: list[dict[str, Any]], blobs: dict[str, bytes]) -> bytes:
    """The image's config and manifest, added to `blobs`, and its index.json, which names it `name`."""
    config: dict[str, Any] = dict(platform)
    config.update({
        "created": "1970-01-01T00:00:00Z",
        "config": {"Env": [f"PATH={PATH_ENV}"], "Cmd": cmd, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": f"node-agent testbed {name}"}
                    for _ in diff_ids],
    })
    cfg_digest, cfg_size = _blob(blobs, _json(config))
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": cfg_digest, "size": cfg_size},
        "layers": layer_descs,
    }
    man_digest, man_size = _blob(blobs, _json(manifest))
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": man_digest, "size": man_size, "platform": platform,
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]},
        }],
    }
    return _json(index)


def oci_archive(name: str, layers: list[bytes], cmd: list[str], platform: dict[str, str]) -> bytes:
    """An OCI image layout as a tar stream, named `name` for `ctr images import`."""
    blobs: dict[str, bytes] = {}
    layer_descs, diff_ids = [], []
    for tar in layers:
        diff_ids.append("sha256:" + hashlib.sha256(tar).hexdigest())
        digest, size = _blob(blobs, gzip.compress(tar, compresslevel=6, mtime=0))
        layer_descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                            "digest": digest, "size": size})
    index = _documents(name, cmd, platform, diff_ids, layer_descs, blobs)
    out = Layer()
    out.file("oci-layout", b'{"imageLayoutVersion":"1.0.0"}', 0o644)
    out.file("index.json", index, 0o644)
    for digest in sorted(blobs):
        out.file("blobs/sha256/" + digest.split(":", 1)[1], blobs[digest], 0o644)
    return out.finish()


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 22)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


def oci_archive_file(name: str, layers: list[str], cmd: list[str], platform: dict[str, str], out: str) -> None:
    """Like `oci_archive`, but streamed from and to files, with uncompressed layers
    (application/vnd.oci.image.layer.v1.tar): the Debian image is hundreds of MiB,
    most of it packages and random weights that gzip would only slow down."""
    layer_digests = ["sha256:" + _sha256_file(p) for p in layers]
    small: dict[str, bytes] = {}
    layer_descs: list[dict[str, Any]] = [
        {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": os.path.getsize(p)}
        for d, p in zip(layer_digests, layers)]
    index = _documents(name, cmd, platform, layer_digests, layer_descs, small)
    entries: dict[str, Any] = dict(small)
    entries.update(zip(layer_digests, layers))
    tmp = f"{out}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT) as tar:
            def add(path: str, data: bytes | None = None, source: str | None = None) -> None:
                info = tarfile.TarInfo(path)
                info.mode, info.mtime, info.uname, info.gname = 0o644, 0, "root", "root"
                if source is not None:
                    info.size = os.path.getsize(source)
                    with open(source, "rb") as src:
                        tar.addfile(info, src)
                else:
                    assert data is not None
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))

            add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
            add("index.json", index)
            for digest in sorted(entries):
                path = "blobs/sha256/" + digest.split(":", 1)[1]
                value = entries[digest]
                add(path, source=value) if isinstance(value, str) else add(path, data=value)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
