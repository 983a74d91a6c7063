"""Checkpoint to pod: sandbox, containers in CREATED, restore plans.

Reads a verified checkpoint from the store, creates a new sandbox through
CRI with the restore runtime handler, puts the pod's /dev/shm back, creates
each container, and leaves a restore plan per container ID for the runtime
wrapper (`criu_bridge.wrapper`), which turns the container's `create` into
`runc restore` when someone calls StartContainer. Before anything is made,
the request's `admission.RestoreAdmission` applies the node's policy for the
target namespace, the rule on other engines' checkpoints, the signature
requirement and the host-access check (every restore path, the CRI
endpoint's restore through a Pod included, asks the same rules there).
Everything created is journalled, the sandbox before RunPodSandbox is
called, and removed again on any error, until the runtime confirms it
(`node_agent.undoing`). A lazy
restore (`node_agent.lazy`) stages the memory that can come on demand
sparse and starts each container's lazy-pages helpers once its plan is
written. `Restorer` is the long-lived service; each restore is a
`RestoreRun`, which holds that operation's state (the request, the
checkpoint, the phase, the sandbox and containers made, the journal entry)
and whose methods are its steps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import uuid
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, Mapping

from criu_bridge import locks
from criu_bridge.errors import RuntimeFailure
from criu_bridge.rpc import CriuClient
from criu_bridge.wrapper import LOCKS_FILE, PLAN_ANNOTATION, PLAN_FILE
from node_agent import devshm, errors, hostaccess, podformat, podimages, runtime_handler
from node_agent.admission import RestoreAdmission, RestoreOptions, admit
from node_agent.config.schema import Settings
from node_agent.cri import CriClient
from node_agent.cri.client import RuntimeUnavailable
from node_agent.interop import imagefacts
from node_agent.journal import Entry, Journal
from node_agent.lazy import pagemap
from node_agent.lazy.restores import LazyRestores
from node_agent.lazy.staging import Memory, read_memory
from node_agent.metrics import Metrics, instrumented
from node_agent.podformat import SavedPod, check_name, load_saved
from node_agent.progress import Progress, ProgressFn, no_progress
from node_agent.replicas import Replica, Replicas, log_path_of, now_rfc3339
from node_agent.store import CheckpointRecord, Store
from node_agent.undoing import RESTORE_OP, Undoer, sandbox_record

log = logging.getLogger(__name__)

# How long a failed StartContainer of a lazy restore waits for its page source's account of why.
LAZY_REASON_WAIT = 5.0
RESTORED_FROM = "node-agent.io/restored-from"


@dataclass(frozen=True)
class RestoreRequest:
    checkpoint_id: str
    namespace: str = ""
    name: str = ""
    start: bool = False
    # Parsed by the entry path (`admission.parse_restore_options`, or a Pod's annotations).
    options: RestoreOptions = RestoreOptions()
    runtime_handler: str = ""
    # CRI RestorePod: the store holding the checkpoint (the agent's own when
    # None), and the caller's new PodSandboxConfig and ContainerConfigs (by
    # container name) as JSON. Given configs replace the checkpointed ones;
    # the pod's name, namespace and UID then come from `pod_config`.
    source: Store | None = None
    pod_config: Mapping[str, Any] | None = None
    container_configs: Mapping[str, Mapping[str, Any]] | None = None


@dataclass(frozen=True)
class RestoredPod:
    pod_sandbox_id: str
    namespace: str
    name: str
    uid: str
    checkpoint_id: str
    containers: tuple[tuple[str, str], ...]  # (name, container ID)
    started: bool


def target_pod_config(saved: SavedPod, namespace: str, name: str, uid: str, checkpoint_id: str,
                      log_root: str) -> dict[str, Any]:
    """The new sandbox's config: the checkpoint's, under the new identity, with none of its annotations.

    The log directory is the new pod's own under `log_root` (the
    checkpoint's path is not trusted for where the node writes).
    """
    cfg: dict[str, Any] = json.loads(json.dumps(saved.pod_config))
    old_meta = cfg.get("metadata") or {}
    cfg["metadata"] = {"name": name, "namespace": namespace, "uid": uid, "attempt": 0}
    if cfg.get("log_directory"):
        cfg["log_directory"] = os.path.join(log_root, f"{namespace}_{name}_{uid}")
    if cfg.get("hostname") in (old_meta.get("name"), None, ""):
        cfg["hostname"] = name[:63]
    cfg["annotations"] = {RESTORED_FROM: checkpoint_id}
    return cfg


def target_container_config(saved_config: Mapping[str, Any], cname: str, *, allow_host_access: bool) -> dict[str, Any]:
    """A new container's config from its checkpointed one: no annotation of the checkpoint survives.

    With host access allowed, CDI devices that the checkpoint asked for
    through annotations are carried over as explicit `CDI_devices`.
    """
    ccfg: dict[str, Any] = json.loads(json.dumps(saved_config))
    ccfg["metadata"] = {"name": cname, "attempt": 0}
    if allow_host_access:
        devices = hostaccess.cdi_devices_of(ccfg)
        if devices:
            ccfg["CDI_devices"] = [{"name": d} for d in dict.fromkeys(devices)]
    ccfg["annotations"] = {}
    return ccfg


def with_plan_mark(config: Mapping[str, Any], nonce: str) -> dict[str, Any]:
    """A container config marked as restored from the plan with this nonce (`criu_bridge.wrapper`)."""
    cfg = dict(config)
    cfg["annotations"] = {**(config.get("annotations") or {}), PLAN_ANNOTATION: nonce}
    return cfg


def plan_locks(images: str, mounts: Any) -> list[dict[str, Any]]:
    """The file locks in a plan's CRIU images, each with the host path of its file where a mount provides it.

    Files in the container's own rootfs (its new writable layer) have no
    host path: only a lock on a mounted host path can meet a live holder.
    """
    binds = sorted(
        ((str(m.get("container_path", "")).rstrip("/") or "/", str(m.get("host_path", "")))
         for m in (mounts if isinstance(mounts, list) else []) if isinstance(m, Mapping) and m.get("host_path")),
        key=lambda b: len(b[0]), reverse=True,
    )
    out = []
    for lk in imagefacts.file_locks(images):
        path = str(lk["path"])
        host = ""
        for dest, src in binds:
            if path == dest or path.startswith(dest.rstrip("/") + "/"):
                rest = path[len(dest):].lstrip("/")
                if ".." not in rest.split("/"):
                    host = os.path.join(src, rest) if rest else src
                break
        out.append({"path": path, "host": host, "kind": lk["kind"], "write": lk["write"],
                    "start": lk["start"], "len": lk["len"]})
    return out


def with_restored_from(pod_config: Mapping[str, Any], checkpoint_id: str) -> dict[str, Any]:
    """A caller's pod config, annotated with the checkpoint it is restored from."""
    cfg: dict[str, Any] = json.loads(json.dumps(pod_config))
    cfg["annotations"] = {**(cfg.get("annotations") or {}), RESTORED_FROM: checkpoint_id}
    return cfg


class Restorer:
    """The restore service: long-lived clients, the pods being restored into, the CPU checks passed.

    Each `restore` call is a `RestoreRun`.
    """

    def __init__(
        self, settings: Settings, cri: CriClient, store: Store, journal: Journal, criu: CriuClient, metrics: Metrics,
        *, undoer: Undoer | None = None,
    ) -> None:
        self.settings = settings
        self.undoer = undoer or Undoer(settings, cri, journal)
        self.cri = cri
        self.store = store
        self.journal = journal
        self.criu = criu
        self._targets: set[str] = set()
        self.metrics = metrics
        # Checkpoints whose CPU check passed on this node (stable while the agent runs).
        self._cpu_ok: set[str] = set()
        self.replicas = Replicas(settings.replicas_dir)  # every container restored, and whether it failed
        self.lazy = LazyRestores(settings, self.replicas)

    @instrumented("restore")
    async def restore(
        self, req: RestoreRequest, *, timeout: float | None = None, progress: ProgressFn = no_progress
    ) -> RestoredPod:
        timeout = timeout if timeout is not None else self.settings.timeouts.restore
        run = RestoreRun(self, req, progress)
        entry = run.entry
        try:
            async with asyncio.timeout(timeout):
                result = await run.run()
        except BaseException as exc:
            done = await asyncio.shield(asyncio.ensure_future(run.undo()))
            undone = ("everything it created was removed" if done else "removing what it created is pending: the "
                      f"agent retries until the runtime answers (journal entry {entry.op_id})")
            if isinstance(exc, TimeoutError):
                raise errors.DeadlineExceeded(f"restore of {req.checkpoint_id}: the deadline ({timeout:g}s) passed "
                                              f"during {run.phase}; {undone}") from exc
            if isinstance(exc, RuntimeUnavailable) and entry.pid:
                raise errors.Unavailable(
                    f"restore as pod {entry.data.get('pod', '?')}, phase {run.phase}: the container runtime at "
                    f"{self.settings.cri_endpoint} did not answer ({_innermost(exc)}); {undone}"
                ) from exc
            if not done and isinstance(exc, errors.AgentError):  # the caller hears that something stays, for now
                raise type(exc)(f"{exc}; {undone}") from exc
            raise
        self.journal.remove(entry)
        self.lazy.done(entry.op_id)
        return result

    def unpack(self, record: CheckpointRecord, staging: str, source: Store | None = None, lazy: bool = False, *,
               containers: Collection[str] | None = None, devshm: bool = True) -> dict[str, Memory]:
        """Read and verify the files the restore needs into ``staging``.

        Paged (``lazy``: lazily, or in full through the page source), the
        pages files are left out: what CRIU places itself is returned, read
        and verified, by container, to be written when it starts (`staging`).
        ``containers`` (every one when None) names whose files come, and
        ``devshm`` whether the pod's /dev/shm does. A chunk a pull left in
        the registry is fetched from there (`store.origins`), verified alike.
        """
        store = source or self.store
        try:
            memory = read_memory(store, record, containers) if lazy else {}
            prefixes = ([podformat.CONTAINERS_DIR] if containers is None
                        else [podformat.container_dir(c) for c in containers])
            for prefix in prefixes:
                store.materialize(record, staging, prefix=prefix, exclude={f.path for m in memory.values()
                                                                            for f in m.files})
            if devshm and any(f.path == podformat.POD_DEVSHM for f in record.files):
                store.materialize(record, staging, prefix=podformat.POD_DEVSHM)
        except errors.DataLoss as exc:
            raise errors.DataLoss(f"checkpoint {record.id} failed verification, not restoring it: {exc}") from exc
        except pagemap.PagemapError as exc:
            raise errors.DataLoss(f"checkpoint {record.id}: unusable memory image: {exc}") from exc
        return memory

    async def admit(self, record: CheckpointRecord, saved: SavedPod, namespace: str, where: str,
                    source: Store | None = None) -> str:
        """May this checkpoint be restored into `namespace` (as pod `where`)? PERMISSION_DENIED if not.

        `admission.admit`, off the event loop, reading signatures from
        `source` (the agent's store when None). Returns the signer's key id
        ("" when no signature is required).
        """
        return await asyncio.to_thread(admit, self.settings, source or self.store, record, saved, namespace, where)

    async def preflight(self, record: CheckpointRecord, saved: SavedPod, source: Store | None = None, *,
                        images: bool = True) -> None:
        """What must hold before anything is made: the images (with `images`), free space, the CPU's features.

        A restore no kubelet precedes (the CLI, the API) pulls an image the
        node lacks itself (`podimages.ensure_image`). The Pod path passes
        `images=False`: there the kubelet pulls each container's image after
        RunPodSandbox, and CreateContainer checks it (`podimages.check_image`).
        """
        for cname, cfg, _ in saved.containers:
            image = podimages.saved_image(record, cname, cfg)
            if images:
                await podimages.ensure_image(self.cri, self.settings, record, cname, image)
        os.makedirs(self.settings.plans_dir, mode=0o700, exist_ok=True)
        st = os.statvfs(self.settings.plans_dir)
        free = st.f_bavail * st.f_frsize
        need = record.size + self.settings.min_free_bytes
        if free < need:
            raise errors.ResourceExhausted(
                f"restore of {record.id}: {free >> 20} MiB free under {self.settings.plans_dir}, need {need >> 20} MiB"
            )
        if record.id in self._cpu_ok:
            return  # this node's CPU already passed this checkpoint's check
        tmp = os.path.join(self.settings.work_dir, "cpuinfo-" + secrets.token_hex(4))
        os.makedirs(tmp, mode=0o700)
        try:
            await asyncio.to_thread((source or self.store).materialize, record, tmp, prefix=podformat.POD_CPUINFO_DIR)
            try:
                await self.criu.cpuinfo_check(os.path.join(tmp, podformat.POD_CPUINFO_DIR))
            except RuntimeFailure as exc:
                raise errors.FailedPrecondition(
                    f"restore of {record.id}: this node's CPU lacks features the checkpoint's processes use: "
                    + "; ".join(exc.decisive)
                ) from exc
            if len(self._cpu_ok) >= 1024:
                self._cpu_ok.clear()
            self._cpu_ok.add(record.id)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    async def shutdown(self) -> None:
        """The agent stops: end the helpers of containers not started yet; let running transfers go on alone."""
        await self.lazy.shutdown()

    def write_plan(
        self, record: CheckpointRecord, staging: str, cname: str, plan_dir: str, where: str, options: tuple[str, ...],
        lazy: bool = False, *, nonce: str, mounts: Any = None, sandbox: str = "", logs: tuple[str, str] = ("", ""),
        filled: bool = False, pid_floor: int = 0,
    ) -> None:
        """Move a container's verified files from staging into its plan dir (renames only).

        The plan names its `nonce` (the container's mark), and lists the
        file locks its processes will take again (`locks.json`): a lock
        that a live process on this node holds against it fails the restore
        here, by name, instead of leaving CRIU waiting for it. The container
        is recorded as a replica of its `sandbox` (`replicas`), with its CRI
        log (`logs`: the sandbox's log directory, the container's log path).
        `pid_floor` is the highest PID any container of the checkpoint takes
        back (`podformat.highest_pid`): the wrapper moves a PID namespace the
        container joins past it before CRIU runs.
        """
        os.makedirs(plan_dir, mode=0o700)
        src = os.path.join(staging, podformat.container_dir(cname))
        os.replace(os.path.join(src, podformat.IMAGES_DIR), os.path.join(plan_dir, "images"))
        if os.path.isdir(os.path.join(src, podformat.PREDUMP_DIR)):
            os.replace(os.path.join(src, podformat.PREDUMP_DIR), os.path.join(plan_dir, "predump"))
            os.symlink("../predump", os.path.join(plan_dir, "images", "parent"))
        for fname in ("rootfs-diff.tar", "deleted.files", "opaque.dirs"):
            if os.path.exists(os.path.join(src, fname)):
                os.replace(os.path.join(src, fname), os.path.join(plan_dir, fname))
        try:
            wanted = plan_locks(os.path.join(plan_dir, "images"), mounts)
        except errors.AgentError as exc:
            raise errors.DataLoss(f"checkpoint {record.id}: container {cname}: unreadable file-lock images: {exc}") from exc
        held = locks.conflicts(wanted)
        if held:
            raise errors.FailedPrecondition(f"restore as pod {where}, container {cname}, phase file-locks: "
                                            + "; ".join(held))
        if wanted:
            with open(os.path.join(plan_dir, LOCKS_FILE), "w", encoding="utf-8") as fh:
                json.dump(wanted, fh)
        plan = {"version": 1, "checkpoint": record.id, "pod": where, "container": cname, "options": list(options),
                "lazy": lazy, "filled": lazy and filled, "nonce": nonce,
                # The pages files are not here: the wrapper asks the page source to write them, before CRIU runs.
                "memory_at_start": lazy, "pid_floor": pid_floor}
        path = os.path.join(plan_dir, PLAN_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(plan, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(path + ".tmp", path)
        if sandbox:
            # Listed as a full restore when filled: its processes ran only once every page was in.
            self.replicas.record(Replica(os.path.basename(plan_dir), sandbox, where, cname, record.id,
                                         lazy and not filled,
                                         log_path_of(*logs), logs[0], now_rfc3339()))


class RestoreRun:
    """One restore of one checkpoint as one pod: its state from the request to the restored pod, and its steps.

    `phase` is the step under way, as errors and a passed deadline name it.
    Everything the run makes is recorded in its journal entry (`entry`: the
    sandbox before it is asked for, each sandbox and plan once made), which
    `undo` removes again when the run fails.
    """

    # Set by the steps, in order: the checkpoint and where it is read from, the pod it
    # becomes, its rules, the sandbox's config and ID, the staging dir, whether lazily.
    store: Store
    record: CheckpointRecord
    saved: SavedPod
    namespace: str
    name: str
    uid: str
    where: str
    handler: str
    admission: RestoreAdmission
    pod_config: dict[str, Any]
    pod_id: str
    staging: str
    lazy: bool  # the memory comes while the processes run
    filled: bool  # full, but through the page source: the processes resume once every page is in
    memory: dict[str, Memory]  # paged: by container, its memory until its page source takes it

    @property
    def paged(self) -> bool:
        """Whether the memory comes through page sources rather than the plan's images."""
        return self.lazy or self.filled

    def __init__(self, service: Restorer, req: RestoreRequest, progress: ProgressFn) -> None:
        self.service = service
        self.settings = service.settings
        self.req = req
        self.options = req.options
        self.progress = progress
        self.phase = "verify"
        self.entry = Entry("restore", data={"sandboxes": [], "plans": []})
        self.created: list[tuple[str, str, str]] = []  # name, container ID, plan nonce
        self.started = False
        self.fetching_ahead = ""  # the checkpoint whose chunks are fetched ahead of this restore (`lazy.prefetch`)

    async def run(self) -> RestoredPod:
        """Hold the checkpoint while it is restored.

        Removing it (or retention dropping it) meanwhile leaves its blobs in
        place until this restore is done with them.
        """
        self.store = self.req.source or self.service.store
        self.record = await asyncio.to_thread(self.store.get, self.req.checkpoint_id)
        hold = await asyncio.to_thread(self.store.hold, self.record.id)
        try:
            return await self._run_held()
        finally:
            hold.release()

    async def _run_held(self) -> RestoredPod:
        """The new pod's identity, the rules, one restore per target pod, then the restore into it."""
        req, svc = self.req, self.service
        self.saved = saved = await asyncio.to_thread(load_saved, self.store, self.record)
        if req.pod_config is not None:
            given = req.pod_config.get("metadata") or {}
            self.namespace = check_name("namespace", str(given.get("namespace", "")))
            self.name = check_name("pod name", str(given.get("name", "")))
            self.uid = str(given.get("uid") or "") or str(uuid.uuid4())
        else:
            self.namespace = check_name("namespace", req.namespace) if req.namespace else saved.namespace
            self.name = (check_name("pod name", req.name) if req.name
                         else f"{saved.name}-restored-{secrets.token_hex(3)}"[:253])
            self.uid = str(uuid.uuid4())
        self.where = where = f"{self.namespace}/{self.name}"
        self.admission = RestoreAdmission(self.settings, self.namespace, where, self.options)
        await asyncio.to_thread(self.admission.admit, self.store, self.record, saved)
        self.handler = req.runtime_handler or self.settings.runtime_handler
        if where in svc._targets:
            raise errors.Aborted(f"restore as pod {where}: another restore into that pod is in progress")
        svc._targets.add(where)
        try:
            pods = await svc.cri.list_pods()
            if any(p.namespace == self.namespace and p.name == self.name and p.ready for p in pods):
                raise errors.AlreadyExists(f"restore as pod {where}: a pod of that name is already running")
            return await self._restore_into()
        finally:
            svc._targets.discard(where)

    async def _restore_into(self) -> RestoredPod:
        """Preflight, the sandbox (journalled before it is asked for), the verified files, /dev/shm, the containers."""
        req, svc, record, saved, where = self.req, self.service, self.record, self.saved, self.where
        self.admission.check_host_access(record, saved)
        self.phase = "preflight"
        self.progress(Progress("preflight", message=where))
        await svc.preflight(record, saved, req.source)
        # The handler must be this agent's wrapper, or the containers would
        # start fresh from their images: refused before anything is made.
        await runtime_handler.require(svc.cri, self.settings, self.handler, f"restore as pod {where}")

        self.phase = "sandbox"
        self.pod_config = pod_config = (
            target_pod_config(saved, self.namespace, self.name, self.uid, record.id, self.settings.pod_log_root)
            if req.pod_config is None else with_restored_from(req.pod_config, record.id)
        )
        entry = self.entry
        pod_config["annotations"] = {**(pod_config.get("annotations") or {}), RESTORE_OP: entry.op_id}
        # The sandbox is findable before it exists: an answer lost leaves no sandbox behind.
        entry.data.update({"checkpoint": record.id, "pod": where, "sandbox": sandbox_record(pod_config, entry.op_id)})
        svc.journal.write(entry)
        self.lazy = await svc.lazy.wanted(self.options.lazy, record)
        self.filled = not self.lazy and await svc.lazy.filled(self.options.lazy, record)
        if self.paged and req.source is None:  # the link to its registry is idle until the restore connects
            svc.lazy.prefetch(svc.store, record, f"restore of pod {where}")
            self.fetching_ahead = record.id
        self.progress(Progress("sandbox", 0, len(saved.containers), message=where + (" (lazy)" if self.lazy else "")))
        # Read and verify every file while containerd makes the sandbox.
        self.staging = staging = os.path.join(self.settings.work_dir, f"restore-{entry.op_id}")
        os.makedirs(staging, mode=0o700)
        try:
            unpack = asyncio.create_task(
                asyncio.to_thread(svc.unpack, record, staging, req.source, self.paged), name=f"unpack {record.id[:19]}"
            )
            try:
                self.pod_id = await svc.cri.run_pod(pod_config, self.handler)
            except BaseException:
                await _settle(unpack)
                raise
            entry.data["sandboxes"].append(self.pod_id)
            svc.journal.write(entry)
            self.phase = "verify"
            self.progress(Progress("verify", message=record.id))
            self.memory = await unpack
            await devshm.restore(svc.cri, staging, self.pod_id, where)
            await self.create_containers()
            if req.start:
                await self.start_containers()
            log.info("checkpoint %s restored as pod %s (%s)", record.id, where, self.pod_id[:13],
                     extra={"pod": where, "checkpoint": record.id, "phase": "restored"})
            # Success: the journal entry goes, so recovery leaves the pod alone.
            entry.data = {}
            return RestoredPod(self.pod_id, self.namespace, self.name, self.uid, record.id,
                               tuple((n, c) for n, c, _ in self.created), self.started)
        finally:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, staging, True))

    async def create_containers(self) -> None:
        """Each container in CREATED with its plan's mark, its plan written (journalled first), its lazy helpers."""
        req, svc, record, saved, entry = self.req, self.service, self.record, self.saved, self.entry
        pid_floor: int | None = None  # read once, for the first container that joins a shared PID namespace
        for i, (cname, cfg, _spec) in enumerate(saved.containers):
            self.phase = f"create {cname}"
            if req.container_configs is not None:
                ccfg = dict(req.container_configs[cname])
            else:
                ccfg = target_container_config(cfg["config"], cname, allow_host_access=self.options.allow_host_access)
            if pid_floor is None and podformat.shares_pids(ccfg):
                pid_floor = await asyncio.to_thread(podformat.highest_pid, req.source or svc.store, record, saved)
            nonce = secrets.token_hex(16)
            cid = await svc.cri.create_container(self.pod_id, with_plan_mark(ccfg, nonce), self.pod_config)
            plan_dir = os.path.join(self.settings.plans_dir, cid)
            entry.data["plans"].append(plan_dir)
            svc.journal.write(entry)
            await asyncio.to_thread(svc.write_plan, record, self.staging, cname, plan_dir, self.where, saved.options,
                                    self.paged, nonce=nonce, mounts=ccfg.get("mounts"), sandbox=self.pod_id,
                                    logs=(str(self.pod_config.get("log_directory") or ""),
                                          str(ccfg.get("log_path") or "")), filled=self.filled, pid_floor=pid_floor or 0)
            if self.paged:
                await svc.lazy.start(entry.op_id, req.source or svc.store, record, self.where, cname, cid, plan_dir,
                                     callers=req.source is not None, exists=container_exists(svc.cri, cid),
                                     filled=self.filled, memory=self.memory.pop(cname, None))
            self.created.append((cname, cid, nonce))
            self.progress(Progress("create", i + 1, len(saved.containers), message=cname))

    async def start_containers(self) -> None:
        """StartContainer for each, then verified as restored from its plan; a failure says the decisive reason."""
        svc, where, plans_dir = self.service, self.where, self.settings.plans_dir
        for i, (cname, cid, nonce) in enumerate(self.created):
            self.phase = f"start {cname}"
            log.debug("restore of pod %s: starting container %s (%s)", where, cname, cid[:13],
                      extra={"pod": where, "container": cname, "phase": "start"})
            try:
                await svc.cri.start_container(cid)
            except errors.AgentError as exc:
                # A refusal before runc ran (the wrapper's FAILED_PRECONDITION) is the reason (or, where a
                # container started before this one lost its transfer and failed the pod, that loss): the
                # page source then only lost its restore. When CRIU itself failed under a lazy
                # restore, or the pre-resume gate of a filled one stopped it, the page source says
                # why (a chunk that failed verification, a registry gone), not the log CRIU left as
                # it was cut off nor a gate that came after the source had failed.
                refused = runtime_handler.refusal(os.path.join(plans_dir, cid))
                if refused is not None and not isinstance(refused, errors.Internal):
                    for _name, before, _ in self.created[:i] if self.paged else ():
                        if (lost := await svc.lazy.failure(self.entry.op_id, before, 0.0, early=True)) is not None:
                            raise lost from exc
                    raise refused from exc
                gated = refused is not None and runtime_handler.gate_stopped(refused)
                lost = (await svc.lazy.failure(self.entry.op_id, cid, LAZY_REASON_WAIT, early=gated)
                        if self.paged else None)
                if lost is not None:
                    raise lost from exc
                if refused is not None:
                    raise refused from exc
                raise type(exc)(f"restore of pod {where}, container {cname}: {exc}") from exc
            await runtime_handler.verify_restored(
                svc.cri, self.settings, cid, os.path.join(plans_dir, cid), nonce,
                where=f"restore of pod {where}, container {cname}", handler=self.handler)
            self.progress(Progress("start", i + 1, len(self.created), message=cname))
        self.started = True

    async def undo(self) -> bool:
        """Remove every sandbox and plan this restore created, then its journal entry; False: still pending.

        Runs as its own task: a second cancellation of the call cannot cut it
        short. What the runtime could not remove now, the undoer retries.
        """
        await self.service.lazy.cancel(self.entry.op_id)
        if self.fetching_ahead:
            self.service.lazy.stop_prefetch(self.fetching_ahead, "the restore failed")
        return await self.service.undoer.undo(self.entry)


def container_exists(cri: CriClient, container_id: str) -> Callable[[], Awaitable[bool | None]]:
    """Whether the container is there, asked of the runtime (None: not known now), for its page source."""
    async def exists() -> bool | None:
        try:
            await cri.container_status(container_id)
        except errors.NotFound:
            return False
        except errors.AgentError:
            return None  # not known now; asked again later
        return True

    return exists


async def _settle(task: asyncio.Task[Any]) -> None:
    """Wait for a thread-backed task we no longer need (threads can't be cancelled)."""
    try:
        await asyncio.shield(task)
    except BaseException:  # noqa: BLE001 - its result no longer matters
        pass


def _innermost(exc: BaseException) -> str:
    """The message of the first error in `exc`'s chain of causes (the runtime's own answer)."""
    while isinstance(exc.__cause__, errors.AgentError):
        exc = exc.__cause__
    return str(exc)
