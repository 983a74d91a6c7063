"""Restore through a Pod: the kubelet's own calls restore a Pod annotated `restore-from`.

`RunPodSandbox` of a Pod annotated `checkpoint.node-agent.io/restore-from`
does only what must come before the sandbox: it finds the checkpoint (a
registry reference is pulled with everything but its saved configs left in
the registry, `lazy.remote.beyond_sandbox`), admits it, checks the node's
CPU against it and forwards the kubelet's request with the restore handler;
once the sandbox is made, what the pull left in the registry is fetched in
the background until the restored process connects (`lazy.prefetch`).
The kubelet pulls each container's image after that; `CreateContainer` of
each checkpointed container checks the image is the checkpoint's, reads
and verifies that container's files (and the pod's /dev/shm, before the
first), fetching from the registry what is still there, appends the plan's
mark and writes its restore plan. A lazy restore (the node's
`lazy-restore`, no pre-dumped memory) leaves the memory to its page source,
which streams it from the store or the registry once StartContainer
restores the process (the CRI endpoint verifies it). `RemoveContainer` and
`RemovePodSandbox` take the plans and the state along. A container whose
restore failed is not created again in its sandbox: the kubelet's
CreateContainer of that name there is refused, naming the failure
(`restore.after-failed-restore`), instead of starting its image fresh in a
pod that says it was restored.

Rule: the annotations are whoever may create Pods', never trusted. The
checkpoint must be of the Pod's own namespace (its key domain too), or of
one `restore.pod-sources` lets in, and any other gets the answer of one
that does not exist; registry references only from `restore.pod-registries`,
admitted before they are published; host access by annotation only in
`restore.pod-host-access-namespaces`. The per-sandbox state survives an agent
restart; no plaintext is kept between the kubelet's calls.
See docs/cri-endpoint.md and docs/security.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from functools import partial

import grpc

from criu_bridge.wrapper import PLAN_ANNOTATION
from node_agent import devshm, errors, podformat, podimages, policy, runtime_handler
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri
from node_agent.admission import RestoreAdmission, RestoreOptions
from node_agent.api.status import abort_with
from node_agent.api.cri_proxy import CriProxy
from node_agent.cancelling import thread_to_the_end
from node_agent.checkpointing import Checkpointer
from node_agent.cri.client import to_json
from node_agent.kubeapi import KubeClient
from node_agent.podcheckpoints.resolve import cluster, named, resolve
from node_agent.options import boolean
from node_agent.podformat import SavedPod, highest_pid, load_saved, namespace_of, shares_pids
from node_agent.replicas import valid_id
from node_agent.restoring import Restorer, container_exists
from node_agent.store import CheckpointRecord, Store

log = logging.getLogger(__name__)

RT = "/runtime.v1.RuntimeService/"
RESTORE_FROM = "checkpoint.node-agent.io/restore-from"
# On a Pod restored through its annotation: let the checkpoint's configs reach
# into the host (`true` or `false`; docs/cri-endpoint.md).
ALLOW_HOST_ACCESS = "checkpoint.node-agent.io/allow-host-access"
STATE_DIR = "cri-restores"
# What is trimmed around the annotation's value: exactly the characters the admission policy skips before
# `podcheckpoint/` (deploy/restore-admission.yaml), so that both read the same value.
ANNOTATION_SPACE = " \t\n\f\r"
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass
class _PodRestore:
    sandbox_id: str
    checkpoint: str
    pod: str  # namespace/name
    options: tuple[str, ...]
    pending: list[str]  # checkpointed containers not created yet
    dir: str
    lazy: bool = False  # memory comes through page sources (decided once, at RunPodSandbox)
    devshm: bool = False  # the pod's /dev/shm is still to be restored (by the first CreateContainer)
    # Restored by PodCheckpoint name: the checkpoint's containers, and the Pod may have no other (KEP-5823).
    only: tuple[str, ...] = ()
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The highest PID of the checkpoint's containers (`podformat.highest_pid`), once the first one read it.
    pid_floor: int | None = None

    @property
    def op(self) -> str:
        """What the page sources of this Pod's containers are tracked under (`LazyRestores`)."""
        return "pod-" + self.sandbox_id

    def save(self) -> None:
        doc = {"sandbox_id": self.sandbox_id, "checkpoint": self.checkpoint, "pod": self.pod,
               "options": list(self.options), "pending": self.pending, "lazy": self.lazy, "devshm": self.devshm,
               "only": list(self.only)}
        path = os.path.join(self.dir, "state.json")
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(doc, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(path + ".tmp", path)

    @classmethod
    def load(cls, d: str) -> _PodRestore:
        """The state `save` wrote; one from before restores were lazy (no `devshm`) restored /dev/shm already."""
        with open(os.path.join(d, "state.json"), encoding="utf-8") as fh:
            doc = json.load(fh)
        return cls(str(doc["sandbox_id"]), str(doc["checkpoint"]), str(doc["pod"]),
                   tuple(str(o) for o in doc.get("options", [])), [str(n) for n in doc.get("pending", [])], d,
                   doc.get("lazy") is True, doc.get("devshm") is True, tuple(str(n) for n in doc.get("only", [])))


class PodRestores:
    """The Pods being restored through their annotations, by sandbox ID, and the CRI calls that make them."""

    def __init__(self, checkpointer: Checkpointer, restorer: Restorer, store: Store, proxy: CriProxy) -> None:
        self.settings = checkpointer.settings
        self.checkpointer = checkpointer
        self.restorer = restorer
        self.store = store
        self._forward_run = proxy.unary_forwarder(RT + "RunPodSandbox")
        self._forward_create = proxy.unary_forwarder(RT + "CreateContainer")
        self._forward_remove = proxy.unary_forwarder(RT + "RemovePodSandbox")
        self._forward_remove_container = proxy.unary_forwarder(RT + "RemoveContainer")
        self.state_root = os.path.join(self.settings.store, STATE_DIR)
        self.restores: dict[str, _PodRestore] = {}
        self._cluster: tuple[KubeClient, str] | None = None  # for restores by PodCheckpoint name, made when asked
        self._load_state()

    def _load_state(self) -> None:
        os.makedirs(self.state_root, mode=0o700, exist_ok=True)
        for name in os.listdir(self.state_root):
            d = os.path.join(self.state_root, name)
            try:
                st = _PodRestore.load(d)
            except (OSError, ValueError, KeyError, TypeError):
                shutil.rmtree(d, ignore_errors=True)  # a sandbox that never finished being made
                continue
            # Verified files (plaintext) a CreateContainer cut short by a crash staged, or an agent from before
            # lazy Pod restores kept between calls: a CreateContainer reads them again.
            for entry in os.listdir(d):
                if entry != "state.json":
                    shutil.rmtree(os.path.join(d, entry), ignore_errors=True)
            self.restores[st.sandbox_id] = st

    async def prune(self) -> None:
        """Forget restores and restored replicas whose sandbox is gone (removed while the agent was down, or not here).

        The replicas' records are listed before the sandboxes: one recorded
        meanwhile, whose sandbox is new, is never dropped.
        """
        recorded = self.restorer.replicas.sandboxes()
        if not self.restores and not recorded:
            return
        try:
            alive = {p.id for p in await self.checkpointer.cri.list_pods()}
        except errors.AgentError as exc:
            log.warning("cannot list sandboxes to prune pending restores: %s", exc)
            return
        for pod_id in [i for i in self.restores if i not in alive]:
            st = self.restores.pop(pod_id)
            shutil.rmtree(st.dir, ignore_errors=True)
            self._end_prefetch(st.checkpoint, f"pod {st.pod} is gone")
        self.restorer.replicas.prune([i for i in recorded if i not in alive])

    async def sweep(self) -> None:
        """Forget restores whose sandbox is gone (`prune`), periodically."""
        await self.prune()

    async def run_pod_sandbox(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        req = cri.RunPodSandboxRequest.FromString(raw)
        ref = req.config.annotations.get(RESTORE_FROM, "")
        if not ref:
            return await self._forward_run(raw, context)
        meta = req.config.metadata
        where = f"{meta.namespace}/{meta.name}"
        try:
            # The annotations are whoever may create Pods': held to the node's rules for them.
            allow = boolean(req.config.annotations.get(ALLOW_HOST_ACCESS, "false"), f"annotation {ALLOW_HOST_ACCESS}")
            admission = RestoreAdmission(self.settings, meta.namespace, where, RestoreOptions(allow_host_access=allow))
            admission.require_pod_host_access()
            # A namespace the policy refuses pulls nothing.
            admission.require_policy()
            record, saved = await self._resolve_checkpoint(ref.strip(ANNOTATION_SPACE), meta.namespace, where,
                                                           admission)
            # The rules a pull has not already applied to this checkpoint.
            await asyncio.to_thread(admission.admit, self.restorer.store, record, saved)
            admission.check_host_access(record, saved)
            await self.restorer.preflight(record, saved, images=False)  # the kubelet pulls them later
            await runtime_handler.require(self.checkpointer.cri, self.settings, self.settings.runtime_handler, "")
            lazy = await self.restorer.lazy.wanted(None, record)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status here
            await self._refuse(context, exc, where, ref)
            raise  # not reached
        # The kubelet's request, byte for byte, with the restore handler appended
        # (a later occurrence of a scalar field wins when protobuf parses).
        override = cri.RunPodSandboxRequest(runtime_handler=self.settings.runtime_handler).SerializeToString()
        resp_raw = await self._forward_run(raw + override, context)
        pod_id = cri.RunPodSandboxResponse.FromString(resp_raw).pod_sandbox_id
        names = [c[0] for c in saved.containers]
        st = _PodRestore(pod_id, record.id, where, saved.options, list(names),
                         os.path.join(self.state_root, pod_id), lazy,
                         any(f.path == podformat.POD_DEVSHM for f in record.files),
                         tuple(names) if named(ref.strip(ANNOTATION_SPACE)) is not None else ())
        try:
            os.makedirs(st.dir, mode=0o700)
            st.save()
        except Exception as exc:  # noqa: BLE001 - every error becomes a status here
            shutil.rmtree(st.dir, ignore_errors=True)
            await asyncio.shield(asyncio.ensure_future(self.restorer.undoer.remove_sandbox(pod_id, where)))
            await self._refuse(context, exc, where, ref)
        self.restores[pod_id] = st
        log.info("pod %s: sandbox %s made to restore checkpoint %s%s", where, pod_id[:13], record.id,
                 " (lazily)" if lazy else "", extra={"pod": where, "checkpoint": record.id, "phase": "sandbox"})
        # What the pull left in the registry comes while the kubelet pulls the images and creates the containers.
        self.restorer.lazy.prefetch(self.store, record, f"pod {where}")
        return resp_raw

    async def _resolve_checkpoint(self, ref: str, namespace: str, where: str,
                                  admission: RestoreAdmission) -> tuple[CheckpointRecord, SavedPod]:
        """The checkpoint a Pod in `namespace` names: one of its own namespace, or one `restore.pod-sources` lets in.

        A store ID of any other checkpoint gets the answer of one that does
        not exist. A registry reference must lie in `restore.pod-registries`;
        what it pulls is admitted before it is published (the namespace
        rule, then `admission`'s: the restore policy, signatures, host
        access), so a refused pull leaves nothing in the store.
        """
        name = named(ref)
        if name is not None:
            ref = await self._by_name(name, namespace, admission)
        if _DIGEST_RE.match(ref):
            missing = errors.FailedPrecondition(f"checkpoint {ref} is not in this node's store")
            try:
                record = await asyncio.to_thread(
                    self.store.get, ref,
                    within=lambda rec: policy.pod_may_restore_from(self.settings, namespace_of(rec), namespace))
            except errors.NotFound as exc:
                raise missing from exc
            saved = await asyncio.to_thread(load_saved, self.store, record)
            if self._outside(record, saved, namespace):
                raise missing
            return record, saved
        from node_agent.lazy.remote import beyond_sandbox
        from node_agent.registry import Admission, Credentials, pull
        from node_agent.registry.reference import listed

        allowed = self.settings.restore.pod_registries
        if not listed(ref, allowed):
            raise errors.PermissionDenied(
                f"restore as pod {where}: {ref} is not in a registry or repository this node lets Pods restore "
                f"from (restore.pod-registries: {', '.join(allowed) or 'none'})")

        def admit(pulled: Admission[CheckpointRecord]) -> None:
            got = load_saved(self.store, pulled.record)
            outside = self._outside(pulled.record, got, namespace)
            if outside:
                raise errors.PermissionDenied(
                    f"restore as pod {where}: checkpoint {pulled.record.id} from {ref} {outside}; a Pod restores "
                    "only checkpoints of its own namespace, or of those restore.pod-sources lets in")
            admission.admit(pulled, pulled.record, got)
            admission.check_host_access(pulled.record, got)

        # The node's logins go only where restore.pod-credentials lets this namespace's Pods use them:
        # otherwise whoever may create a Pod pulls with them whatever they can name.
        logins = self.settings.restore.pod_credentials
        node_logins = listed(ref, (*logins.get(namespace, ()), *logins.get("*", ())))
        # Only the saved configs come now; the rest when the kubelet creates each container (or later, lazily).
        report = await asyncio.to_thread(lambda: pull(
            self.store, ref, Credentials(), settings=self.settings.registry, defer=partial(beyond_sandbox, self.store),
            min_free_bytes=self.settings.min_free_bytes, admit=admit, node_logins=node_logins))
        record = await asyncio.to_thread(self.store.get, report.checkpoint_id)
        saved = await asyncio.to_thread(load_saved, self.store, record)
        outside = self._outside(record, saved, namespace)
        if outside:  # already in the store before this pull, so not admitted by it
            raise errors.PermissionDenied(f"restore as pod {where}: checkpoint {record.id} from {ref} {outside}")
        return record, saved

    async def _by_name(self, name: str, namespace: str, admission: RestoreAdmission) -> str:
        """`podcheckpoint/<name>`: the checkpoint it took, in this node's store, or else its pushed copy, which
        is restored only with a trusted signature (`podcheckpoints.resolve`)."""
        if self._cluster is None:
            found = await asyncio.to_thread(cluster, self.settings)
            if isinstance(found, str):
                raise errors.FailedPrecondition(f"restore from podcheckpoint/{name}: this node has {found}")
            self._cluster = found
        kube, node = self._cluster
        got = await asyncio.to_thread(resolve, kube, node, self.store, namespace, name)
        if got.checkpoint_id:
            return got.checkpoint_id
        admission.require_signed()
        return got.reference

    def _outside(self, record: CheckpointRecord, saved: SavedPod, target: str) -> str:
        """Why a Pod in `target` may not restore this checkpoint ("" when it may).

        Its namespace, as its metadata and its saved pod config say, must be
        `target`, or one `restore.pod-sources` lets into `target`; a sealed
        checkpoint of `target` itself must be sealed in `target`'s key domain.
        """
        given = (saved.pod_config.get("metadata") or {}).get("namespace") or saved.namespace
        for source in dict.fromkeys((saved.namespace, str(given))):
            if source != target:
                if not policy.pod_may_restore_from(self.settings, source, target):
                    return f"is of namespace {source}"
                continue
            if record.key_id:
                keys = self.checkpointer.keys
                key = keys.key(record.key_id) if keys is not None else None
                if key is None or keys is None or key.domain != keys.domain_of(target):
                    return f"is sealed under key {record.key_id}, not in namespace {target}'s key domain"
        return ""

    async def create_container(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        req = cri.CreateContainerRequest.FromString(raw)
        st = self.restores.get(req.pod_sandbox_id)
        name = req.config.metadata.name
        await self._after_failed_restore(req.pod_sandbox_id, name, context)
        if st is not None and st.only and name not in st.only:
            await self._refuse(context, errors.FailedPrecondition(
                f"container {name} is not in the checkpoint (its containers: {', '.join(st.only)}); a Pod restored "
                "from a PodCheckpoint has the checkpoint's containers and no other"), st.pod, st.checkpoint)
        if st is None or name not in st.pending:
            return await self._forward_create(raw, context)
        async with st.lock:
            if name not in st.pending:
                return await self._forward_create(raw, context)
            staging = os.path.join(st.dir, "staging-" + secrets.token_hex(6))
            try:
                return await self._create_restored(raw, req, st, name, staging, context)
            finally:
                await asyncio.shield(asyncio.to_thread(shutil.rmtree, staging, True))

    async def _create_restored(self, raw: bytes, req: cri.CreateContainerRequest, st: _PodRestore, name: str,
                               staging: str, context: grpc.aio.ServicerContext) -> bytes:
        """One checkpointed container: its files read and verified, created with the plan's mark, its plan written.

        The container's files come from the store, or from the registry where
        the pull left them; lazily, its memory is left to its page source,
        started once the plan is written. The pod's /dev/shm comes with the
        first container, before any is started.
        """
        restorer = self.restorer
        try:
            record = await asyncio.to_thread(self.store.get, st.checkpoint)
            # The kubelet pulled the container's image just now: it must be the checkpoint's own.
            saved = await asyncio.to_thread(load_saved, self.store, record)
            await podimages.check_image(self.checkpointer.cri, record, saved, name, req.config.image.image)
            config = to_json(req.config)
            if st.pid_floor is None and shares_pids(config):
                st.pid_floor = await asyncio.to_thread(highest_pid, self.store, record, saved)
            os.makedirs(staging, mode=0o700)
            # Cut off (the kubelet's deadline), the reading ends before its staging is removed.
            memory = await thread_to_the_end(restorer.unpack, record, staging, lazy=st.lazy, containers=(name,),
                                             devshm=st.devshm)
            if st.devshm:
                await devshm.restore(restorer.cri, staging, st.sandbox_id, st.pod)
                st.devshm = False
                st.save()
        except Exception as exc:  # noqa: BLE001 - every error becomes a status here
            await self._refuse(context, exc, st.pod, st.checkpoint)
            raise  # not reached
        # The kubelet's request, with the plan's mark appended (map
        # entries of a later occurrence are merged in when protobuf parses).
        nonce = secrets.token_hex(16)
        mark = cri.CreateContainerRequest(config=cri.ContainerConfig(annotations={PLAN_ANNOTATION: nonce}))
        resp_raw = await self._forward_create(raw + mark.SerializeToString(), context)
        cid = cri.CreateContainerResponse.FromString(resp_raw).container_id
        plan_dir = os.path.join(self.settings.plans_dir, cid)
        try:
            await asyncio.to_thread(
                restorer.write_plan, record, staging, name, plan_dir, st.pod, st.options, st.lazy,
                nonce=nonce, mounts=config.get("mounts"), sandbox=st.sandbox_id,
                logs=(req.sandbox_config.log_directory, req.config.log_path), pid_floor=st.pid_floor or 0,
            )
            if st.lazy:
                await restorer.lazy.start(st.op, self.store, record, st.pod, name, cid, plan_dir, callers=False,
                                          exists=container_exists(restorer.cri, cid), memory=memory.pop(name, None))
                restorer.lazy.done(st.op)  # its page source goes on by itself
            else:
                await asyncio.to_thread(self._settle, record.id)
            st.pending.remove(name)
            st.save()
        except Exception as exc:  # noqa: BLE001 - every error becomes a status here
            await restorer.lazy.cancel(st.op)
            self._end_prefetch(st.checkpoint, f"the restore of pod {st.pod} failed", st)
            shutil.rmtree(plan_dir, ignore_errors=True)
            try:
                await self.checkpointer.cri.remove_container(cid)
            except errors.AgentError as rm_exc:
                log.error("cannot remove container %s of a failed restore: %s", cid[:13], rm_exc)
            await self._refuse(context, exc, st.pod, st.checkpoint)
        log.info("pod %s: container %s (%s) will restore from checkpoint %s%s", st.pod, name, cid[:13], st.checkpoint,
                 " (lazily)" if st.lazy else "",
                 extra={"pod": st.pod, "container": name, "checkpoint": st.checkpoint, "phase": "create"})
        return resp_raw

    async def _refuse(self, context: grpc.aio.ServicerContext, exc: BaseException, where: str, ref: str) -> None:
        """The kubelet's call fails: counted (`node_agent_failures_total{operation="pod-restore"}`) and answered
        with the pod and the checkpoint named."""
        failed = _for_pod(exc, where, ref)
        self.restorer.metrics.observe_failure("pod-restore", failed)
        await abort_with(context, failed)

    def _settle(self, checkpoint_id: str) -> None:
        """A pulled checkpoint whose last blobs a restore just fetched from the registry is whole in the store now."""
        try:
            if self.store.origins.get(checkpoint_id) is not None and self.store.origins.settle(checkpoint_id):
                log.info("checkpoint %s: every blob is in the store now", checkpoint_id,
                         extra={"checkpoint": checkpoint_id})
        except errors.AgentError as exc:
            log.warning("checkpoint %s: %s", checkpoint_id, exc)

    async def remove_pod_sandbox(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """RemovePodSandbox, forwarded; then the restore plans of its containers and its restore state go.

        A container created and never started has no task, so runc (and the
        wrapper, which removes a plan on `delete`) never hears of its removal.
        """
        pod_id = cri.RemovePodSandboxRequest.FromString(raw).pod_sandbox_id
        try:
            ids = [c.id for c in await self.checkpointer.cri.list_containers(pod_id)] if pod_id else []
        except errors.AgentError as exc:
            log.warning("cannot list the containers of sandbox %s before it is removed: %s (the periodic sweep "
                        "removes their restore plans)", pod_id[:13], exc)
            ids = []
        resp = await self._forward_remove(raw, context)
        for cid in ids:
            self._drop_plan(cid)
        st = self.restores.pop(pod_id, None)
        if st is not None:
            shutil.rmtree(st.dir, ignore_errors=True)
            self._end_prefetch(st.checkpoint, f"pod {st.pod} was removed")
        if pod_id:
            self.restorer.replicas.forget(pod_id)
        return resp

    def _end_prefetch(self, checkpoint_id: str, why: str, failed: _PodRestore | None = None) -> None:
        """No more fetches ahead of `checkpoint_id`'s restore, unless a Pod (but `failed`) still restores it."""
        if not any(st.checkpoint == checkpoint_id and st.pending and st is not failed for st in self.restores.values()):
            self.restorer.lazy.stop_prefetch(checkpoint_id, why)

    async def _after_failed_restore(self, sandbox: str, name: str, context: grpc.aio.ServicerContext) -> None:
        """Refuse to create a container again where its restore failed (`restore.after-failed-restore: refuse`).

        The kubelet creates a container again after it exited; one whose
        restore failed would start from its image, fresh, in a pod that says
        it was restored. The refusal (FAILED_PRECONDITION, which the kubelet
        shows as the container's error) names the failure.
        """
        failed = self.restorer.replicas.failed_name(sandbox, name) if sandbox else None
        if failed is None:
            return
        rep, reason = failed
        if self.settings.restore.after_failed_restore == "start-fresh":
            log.warning("pod %s: container %s, whose restore failed (%s), starts from its image "
                        "(restore.after-failed-restore: start-fresh)", rep.pod, name, reason,
                        extra={"pod": rep.pod, "container": name, "phase": "create"})
            return
        await abort_with(context, errors.FailedPrecondition(
            f"{rep.failure_text(reason)}; it is not created again from its image in a pod restored from checkpoint "
            f"{rep.checkpoint} (restore.after-failed-restore: refuse): delete the pod and restore it again"))

    async def remove_container(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """RemoveContainer, forwarded; then the container's restore plan goes."""
        resp = await self._forward_remove_container(raw, context)
        self._drop_plan(cri.RemoveContainerRequest.FromString(raw).container_id)
        return resp

    def _drop_plan(self, container_id: str) -> None:
        if valid_id(container_id):
            shutil.rmtree(os.path.join(self.settings.plans_dir, container_id), ignore_errors=True)


def _for_pod(exc: BaseException, where: str, ref: str) -> BaseException:
    """An error that says which pod and checkpoint, for the pod's events."""
    if isinstance(exc, errors.AgentError):
        return type(exc)(f"restore of pod {where} from {ref}: {exc}")
    return exc
