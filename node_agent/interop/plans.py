"""What an import stores: each staged member's path in the pod checkpoint, and the checkpoint's metadata.

Two kinds of archive:

- node-agent's own (`node-agent/manifest.json` present): the mapping of
  `exporting.py` is undone file for file, so every file comes back
  byte-identical, and the metadata is the export's, checked, as are the
  pod's paths and what its configs would reach on the host;
- another engine's (Podman, CRI-O, containerd): the CRI configs are built by
  `foreign.synthesize`, the CPU description is this node's, and the root
  directory's mode is dropped from CRIU's files.img (`imagefacts`). containerd's
  writable layer becomes a diff (`layer`); its status.dump is read, bounded,
  for the container's name.

Paths follow the pod checkpoint format (`podformat`); no two members may
map to one file, and the documents a restore needs must be there.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from criu_bridge import tarstream
from node_agent import errors, podformat
from node_agent.interop import common as c
from node_agent.interop import foreign, imagefacts
from node_agent.interop.archive import IGNORED_TOP, check_nested_tar
from node_agent.interop.layer import layer_to_diff, unique
from node_agent.interop.landing import Meter, Staged, Staging
from node_agent.podformat import INTEROP_DIR, METADATA_KIND, parse_options
from node_agent.store import Store

# Top-level members of a foreign archive that are kept as they are.
FOREIGN_KEEP = frozenset({c.SPEC_DUMP, c.ROOTFS_DIFF, c.DELETED_FILES, c.OPAQUE_DIRS, c.DUMP_LOG})


def _path_list(staging: Staging, entry: Out | None, what: str, limits: c.ImportLimits) -> list[str]:
    """A foreign archive's deleted.files or opaque.dirs: a JSON list of paths (empty when absent)."""
    if entry is None:
        return []
    if entry.is_dir or not entry.staged:
        raise errors.InvalidArgument(f"{what} is not a file")
    value = c.parse_json(staging.read(entry.staged, limits.max_json_bytes, what), what, limits.max_json_bytes)
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise errors.InvalidArgument(f"{what} is not a JSON list of paths")
    return value


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, indent=1).encode("utf-8")


def _read_json(staging: Staging, entries: Mapping[str, Staged], path: str, limits: c.ImportLimits) -> Any:
    entry = entries.get(path)
    if entry is None or entry.kind != tarstream.FILE or entry.name is None:
        raise errors.InvalidArgument(f"the archive has no {path}")
    return c.parse_json(staging.read(entry.name, limits.max_json_bytes, path), path, limits.max_json_bytes)


def _check_pod_paths(pod_cfg: Mapping[str, Any], log_root: str | None) -> None:
    """The pod's log directory and cgroup parent: absolute, no '..'; the log directory under `log_root`."""
    linux = pod_cfg.get("linux")
    parent = linux.get("cgroup_parent") if isinstance(linux, Mapping) else None
    if parent not in (None, ""):
        text = c.bounded_str(parent, "pod cgroup_parent")
        if ".." in text.split("/"):
            raise errors.InvalidArgument(f"pod cgroup_parent {text!r} has a '..' component")
    value = pod_cfg.get("log_directory")
    if value in (None, ""):
        return
    path = c.bounded_str(value, "pod log_directory")
    parts = path.split("/")
    if not path.startswith("/") or ".." in parts:
        raise errors.InvalidArgument(f"pod log_directory {path!r} is not an absolute path without '..'")
    if log_root is not None:
        root = os.path.normpath(log_root)
        if os.path.dirname(os.path.normpath(path)) != root:
            raise errors.FailedPrecondition(f"pod log_directory {path!r} is not under {root}")


@dataclass(frozen=True)
class Out:
    path: str
    mode: int
    staged: str | None = None
    data: bytes | None = None
    is_dir: bool = False


def own_plan(
    staging: Staging, entries: Mapping[str, Staged], limits: c.ImportLimits, bounds: c.StagingBounds, *,
    namespace: str | None, name: str | None, log_root: str | None, allow_host_access: bool, kubelet_root: str,
    store_root: str,
) -> tuple[list[Out], dict[str, Any]]:
    """Undo exporting.archive_path; metadata from node-agent/manifest.json."""
    doc = _read_json(staging, entries, c.OWN_MANIFEST, limits)
    if not isinstance(doc, Mapping) or doc.get("kind") != c.EXPORT_KIND or doc.get("version") != 1:
        raise errors.InvalidArgument(f"{c.OWN_MANIFEST} is not a node-agent export manifest of version 1")
    container = c.check_container_name(doc.get("container"), f"{c.OWN_MANIFEST} container")
    meta = doc.get("metadata")
    if not isinstance(meta, Mapping) or meta.get("kind") != METADATA_KIND:
        raise errors.InvalidArgument(f"{c.OWN_MANIFEST} carries no pod checkpoint metadata")
    pod = meta.get("pod")
    if not isinstance(pod, Mapping):
        raise errors.InvalidArgument(f"{c.OWN_MANIFEST}: metadata has no pod")
    ns = c.check_name(namespace if namespace else pod.get("namespace"), "pod namespace")
    pod_name = c.check_name(name if name else pod.get("name"), "pod name")
    listed = meta.get("containers")
    if not isinstance(listed, list) or len(listed) != 1 or not isinstance(listed[0], Mapping):
        raise errors.InvalidArgument(f"{c.OWN_MANIFEST}: metadata must list exactly the exported container")
    entry = dict(listed[0])
    if entry.get("name") != container:
        raise errors.InvalidArgument(f"{c.OWN_MANIFEST}: metadata lists {entry.get('name')!r}, not {container!r}")
    for key in ("image", "image_ref", "id"):
        c.bounded_str(entry.get(key, ""), f"container {key}", allow_empty=True)
    options = meta.get("options") or {}
    if not isinstance(options, Mapping):
        raise errors.InvalidArgument(f"{c.OWN_MANIFEST}: malformed options")
    flags = parse_options({str(k): str(v) for k, v in options.items()})
    source = doc.get("checkpoint")
    out_meta = dict(meta)
    out_meta["pod"] = {**pod, "namespace": ns, "name": pod_name}
    out_meta["containers"] = [entry]
    out_meta["options"] = flags.as_options()
    out_meta["imported"] = {
        "format": "node-agent",
        "checkpoint": source if isinstance(source, str) and c.CHECKPOINT_ID_RE.fullmatch(source) else "",
        "at": _now(),
    }

    base = podformat.container_dir(container)
    plan: list[Out] = []
    for path, st in entries.items():
        if path == c.OWN_MANIFEST:
            continue
        if path == c.OWN_POD_DIR or path.startswith(c.OWN_POD_DIR + "/"):
            target: str | None = podformat.POD_DIR + path[len(c.OWN_POD_DIR) :]
        elif path == c.OWN_DIR or path.startswith(c.OWN_DIR + "/"):
            target = None
        elif path == c.DEVSHM_TAR:
            target = podformat.POD_DEVSHM
        elif path == c.STATS_DUMP:
            # Some engines keep it in checkpoint/ as well; that copy wins.
            stats_inside = f"{c.CHECKPOINT_DIR}/{c.STATS_DUMP}" in entries
            target = None if stats_inside else f"{base}/{c.CHECKPOINT_DIR}/{c.STATS_DUMP}"
        elif path.split("/", 1)[0] in IGNORED_TOP:
            target = None
        else:
            target = f"{base}/{path}"
        if target is None:
            continue
        if st.kind == tarstream.DIR:
            plan.append(Out(target, st.mode & 0o777, is_dir=True))
        else:
            plan.append(Out(target, st.mode & 0o777, staged=st.name))

    by_path = {o.path: o for o in plan}
    if len(by_path) != len(plan):
        raise errors.InvalidArgument("two archive members map to the same checkpoint file")
    for need in (f"{base}/{c.CONFIG_DUMP}", f"{base}/{c.SPEC_DUMP}", podformat.POD_CONFIG):
        if need not in by_path or by_path[need].is_dir:
            raise errors.InvalidArgument(f"the archive has no {need} (as node-agent stores it)")
    if not any(p.startswith(f"{base}/{c.CHECKPOINT_DIR}/") and not o.is_dir for p, o in by_path.items()):
        raise errors.InvalidArgument("the archive has no CRIU images (checkpoint/)")

    cfg = c.parse_json(staging.read(by_path[f"{base}/{c.CONFIG_DUMP}"].staged or "", limits.max_json_bytes, c.CONFIG_DUMP),
                       c.CONFIG_DUMP, limits.max_json_bytes)
    if not isinstance(cfg, Mapping) or not isinstance(cfg.get("config"), Mapping):
        raise errors.InvalidArgument("config.dump has no CRI container config")
    spec = c.parse_json(staging.read(by_path[f"{base}/{c.SPEC_DUMP}"].staged or "", limits.max_json_bytes, c.SPEC_DUMP),
                        c.SPEC_DUMP, limits.max_json_bytes)
    if not isinstance(spec, Mapping):
        raise errors.InvalidArgument("spec.dump is not a JSON object")
    pod_doc = c.parse_json(staging.read(by_path[podformat.POD_CONFIG].staged or "", limits.max_json_bytes, "pod config"),
                           "node-agent/pod/config.json", limits.max_json_bytes)
    if not isinstance(pod_doc, Mapping) or not isinstance(pod_doc.get("config"), Mapping):
        raise errors.InvalidArgument("node-agent/pod/config.json has no pod config")
    _check_pod_paths(pod_doc["config"], log_root)
    podformat.refuse_host_access(f"the archive of container {container}", pod_doc["config"],
                                 [(container, cfg["config"])], kubelet_root=kubelet_root, store_root=store_root,
                                 allowed=allow_host_access)
    for nested, what in ((f"{base}/{c.ROOTFS_DIFF}", c.ROOTFS_DIFF), (podformat.POD_DEVSHM, c.DEVSHM_TAR)):
        if nested in by_path and by_path[nested].staged:
            check_nested_tar(staging, by_path[nested].staged or "", what, limits, bounds)
    return plan, out_meta


def _marker_files(store: Store, paths: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """An empty file for each marker mount, under <store>/interop/<token>/; (dir, container path -> file)."""
    top = os.path.join(store.root, INTEROP_DIR)
    os.makedirs(top, mode=0o700, exist_ok=True)
    directory = os.path.join(top, secrets.token_hex(8))
    os.mkdir(directory, 0o700)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    out: dict[str, str] = {}
    try:
        for i, dest in enumerate(paths):
            fname = f"{i}-{os.path.basename(dest).lstrip('.') or 'file'}"
            fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
            os.close(fd)
            out[dest] = os.path.join(directory, fname)
    finally:
        os.close(dfd)
    return directory, out


def foreign_plan(
    store: Store, staging: Staging, meter: Meter, entries: Mapping[str, Staged], limits: c.ImportLimits,
    bounds: c.StagingBounds, opts: foreign.ForeignOptions, options: Mapping[str, str], cpuinfo: Callable[[str], None],
    cleanup: list[str],
) -> tuple[list[Out], dict[str, Any]]:
    cfg = _read_json(staging, entries, c.CONFIG_DUMP, limits)
    spec = _read_json(staging, entries, c.SPEC_DUMP, limits)
    if not isinstance(cfg, Mapping) or not isinstance(spec, Mapping):
        raise errors.InvalidArgument("config.dump and spec.dump must be JSON objects")
    if not any(p.startswith(c.CHECKPOINT_DIR + "/") and s.kind == tarstream.FILE for p, s in entries.items()):
        raise errors.InvalidArgument("the archive has no CRIU images (checkpoint/)")
    flags = parse_options(options)
    uid = str(uuid.uuid4())
    native = foreign.engine_of(spec) == "containerd"  # containerd's CRI CheckpointContainer
    status_name = ""
    status = entries.get(c.STATUS_DUMP)
    if native and status is not None:
        if status.kind != tarstream.FILE:
            raise errors.InvalidArgument(f"{c.STATUS_DUMP} is not a file")
        status_name = foreign.status_name(_read_json(staging, entries, c.STATUS_DUMP, limits), cfg)
    syn = foreign.synthesize(spec, cfg, opts, uid=uid, status_name=status_name)
    base = podformat.container_dir(syn.container)

    plan: list[Out] = []
    for path, st in entries.items():
        top = path.split("/", 1)[0]
        if top == c.CHECKPOINT_DIR:
            target: str | None = f"{base}/{path}"
        elif path == c.STATS_DUMP:
            stats_inside = f"{c.CHECKPOINT_DIR}/{c.STATS_DUMP}" in entries
            target = None if stats_inside else f"{base}/{c.CHECKPOINT_DIR}/{c.STATS_DUMP}"
        elif path == c.DEVSHM_TAR:
            target = podformat.POD_DEVSHM
        elif path in FOREIGN_KEEP:
            target = f"{base}/{path}"
        else:
            target = None
        if target is None:
            continue
        if st.kind == tarstream.DIR:
            plan.append(Out(target, (st.mode & 0o777) | 0o700, is_dir=True))
        else:
            plan.append(Out(target, (st.mode & 0o777) | 0o600, staged=st.name))
    by_path = {o.path: o for o in plan}
    if len(by_path) != len(plan):
        raise errors.InvalidArgument("two archive members map to the same checkpoint file")

    files_img = f"{base}/{c.CHECKPOINT_DIR}/files.img"
    if files_img in by_path and by_path[files_img].staged:
        old = by_path[files_img]
        data = staging.read(old.staged or "", imagefacts.MAX_FILES_IMG, "files.img")
        relaxed, _changed = imagefacts.relax_root_dir_mode(data)
        plan[plan.index(old)] = Out(files_img, old.mode, data=relaxed)
    deleted_path, opaque_path = f"{base}/{c.DELETED_FILES}", f"{base}/{c.OPAQUE_DIRS}"
    deleted = _path_list(staging, by_path.get(deleted_path), c.DELETED_FILES, limits)
    opaque = _path_list(staging, by_path.get(opaque_path), c.OPAQUE_DIRS, limits)
    diff_path = f"{base}/{c.ROOTFS_DIFF}"
    if native and diff_path in by_path and by_path[diff_path].staged:
        # An OCI layer: its whiteouts join the archive's own lists, the rest becomes a plain tar.
        old = by_path[diff_path]
        layer = layer_to_diff(staging, meter, old.staged or "", limits, bounds)
        if not any(o.staged == old.staged for o in plan if o is not old):  # not shared by a hardlink
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old.staged or "", dir_fd=staging.fd)
                meter.staged -= entries[c.ROOTFS_DIFF].size
        plan[plan.index(old)] = by_path[diff_path] = Out(diff_path, old.mode, staged=layer.staged)
        lists = {deleted_path: unique(deleted + layer.deleted), opaque_path: unique(opaque + layer.opaque)}
        if not lists[opaque_path]:
            del lists[opaque_path]
        if not lists[deleted_path] and opaque_path not in lists:
            del lists[deleted_path]  # the restore reads opaque.dirs only beside a deleted.files
        plan = [o for o in plan if o.path not in (deleted_path, opaque_path)]
        for target, paths in lists.items():
            data = _json_bytes(paths)
            if len(data) > limits.max_json_bytes:
                raise errors.ResourceExhausted(
                    f"{target.rsplit('/', 1)[-1]} of the layer's whiteouts: {len(data)} bytes is more than the "
                    f"limit of {limits.max_json_bytes} (max_json_bytes)"
                )
            plan.append(Out(target, 0o600, data=data))
        by_path = {o.path: o for o in plan}
    for nested, what in ((f"{base}/{c.ROOTFS_DIFF}", c.ROOTFS_DIFF), (podformat.POD_DEVSHM, c.DEVSHM_TAR)):
        if nested in by_path and by_path[nested].staged:
            check_nested_tar(staging, by_path[nested].staged or "", what, limits, bounds)

    config_dump = syn.config_dump
    interop_dir = ""
    if syn.marker_mounts:
        interop_dir, files = _marker_files(store, syn.marker_mounts)
        cleanup.append(interop_dir)
        for dest in syn.marker_mounts:
            config_dump["config"]["mounts"].append({"container_path": dest, "host_path": files[dest]})
    plan.append(Out(f"{base}/{c.CONFIG_DUMP}", 0o600, data=_json_bytes(config_dump)))
    plan.append(Out(podformat.POD_CONFIG, 0o600, data=_json_bytes(syn.pod_doc)))
    cpu_dir = os.path.join(staging.root, "cpuinfo")
    os.mkdir(cpu_dir, 0o700)
    cpuinfo(cpu_dir)
    cpu_file = os.path.join(cpu_dir, "cpuinfo.img")
    if not os.path.isfile(cpu_file) or os.path.islink(cpu_file):
        raise errors.FailedPrecondition("the CPU description (cpuinfo.img) was not written")
    plan.append(Out(podformat.POD_CPUINFO, 0o600, staged="cpuinfo/cpuinfo.img"))

    meta: dict[str, Any] = {
        "kind": METADATA_KIND,
        "version": 1,
        "created": _now(),
        "node": socket.gethostname(),
        "pod": {"id": "", "name": syn.pod_name, "namespace": syn.namespace, "uid": uid,
                "runtime_handler": opts.runtime_handler},
        "containers": [{"name": syn.container, "id": syn.original_id, "image": syn.image,
                        "image_ref": config_dump["rootfsImageRef"], "dump_ms": 0.0}],
        "frozen_ms": 0.0,
        "options": flags.as_options(),
        "criu_version": "",
        "imported": {"format": syn.engine, "container_id": syn.original_id, "container_name": syn.original_name,
                     "files": interop_dir, "at": _now()},
    }
    return plan, meta
