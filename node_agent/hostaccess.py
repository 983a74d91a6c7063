"""What a checkpoint's saved configs would let a restored pod reach on the host.

A checkpoint is hostile input, and so are the pod and container configs it
carries. Whoever made it must not decide, through them, what a new
container may touch on this node: `findings` names every item of those
configs that reaches past the pod's own sandbox, and `refuse` turns them
into FAILED_PRECONDITION unless the caller allowed host access. One check
(`podformat.refuse_host_access`) for every path that restores or imports a
checkpoint: the store restore (CLI, API), CRI RestorePod, restore through a
Pod, and archive import.

Host access is:
- a host-path mount outside the pod's own volumes (the kubelet's
  ``<kubelet-root>/pods/<pod uid>/`` of the checkpointed pod, or the empty
  marker files the agent made for an imported archive,
  ``<store>/interop/<token>/<file>``), or one with bidirectional mount
  propagation;
- device nodes;
- CDI devices, from the ``CDI_devices`` field or from CDI annotations
  (``cdi.k8s.io/...``);
- privileged mode (pod or container);
- the host's network, PID or IPC namespace (pod or container);
- capabilities added beyond the runtime's default set;
- host ports.

Annotations of a checkpoint never reach a new container (the restore sets
its own); with host access allowed, CDI annotations are carried over as
explicit ``CDI_devices`` (`cdi_devices_of`).
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Mapping, Sequence

from node_agent import errors

# containerd's (and the OCI runtime spec's) default capability set.
DEFAULT_CAPABILITIES = frozenset({
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW", "CAP_SETGID",
    "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL",
    "CAP_AUDIT_WRITE",
})
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
NODE_NAMESPACE = 2  # CRI NamespaceMode NODE
PROPAGATION_BIDIRECTIONAL = 2  # CRI MountPropagation
_UID_RE = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,127}$")
_MARKER_RE = re.compile(r"^[0-9a-f]{16}/[0-9]+-[-A-Za-z0-9_.]{1,200}$")


def _m(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _is_node(value: Any) -> bool:
    return bool(value == NODE_NAMESPACE or value == "NODE")


def _namespaces(where: str, sc: Mapping[str, Any], out: list[str]) -> None:
    if sc.get("privileged") is True:
        out.append(f"{where} is privileged")
    opts = _m(sc.get("namespace_options"))
    for ns in ("network", "pid", "ipc"):
        if _is_node(opts.get(ns)):
            out.append(f"{where} uses the host's {ns} namespace")


def pod_volume_root(kubelet_root: str, pod_uid: str) -> str | None:
    """``<kubelet-root>/pods/<uid>``, where the kubelet keeps a pod's own volumes (None for an unusable UID)."""
    if not isinstance(pod_uid, str) or not _UID_RE.fullmatch(pod_uid) or pod_uid in (".", ".."):
        return None
    return os.path.join(os.path.normpath(kubelet_root), "pods", pod_uid)


def _within(path: str, root: str | None) -> bool:
    if root is None or not path.startswith("/") or ".." in path.split("/"):
        return False
    path = os.path.normpath(path)
    return path.startswith(root.rstrip("/") + "/")


def cdi_devices_of(config: Mapping[str, Any]) -> list[str]:
    """The CDI devices a container config asks for: its CDI_devices field and its CDI annotations."""
    out = [str(_m(d).get("name", "")) for d in _list(config.get("CDI_devices"))]
    for key, value in _m(config.get("annotations")).items():
        if isinstance(key, str) and key.startswith(CDI_ANNOTATION_PREFIX):
            out += [v.strip() for v in str(value).split(",") if v.strip()]
    return out


def _agent_marker(path: str, agent_files: str | None) -> bool:
    """One of the empty files the agent made for an imported archive's marker mounts."""
    if not agent_files or not path.startswith("/") or ".." in path.split("/"):
        return False
    root = os.path.normpath(agent_files).rstrip("/") + "/"
    path = os.path.normpath(path)
    return path.startswith(root) and _MARKER_RE.fullmatch(path[len(root):]) is not None


def _container(name: str, cfg: Mapping[str, Any], volumes: str | None, agent_files: str | None,
               out: list[str]) -> None:
    where = f"container {name}"
    linux = _m(cfg.get("linux"))
    sc = _m(linux.get("security_context"))
    _namespaces(where, sc, out)
    caps = _m(sc.get("capabilities"))
    added = []
    for cap in _list(caps.get("add_capabilities")):
        c = str(cap).upper()
        c = c if c.startswith("CAP_") or c == "ALL" else "CAP_" + c
        if c not in DEFAULT_CAPABILITIES:
            added.append(c)
    if added:
        out.append(f"{where} adds capabilities {', '.join(sorted(set(added)))}")
    for m in _list(cfg.get("mounts")):
        m = _m(m)
        host = str(m.get("host_path") or "")
        dest = str(m.get("container_path") or "?")
        if not host and m.get("image"):
            continue  # an image volume: no host path
        if not _within(host, volumes) and not _agent_marker(host, agent_files):
            out.append(f"{where} mounts host path {host or '(empty)'} at {dest}")
        elif m.get("propagation") in (PROPAGATION_BIDIRECTIONAL, "PROPAGATION_BIDIRECTIONAL"):
            out.append(f"{where} mounts {host} at {dest} with bidirectional propagation")
    for d in _list(cfg.get("devices")):
        d = _m(d)
        out.append(f"{where} gets device {d.get('host_path', '?')} as {d.get('container_path', '?')}")
    for dev in _list(cfg.get("CDI_devices")):
        out.append(f"{where} asks for CDI device {_m(dev).get('name', '?')}")
    for key, value in _m(cfg.get("annotations")).items():
        if isinstance(key, str) and key.startswith(CDI_ANNOTATION_PREFIX):
            out.append(f"{where} asks for CDI devices {str(value)[:200]} (annotation {key})")


def findings(pod: Mapping[str, Any], containers: Iterable[tuple[str, Mapping[str, Any]]], *,
             kubelet_root: str, agent_files: str | None = None) -> list[str]:
    """Every item of a saved pod config and its container configs that reaches into the host.

    `agent_files`: the store's directory of files the agent made for
    imported archives (their marker mounts).
    """
    out: list[str] = []
    linux = _m(pod.get("linux"))
    _namespaces("the pod", _m(linux.get("security_context")), out)
    for p in _list(pod.get("port_mappings")):
        if _m(p).get("host_port"):
            out.append(f"the pod maps host port {_m(p).get('host_port')}")
    volumes = pod_volume_root(kubelet_root, str(_m(pod.get("metadata")).get("uid", "")))
    for name, cfg in containers:
        _container(name, _m(cfg), volumes, agent_files, out)
    return out


def refuse(what: str, found: Sequence[str], *, allowed: bool) -> None:
    """FAILED_PRECONDITION naming every item, unless host access was allowed."""
    if found and not allowed:
        raise errors.FailedPrecondition(
            f"{what} reaches into the host: {'; '.join(found)}; refused unless the caller passes "
            "allow-host-access=true"
        )
