"""An asyncio CRI client over grpc.aio, returning dataclasses."""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping, TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from node_agent import errors
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from node_agent.cri.types import Container, ContainerDetail, Pod, PodDetail

log = logging.getLogger(__name__)

_MAX_MSG = 64 << 20

class RuntimeUnavailable(errors.Unavailable):
    """The container runtime itself did not answer (down, restarting): UNAVAILABLE from a CRI call."""


_CODE_TO_ERROR: dict[grpc.StatusCode, type[errors.AgentError]] = {
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: RuntimeUnavailable,
    grpc.StatusCode.CANCELLED: errors.Cancelled,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.ABORTED: errors.Aborted,
    grpc.StatusCode.DATA_LOSS: errors.DataLoss,
}


def grpc_target(endpoint: str) -> str:
    """A CRI endpoint URL as a gRPC target (unix:///path or host:port)."""
    if endpoint.startswith("unix://"):
        return "unix://" + endpoint[len("unix://") :] if endpoint.startswith("unix:///") else endpoint
    if endpoint.startswith("/"):
        return "unix://" + endpoint
    return endpoint


def _pod_from(sb: Any) -> Pod:
    return Pod(
        id=sb.id,
        name=sb.metadata.name,
        namespace=sb.metadata.namespace,
        uid=sb.metadata.uid,
        attempt=sb.metadata.attempt,
        state=cri.PodSandboxState.Name(sb.state),
        created_ns=sb.created_at,
        runtime_handler=getattr(sb, "runtime_handler", ""),
        labels=dict(sb.labels),
        annotations=dict(sb.annotations),
    )


def _container_from(c: Any, pod_id: str) -> Container:
    return Container(
        id=c.id,
        pod_id=pod_id,
        name=c.metadata.name,
        attempt=c.metadata.attempt,
        state=cri.ContainerState.Name(c.state),
        image=c.image.image,
        image_ref=c.image_ref,
        created_ns=c.created_at,
        labels=dict(c.labels),
        annotations=dict(c.annotations),
    )


def _verbose_info(info: Mapping[str, str]) -> dict[str, Any]:
    raw = info.get("info")
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise errors.Internal(f"the runtime's verbose status is not JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


class CriClient:
    """RuntimeService and ImageService of one CRI endpoint."""

    def __init__(self, endpoint: str, *, timeout: float = 30.0) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(
            grpc_target(endpoint),
            options=[
                ("grpc.max_receive_message_length", _MAX_MSG),
                ("grpc.max_send_message_length", _MAX_MSG),
            ],
        )
        self._rt = cri_grpc.RuntimeServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._img = cri_grpc.ImageServiceStub(self._channel)  # type: ignore[no-untyped-call]

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, what: str, method: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            return await method(request, timeout=timeout or self.timeout)
        except grpc.aio.AioRpcError as exc:
            cls = _CODE_TO_ERROR.get(exc.code(), errors.Internal)
            raise cls(f"{what}: {exc.details() or exc.code().name}") from exc

    # ---- runtime -----------------------------------------------------------

    async def version(self) -> tuple[str, str]:
        r = await self._call("CRI Version", self._rt.Version, cri.VersionRequest(version="v1"))
        return r.runtime_name, r.runtime_version

    async def status_info(self) -> dict[str, str]:
        """The runtime's verbose Status `info` (containerd: its CRI config as JSON under "config")."""
        r = await self._call("CRI Status", self._rt.Status, cri.StatusRequest(verbose=True))
        return dict(r.info)

    async def list_pods(self) -> list[Pod]:
        r = await self._call("ListPodSandbox", self._rt.ListPodSandbox, cri.ListPodSandboxRequest())
        return [_pod_from(sb) for sb in r.items]

    async def pod_status(self, pod_id: str) -> PodDetail:
        r = await self._call(
            f"PodSandboxStatus {pod_id[:13]}",
            self._rt.PodSandboxStatus,
            cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True),
        )
        st = r.status
        info = _verbose_info(r.info)
        pod = Pod(
            id=st.id,
            name=st.metadata.name,
            namespace=st.metadata.namespace,
            uid=st.metadata.uid,
            attempt=st.metadata.attempt,
            state=cri.PodSandboxState.Name(st.state),
            created_ns=st.created_at,
            runtime_handler=st.runtime_handler or str(info.get("runtimeHandler", "")),
            labels=dict(st.labels),
            annotations=dict(st.annotations),
        )
        return PodDetail(
            pod=pod,
            config=info.get("config") or {},
            spec=info.get("runtimeSpec") or {},
            pid=int(info.get("pid") or 0),
            ip=st.network.ip,
        )

    async def list_containers(self, pod_id: str | None = None) -> list[Container]:
        flt = cri.ContainerFilter(pod_sandbox_id=pod_id or "")
        r = await self._call("ListContainers", self._rt.ListContainers, cri.ListContainersRequest(filter=flt))
        return [_container_from(c, c.pod_sandbox_id) for c in r.containers]

    async def container_status(self, container_id: str) -> ContainerDetail:
        r = await self._call(
            f"ContainerStatus {container_id[:13]}",
            self._rt.ContainerStatus,
            cri.ContainerStatusRequest(container_id=container_id, verbose=True),
        )
        st = r.status
        info = _verbose_info(r.info)
        c = Container(
            id=st.id,
            pod_id=str(info.get("sandboxID", "")),
            name=st.metadata.name,
            attempt=st.metadata.attempt,
            state=cri.ContainerState.Name(st.state),
            image=st.image.image,
            image_ref=st.image_ref,
            created_ns=st.created_at,
            labels=dict(st.labels),
            annotations=dict(st.annotations),
        )
        return ContainerDetail(
            container=c,
            config=info.get("config") or {},
            spec=info.get("runtimeSpec") or {},
            pid=int(info.get("pid") or 0),
            log_path=st.log_path,
            snapshot_key=str(info.get("snapshotKey", "")),
            snapshotter=str(info.get("snapshotter", "")),
        )

    async def run_pod(self, config: Mapping[str, Any], runtime_handler: str) -> str:
        req = cri.RunPodSandboxRequest(config=_parse(config, cri.PodSandboxConfig, "pod config"), runtime_handler=runtime_handler)
        r = await self._call("RunPodSandbox", self._rt.RunPodSandbox, req, timeout=max(self.timeout, 120))
        return str(r.pod_sandbox_id)

    async def stop_pod(self, pod_id: str) -> None:
        await self._call(f"StopPodSandbox {pod_id[:13]}", self._rt.StopPodSandbox, cri.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=max(self.timeout, 60))

    async def remove_pod(self, pod_id: str) -> None:
        await self._call(f"RemovePodSandbox {pod_id[:13]}", self._rt.RemovePodSandbox, cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=max(self.timeout, 60))

    async def create_container(self, pod_id: str, config: Mapping[str, Any], pod_config: Mapping[str, Any]) -> str:
        req = cri.CreateContainerRequest(
            pod_sandbox_id=pod_id,
            config=_parse(config, cri.ContainerConfig, "container config"),
            sandbox_config=_parse(pod_config, cri.PodSandboxConfig, "pod config"),
        )
        r = await self._call("CreateContainer", self._rt.CreateContainer, req)
        return str(r.container_id)

    async def start_container(self, container_id: str, *, timeout: float | None = None) -> None:
        await self._call(f"StartContainer {container_id[:13]}", self._rt.StartContainer, cri.StartContainerRequest(container_id=container_id), timeout=timeout or max(self.timeout, 120))

    async def stop_container(self, container_id: str, *, timeout: int = 0) -> None:
        """StopContainer, killing after `timeout` seconds (0: at once)."""
        await self._call(f"StopContainer {container_id[:13]}", self._rt.StopContainer,
                         cri.StopContainerRequest(container_id=container_id, timeout=timeout),
                         timeout=max(self.timeout, timeout + 30))

    async def remove_container(self, container_id: str) -> None:
        await self._call(f"RemoveContainer {container_id[:13]}", self._rt.RemoveContainer, cri.RemoveContainerRequest(container_id=container_id))

    # ---- images ------------------------------------------------------------

    async def image_present(self, image: str) -> bool:
        return bool((await self.image_ids(image))[0])

    async def image_ids(self, image: str) -> tuple[str, tuple[str, ...]]:
        """The image's ID on this node (``sha256:...``; "" when it is not here) and its repo digests."""
        r = await self._call(f"ImageStatus {image}", self._img.ImageStatus,
                             cri.ImageStatusRequest(image=cri.ImageSpec(image=image)))
        return str(r.image.id), tuple(str(d) for d in r.image.repo_digests)

    async def pull_image(self, image: str, *, username: str = "", password: str = "",
                         timeout: float | None = None) -> str:
        """PullImage, with a login when given (as the kubelet sends the node's): the image's reference."""
        auth = cri.AuthConfig(username=username, password=password) if username else None
        r = await self._call(f"PullImage {image}", self._img.PullImage,
                             cri.PullImageRequest(image=cri.ImageSpec(image=image), auth=auth), timeout)
        return str(r.image_ref)


M = TypeVar("M", bound=Message)


def _parse(data: Mapping[str, Any], msg_type: type[M], what: str) -> M:
    """A JSON-shaped CRI config as its message; unknown fields are errors."""
    try:
        return json_format.ParseDict(dict(data), msg_type())
    except json_format.ParseError as exc:
        raise errors.InvalidArgument(f"{what} does not match the CRI schema: {exc}") from exc


def normalized(config: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """A pod ("pod") or container ("container") config checked against the CRI schema, in canonical JSON.

    Unknown fields are refused; enums come back as numbers and field names
    as in the .proto, whatever spelling the input used.
    """
    msg_type = cri.PodSandboxConfig if kind == "pod" else cri.ContainerConfig
    return to_json(_parse(config, msg_type, f"{kind} config"))


def to_json(msg: Any) -> dict[str, Any]:
    """A CRI message as JSON with snake_case names (the form configs travel in)."""
    return json_format.MessageToDict(msg, preserving_proto_field_name=True, use_integers_for_enums=True)
