"""One container of a stored pod checkpoint as a container checkpoint archive.

The archive is what CRI-O, Podman and checkpointctl read (see
docs/interop.md): the container's files at the top level, CRIU's images in
`checkpoint/`, `stats-dump` next to them, the pod's /dev/shm as
`devshm-checkpoint.tar`. What node-agent needs to rebuild the pod goes under
`node-agent/`, which other tools ignore. Every file is streamed from the
store; the archive is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import os
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, BinaryIO

import zstandard

from criu_bridge.tarstream import DIR
from criu_bridge.tarwrite import TarWriter
from node_agent import errors, podformat, strictjson
from node_agent.podformat import METADATA_KIND
from node_agent.interop import common as c
from node_agent.store import CheckpointRecord, Store

TYPE_CHECKING = False
if TYPE_CHECKING:
    from criu_bridge.tarwrite import Writable

COMPRESSIONS = ("none", "gzip", "zstd")


@dataclass(frozen=True)
class ExportReport:
    path: str
    checkpoint_id: str
    container: str
    size: int  # bytes of the archive as written
    members: int
    content_bytes: int  # file content inside the archive, uncompressed
    compression: str


def compression_for(path: str) -> str:
    """The compression an archive name asks for: .tar.gz/.tgz gzip, .tar.zst zstd, anything else none."""
    low = path.lower()
    if low.endswith((".tar.gz", ".tgz")):
        return "gzip"
    if low.endswith((".tar.zst", ".tar.zstd", ".tzst")):
        return "zstd"
    return "none"


def archive_path(store_path: str, container: str) -> str | None:
    """Where a store path of one container's checkpoint goes in its archive; None if it stays out."""
    base = podformat.container_dir(container) + "/"
    if store_path.startswith(base):
        rest = store_path[len(base) :]
        if rest == f"{c.CHECKPOINT_DIR}/{c.STATS_DUMP}":
            return c.STATS_DUMP
        top = rest.split("/", 1)[0]
        if top in c.RESERVED_TOP:
            raise errors.FailedPrecondition(
                f"container {container} has a file {rest!r} whose name the archive format reserves"
            )
        return rest
    if store_path == podformat.POD_DEVSHM:
        return c.DEVSHM_TAR
    if store_path == podformat.POD_DIR or store_path.startswith(podformat.POD_DIR + "/"):
        return c.OWN_DIR + "/" + store_path
    return None


def _container_entry(record: CheckpointRecord, container: str) -> Mapping[str, Any]:
    meta = record.metadata
    if not isinstance(meta, Mapping) or meta.get("kind") != METADATA_KIND:
        raise errors.FailedPrecondition(f"{record.id} is not a pod checkpoint")
    entries = meta.get("containers")
    names = []
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, Mapping):
            names.append(str(entry.get("name", "")))
            if entry.get("name") == container:
                return entry
    raise errors.NotFound(
        f"checkpoint {record.id} has no container {container!r} (it has: {', '.join(names) or 'none'})"
    )


def _plain(obj: Any) -> Any:
    """A deep copy of JSON-shaped data as plain dicts and lists (record metadata is read-only views)."""
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def status_dump(store: Store, record: CheckpointRecord, container: str) -> bytes:
    """status.dump: the container's CRI ContainerStatus as containerd 2.x writes and reads it (Go JSON).

    Made from config.dump (the CRI config, the image and its reference, the
    creation time): containerd's restore takes the container's name, labels,
    annotations and image from it; checkpointctl shows it.
    """
    path = podformat.container_path(container, c.CONFIG_DUMP)
    with store.open(record.id, path) as fh:
        if fh.size > 16 << 20:
            raise errors.DataLoss(f"checkpoint {record.id}: {path} is larger than 16 MiB")
        raw = fh.read(fh.size)
    try:
        doc = strictjson.loads(raw)
    except strictjson.StrictJsonError as exc:
        raise errors.DataLoss(f"checkpoint {record.id}: {path} {exc}") from exc
    if not isinstance(doc, Mapping):
        raise errors.DataLoss(f"checkpoint {record.id}: {path} is not a JSON object")
    raw_cfg = doc.get("config")
    cfg: Mapping[str, Any] = raw_cfg if isinstance(raw_cfg, Mapping) else {}
    created = 0
    try:
        created = int(datetime.fromisoformat(str(doc.get("createdTime", "")).replace("Z", "+00:00")).timestamp() * 1e9)
    except ValueError:
        pass
    raw_meta = cfg.get("metadata")
    meta: Mapping[str, Any] = raw_meta if isinstance(raw_meta, Mapping) else {}
    status = {
        "id": str(doc.get("id", "")),
        "metadata": {"name": str(meta.get("name") or container), "attempt": int(meta.get("attempt") or 0)},
        "state": 1,  # CONTAINER_RUNNING: it ran when it was checkpointed
        "created_at": created,
        "started_at": created,
        "image": {"image": str(doc.get("rootfsImageName") or "")},
        "image_ref": str(doc.get("rootfsImageRef") or ""),
        "labels": dict(cfg.get("labels") or {}),
        "annotations": dict(cfg.get("annotations") or {}),
        "mounts": list(cfg.get("mounts") or []),
        "log_path": str(doc.get("log_path") or ""),
    }
    return json.dumps(status, sort_keys=True).encode()


def own_manifest(record: CheckpointRecord, container: str) -> bytes:
    """node-agent/manifest.json: the checkpoint's metadata narrowed to this one container."""
    entry = _container_entry(record, container)
    meta = _plain(record.metadata)
    meta["containers"] = [_plain(entry)]
    doc = {
        "kind": c.EXPORT_KIND,
        "version": 1,
        "checkpoint": record.id,
        "container": container,
        "created": record.created,
        "metadata": meta,
    }
    return json.dumps(doc, sort_keys=True, indent=1).encode("utf-8")


def _mtime(created: str) -> int:
    """Every member's mtime: the checkpoint's creation, in whole seconds that fit a ustar header."""
    try:
        seconds = int(datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0
    return max(0, min(seconds, 8**11 - 1))


def _members(record: CheckpointRecord, container: str) -> list[tuple[str, str, Any]]:
    """(archive path, store path, entry) for every entry that goes into the archive, archive order."""
    out: list[tuple[str, str, Any]] = []
    seen: set[str] = set()
    for entry in record.files:
        arc = archive_path(entry.path, container)
        if arc is None or not arc:
            continue
        if arc in seen:
            raise errors.FailedPrecondition(f"checkpoint {record.id}: two files map to {arc!r} in the archive")
        seen.add(arc)
        out.append((arc, entry.path, entry))
    if not any(a == c.CONFIG_DUMP for a, _, _ in out) or not any(a == c.SPEC_DUMP for a, _, _ in out):
        raise errors.DataLoss(f"checkpoint {record.id}: container {container} has no config.dump or spec.dump")
    # The small documents an import needs first (after the manifest, which
    # export_container writes before everything), then the rest: parents
    # before children, a directory's own entry before what is in it.
    lead = {name: i for i, name in enumerate(c.LEAD_MEMBERS)}
    out.sort(key=lambda item: (lead.get(item[0], len(lead)), item[0].split("/")))
    return out


@contextlib.contextmanager
def _compressed(raw: BinaryIO, compression: str) -> Iterator[Writable]:
    if compression == "gzip":
        gz = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6)
        try:
            yield gz
        finally:
            gz.close()
    elif compression == "zstd":
        zw = zstandard.ZstdCompressor(level=3, threads=-1).stream_writer(raw, closefd=False, write_return_read=True)
        try:
            yield zw
        finally:
            zw.close()  # type: ignore[no-untyped-call]
    else:
        yield raw


def _os_error(exc: OSError, what: str) -> errors.AgentError:
    detail = f"{what}: {exc.strerror or exc}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return errors.ResourceExhausted(detail)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return errors.PermissionDenied(detail)
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return errors.InvalidArgument(detail)
    return errors.Internal(detail)


def export_container(
    store: Store,
    checkpoint_id: str,
    container: str,
    out_path: str,
    *,
    compression: str | None = None,
    overwrite: bool = False,
    plaintext: bool = False,
) -> ExportReport:
    """Write one container of a pod checkpoint as a checkpoint archive at `out_path`.

    `compression` is "none", "gzip" or "zstd"; by default the name decides
    (`compression_for`). An existing `out_path` is AlreadyExists unless
    `overwrite`. Archives are plaintext (other engines read them), so an
    encrypted checkpoint is exported only with `plaintext`.
    """
    record = store.get(checkpoint_id)
    record.require_open()
    if record.key_id and not plaintext:
        raise errors.FailedPrecondition(
            f"checkpoint {record.id} is encrypted (key id {record.key_id}) and an archive is plaintext: "
            "export it with --plaintext to copy its contents out in the clear"
        )
    c.check_container_name(container, "container")
    _container_entry(record, container)
    compression = compression or compression_for(out_path)
    if compression not in COMPRESSIONS:
        raise errors.InvalidArgument(f"compression {compression!r} is not one of {', '.join(COMPRESSIONS)}")
    members = _members(record, container)
    manifest = own_manifest(record, container)
    status = status_dump(store, record, container)
    out_path = os.path.abspath(out_path)
    directory, base = os.path.split(out_path)
    if not base:
        raise errors.InvalidArgument(f"{out_path!r} names no file")
    if not overwrite and os.path.lexists(out_path):
        raise errors.AlreadyExists(f"{out_path} exists")
    tmp = os.path.join(directory, f".{base}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise _os_error(exc, f"cannot create the archive in {directory}") from exc
    done = False
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as raw:
            with _compressed(raw, compression) as out:
                tw = TarWriter(out, mtime_ns=_mtime(record.created) * 1_000_000_000, uname=b"root", gname=b"root")
                tw.add_bytes(c.OWN_MANIFEST.encode(), 0o600, manifest)
                for arc, spath, entry in members:
                    if entry.type == "dir":
                        tw.member(arc.encode(), DIR, entry.mode)
                        continue
                    with store.open(record.id, spath) as fh:
                        tw.add_file(arc.encode(), entry.mode, fh.size, fh)
                tw.add_bytes(c.STATUS_DUMP.encode(), 0o600, status)
                tw.close()
            raw.flush()
            os.fsync(raw.fileno())
            size = os.fstat(raw.fileno()).st_size
        if overwrite:
            os.replace(tmp, out_path)
        else:
            try:
                os.link(tmp, out_path)
            except FileExistsError:
                raise errors.AlreadyExists(f"{out_path} exists") from None
            os.unlink(tmp)
        done = True
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except EOFError as exc:  # a stored file shorter than its record
        raise errors.DataLoss(str(exc)) from None
    except OSError as exc:
        raise _os_error(exc, f"writing {out_path}") from exc
    finally:
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return ExportReport(
        path=out_path, checkpoint_id=record.id, container=container, size=size,
        members=tw.members, content_bytes=tw.content_bytes, compression=compression,
    )
