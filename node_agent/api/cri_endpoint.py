"""The CRI endpoint: `runtime.v1` served by the agent, in front of containerd.

The kubelet (or any CRI client) talks to this endpoint instead of
containerd. Everything is forwarded to containerd byte for byte
(`cri_proxy`), except:

- `CheckpointPod` and `RestorePod` (KEP-5823), implemented here: the
  checkpoint is a self-contained OCI layout inside the caller's directory;
- `RunPodSandbox`, `CreateContainer`, `RemoveContainer` and
  `RemovePodSandbox`, for restore through a Pod annotated
  `checkpoint.node-agent.io/restore-from` (`pod_restores`); other pods' calls
  are forwarded untouched;
- `StartContainer` of a container with a restore plan: forwarded, then
  verified (`node_agent.runtime_handler`): the runtime must have restored it from
  its plan, or it is stopped and the call fails. A restore that fails there
  fails its whole pod (`lazy.kill.stop_pod`), and a container whose restore
  failed is not started;
- `ContainerStatus` of a container whose restore failed: its `reason`
  (`RestoreFailed`) and `message` (why) say so. The response is decoded
  only for containers the agent restored; every other call is forwarded
  byte for byte.

See docs/cri-endpoint.md.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shutil
import stat
import threading
from typing import Any

import grpc

from node_agent import errors, runtime_handler
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from node_agent.admission import parse_checkpoint_options, parse_restore_options, require_checkpoint
from node_agent.api.status import abort_with, operation_timeout
from node_agent.api.cri_proxy import CriProxy, LocalHandler
from node_agent.api.pod_restores import ALLOW_HOST_ACCESS, RESTORE_FROM, RT, PodRestores
from node_agent.api.unix_sockets import claim_socket
from node_agent.checkpointing import CheckpointRequest, Checkpointer
from node_agent.cri.client import to_json
from node_agent.lazy.kill import stop_pod
from node_agent.podformat import load_saved
from node_agent.replicas import Replica, valid_id
from node_agent.restoring import RestoreRequest, Restorer
from node_agent.store import Store, WriterHooks
from node_agent.store.sealing import Keyring

log = logging.getLogger(__name__)

__all__ = ["ALLOW_HOST_ACCESS", "RESTORE_FAILED", "RESTORE_FROM", "CriEndpoint", "CriListener"]

# ContainerStatus.reason of a container whose restore failed (its message says why).
RESTORE_FAILED = "RestoreFailed"


# ---- caller-owned directories -------------------------------------------------


def _caller_dir(what: str, path: str, agent_store: str) -> str:
    """An absolute, existing, real directory outside the agent's store."""
    if not path or not os.path.isabs(path):
        raise errors.InvalidArgument(f"{what} must be an absolute path, got {path!r}")
    try:
        st = os.lstat(path)
    except FileNotFoundError as exc:
        raise errors.FailedPrecondition(f"{what} {path} does not exist") from exc
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise errors.FailedPrecondition(f"{what} {path} is not a directory (symbolic links are refused)")
    real, store = os.path.realpath(path), os.path.realpath(agent_store)
    if real == store or real.startswith(store + os.sep) or store.startswith(real + os.sep):
        raise errors.InvalidArgument(f"{what} {path} overlaps the agent's own store")
    return path


def _empty_dir(path: str) -> None:
    """Remove everything inside `path`, leaving the directory itself."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        p = os.path.join(path, name)
        try:
            if stat.S_ISDIR(os.lstat(p).st_mode):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        except OSError as exc:
            log.warning("cannot remove %s: %s", p, exc.strerror)


def _open_store(path: str, keys: Keyring | None, writer_hooks: WriterHooks | None = None) -> Store:
    """A store rooted at a caller's directory (sealed with the node's keys), leaving the directory's own mode alone."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    try:
        return Store(path, writer_hooks=writer_hooks, keys=keys)
    finally:
        os.chmod(path, mode)


class _OutputWriters:
    """The writers of the caller's output_path (its store's ``WriterHooks``): they can be abandoned, and waited for.

    A cancelled call stops awaiting the writer's thread, which may still be
    storing chunks; `abandon` makes it fail at its next step and
    `wait_idle` waits until it has let go, so that emptying the directory
    afterwards is final.
    """

    def __init__(self) -> None:
        self._abandoned = threading.Event()
        self._writers = 0
        self._idle = threading.Condition()

    def _check(self) -> None:
        if self._abandoned.is_set():
            raise errors.Cancelled("the CheckpointPod call ended; its checkpoint is discarded")

    def opened(self) -> None:
        self._check()
        with self._idle:
            self._writers += 1

    def progress(self, done: int, total: int) -> None:
        self._check()

    def closed(self) -> None:
        with self._idle:
            self._writers -= 1
            self._idle.notify_all()

    def abandon(self) -> None:
        self._abandoned.set()

    def wait_idle(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._writers <= 0, timeout)


class CriEndpoint:
    """The agent's own CRI methods; the rest goes through `proxy`."""

    def __init__(self, checkpointer: Checkpointer, restorer: Restorer, store: Store, upstream: grpc.aio.Channel) -> None:
        self.settings = checkpointer.settings
        self.checkpointer = checkpointer
        self.restorer = restorer
        self.store = store
        self.upstream = upstream
        self.proxy = CriProxy(upstream)
        self.pods = PodRestores(checkpointer, restorer, store, self.proxy)
        self.proxy.local = self.handlers()
        self._forward_start = self.proxy.unary_forwarder(RT + "StartContainer", before_error=self._start_failed)
        self._forward_status = self.proxy.unary_forwarder(RT + "ContainerStatus")
        self.replicas = restorer.replicas
        self._images = cri_grpc.ImageServiceStub(upstream)  # type: ignore[no-untyped-call]

    def handlers(self) -> dict[str, LocalHandler]:
        return {
            RT + "CheckpointPod": self.checkpoint_pod,
            RT + "RestorePod": self.restore_pod,
            RT + "RunPodSandbox": self.pods.run_pod_sandbox,
            RT + "CreateContainer": self.pods.create_container,
            RT + "RemovePodSandbox": self.pods.remove_pod_sandbox,
            RT + "RemoveContainer": self.pods.remove_container,
            RT + "StartContainer": self.start_container,
            RT + "ContainerStatus": self.container_status,
        }

    # ---- CheckpointPod ------------------------------------------------------

    async def checkpoint_pod(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            req = cri.CheckpointPodRequest.FromString(raw)
            await self._checkpoint_pod(req, operation_timeout(context))
        except Exception as exc:  # noqa: BLE001 - every error becomes a status here
            await abort_with(context, exc)
        return cri.CheckpointPodResponse().SerializeToString()

    async def _checkpoint_pod(self, req: Any, timeout: float | None) -> None:
        # Everything is checked before the first byte is written.
        options = parse_checkpoint_options(dict(req.options))
        if not req.pod_sandbox_id:
            raise errors.InvalidArgument("CheckpointPod: pod_sandbox_id is empty")
        out = _caller_dir("output_path", req.output_path, self.settings.store)
        if os.listdir(out):
            raise errors.FailedPrecondition(f"output_path {out} is not empty")
        ids = list(req.container_ids)
        if not ids:
            raise errors.InvalidArgument("CheckpointPod: container_ids is empty")
        if len(set(ids)) != len(ids):
            raise errors.InvalidArgument("CheckpointPod: container_ids has duplicates")
        cri_client = self.checkpointer.cri
        pods = [p for p in await cri_client.list_pods() if p.id == req.pod_sandbox_id]
        if not pods:
            raise errors.NotFound(f"pod sandbox {req.pod_sandbox_id} not found")
        # Refused before output_path is touched (the checkpointer takes the pod as admitted).
        require_checkpoint(self.settings, pods[0])
        containers = {c.id: c for c in await cri_client.list_containers(req.pod_sandbox_id)}
        for cid in ids:
            c = containers.get(cid)
            if c is None or c.pod_id != req.pod_sandbox_id:
                raise errors.NotFound(f"container {cid} is not in pod sandbox {req.pod_sandbox_id}")
            if not c.running:
                raise errors.FailedPrecondition(f"container {c.name} ({cid[:13]}) is not running")
        writers = _OutputWriters()
        target: Store | None = None
        try:
            target = await asyncio.to_thread(_open_store, out, self.store.keys, writers)
            record = await self.checkpointer.checkpoint(
                CheckpointRequest(pod=req.pod_sandbox_id, containers=ids, options=options, store=target,
                                  resolved=pods[0]),
                timeout=timeout,
            )
        except BaseException:
            if target is not None:
                writers.abandon()
                try:
                    await asyncio.shield(asyncio.to_thread(writers.wait_idle, self.settings.timeouts.cleanup))
                finally:
                    _empty_dir(out)
            else:
                _empty_dir(out)
            raise
        log.info("CheckpointPod of %s wrote checkpoint %s into %s", pods[0].ref, record.id, out,
                 extra={"pod": pods[0].ref, "checkpoint": record.id, "phase": "publish"})

    # ---- RestorePod ---------------------------------------------------------

    async def restore_pod(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            req = cri.RestorePodRequest.FromString(raw)
            resp = await self._restore_pod(req, operation_timeout(context))
        except Exception as exc:  # noqa: BLE001 - every error becomes a status here
            await abort_with(context, exc)
            raise  # not reached
        return bytes(resp.SerializeToString())

    async def _restore_pod(self, req: Any, timeout: float | None) -> Any:
        options = parse_restore_options(dict(req.options))
        if not req.HasField("config"):
            raise errors.InvalidArgument("RestorePod: config (the new PodSandboxConfig) is missing")
        handler = req.runtime_handler or self.settings.runtime_handler
        if handler != self.settings.runtime_handler:
            raise errors.InvalidArgument(
                f"RestorePod: runtime handler {handler!r} cannot restore; use {self.settings.runtime_handler!r}"
            )
        path = _caller_dir("checkpoint_path", req.checkpoint_path, self.settings.store)
        if not os.path.isfile(os.path.join(path, "oci-layout")):
            raise errors.FailedPrecondition(f"checkpoint_path {path} holds no checkpoint written by CheckpointPod")
        source = await asyncio.to_thread(_open_store, path, self.store.keys)
        records, problems = await asyncio.to_thread(source.scan)
        if len(records) != 1:
            if problems and not records:
                # The decisive reason, not only a count: the one checkpoint there is unreadable.
                raise type(problems[0])(f"checkpoint_path {path}: {problems[0]}")
            raise errors.FailedPrecondition(
                f"checkpoint_path {path} holds {len(records)} readable checkpoints; CheckpointPod writes exactly one"
                + (f" (unreadable: {'; '.join(str(p) for p in problems[:3])})" if problems else "")
            )
        record = records[0]
        saved = await asyncio.to_thread(load_saved, source, record)
        want = sorted(c[0] for c in saved.containers)
        configs: dict[str, dict[str, Any]] = {}
        for cc in req.container_configs:
            name = cc.metadata.name
            if name in configs:
                raise errors.InvalidArgument(f"RestorePod: container_configs names {name!r} twice")
            configs[name] = to_json(cc)
        if sorted(configs) != want:
            raise errors.InvalidArgument(
                f"RestorePod: container_configs name {sorted(configs)}, the checkpoint holds {want}"
            )
        for cname, cfg, _ in saved.containers:
            await self._same_image(cname, str((cfg["config"].get("image") or {}).get("image") or ""),
                                   str((configs[cname].get("image") or {}).get("image") or ""))
        restored = await self.restorer.restore(
            RestoreRequest(
                checkpoint_id=record.id, options=options, runtime_handler=handler, source=source,
                pod_config=to_json(req.config), container_configs=configs,
            ),
            timeout=timeout,
        )
        return cri.RestorePodResponse(
            pod_sandbox_id=restored.pod_sandbox_id,
            restored_containers=[cri.RestoredContainer(name=n, container_id=c) for n, c in restored.containers],
        )

    async def _same_image(self, cname: str, saved: str, given: str) -> None:
        """The new config's image must be the checkpointed one (the rootfs diff applies to it)."""
        if not given:
            raise errors.InvalidArgument(f"RestorePod: container {cname} names no image")
        if given == saved:
            return
        ids = []
        for image in (saved, given):
            try:
                r = await self._images.ImageStatus(
                    cri.ImageStatusRequest(image=cri.ImageSpec(image=image)), timeout=self.settings.timeouts.cri_call
                )
            except grpc.aio.AioRpcError as exc:
                raise errors.Unavailable(f"ImageStatus {image}: {exc.details()}") from exc
            ids.append(r.image.id)
        if not ids[1]:
            raise errors.FailedPrecondition(f"RestorePod: image {given} (container {cname}) is not present on this node")
        if ids[0] != ids[1]:
            raise errors.FailedPrecondition(
                f"RestorePod: container {cname} was checkpointed from image {saved}, not {given}"
            )

    async def start_container(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """StartContainer, forwarded; for a container with a restore plan, then verified as restored.

        A restored container whose restore failed (its pod's, or its own) is
        not started; one whose start fails (the runtime's error, or the
        check after it) fails its pod's restore: its pod's other restored
        containers are stopped, and the kubelet may not create it again.
        """
        cid = cri.StartContainerRequest.FromString(raw).container_id
        plan_dir = os.path.join(self.settings.plans_dir, cid) if valid_id(cid) else ""
        nonce = runtime_handler.plan_nonce(plan_dir) if plan_dir else None
        replica = self.replicas.get(cid)
        failed = self.replicas.failure(replica) if replica is not None else None
        if replica is not None and failed is not None:
            await abort_with(context, errors.FailedPrecondition(replica.failure_text(failed)))
        resp = await self._forward_start(raw, context)
        if nonce is None:
            return resp
        try:
            with open(os.path.join(plan_dir, "plan.json"), encoding="utf-8") as fh:
                plan = json.loads(fh.read(1 << 20))
            where = f"restore of pod {plan.get('pod', '?')}, container {plan.get('container', '?')}"
        except (OSError, ValueError, AttributeError):
            where = f"restore of container {cid[:13]}"
        try:
            await runtime_handler.verify_restored(self.checkpointer.cri, self.settings, cid, plan_dir, nonce,
                                                  where=where, handler=self.settings.runtime_handler)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status here
            if replica is not None:
                await self._restore_failed(replica, str(exc))
            await abort_with(context, exc)
        if replica is not None:
            failed = self.replicas.failure(replica)
            if failed is not None:  # the pod failed while this one was being restored: it stops too
                await self._restore_failed(replica, failed)
                await abort_with(context, errors.FailedPrecondition(replica.failure_text(failed)))
        return resp

    async def _start_failed(self, raw: bytes, exc: grpc.aio.AioRpcError) -> None:
        """The runtime failed StartContainer: for a restored container, its restore (and its pod's) failed.

        The reason is the wrapper's own account when it wrote one, else the
        runtime's answer; it is recorded before the answer is relayed (the
        kubelet then creates the container again, and is refused). A start
        the caller gave up on may still be restoring: its state is waited for.
        """
        cid = cri.StartContainerRequest.FromString(raw).container_id
        replica = self.replicas.get(cid)
        plan_dir = os.path.join(self.settings.plans_dir, cid) if valid_id(cid) else ""
        if replica is None or not plan_dir or runtime_handler.plan_nonce(plan_dir) is None:
            return
        refused = runtime_handler.refusal(plan_dir)
        await self._restore_failed(replica, str(refused) if refused is not None else
                                   f"StartContainer failed: {exc.details() or exc.code().name}",
                                   wait_for_state=exc.code() in (grpc.StatusCode.CANCELLED,
                                                                 grpc.StatusCode.DEADLINE_EXCEEDED))

    async def _restore_failed(self, replica: Replica, reason: str, *, wait_for_state: bool = False) -> None:
        """A restored container's restore failed: stop its whole pod's restored containers (`stop_pod`)."""
        reason = reason.removeprefix(f"restore of pod {replica.pod}, container {replica.container}, ")
        reason = reason.removesuffix("; the container was stopped")
        await asyncio.to_thread(functools.partial(stop_pod, self.replicas, self.settings.runc_root, replica, reason,
                                                  wait_for_state=wait_for_state, plans_dir=self.settings.plans_dir))

    async def container_status(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """ContainerStatus, forwarded; a failed restored container's `reason` and `message` say why it failed."""
        replica = self.replicas.get(cri.ContainerStatusRequest.FromString(raw).container_id)
        resp = await self._forward_status(raw, context)
        failed = self.replicas.failure(replica) if replica is not None else None
        if replica is None or failed is None:
            return resp
        answer = cri.ContainerStatusResponse.FromString(resp)
        answer.status.reason = RESTORE_FAILED
        answer.status.message = replica.failure_text(failed)
        return bytes(answer.SerializeToString())


class CriListener:
    """The CRI endpoint's own gRPC server on a Unix socket (mode 0660, root)."""

    # A proxy must not cap what the kubelet and containerd send each other.
    _OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]

    def __init__(self, listen: str, checkpointer: Checkpointer, restorer: Restorer, store: Store) -> None:
        from node_agent.cri.client import grpc_target

        s = checkpointer.settings
        self.path = listen[len("unix://"):]
        self.channel = grpc.aio.insecure_channel(grpc_target(s.cri_endpoint), options=self._OPTIONS)
        self.endpoint = CriEndpoint(checkpointer, restorer, store, self.channel)
        self.server = grpc.aio.server(options=self._OPTIONS)
        self.server.add_generic_rpc_handlers((self.endpoint.proxy,))

    async def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
        claim_socket(self.path, "cri-listen socket")
        self.server.add_insecure_port("unix://" + self.path)
        from node_agent.api.grpc_health import add_operability

        await add_operability(self.server, ("runtime.v1.RuntimeService", "runtime.v1.ImageService"))
        await self.server.start()
        os.chmod(self.path, 0o660)
        await self.endpoint.pods.prune()
        log.info("serving the CRI on unix://%s, forwarding to %s", self.path, self.endpoint.settings.cri_endpoint)

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace=grace)
        await self.channel.close()
