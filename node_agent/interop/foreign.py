"""CRI pod and container configs for a checkpoint another engine made.

A Podman, CRI-O or containerd archive carries the container's OCI spec
(`spec.dump`) and the engine's own `config.dump`, but no CRI configs. This
module builds them so that `restoring.py` can restore the container as a pod:

- names: the container name from config.dump (or the Kubernetes annotations
  of a CRI-O/containerd spec) made into a DNS label; the pod takes the
  container's name and the namespace "default" unless the caller or the
  annotations say otherwise;
- the image from config.dump's `rootfsImageName`, unless the caller names one;
- command, environment, working directory and user from the spec's process;
- namespaces: the container's own PID namespace (CRIU restores the dumped
  one), or, for a containerd container that shared its pod's PID namespace
  (the pause process's), the new pod's (runc dumped it as external, and the
  restored processes keep their PIDs in the one they are given); the pod's
  network namespace when the engine gave the container one by path (runc
  dumped it as external, and restores into the one it is given); IPC from
  the pod; host namespaces map to NODE, which restore refuses unless
  allowed; a PID namespace joined from another container is refused;
- mounts: every bind mount of the dump must be offered again at restore,
  since CRIU restores the mount tree and runc supplies bind mounts only by
  destination. /etc/hosts, /etc/hostname, /etc/resolv.conf and /dev/shm come
  with every CRI container; Podman's /run/.containerenv becomes a small file
  under the store; any other bind mount needs a host path from the caller
  (`volumes`), or the import is refused naming it.

Everything read from the archive is hostile: types, lengths and characters
are checked, and nothing from it reaches a host path.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from node_agent import errors
from node_agent.interop import common as c

ENGINE_MANAGER_ANNOTATION = "io.container.manager"
# Bind mounts every CRI container gets from its sandbox.
SANDBOX_MOUNTS = frozenset({"/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/dev/shm"})
# Bind mounts of engine marker files, offered again as an empty file.
MARKER_FILES = frozenset({"/run/.containerenv"})
# CRI NamespaceMode.
POD, CONTAINER, NODE = 0, 1, 2
IMPORTED_FROM = "node-agent.io/imported-from"
DEFAULT_LOG_ROOT = "/var/log/pods"
_MAX_ARGS = 4096
_MAX_ENV = 4096


@dataclass(frozen=True)
class ForeignOptions:
    namespace: str | None = None
    name: str | None = None  # pod name
    container_name: str | None = None
    image: str | None = None
    cgroup_parent: str | None = None
    log_root: str | None = None  # parent of the pod's log directory
    runtime_handler: str = ""
    volumes: Mapping[str, str] = field(default_factory=dict)  # container path -> host path


@dataclass(frozen=True)
class Synthesized:
    engine: str
    namespace: str
    pod_name: str
    container: str
    image: str
    original_id: str
    original_name: str
    pod_doc: dict[str, Any]  # pod/config.json
    config_dump: dict[str, Any]  # containers/<name>/config.dump
    marker_mounts: tuple[str, ...]  # container paths that need an empty file


def engine_of(spec: Mapping[str, Any]) -> str:
    ann = spec.get("annotations")
    ann = ann if isinstance(ann, Mapping) else {}
    manager = ann.get(ENGINE_MANAGER_ANNOTATION)
    if manager == "libpod":
        return "podman"
    if manager == "cri-o" or (not manager and any(isinstance(k, str) and k.startswith("io.kubernetes.cri-o.") for k in ann)):
        return "cri-o"
    if any(isinstance(k, str) and k.startswith("io.kubernetes.cri.") for k in ann):
        return "containerd"
    return "unknown"


def _annotation(spec: Mapping[str, Any], *keys: str) -> str:
    ann = spec.get("annotations")
    if isinstance(ann, Mapping):
        for key in keys:
            value = ann.get(key)
            if isinstance(value, str) and value:
                return value
    return ""


def _abs_path(value: object, what: str) -> str:
    path = c.bounded_str(value, what)
    if not path.startswith("/"):
        raise errors.InvalidArgument(f"{what} {path!r} is not an absolute path")
    if ".." in path.split("/"):
        raise errors.InvalidArgument(f"{what} {path!r} has a '..' component")
    return posixpath.normpath("/" + path.lstrip("/"))


def _str_list(value: object, what: str, limit: int) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > limit:
        raise errors.InvalidArgument(f"{what} must be a list of at most {limit} strings")
    out = []
    for item in value:
        if not isinstance(item, str) or len(item) > 1 << 20 or "\0" in item:
            raise errors.InvalidArgument(f"{what} holds something other than a string")
        out.append(item)
    return out


def _image(cfg: Mapping[str, Any], override: str | None) -> str:
    if override:
        return c.bounded_str(override, "image")
    for key in ("rootfsImageName", "RawImageName", "rootfsImage"):
        value = cfg.get(key)
        if isinstance(value, str) and value:
            image = c.bounded_str(value, f"config.dump {key}")
            if any(ch.isspace() for ch in image):
                raise errors.InvalidArgument(f"config.dump {key} {image!r} is not an image name")
            return image
    raise errors.FailedPrecondition("the archive names no image (config.dump has no rootfsImageName); pass one")


_PROC_NS_RE = re.compile(r"^/proc/([1-9][0-9]{0,9})/ns/(pid|ipc|uts|net)$")


def _sandbox_pid_namespace(paths: Mapping[str, str]) -> bool:
    """Whether a containerd spec's PID namespace path is its sandbox's.

    containerd joins a container (CRI pid POD) to the pause process's PID
    namespace as /proc/<sandbox pid>/ns/pid, and gives every container of the
    pod its IPC and UTS namespaces (and the network one, unless it is a named
    netns) from the same /proc/<sandbox pid>/ns/. A PID path of another
    process (CRI TARGET: another container's namespace) matches none of them.
    """
    match = _PROC_NS_RE.fullmatch(paths.get("pid", ""))
    if not match or match.group(2) != "pid":
        return False
    pid = match.group(1)
    others = {kind: f"/proc/{pid}/ns/{proc}" for kind, proc in (("ipc", "ipc"), ("uts", "uts"), ("network", "net"))}
    return any(paths.get(kind) == path for kind, path in others.items())


def _namespaces(spec: Mapping[str, Any], engine: str) -> dict[str, int]:
    linux = spec.get("linux")
    entries = linux.get("namespaces") if isinstance(linux, Mapping) else None
    if not isinstance(entries, list) or len(entries) > 64:
        raise errors.InvalidArgument("spec.dump has no linux.namespaces list")
    paths: dict[str, str] = {}  # type -> its path ("" when the container made its own)
    for ns in entries:
        if not isinstance(ns, Mapping) or not isinstance(ns.get("type"), str):
            raise errors.InvalidArgument("spec.dump: malformed namespace entry")
        path = ns.get("path")
        paths[ns["type"]] = path if isinstance(path, str) and len(path) <= 4096 else ""
    if "user" in paths:
        raise errors.FailedPrecondition(
            "the container ran in a user namespace (rootless or --userns); restoring it through CRI is not supported"
        )
    if "mount" not in paths:
        raise errors.FailedPrecondition("the container shared the host's mount namespace")
    pid = NODE if "pid" not in paths else CONTAINER
    if paths.get("pid"):
        if engine == "containerd" and _sandbox_pid_namespace(paths):
            # The pod's PID namespace (CRI pid POD): runc dumped it as external; the restore
            # joins the new pod's, where only its pause process (PID 1) runs.
            pid = POD
        else:
            raise errors.FailedPrecondition(
                "the container joined another container's PID namespace (Podman --pid container:..., CRI TARGET); "
                "a single-container archive cannot bring that namespace along, so it cannot be restored: "
                "checkpoint a container that has its own PID namespace or shares its pod's"
            )
    return {
        "network": NODE if "network" not in paths else POD,
        "pid": pid,
        "ipc": NODE if "ipc" not in paths else POD,
    }


def _mounts(spec: Mapping[str, Any], volumes: Mapping[str, str]) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    mounts = spec.get("mounts")
    if mounts is None:
        mounts = []
    if not isinstance(mounts, list) or len(mounts) > 1024:
        raise errors.InvalidArgument("spec.dump mounts must be a list")
    wanted: list[dict[str, Any]] = []
    markers: list[str] = []
    missing: list[str] = []
    for m in mounts:
        if not isinstance(m, Mapping):
            raise errors.InvalidArgument("spec.dump: malformed mount")
        options = _str_list(m.get("options"), "spec.dump mount options", 256)
        if m.get("type") != "bind" and "bind" not in options and "rbind" not in options:
            continue  # proc, sysfs, tmpfs, devpts, mqueue, cgroup: from the image or the runtime
        dest = _abs_path(m.get("destination"), "spec.dump mount destination")
        if dest in SANDBOX_MOUNTS:
            continue
        if dest in volumes:
            host = _abs_path(volumes[dest], f"host path for {dest}")
            wanted.append({"container_path": dest, "host_path": host, "readonly": "ro" in options})
        elif dest in MARKER_FILES:
            markers.append(dest)
        else:
            missing.append(dest)
    if missing:
        raise errors.FailedPrecondition(
            "the container had bind mounts that a restore must offer again: "
            + ", ".join(sorted(missing))
            + "; give each a host path (volumes)"
        )
    unused = sorted(set(volumes) - {w["container_path"] for w in wanted})
    if unused:
        raise errors.InvalidArgument(f"volumes name paths the container did not mount: {', '.join(unused)}")
    return wanted, tuple(markers)


def status_name(status: object, cfg: Mapping[str, Any]) -> str:
    """The container name in containerd's status.dump (its CRI ContainerStatus as JSON), checked.

    Only `id` (which must be config.dump's) and `metadata.name` are read;
    the labels, annotations, mounts, log path and image it also records are
    the source node's and never reach the new container.
    """
    if not isinstance(status, Mapping):
        raise errors.InvalidArgument("status.dump is not a JSON object")
    sid = status.get("id")
    if sid is not None:
        sid = c.bounded_str(sid, "status.dump id", 128, allow_empty=True)
        cid = cfg.get("id")
        if sid and isinstance(cid, str) and cid and sid != cid:
            raise errors.InvalidArgument(
                f"status.dump describes container {sid[:64]!r}, config.dump container {cid[:64]!r}"
            )
    meta = status.get("metadata")
    if meta is None:
        return ""
    if not isinstance(meta, Mapping):
        raise errors.InvalidArgument("status.dump metadata is not a JSON object")
    name = meta.get("name")
    return "" if name is None else c.bounded_str(name, "status.dump metadata.name", 253, allow_empty=True)


def synthesize(spec: Mapping[str, Any], cfg: Mapping[str, Any], opts: ForeignOptions, *, uid: str,
               status_name: str = "") -> Synthesized:
    """The CRI pod and container configs for a foreign archive's container.

    `status_name`: the container's name from containerd's status.dump, used
    when the spec's annotations name none.
    """
    engine = engine_of(spec)
    process = spec.get("process")
    if not isinstance(process, Mapping):
        raise errors.InvalidArgument("spec.dump has no process")
    if process.get("terminal") is True:
        raise errors.FailedPrecondition(
            "the container ran with a terminal (-t); CRI restores need a container without one"
        )
    linux = spec.get("linux")
    if isinstance(linux, Mapping) and linux.get("devices"):
        raise errors.FailedPrecondition("the container had device nodes added; importing those is not supported")
    args = _str_list(process.get("args"), "spec.dump process.args", _MAX_ARGS)
    if not args:
        raise errors.InvalidArgument("spec.dump process.args is empty")
    env = _str_list(process.get("env"), "spec.dump process.env", _MAX_ENV)
    cwd = _abs_path(process.get("cwd") or "/", "spec.dump process.cwd")
    user = process.get("user")
    user = user if isinstance(user, Mapping) else {}
    run_as: dict[str, Any] = {}
    for key, cri_key in (("uid", "run_as_user"), ("gid", "run_as_group")):
        value = user.get(key, 0)
        if type(value) is not int or not 0 <= value < 2**32 - 1:
            raise errors.InvalidArgument(f"spec.dump process.user.{key} is not a valid id")
        run_as[cri_key] = {"value": value}

    original_name = cfg.get("name")
    original_name = original_name if isinstance(original_name, str) else ""
    raw_container = opts.container_name or _annotation(
        spec, "io.kubernetes.container.name", "io.kubernetes.cri.container-name"
    ) or status_name or original_name
    container = c.dns_label(raw_container, "container")
    if opts.container_name:
        c.check_container_name(opts.container_name, "container name")
        container = opts.container_name
    namespace = opts.namespace or c.dns_label(
        _annotation(spec, "io.kubernetes.pod.namespace", "io.kubernetes.cri.sandbox-namespace"), "default"
    )
    c.check_name(namespace, "namespace")
    pod_name = opts.name or c.dns_label(
        _annotation(spec, "io.kubernetes.pod.name", "io.kubernetes.cri.sandbox-name"), container
    )
    c.check_name(pod_name, "pod name")
    image = _image(cfg, opts.image)
    ns_modes = _namespaces(spec, engine)
    mounts, markers = _mounts(spec, opts.volumes)
    original_id = cfg.get("id")
    original_id = original_id if isinstance(original_id, str) and len(original_id) <= 128 and original_id.isalnum() else ""
    hostname = spec.get("hostname")
    hostname = c.dns_label(hostname, pod_name[:63]) if isinstance(hostname, str) else pod_name[:63]

    log_root = _abs_path(opts.log_root or DEFAULT_LOG_ROOT, "log root")
    linux_pod: dict[str, Any] = {"security_context": {"namespace_options": dict(ns_modes)}}
    if opts.cgroup_parent:
        linux_pod["cgroup_parent"] = _abs_path(opts.cgroup_parent, "cgroup parent")
    pod_config: dict[str, Any] = {
        "metadata": {"name": pod_name, "namespace": namespace, "uid": uid, "attempt": 0},
        "hostname": hostname,
        "log_directory": posixpath.join(log_root, f"{namespace}_{pod_name}_{uid}"),
        "labels": {},
        "annotations": {IMPORTED_FROM: engine},
        "linux": linux_pod,
    }
    envs = []
    for item in env:
        key, eq, value = item.partition("=")
        if key:
            envs.append({"key": key, "value": value if eq else ""})
    container_config: dict[str, Any] = {
        "metadata": {"name": container, "attempt": 0},
        "image": {"image": image},
        "command": args,
        "args": [],
        "working_dir": cwd,
        "envs": envs,
        "mounts": mounts,
        "labels": {},
        "annotations": {IMPORTED_FROM: engine},
        "log_path": f"{container}/0.log",
        "linux": {"security_context": {"namespace_options": dict(ns_modes), **run_as}},
    }
    if cfg.get("privileged") is True:
        container_config["linux"]["security_context"]["privileged"] = True
    created = cfg.get("createdTime")
    config_dump = {
        "id": original_id,
        "name": container,
        "rootfsImage": image,
        "rootfsImageRef": c.bounded_str(cfg.get("rootfsImageID") or cfg.get("rootfsImageRef") or "", "image ID",
                                        allow_empty=True),
        "rootfsImageName": image,
        "runtime": "runc",
        "createdTime": created if isinstance(created, str) and len(created) <= 64 else "",
        "config": container_config,
        "log_path": "",
    }
    return Synthesized(
        engine=engine, namespace=namespace, pod_name=pod_name, container=container, image=image,
        original_id=original_id, original_name=c.bounded_str(original_name, "name", 253, allow_empty=True),
        pod_doc={"config": pod_config, "runtime_handler": opts.runtime_handler},
        config_dump=config_dump, marker_mounts=markers,
    )
