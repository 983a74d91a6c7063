"""The pod checkpoint format: what a pod checkpoint in the store holds, and how it is read back.

A pod checkpoint is a store checkpoint (docs/store.md) whose metadata has
kind `METADATA_KIND` and whose files are laid out as:

    pod/config.json                     the pod's CRI PodSandboxConfig and runtime handler
    pod/cpuinfo/cpuinfo.img             CRIU's account of the checkpointing node's CPU
    pod/devshm.tar, pod/devshm.deleted  the pod's own /dev/shm, when it has one
    containers/<name>/config.dump       the container's identity and CRI ContainerConfig
    containers/<name>/spec.dump         its OCI spec
    containers/<name>/checkpoint/       CRIU's images (pagemap-<id>.img, pages-<id>.img, ...)
    containers/<name>/predump/          the pre-dump the final images build on, if any
    containers/<name>/rootfs-diff.tar   its writable layer's diff, with deleted.files
                                        (and opaque.dirs, `criu_bridge.rootfs`)
    containers/<name>/dump.log          CRIU's log of the dump

The checkpointer writes it (`checkpointing`), restores read it back
(`restoring`, the CRI endpoint), and interop converts single-container
archives to and from it. Every path into this layout is built here.

A checkpoint is hostile input. `load_saved` checks what it says about its
pod (names, configs against the CRI schema, recorded options) before
anything uses it, and `check_host_access` refuses configs that reach into
the host (`hostaccess`) unless the caller allowed that.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from criu_bridge import taskimages
from criu_bridge.errors import BridgeError
from criu_bridge.runtime import CHECKPOINT_OPTIONS, RECORDED_OPTIONS, CheckpointFlags
from node_agent import errors, hostaccess, strictjson
from node_agent.config.schema import Settings
from node_agent.options import boolean
from node_agent.store import CheckpointRecord, Store

METADATA_KIND = "node-agent.pod-checkpoint"
# Manifest annotations (OCI): describe the checkpoint to registries and tools.
ANNOTATION_PREFIX = "io.node-agent.checkpoint"
POD_ANNOTATION = "io.node-agent.pod"  # "namespace/name": the retention group

# ---- the layout -------------------------------------------------------------

POD_DIR = "pod"
POD_CONFIG = "pod/config.json"
POD_CPUINFO_DIR = "pod/cpuinfo"
POD_CPUINFO = "pod/cpuinfo/cpuinfo.img"
POD_DEVSHM = "pod/devshm.tar"
POD_DEVSHM_DELETED = "pod/devshm.deleted"
CONTAINERS_DIR = "containers"
# In a container's directory.
IMAGES_DIR = "checkpoint"
PREDUMP_DIR = "predump"
CONFIG_DUMP = "config.dump"
SPEC_DUMP = "spec.dump"
DUMP_LOG = "dump.log"
# The store's directory of the files the agent made for imported archives
# (their marker mounts, `interop.archive_import`): not host access.
INTEROP_DIR = "interop"

# A task's pagemap in a container's images, and the pages file it describes.
PAGEMAP_PATH = re.compile(r"^containers/([^/]+)/checkpoint/pagemap-([0-9]{1,10})\.img$")
PAGES_PATH = re.compile(r"^containers/[^/]+/checkpoint/pages-[0-9]{1,10}\.img$")
# What a restore through a Pod reads before its sandbox is made: the saved configs it
# is admitted by (`load_saved`) and the CPU features it is checked against.
SANDBOX_PATH = re.compile(r"^(pod/config\.json|pod/cpuinfo/[^/]+|containers/[^/]+/(config|spec)\.dump)$")


def container_dir(name: str) -> str:
    """``containers/<name>``: one container's part of the checkpoint."""
    return f"{CONTAINERS_DIR}/{name}"


def container_path(name: str, *parts: str) -> str:
    """``containers/<name>/<parts...>``."""
    return "/".join((container_dir(name), *parts))


def image_path(name: str, image: str) -> str:
    """``containers/<name>/checkpoint/<image>``: one of a container's CRIU images."""
    return container_path(name, IMAGES_DIR, image)


# ---- checkpoint options -----------------------------------------------------

# Options handled by the agent itself rather than passed to runc.
AGENT_OPTIONS = ("pre-dump",)
SUPPORTED_OPTIONS = tuple(sorted((*CHECKPOINT_OPTIONS, *AGENT_OPTIONS)))

# What a new checkpoint does unless its options say otherwise. File locks are
# on, as LXC has them: databases, lock files and pid files are everywhere,
# and CRIU refuses to dump a process that holds a lock without them.
CHECKPOINT_DEFAULTS = {"file_locks": True}


def parse_options(options: Mapping[str, str]) -> CheckpointFlags:
    """The options a checkpoint was made with, as runc flags (absent: off); anything undocumented is refused."""
    return parse_all_options(options, defaults=False)[0]


def parse_all_options(options: Mapping[str, str], *, defaults: bool = True) -> tuple[CheckpointFlags, bool | None]:
    """(runc flags, pre-dump wish: True/False, or None for the node's default) of a checkpoint to make.

    `defaults`: options not given take `CHECKPOINT_DEFAULTS` (a new
    checkpoint); without, they are off (options recorded with a dump).
    """
    values: dict[str, bool] = dict(CHECKPOINT_DEFAULTS) if defaults else {}
    pre_dump: bool | None = None
    for key, raw in options.items():
        if key not in SUPPORTED_OPTIONS and (defaults or key not in RECORDED_OPTIONS):
            raise errors.InvalidArgument(
                f"unknown checkpoint option {key!r} (supported: {', '.join(SUPPORTED_OPTIONS)})"
            )
        flag = boolean(raw, f"checkpoint option {key!r}")
        if key == "pre-dump":
            pre_dump = flag
        else:
            values[key.replace("-", "_")] = flag
    return CheckpointFlags(**values), pre_dump


# ---- manifest annotations ---------------------------------------------------

_OCI_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le", "s390x": "s390x"}


def manifest_annotations(meta: Mapping[str, Any]) -> dict[str, str]:
    """OCI manifest annotations that describe a checkpoint to registries and tools."""
    pod = meta["pod"]
    uname = os.uname()
    p = ANNOTATION_PREFIX
    return {
        POD_ANNOTATION: f"{pod['namespace']}/{pod['name']}",
        f"{p}.pod.namespace": str(pod["namespace"]),
        f"{p}.pod.name": str(pod["name"]),
        f"{p}.pod.uid": str(pod["uid"]),
        f"{p}.containers": ",".join(c["name"] for c in meta["containers"]),
        f"{p}.images": ",".join(c["image"] for c in meta["containers"]),
        f"{p}.criu.version": str(meta.get("criu_version", "")),
        f"{p}.kernel": uname.release,
        f"{p}.architecture": _OCI_ARCH.get(uname.machine, uname.machine),
        f"{p}.node": str(meta.get("node", "")),
        f"{p}.frozen-ms": f"{float(meta.get('frozen_ms', 0.0)):.1f}",
        f"{p}.pre-dump": "true" if meta.get("pre_dump") else "false",
    }


def namespace_of(record: CheckpointRecord) -> str:
    """The namespace a checkpoint's pod was in, as its metadata says ("" when it says none).

    A locked checkpoint (its key is not here) says it only in the clear
    annotation `POD_ANNOTATION`.
    """
    pod = record.metadata.get("pod") if isinstance(record.metadata, Mapping) else None
    ns = pod.get("namespace") if isinstance(pod, Mapping) else None
    if isinstance(ns, str):
        return ns
    return record.annotations.get(POD_ANNOTATION, "").partition("/")[0] if record.locked else ""


# ---- reading a saved checkpoint back ----------------------------------------

NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
CONTAINER_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,251}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class SavedPod:
    """What a checkpoint says about its pod, checked as hostile input."""

    namespace: str
    name: str
    pod_config: Mapping[str, Any]
    containers: tuple[tuple[str, Mapping[str, Any], Mapping[str, Any]], ...]  # name, config.dump, spec
    options: tuple[str, ...]


def check_name(what: str, value: str, rx: re.Pattern[str] = NAME_RE) -> str:
    """`value` if it is a valid name (a DNS subdomain, or `rx`), else INVALID_ARGUMENT."""
    if not isinstance(value, str) or not rx.fullmatch(value):
        raise errors.InvalidArgument(f"{what} {value!r} is not a valid name")
    return value


def _read_bytes(store: Store, record: CheckpointRecord, path: str, limit: int = 16 << 20) -> bytes:
    with store.open(record, path) as fh:
        if fh.size > limit:
            raise errors.DataLoss(f"checkpoint {record.id}: {path} is larger than {limit} bytes")
        return fh.read(fh.size)


def _read_json(store: Store, record: CheckpointRecord, path: str, limit: int = 16 << 20) -> Any:
    data = _read_bytes(store, record, path, limit)
    try:
        return strictjson.loads(data)
    except strictjson.StrictJsonError as exc:
        raise errors.DataLoss(f"checkpoint {record.id}: {path} {exc}") from exc


def shares_pids(config: Mapping[str, Any]) -> bool:
    """Whether a container of this CRI container config (JSON form) joins a PID namespace it shares with
    others: the pod's (``pid`` POD, also when no namespace options are given, as the runtime takes them) or
    a target container's (TARGET). Its own (CONTAINER) and the node's (NODE) are not shared with the pod."""
    opts: Any = config
    for key in ("linux", "security_context", "namespace_options"):
        opts = opts.get(key) if isinstance(opts, Mapping) else None
    return (opts.get("pid", 0) if isinstance(opts, Mapping) else 0) in (0, "POD", 3, "TARGET")


def highest_pid(store: Store, record: CheckpointRecord, saved: SavedPod) -> int:
    """The highest PID any of the checkpoint's containers takes back when restored (their ``pstree.img``).

    Where the pod's containers share one PID namespace, each restore first
    moves that namespace's next PID past it (`criu_bridge.pidns`), so what
    a container restored earlier forks cannot take a PID a later one needs.
    Read only for a container that joins one (`shares_pids`).
    """
    top = 0
    for cname, _cfg, _spec in saved.containers:
        path = image_path(cname, "pstree.img")
        try:
            top = max(top, taskimages.highest_pid(_read_bytes(store, record, path)))
        except errors.NotFound as exc:
            raise errors.DataLoss(f"checkpoint {record.id}: container {cname} has no {path}") from exc
        except BridgeError as exc:
            raise errors.DataLoss(f"checkpoint {record.id}: {path}: {exc}") from exc
    return top


def _schema(checkpoint_id: str, path: str, config: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """A saved config, checked against the CRI schema (unknown fields refused) and normalized."""
    # Imported here: the schema brings in grpc and the CRI stubs, which the
    # page source process (`lazy.source`, the layout only) does without.
    from node_agent.cri.client import normalized

    try:
        return normalized(config, kind)
    except errors.InvalidArgument as exc:
        raise errors.DataLoss(f"checkpoint {checkpoint_id}: {path}: {exc}") from exc


def load_saved(store: Store, record: CheckpointRecord) -> SavedPod:
    """The pod a checkpoint holds: FAILED_PRECONDITION if it is no pod checkpoint, DATA_LOSS if it is malformed."""
    meta = record.metadata
    if not isinstance(meta, Mapping) or meta.get("kind") != METADATA_KIND:
        raise errors.FailedPrecondition(f"{record.id} is not a pod checkpoint")
    pod = meta.get("pod")
    if not isinstance(pod, Mapping):
        raise errors.DataLoss(f"checkpoint {record.id}: metadata has no pod")
    ns = check_name("checkpointed namespace", pod.get("namespace", ""))
    name = check_name("checkpointed pod name", pod.get("name", ""))
    paths = {f.path for f in record.files}
    pod_doc = _read_json(store, record, POD_CONFIG)
    if not isinstance(pod_doc, Mapping) or not isinstance(pod_doc.get("config"), Mapping):
        raise errors.DataLoss(f"checkpoint {record.id}: {POD_CONFIG} has no config")
    pod_cfg = _schema(record.id, POD_CONFIG, pod_doc["config"], "pod")
    containers = []
    entries = meta.get("containers")
    if not isinstance(entries, list) or not entries:
        raise errors.DataLoss(f"checkpoint {record.id}: metadata lists no containers")
    for c in entries:
        cname = check_name("checkpointed container name", c.get("name", "") if isinstance(c, Mapping) else "",
                           CONTAINER_NAME_RE)
        config_path, spec_path = container_path(cname, CONFIG_DUMP), container_path(cname, SPEC_DUMP)
        if config_path not in paths or spec_path not in paths:
            raise errors.DataLoss(f"checkpoint {record.id}: container {cname} has no config.dump or spec.dump")
        cfg = _read_json(store, record, config_path)
        spec = _read_json(store, record, spec_path, limit=64 << 20)
        if not isinstance(cfg, Mapping) or not isinstance(cfg.get("config"), Mapping) or not isinstance(spec, Mapping):
            raise errors.DataLoss(f"checkpoint {record.id}: container {cname} has a malformed config.dump or spec.dump")
        cfg = {**cfg, "config": _schema(record.id, config_path, cfg["config"], "container")}
        containers.append((cname, cfg, spec))
    if len({c[0] for c in containers}) != len(containers):
        raise errors.DataLoss(f"checkpoint {record.id}: container names repeat")
    opts = meta.get("options") or {}
    if not isinstance(opts, Mapping):
        raise errors.DataLoss(f"checkpoint {record.id}: malformed options")
    try:
        flags = parse_options(opts)
    except errors.InvalidArgument as exc:
        raise errors.DataLoss(f"checkpoint {record.id}: its recorded options: {exc}") from exc
    return SavedPod(ns, name, pod_cfg, tuple(containers), tuple(sorted(flags.as_options())))


# ---- host access ------------------------------------------------------------

def refuse_host_access(what: str, pod_config: Mapping[str, Any], containers: Iterable[tuple[str, Mapping[str, Any]]],
                       *, kubelet_root: str, store_root: str, allowed: bool) -> None:
    """FAILED_PRECONDITION naming each way saved configs reach into the host, unless allowed.

    The one host-access check of every path that restores or imports a
    checkpoint; `what` names the checkpoint or archive in the error.
    """
    found = hostaccess.findings(pod_config, containers, kubelet_root=kubelet_root,
                                agent_files=os.path.join(store_root, INTEROP_DIR))
    hostaccess.refuse(what, found, allowed=allowed)


def check_host_access(checkpoint_id: str, saved: SavedPod, s: Settings, *, allowed: bool) -> None:
    """`refuse_host_access` for a saved pod checkpoint, against this node's kubelet and store."""
    refuse_host_access(f"checkpoint {checkpoint_id}", saved.pod_config,
                       [(n, cfg["config"]) for n, cfg, _ in saved.containers],
                       kubelet_root=s.kubelet_root, store_root=s.store, allowed=allowed)
