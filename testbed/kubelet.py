"""A pod started as the kubelet starts it: its CRI calls, in its order (kuberuntime's SyncPod).

RunPodSandbox; then, for each container in turn: ImageStatus, PullImage when the image is not on the
node (with the login the kubelet would send: the pod's pull secret, else the node's), CreateContainer,
StartContainer. The requests are the CRI's own messages, built from its schema (a field the schema does
not have is refused before anything is sent), and go to one CRI endpoint for both services, as the
kubelet's `--container-runtime-endpoint` does. What a real kubelet also does around them (probes, status
polling, the pause image's own pull) is left out; the order of these calls is not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from node_agent.cri import CriClient
from node_agent.errors import AgentError

T = TypeVar("T")


@dataclass
class StartedPod:
    """What a pod start made: its sandbox, its containers by name, the images pulled, every call in order,
    and the error that stopped it after the sandbox was made (None when every call succeeded)."""

    sandbox_id: str
    containers: dict[str, str] = field(default_factory=dict)
    pulled: list[str] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    error: AgentError | None = None
    seconds: list[float] = field(default_factory=list)  # how long each of `calls` took, in its order


@dataclass(frozen=True)
class PullSecret:
    """A login the kubelet sends with PullImage for images of ``registry`` (``host[:port]``)."""

    registry: str
    username: str
    password: str = field(repr=False)


class Kubelet:
    """Starts pods through ``endpoint`` (``unix:///...``) with the kubelet's calls, in its order."""

    def __init__(self, endpoint: str, *, secrets: tuple[PullSecret, ...] = (), timeout: float = 300.0) -> None:
        self.endpoint = endpoint
        self.secrets = secrets
        self.timeout = timeout

    def _login(self, image: str) -> PullSecret | None:
        registry = image.split("/", 1)[0] if "/" in image else ""
        return next((s for s in self.secrets if s.registry == registry), None)

    async def start_pod(self, pod_config: Mapping[str, Any], containers: list[Mapping[str, Any]],
                        runtime_handler: str = "", *, sandboxed: Callable[[str], None] | None = None,
                        started_one: Callable[[str, str], None] | None = None,
                        client: CriClient | None = None) -> StartedPod:
        """RunPodSandbox, then each container: ImageStatus, PullImage if absent, CreateContainer, StartContainer.

        A failed RunPodSandbox raises the agent's error for its status (``node_agent.errors``); a later
        call that fails ends the start with ``error`` set, and what was made before it stays, as the
        kubelet leaves it for its next sync. ``sandboxed``, when given, is called with the sandbox's ID
        once RunPodSandbox has returned, before anything else is asked (to look at the node between);
        ``started_one`` with each container's name and ID once its StartContainer has returned, before the
        next container's calls (to act on the node between, as the pod's own first container could).
        ``client``, when given, is a connection to the endpoint opened beforehand (left open), as the
        kubelet's stays open across pods.
        """
        for c in containers:
            os.makedirs(os.path.join(str(pod_config["log_directory"]), str(c["metadata"]["name"])), exist_ok=True)
        cri = client if client is not None else CriClient(self.endpoint, timeout=self.timeout)
        try:
            m0 = time.monotonic()
            started = StartedPod(await cri.run_pod(pod_config, runtime_handler))
            started.calls.append("RunPodSandbox")
            started.seconds.append(time.monotonic() - m0)
            if sandboxed is not None:
                sandboxed(started.sandbox_id)
            try:
                await self._containers(cri, started, pod_config, containers, started_one)
            except AgentError as exc:
                started.error = exc
            return started
        finally:
            if client is None:
                await cri.close()

    async def _containers(self, client: CriClient, started: StartedPod, pod_config: Mapping[str, Any],
                          containers: list[Mapping[str, Any]],
                          started_one: Callable[[str, str], None] | None) -> None:
        async def call(name: str, step: Awaitable[T]) -> T:
            started.calls.append(name)
            m0 = time.monotonic()
            try:
                return await step
            finally:
                started.seconds.append(time.monotonic() - m0)

        for c in containers:
            image = str(c["image"]["image"])
            if not await call("ImageStatus", client.image_present(image)):
                login = self._login(image)
                await call("PullImage", client.pull_image(image, username=login.username if login else "",
                                                          password=login.password if login else "",
                                                          timeout=self.timeout))
                started.pulled.append(image)
            cid = await call("CreateContainer", client.create_container(started.sandbox_id, c, pod_config))
            started.containers[str(c["metadata"]["name"])] = cid
            await call("StartContainer", client.start_container(cid, timeout=self.timeout))
            if started_one is not None:
                started_one(str(c["metadata"]["name"]), cid)
