"""Checkpoint to pod: sandbox, containers in CREATED, restore plans.

Reads a verified checkpoint from the store, creates a new sandbox through
CRI with the restore runtime handler, puts the pod's /dev/shm back, creates
each container, and leaves a restore plan per container ID for the runtime
wrapper (`criu_bridge.wrapper`), which turns the container's `create` into
`runc restore` when someone calls StartContainer. Everything created is
journalled and removed again on any error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import shutil
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from criu_bridge import locks, rootfs
from criu_bridge.errors import BridgeError, RuntimeFailure
from criu_bridge.rpc import CriuClient
from criu_bridge.wrapper import LOCKS_FILE, PLAN_ANNOTATION, PLAN_FILE
from node_agent import errors, handler, hostaccess, strictjson
from node_agent.checkpointing import METADATA_KIND, Progress, ProgressFn, _no_progress, parse_options, shm_source
from node_agent.config import Settings
from node_agent.cri import CriClient
from node_agent.cri.client import normalized
from node_agent.interop import criuimg
from node_agent.interop.importing import INTEROP_DIR
from node_agent.journal import Entry, Journal
from node_agent.lazy import pagemap
from node_agent.lazy.session import LazySession
from node_agent.lazy.support import lazy_restore_support
from node_agent.metrics import Metrics, instrumented
from node_agent.options import boolean
from node_agent.store import CheckpointRecord, Store

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_CONTAINER_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,251}[A-Za-z0-9])?$")
# allow-host-access: let a checkpoint's configs reach into the host (host
# mounts, devices, privileged mode, host namespaces, added capabilities;
# `hostaccess`), refused by default: a checkpoint is hostile input.
# lazy: start the containers before their memory is read (default: the
# lazy-restore setting, where CRIU and the kernel support it).
# Both take `true` or `false`, nothing else.
RESTORE_OPTIONS = {"allow-host-access", "lazy"}
_PAGEMAP_RE = re.compile(r"^containers/([^/]+)/checkpoint/pagemap-([0-9]{1,10})\.img$")
RESTORED_FROM = "node-agent.io/restored-from"


@dataclass(frozen=True)
class RestoreOptions:
    allow_host_access: bool = False
    lazy: bool | None = None  # None: the node's default


def parse_restore_options(options: Mapping[str, str]) -> RestoreOptions:
    """A restore's options, strictly: known keys, values `true` or `false`."""
    values: dict[str, bool] = {}
    for key, value in options.items():
        if key not in RESTORE_OPTIONS:
            raise errors.InvalidArgument(
                f"unknown restore option {key!r} (supported: {', '.join(sorted(RESTORE_OPTIONS))})"
            )
        values[key.replace("-", "_")] = boolean(value, f"restore option {key!r}")
    return RestoreOptions(**values)


@dataclass(frozen=True)
class RestoreRequest:
    checkpoint_id: str
    namespace: str = ""
    name: str = ""
    start: bool = False
    options: Mapping[str, str] = field(default_factory=dict)
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


@dataclass(frozen=True)
class _Saved:
    """What a checkpoint says about its pod, checked as hostile input."""

    namespace: str
    name: str
    pod_config: Mapping[str, Any]
    containers: tuple[tuple[str, Mapping[str, Any], Mapping[str, Any]], ...]  # name, config.dump, spec
    options: tuple[str, ...]


def _check_name(what: str, value: str, rx: re.Pattern[str] = _NAME_RE) -> str:
    if not isinstance(value, str) or not rx.fullmatch(value):
        raise errors.InvalidArgument(f"{what} {value!r} is not a valid name")
    return value


def _read_json(store: Store, record: CheckpointRecord, path: str, limit: int = 16 << 20) -> Any:
    cid = record.id
    with store.open(record, path) as fh:
        if fh.size > limit:
            raise errors.DataLoss(f"checkpoint {cid}: {path} is larger than {limit} bytes")
        data = fh.read(fh.size)
    try:
        return strictjson.loads(data)
    except strictjson.StrictJsonError as exc:
        raise errors.DataLoss(f"checkpoint {cid}: {path} {exc}") from exc


def load_saved(store: Store, record: CheckpointRecord) -> _Saved:
    meta = record.metadata
    if not isinstance(meta, Mapping) or meta.get("kind") != METADATA_KIND:
        raise errors.FailedPrecondition(f"{record.id} is not a pod checkpoint")
    pod = meta.get("pod")
    if not isinstance(pod, Mapping):
        raise errors.DataLoss(f"checkpoint {record.id}: metadata has no pod")
    ns = _check_name("checkpointed namespace", pod.get("namespace", ""))
    name = _check_name("checkpointed pod name", pod.get("name", ""))
    paths = {f.path for f in record.files}
    pod_doc = _read_json(store, record, "pod/config.json")
    if not isinstance(pod_doc, Mapping) or not isinstance(pod_doc.get("config"), Mapping):
        raise errors.DataLoss(f"checkpoint {record.id}: pod/config.json has no config")
    pod_cfg = _schema(record.id, "pod/config.json", pod_doc["config"], "pod")
    containers = []
    entries = meta.get("containers")
    if not isinstance(entries, list) or not entries:
        raise errors.DataLoss(f"checkpoint {record.id}: metadata lists no containers")
    for c in entries:
        cname = _check_name("checkpointed container name", c.get("name", "") if isinstance(c, Mapping) else "", _CONTAINER_NAME_RE)
        base = f"containers/{cname}"
        if f"{base}/config.dump" not in paths or f"{base}/spec.dump" not in paths:
            raise errors.DataLoss(f"checkpoint {record.id}: container {cname} has no config.dump or spec.dump")
        cfg = _read_json(store, record, f"{base}/config.dump")
        spec = _read_json(store, record, f"{base}/spec.dump", limit=64 << 20)
        if not isinstance(cfg, Mapping) or not isinstance(cfg.get("config"), Mapping) or not isinstance(spec, Mapping):
            raise errors.DataLoss(f"checkpoint {record.id}: container {cname} has a malformed config.dump or spec.dump")
        cfg = {**cfg, "config": _schema(record.id, f"{base}/config.dump", cfg["config"], "container")}
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
    return _Saved(ns, name, pod_cfg, tuple(containers), tuple(sorted(flags.as_options())))


def _schema(checkpoint_id: str, path: str, config: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """A saved config, checked against the CRI schema (unknown fields refused) and normalized."""
    try:
        return normalized(config, kind)
    except errors.InvalidArgument as exc:
        raise errors.DataLoss(f"checkpoint {checkpoint_id}: {path}: {exc}") from exc


def check_host_access(checkpoint_id: str, saved: _Saved, s: Settings, *, allowed: bool) -> None:
    """FAILED_PRECONDITION naming each way the checkpoint's configs reach into the host, unless allowed."""
    found = hostaccess.findings(saved.pod_config, [(n, cfg["config"]) for n, cfg, _ in saved.containers],
                                kubelet_root=s.kubelet_root, agent_files=os.path.join(s.store, INTEROP_DIR))
    hostaccess.refuse(f"checkpoint {checkpoint_id}", found, allowed=allowed)


def target_pod_config(saved: _Saved, namespace: str, name: str, uid: str, checkpoint_id: str,
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
    for lk in criuimg.file_locks(images):
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
    def __init__(self, settings: Settings, cri: CriClient, store: Store, journal: Journal, criu: CriuClient) -> None:
        self.settings = settings
        self.cri = cri
        self.store = store
        self.journal = journal
        self.criu = criu
        self._targets: set[str] = set()
        self.metrics = Metrics()
        self._lazy_support: tuple[bool, str] | None = None
        # Checkpoints whose CPU check passed on this node (stable while the agent runs).
        self._cpu_ok: set[str] = set()
        self._lazy_warned = False
        # Lazy sessions started by each restore in flight (by journal op), for its undo.
        self._op_sessions: dict[str, list[LazySession]] = {}
        self._lazy_tasks: set[asyncio.Task[None]] = set()
        # Every lazy session whose helpers still run.
        self._sessions: set[LazySession] = set()

    @instrumented("restore")
    async def restore(
        self, req: RestoreRequest, *, timeout: float | None = None, progress: ProgressFn = _no_progress
    ) -> RestoredPod:
        parse_restore_options(req.options)  # refused before anything is touched
        timeout = timeout if timeout is not None else self.settings.timeouts.restore
        phase = ["verify"]
        entry = Entry("restore", data={"sandboxes": [], "plans": []})
        try:
            async with asyncio.timeout(timeout):
                result = await self._run(req, entry, phase, progress)
        except TimeoutError as exc:
            await asyncio.shield(asyncio.ensure_future(self._undo(entry)))
            raise errors.DeadlineExceeded(
                f"restore of {req.checkpoint_id}: the deadline ({timeout:g}s) passed during {phase[0]}; "
                "everything it created was removed"
            ) from exc
        except BaseException:
            await asyncio.shield(asyncio.ensure_future(self._undo(entry)))
            raise
        self.journal.remove(entry)
        self._op_sessions.pop(entry.op_id, None)
        return result

    async def _run(self, req: RestoreRequest, entry: Entry, phase: list[str], progress: ProgressFn) -> RestoredPod:
        store = req.source or self.store
        record = await asyncio.to_thread(store.get, req.checkpoint_id)
        # Removing the checkpoint (or retention dropping it) meanwhile leaves
        # its blobs in place until this restore is done with them.
        hold = await asyncio.to_thread(store.hold, record.id)
        try:
            return await self._run_held(req, entry, phase, progress, store, record)
        finally:
            hold.release()

    async def _run_held(
        self, req: RestoreRequest, entry: Entry, phase: list[str], progress: ProgressFn, store: Store,
        record: CheckpointRecord,
    ) -> RestoredPod:
        saved = await asyncio.to_thread(load_saved, store, record)
        if req.pod_config is not None:
            given = req.pod_config.get("metadata") or {}
            namespace = _check_name("namespace", str(given.get("namespace", "")))
            name = _check_name("pod name", str(given.get("name", "")))
            uid = str(given.get("uid") or "") or str(uuid.uuid4())
        else:
            namespace = _check_name("namespace", req.namespace) if req.namespace else saved.namespace
            name = _check_name("pod name", req.name) if req.name else f"{saved.name}-restored-{secrets.token_hex(3)}"[:253]
            uid = str(uuid.uuid4())
        where = f"{namespace}/{name}"
        handler_name = req.runtime_handler or self.settings.runtime_handler
        if where in self._targets:
            raise errors.Aborted(f"restore as pod {where}: another restore into that pod is in progress")
        self._targets.add(where)
        try:
            if any(p.namespace == namespace and p.name == name and p.ready for p in await self.cri.list_pods()):
                raise errors.AlreadyExists(f"restore as pod {where}: a pod of that name is already running")
            return await self._restore_into(req, record, saved, namespace, name, uid, where, handler_name,
                                            entry, phase, progress)
        finally:
            self._targets.discard(where)

    async def _restore_into(
        self, req: RestoreRequest, record: CheckpointRecord, saved: _Saved, namespace: str, name: str, uid: str,
        where: str, handler_name: str, entry: Entry, phase: list[str], progress: ProgressFn,
    ) -> RestoredPod:
        opts = parse_restore_options(req.options)
        check_host_access(record.id, saved, self.settings, allowed=opts.allow_host_access)
        phase[0] = "preflight"
        progress(Progress("preflight", message=where))
        await self.preflight(record, saved, req.source)
        # The handler must be this agent's wrapper, or the containers would
        # start fresh from their images: refused before anything is made.
        await handler.require(self.cri, self.settings, handler_name, f"restore as pod {where}")

        phase[0] = "sandbox"
        entry.data.update({"checkpoint": record.id, "pod": where})
        self.journal.write(entry)
        pod_config = (
            target_pod_config(saved, namespace, name, uid, record.id, self.settings.pod_log_root)
            if req.pod_config is None else with_restored_from(req.pod_config, record.id)
        )
        lazy = await self.lazy_mode(req, record)
        progress(Progress("sandbox", 0, len(saved.containers), message=where + (" (lazy)" if lazy else "")))
        # Read and verify every file while containerd makes the sandbox.
        staging = os.path.join(self.settings.work_dir, f"restore-{entry.op_id}")
        os.makedirs(staging, mode=0o700)
        try:
            unpack = asyncio.create_task(
                asyncio.to_thread(self.unpack, record, staging, req.source, lazy), name=f"unpack {record.id[:19]}"
            )
            try:
                pod_id = await self.cri.run_pod(pod_config, handler_name)
            except BaseException:
                await _settle(unpack)
                raise
            entry.data["sandboxes"].append(pod_id)
            self.journal.write(entry)
            phase[0] = "verify"
            progress(Progress("verify", message=record.id))
            await unpack
            await self.restore_shm(staging, pod_id, where)
            return await self._containers(req, record, saved, staging, pod_id, pod_config, where,
                                          namespace, name, uid, entry, phase, progress, lazy, handler_name, opts)
        finally:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, staging, True))

    def unpack(self, record: CheckpointRecord, staging: str, source: Store | None = None, lazy: bool = False) -> None:
        """Read and verify the files the restore needs into ``staging``.

        Lazily, the memory that can come on demand stays in the store: each
        such pages file is written sparse, with only its other pages in it.
        """
        store = source or self.store
        try:
            sparse = lazy_pages_files(store, record) if lazy else {}
            store.materialize(record, staging, prefix="containers", exclude=set(sparse))
            for path, pm in sparse.items():
                write_sparse_pages(store, record, staging, path, pm)
            if any(f.path == "pod/devshm.tar" for f in record.files):
                store.materialize(record, staging, prefix="pod/devshm.tar")
        except errors.DataLoss as exc:
            raise errors.DataLoss(f"checkpoint {record.id} failed verification, not restoring it: {exc}") from exc
        except pagemap.PagemapError as exc:
            raise errors.DataLoss(f"checkpoint {record.id}: unusable memory image: {exc}") from exc

    async def lazy_supported(self) -> tuple[bool, str]:
        """Whether this CRIU and kernel can restore lazily (`criu check --feature uffd-noncoop`), and why not."""
        if self._lazy_support is None:
            self._lazy_support = await asyncio.to_thread(lazy_restore_support, self.settings.criu, 30.0)
        return self._lazy_support

    async def lazy_mode(self, req: RestoreRequest, record: CheckpointRecord) -> bool:
        """Whether this restore goes lazily: asked for (or the default), possible here, and for this checkpoint."""
        asked = parse_restore_options(req.options).lazy
        if asked is not None:
            if not asked:
                return False
        elif self.settings.lazy_restore != "auto":
            return False
        if any("/predump/" in f.path for f in record.files):
            log.info("checkpoint %s has pre-dumped memory: restoring it in full", record.id)
            return False
        ok, why = await self.lazy_supported()
        if not ok and not self._lazy_warned:
            self._lazy_warned = True
            log.warning("lazy restore is not available here (criu check --feature uffd-noncoop: %s): "
                        "restores read all memory before the containers start", why)
        return ok

    async def _containers(
        self, req: RestoreRequest, record: CheckpointRecord, saved: _Saved, staging: str, pod_id: str,
        pod_config: dict[str, Any], where: str, namespace: str, name: str, uid: str, entry: Entry,
        phase: list[str], progress: ProgressFn, lazy: bool, handler_name: str, opts: RestoreOptions,
    ) -> RestoredPod:
        created: list[tuple[str, str, str]] = []  # name, container ID, plan nonce
        for i, (cname, cfg, _spec) in enumerate(saved.containers):
            phase[0] = f"create {cname}"
            if req.container_configs is not None:
                ccfg = dict(req.container_configs[cname])
            else:
                ccfg = target_container_config(cfg["config"], cname, allow_host_access=opts.allow_host_access)
            nonce = secrets.token_hex(16)
            cid = await self.cri.create_container(pod_id, with_plan_mark(ccfg, nonce), pod_config)
            plan_dir = os.path.join(self.settings.plans_dir, cid)
            entry.data["plans"].append(plan_dir)
            self.journal.write(entry)
            await asyncio.to_thread(self.write_plan, record, staging, cname, plan_dir, where, saved.options, lazy,
                                    nonce=nonce, mounts=ccfg.get("mounts"))
            if lazy:
                store = req.source or self.store
                origin, passwords = _remote_access(store, record.id)
                # The page source holds the blobs it serves until its pages are
                # in: a hold in our store, or links to a caller's checkpoint.
                private = None
                if req.source is not None:
                    private = await asyncio.to_thread(_private_source, store, record, plan_dir, where, cname)
                hold = await asyncio.to_thread(store.hold, record) if private is None else None
                session = LazySession(self.settings, where, cname, cid, record.id, plan_dir,
                                      store.root if private is None else private.root,
                                      origin=origin, passwords=passwords, hold=hold,
                                      private_store=private is not None, exists=self._exists(cid))
                self._op_sessions.setdefault(entry.op_id, []).append(session)
                await session.start()
                self._track(session, store)
            created.append((cname, cid, nonce))
            progress(Progress("create", i + 1, len(saved.containers), message=cname))

        started = False
        if req.start:
            for i, (cname, cid, nonce) in enumerate(created):
                phase[0] = f"start {cname}"
                log.debug("restore of pod %s: starting container %s (%s)", where, cname, cid[:13],
                          extra={"pod": where, "container": cname, "phase": "start"})
                try:
                    await self.cri.start_container(cid)
                except errors.AgentError as exc:
                    raise type(exc)(f"restore of pod {where}, container {cname}: {exc}") from exc
                await handler.verify_restored(self.cri, self.settings, cid, os.path.join(self.settings.plans_dir, cid),
                                              nonce, where=f"restore of pod {where}, container {cname}",
                                              handler=handler_name)
                progress(Progress("start", i + 1, len(created), message=cname))
            started = True
        log.info("checkpoint %s restored as pod %s (%s)", record.id, where, pod_id[:13],
                 extra={"pod": where, "checkpoint": record.id, "phase": "restored"})
        # Success: the journal entry goes, so recovery leaves the pod alone.
        entry.data = {}
        return RestoredPod(pod_id, namespace, name, uid, record.id, tuple((n, c) for n, c, _ in created), started)

    async def preflight(self, record: CheckpointRecord, saved: _Saved, source: Store | None = None) -> None:
        for cname, cfg, _ in saved.containers:
            image = str((cfg["config"].get("image") or {}).get("image") or cfg.get("rootfsImageName") or "")
            if not image:
                raise errors.DataLoss(f"checkpoint {record.id}: container {cname} names no image")
            if not await self.cri.image_present(image):
                raise errors.FailedPrecondition(
                    f"restore of {record.id}: image {image} (container {cname}) is not present on this node"
                )
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
            await asyncio.to_thread((source or self.store).materialize, record, tmp, prefix="pod/cpuinfo")
            try:
                await self.criu.cpuinfo_check(os.path.join(tmp, "pod", "cpuinfo"))
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

    async def restore_shm(self, staging: str, pod_id: str, where: str) -> None:
        tar = os.path.join(staging, "pod", "devshm.tar")
        if not os.path.exists(tar):
            return
        detail = await self.cri.pod_status(pod_id)
        target = shm_source(detail.spec)
        if not target or not os.path.isdir(target):
            raise errors.FailedPrecondition(f"restore as pod {where}: cannot find the new sandbox's /dev/shm")
        try:
            await asyncio.to_thread(rootfs.apply_diff, target, tar, None)
        except BridgeError as exc:
            raise errors.DataLoss(f"restore as pod {where}: the checkpoint's /dev/shm is unusable: {exc}") from exc

    def _exists(self, container_id: str) -> Any:
        async def exists() -> bool | None:
            try:
                await self.cri.container_status(container_id)
            except errors.NotFound:
                return False
            except errors.AgentError:
                return None  # not known now; asked again later
            return True

        return exists

    async def shutdown(self) -> None:
        """The agent stops: end the helpers of containers not started yet; let running transfers go on alone."""
        sessions = list(self._sessions)
        await asyncio.gather(*(
            s.detach() if s.connected else
            s.end("the agent stopped before the container was started, so its page source is gone; "
                  "restore the checkpoint again")
            for s in sessions
        ), return_exceptions=True)
        for task in list(self._lazy_tasks):
            task.cancel()
        await asyncio.gather(*self._lazy_tasks, return_exceptions=True)

    def _track(self, session: LazySession, store: Store) -> None:
        self._sessions.add(session)

        async def forget() -> None:
            try:
                outcome = await session.wait()
            finally:
                self._sessions.discard(session)
            if outcome.ok and store.origin(session.checkpoint_id) is not None:
                try:
                    if await asyncio.to_thread(store.settle_origin, session.checkpoint_id):
                        log.info("checkpoint %s: every blob is in the store now", session.checkpoint_id,
                                 extra={"checkpoint": session.checkpoint_id})
                except errors.AgentError as exc:
                    log.warning("checkpoint %s: %s", session.checkpoint_id, exc)

        task = asyncio.create_task(forget(), name=f"lazy done {session.container_id[:13]}")
        self._lazy_tasks.add(task)
        task.add_done_callback(self._lazy_tasks.discard)

    def write_plan(
        self, record: CheckpointRecord, staging: str, cname: str, plan_dir: str, where: str, options: tuple[str, ...],
        lazy: bool = False, *, nonce: str, mounts: Any = None,
    ) -> None:
        """Move a container's verified files from staging into its plan dir (renames only).

        The plan names its `nonce` (the container's mark), and lists the
        file locks its processes will take again (`locks.json`): a lock
        that a live process on this node holds against it fails the restore
        here, by name, instead of leaving CRIU waiting for it.
        """
        os.makedirs(plan_dir, mode=0o700)
        src = os.path.join(staging, "containers", cname)
        os.replace(os.path.join(src, "checkpoint"), os.path.join(plan_dir, "images"))
        if os.path.isdir(os.path.join(src, "predump")):
            os.replace(os.path.join(src, "predump"), os.path.join(plan_dir, "predump"))
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
                "lazy": lazy, "nonce": nonce}
        path = os.path.join(plan_dir, PLAN_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(plan, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(path + ".tmp", path)

    async def _undo(self, entry: Entry) -> None:
        """Remove every sandbox and plan this restore created, then its journal entry.

        Runs as its own task: a second cancellation of the call cannot cut it short.
        """
        for session in self._op_sessions.pop(entry.op_id, []):
            await session.cancel()
        await undo_restore(self.cri, entry.data, self.settings.timeouts.cleanup)
        self.journal.remove(entry)


async def _settle(task: asyncio.Task[Any]) -> None:
    """Wait for a thread-backed task we no longer need (threads can't be cancelled)."""
    try:
        await asyncio.shield(task)
    except BaseException:  # noqa: BLE001 - its result no longer matters
        pass


async def undo_restore(cri: CriClient, data: Mapping[str, Any], timeout: float) -> None:
    for pod_id in data.get("sandboxes", []):
        try:
            async with asyncio.timeout(timeout):
                try:
                    await cri.stop_pod(pod_id)
                except errors.NotFound:
                    pass
                await cri.remove_pod(pod_id)
        except errors.NotFound:
            pass
        except (errors.AgentError, TimeoutError) as exc:
            log.error("cannot remove sandbox %s of a failed restore: %s", pod_id[:13], exc)
    for plan_dir in data.get("plans", []):
        if isinstance(plan_dir, str) and os.path.isabs(plan_dir):
            shutil.rmtree(plan_dir, ignore_errors=True)


def lazy_pages_files(store: Store, record: CheckpointRecord) -> dict[str, pagemap.Pagemap]:
    """The pages files that hold memory a lazy restore may leave in the store, with their pagemaps."""
    out: dict[str, pagemap.Pagemap] = {}
    for f in record.files:
        m = _PAGEMAP_RE.match(f.path)
        if not m or f.is_dir:
            continue
        if f.size > pagemap.MAX_PAGEMAP_BYTES:
            raise pagemap.PagemapError(f"{f.path} is larger than {pagemap.MAX_PAGEMAP_BYTES} bytes")
        with store.open(record, f.path) as fh:
            pm = pagemap.parse(fh.pread(0, f.size), int(m.group(2)))
        if pm.lazy_pages:
            out[f"containers/{m.group(1)}/checkpoint/{pm.pages_file}"] = pm
    return out


def write_sparse_pages(store: Store, record: CheckpointRecord, staging: str, path: str, pm: pagemap.Pagemap) -> None:
    """Create ``staging/path`` at its full size with only the pages that cannot come lazily written in."""
    entry = record.entry(path)
    if entry.size != pm.pages_size:
        raise pagemap.PagemapError(f"{path} holds {entry.size} bytes, its pagemap accounts for {pm.pages_size}")
    parent, _, fname = path.rpartition("/")
    dir_fd = os.open(os.path.join(staging, parent), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        os.ftruncate(fd, entry.size)
        with store.open(record, path) as reader:
            for ext in pm.extents:
                if ext.offset < 0 or ext.lazy:
                    continue
                pos, end = ext.offset, ext.offset + ext.nr_pages * pagemap.PAGE_SIZE
                while pos < end:
                    data = reader.pread(pos, min(end - pos, 8 << 20))
                    if not data:
                        raise errors.DataLoss(f"checkpoint {record.id}: {path} ends before offset {pos}")
                    os.pwrite(fd, data, pos)
                    pos += len(data)
        os.fchmod(fd, entry.mode & 0o777)
    finally:
        os.close(fd)


SOURCE_STORE = "source-store"


def _private_source(store: Store, record: CheckpointRecord, plan_dir: str, where: str, cname: str) -> Store | None:
    """Hard links to a caller's checkpoint blobs in the plan dir, for the page source (None if impossible).

    A CRI RestorePod caller owns ``checkpoint_path`` and may delete it once
    the call returns: the links keep the pages readable until they are in.
    """
    try:
        return store.link_into(record, os.path.join(plan_dir, SOURCE_STORE))
    except OSError as exc:
        log.warning("restore of pod %s, container %s: cannot link the checkpoint's blobs from %s (%s); "
                    "its pages are read from there, which must stay until they are in",
                    where, cname, store.root, exc.strerror, extra={"pod": where, "container": cname})
        return None


def _remote_access(store: Store, checkpoint_id: str) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """A lazily pulled checkpoint's origin and the remembered password for it, if any (for its page source)."""
    from node_agent.registry.fetching import RemoteBlobs, repository_key

    origin = store.origin(checkpoint_id)
    fetcher = store.fetcher
    if origin is None or not isinstance(fetcher, RemoteBlobs):
        return origin, {}
    key = repository_key(str(origin["reference"]))
    return origin, ({key: fetcher.passwords[key]} if key in fetcher.passwords else {})
