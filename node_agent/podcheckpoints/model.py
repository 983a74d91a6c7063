"""PodCheckpoint objects as plain data: read from the API server's JSON, checked, and their status written back.

The object is whoever may create PodCheckpoints': every field is checked
here again (type, length, form) whatever the CRD's schema already refused,
and a field this version does not know fails the object rather than being
ignored. The status is the agent's own (`status_doc`), with one condition,
``Ready``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Final

from node_agent import errors

GROUP: Final = "node-agent.io"
VERSION: Final = "v1alpha1"
PLURAL: Final = "podcheckpoints"
KIND: Final = "PodCheckpoint"
API: Final = f"/apis/{GROUP}/{VERSION}"
FINALIZER: Final = "node-agent.io/checkpoint"

PENDING, CHECKPOINTING, PUSHING, SUCCEEDED, FAILED = "Pending", "Checkpointing", "Pushing", "Succeeded", "Failed"
PHASES: Final = (PENDING, CHECKPOINTING, PUSHING, SUCCEEDED, FAILED)
FINISHED: Final = (SUCCEEDED, FAILED)

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_SPEC_KEYS = frozenset({"source", "containers", "options", "push", "ttlSecondsAfterFinished"})
_STATUS_KEYS = frozenset({"phase", "node", "checkpointID", "pushedReference", "storedBytes", "frozenMilliseconds",
                          "startTime", "completionTime", "observedGeneration", "message", "conditions"})
MAX_MESSAGE: Final = 4096


@dataclass(frozen=True)
class Spec:
    pod_name: str
    pod_uid: str = ""
    containers: tuple[str, ...] = ()
    options: Mapping[str, str] = field(default_factory=dict)
    push: str = ""  # a registry reference, or "" for none
    ttl_seconds: int | None = None


@dataclass(frozen=True)
class Status:
    phase: str = ""
    node: str = ""
    checkpoint_id: str = ""
    pushed: str = ""
    stored_bytes: int = 0
    frozen_ms: int = 0
    started: str = ""  # RFC 3339, as the API server keeps times
    completed: str = ""
    message: str = ""


@dataclass(frozen=True)
class PodCheckpoint:
    namespace: str
    name: str
    uid: str
    resource_version: str
    generation: int
    deleting: bool
    finalizers: tuple[str, ...]
    spec: Spec
    status: Status
    raw: Mapping[str, Any]  # the object as the API server sent it (for writes that must carry its version)

    @property
    def where(self) -> str:
        return f"podcheckpoint {self.namespace}/{self.name}"

    @property
    def pod(self) -> str:
        return f"{self.namespace}/{self.spec.pod_name}"

    @property
    def path(self) -> str:
        return f"{API}/namespaces/{self.namespace}/{PLURAL}/{self.name}"


def _str(value: Any, what: str, limit: int, pattern: re.Pattern[str] | None = None) -> str:
    if not isinstance(value, str) or len(value) > limit or (pattern is not None and not pattern.match(value)):
        raise errors.InvalidArgument(f"{what} is not a valid value")
    return value


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise errors.InvalidArgument(f"{what} is not a non-negative integer")
    return value


def parse(obj: Any) -> PodCheckpoint:
    """A PodCheckpoint from the API server's JSON; InvalidArgument naming the first field that is wrong."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("metadata"), Mapping):
        raise errors.InvalidArgument("a PodCheckpoint without metadata")
    meta = obj["metadata"]
    namespace = _str(meta.get("namespace"), "metadata.namespace", 63, _DNS_LABEL)
    name = _str(meta.get("name"), "metadata.name", 253, _DNS_SUBDOMAIN)
    where = f"podcheckpoint {namespace}/{name}"
    uid = _str(meta.get("uid", ""), f"{where}: metadata.uid", 64)
    finalizers = meta.get("finalizers") or []
    if not isinstance(finalizers, list) or not all(isinstance(f, str) for f in finalizers):
        raise errors.InvalidArgument(f"{where}: metadata.finalizers is not a list of strings")
    return PodCheckpoint(
        namespace=namespace, name=name, uid=uid,
        resource_version=str(meta.get("resourceVersion") or ""),
        generation=_int(meta.get("generation", 1), f"{where}: metadata.generation"),
        deleting=bool(meta.get("deletionTimestamp")),
        finalizers=tuple(finalizers),
        spec=_spec(obj.get("spec"), where),
        status=_status(obj.get("status") or {}, where),
        raw=obj,
    )


def _spec(spec: Any, where: str) -> Spec:
    if not isinstance(spec, Mapping):
        raise errors.InvalidArgument(f"{where}: spec is missing")
    unknown = set(spec) - _SPEC_KEYS
    if unknown:
        raise errors.InvalidArgument(f"{where}: spec.{sorted(unknown)[0]} is not a field this agent knows")
    source = spec.get("source")
    if not isinstance(source, Mapping) or set(source) - {"podName", "podUID"}:
        raise errors.InvalidArgument(f"{where}: spec.source must hold podName (and podUID) only")
    containers = spec.get("containers") or []
    if not isinstance(containers, list) or len(containers) > 64:
        raise errors.InvalidArgument(f"{where}: spec.containers is not a list of at most 64 names")
    options = spec.get("options") or {}
    if not isinstance(options, Mapping) or len(options) > 32:
        raise errors.InvalidArgument(f"{where}: spec.options is not a map of at most 32 entries")
    push = spec.get("push") or {}
    if not isinstance(push, Mapping) or set(push) - {"reference"}:
        raise errors.InvalidArgument(f"{where}: spec.push must hold reference only")
    ttl = spec.get("ttlSecondsAfterFinished")
    return Spec(
        pod_name=_str(source.get("podName"), f"{where}: spec.source.podName", 253, _DNS_SUBDOMAIN),
        pod_uid=_str(source.get("podUID", ""), f"{where}: spec.source.podUID", 36, _UID) if source.get("podUID")
        else "",
        containers=tuple(_str(c, f"{where}: spec.containers[{i}]", 63, _DNS_LABEL) for i, c in enumerate(containers)),
        options={_str(k, f"{where}: spec.options key", 63): _str(v, f"{where}: spec.options[{k}]", 256)
                 for k, v in options.items()},
        push=_str(push.get("reference"), f"{where}: spec.push.reference", 512) if push else "",
        ttl_seconds=None if ttl is None else _int(ttl, f"{where}: spec.ttlSecondsAfterFinished"),
    )


def _status(status: Any, where: str) -> Status:
    """The status as the object carries it. Only agents write it, but all agents share one ServiceAccount:
    it is checked as strictly as the spec, and what it names is checked again before use."""
    if not isinstance(status, Mapping) or set(status) - _STATUS_KEYS:
        raise errors.InvalidArgument(f"{where}: status holds fields this agent does not write")
    phase = status.get("phase", "")
    if phase and phase not in PHASES:
        raise errors.InvalidArgument(f"{where}: status.phase {phase!r} is not one of {', '.join(PHASES)}")
    return Status(
        phase=phase,
        node=_str(status.get("node", ""), f"{where}: status.node", 253),
        checkpoint_id=_str(status.get("checkpointID", ""), f"{where}: status.checkpointID", 71),
        pushed=_str(status.get("pushedReference", ""), f"{where}: status.pushedReference", 600),
        stored_bytes=_int(status.get("storedBytes", 0), f"{where}: status.storedBytes"),
        frozen_ms=_int(status.get("frozenMilliseconds", 0), f"{where}: status.frozenMilliseconds"),
        started=_str(status.get("startTime", ""), f"{where}: status.startTime", 64),
        completed=_str(status.get("completionTime", ""), f"{where}: status.completionTime", 64),
        message=_str(status.get("message", ""), f"{where}: status.message", MAX_MESSAGE),
    )


def now_rfc3339(wall: float) -> str:
    return datetime.fromtimestamp(wall, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> float | None:
    """Seconds since the epoch of an RFC 3339 time as the API server writes it; None when it is not one."""
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def status_doc(status: Status, generation: int, wall: float, previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The status subresource for ``status``: empty fields left out, and the Ready condition (its transition
    time kept from ``previous`` while its value stays the same)."""
    doc: dict[str, Any] = {"phase": status.phase, "observedGeneration": generation}
    for key, value in (("node", status.node), ("checkpointID", status.checkpoint_id),
                       ("pushedReference", status.pushed), ("startTime", status.started),
                       ("completionTime", status.completed), ("message", status.message[:MAX_MESSAGE])):
        if value:
            doc[key] = value
    if status.checkpoint_id:
        doc["storedBytes"] = status.stored_bytes
        doc["frozenMilliseconds"] = status.frozen_ms
    ready = "True" if status.phase == SUCCEEDED else "False"
    reason = status.phase or PENDING
    since = now_rfc3339(wall)
    for cond in (previous or {}).get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == "Ready" and cond.get("status") == ready \
                and cond.get("reason") == reason and isinstance(cond.get("lastTransitionTime"), str):
            since = cond["lastTransitionTime"]
    message = status.message or {
        PENDING: "waiting for the node agent on the pod's node",
        CHECKPOINTING: f"checkpointing on node {status.node}",
        PUSHING: f"pushing checkpoint {status.checkpoint_id}",
        SUCCEEDED: f"checkpoint {status.checkpoint_id} on node {status.node}",
    }.get(status.phase, "")
    doc["conditions"] = [{"type": "Ready", "status": ready, "reason": reason, "message": message[:MAX_MESSAGE],
                          "lastTransitionTime": since, "observedGeneration": generation}]
    return doc


def with_status(pc: PodCheckpoint, **changes: Any) -> Status:
    return replace(pc.status, **changes)
