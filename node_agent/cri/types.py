"""Plain data for pods and containers as the CRI runtime reports them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class Pod:
    id: str
    name: str
    namespace: str
    uid: str
    attempt: int
    state: str  # SANDBOX_READY / SANDBOX_NOTREADY
    created_ns: int
    runtime_handler: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def ready(self) -> bool:
        return self.state == "SANDBOX_READY"


@dataclass(frozen=True)
class PodDetail:
    pod: Pod
    config: Mapping[str, Any]  # PodSandboxConfig as JSON
    spec: Mapping[str, Any]  # the sandbox container's OCI spec
    pid: int
    ip: str = ""


@dataclass(frozen=True)
class Container:
    id: str
    pod_id: str
    name: str
    attempt: int
    state: str  # CONTAINER_CREATED / _RUNNING / _EXITED / _UNKNOWN
    image: str
    image_ref: str
    created_ns: int
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.state == "CONTAINER_RUNNING"


@dataclass(frozen=True)
class ContainerDetail:
    container: Container
    config: Mapping[str, Any]  # ContainerConfig as JSON
    spec: Mapping[str, Any]  # OCI runtime spec
    pid: int
    log_path: str
    snapshot_key: str = ""
    snapshotter: str = ""
