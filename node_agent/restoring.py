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

from criu_bridge import rootfs
from criu_bridge.errors import BridgeError, RuntimeFailure
from criu_bridge.rpc import CriuClient
from criu_bridge.wrapper import PLAN_FILE
from node_agent import errors
from node_agent.checkpointing import METADATA_KIND, Progress, ProgressFn, _no_progress, shm_source
from node_agent.config import Settings
from node_agent.cri import CriClient
from node_agent.journal import Entry, Journal
from node_agent.metrics import Metrics, instrumented
from node_agent.store import CheckpointRecord, Store

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_CONTAINER_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,251}[A-Za-z0-9])?$")
# allow-host-access: let a checkpoint bring back privileged containers or
# host namespaces (refused by default: a checkpoint is hostile input).
RESTORE_OPTIONS = {"allow-host-access"}
_NODE_NAMESPACE = 2  # CRI NamespaceMode NODE
RESTORED_FROM = "node-agent.io/restored-from"


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


def _read_json(store: Store, cid: str, path: str, limit: int = 16 << 20) -> Any:
    with store.open(cid, path) as fh:
        if fh.size > limit:
            raise errors.DataLoss(f"checkpoint {cid}: {path} is larger than {limit} bytes")
        data = fh.read(fh.size)
    try:
        return json.loads(data)
    except ValueError as exc:
        raise errors.DataLoss(f"checkpoint {cid}: {path} is not valid JSON: {exc}") from exc


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
    pod_doc = _read_json(store, record.id, "pod/config.json")
    if not isinstance(pod_doc, Mapping) or not isinstance(pod_doc.get("config"), Mapping):
        raise errors.DataLoss(f"checkpoint {record.id}: pod/config.json has no config")
    containers = []
    entries = meta.get("containers")
    if not isinstance(entries, list) or not entries:
        raise errors.DataLoss(f"checkpoint {record.id}: metadata lists no containers")
    for c in entries:
        cname = _check_name("checkpointed container name", c.get("name", "") if isinstance(c, Mapping) else "", _CONTAINER_NAME_RE)
        base = f"containers/{cname}"
        if f"{base}/config.dump" not in paths or f"{base}/spec.dump" not in paths:
            raise errors.DataLoss(f"checkpoint {record.id}: container {cname} has no config.dump or spec.dump")
        cfg = _read_json(store, record.id, f"{base}/config.dump")
        spec = _read_json(store, record.id, f"{base}/spec.dump", limit=64 << 20)
        if not isinstance(cfg, Mapping) or not isinstance(cfg.get("config"), Mapping) or not isinstance(spec, Mapping):
            raise errors.DataLoss(f"checkpoint {record.id}: container {cname} has a malformed config.dump or spec.dump")
        containers.append((cname, cfg, spec))
    if len({c[0] for c in containers}) != len(containers):
        raise errors.DataLoss(f"checkpoint {record.id}: container names repeat")
    opts = meta.get("options") or {}
    if not isinstance(opts, Mapping):
        raise errors.DataLoss(f"checkpoint {record.id}: malformed options")
    return _Saved(ns, name, pod_doc["config"], tuple(containers), tuple(sorted(k for k, v in opts.items() if v == "true")))


def host_access_refusal(checkpoint_id: str, saved: _Saved) -> None:
    """Refuse configs that reach into the host, unless the caller allowed it."""
    found: list[str] = []

    def namespaces(where: str, sc: Any) -> None:
        if not isinstance(sc, Mapping):
            return
        if sc.get("privileged"):
            found.append(f"{where} is privileged")
        opts = sc.get("namespace_options")
        if isinstance(opts, Mapping):
            for ns in ("network", "pid", "ipc"):
                if opts.get(ns) == _NODE_NAMESPACE:
                    found.append(f"{where} uses the host's {ns} namespace")

    linux = saved.pod_config.get("linux")
    if isinstance(linux, Mapping):
        namespaces("the pod", linux.get("security_context"))
    for cname, cfg, _ in saved.containers:
        clinux = cfg["config"].get("linux")
        if isinstance(clinux, Mapping):
            namespaces(f"container {cname}", clinux.get("security_context"))
    if found:
        raise errors.FailedPrecondition(
            f"checkpoint {checkpoint_id}: {'; '.join(found)}; restore it only with --option allow-host-access=true"
        )


def target_pod_config(saved: _Saved, namespace: str, name: str, uid: str, checkpoint_id: str) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads(json.dumps(saved.pod_config))
    old_meta = cfg.get("metadata") or {}
    cfg["metadata"] = {"name": name, "namespace": namespace, "uid": uid, "attempt": 0}
    old_logdir = str(cfg.get("log_directory") or "")
    if old_logdir:
        cfg["log_directory"] = os.path.join(os.path.dirname(old_logdir.rstrip("/")), f"{namespace}_{name}_{uid}")
    if cfg.get("hostname") in (old_meta.get("name"), None, ""):
        cfg["hostname"] = name[:63]
    ann = dict(cfg.get("annotations") or {})
    ann[RESTORED_FROM] = checkpoint_id
    cfg["annotations"] = ann
    return cfg


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

    @instrumented("restore")
    async def restore(
        self, req: RestoreRequest, *, timeout: float | None = None, progress: ProgressFn = _no_progress
    ) -> RestoredPod:
        for key, value in req.options.items():
            if key not in RESTORE_OPTIONS:
                raise errors.InvalidArgument(
                    f"unknown restore option {key!r} (supported: {', '.join(sorted(RESTORE_OPTIONS))})"
                )
            if str(value).lower() not in ("", "true", "false", "1", "0", "yes", "no"):
                raise errors.InvalidArgument(f"restore option {key!r}: expected true or false, got {value!r}")
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
        return result

    async def _run(self, req: RestoreRequest, entry: Entry, phase: list[str], progress: ProgressFn) -> RestoredPod:
        store = req.source or self.store
        record = await asyncio.to_thread(store.get, req.checkpoint_id)
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
        handler = req.runtime_handler or self.settings.runtime_handler
        if where in self._targets:
            raise errors.Aborted(f"restore as pod {where}: another restore into that pod is in progress")
        self._targets.add(where)
        try:
            if any(p.namespace == namespace and p.name == name and p.ready for p in await self.cri.list_pods()):
                raise errors.AlreadyExists(f"restore as pod {where}: a pod of that name is already running")
            return await self._restore_into(req, record, saved, namespace, name, uid, where, handler,
                                            entry, phase, progress)
        finally:
            self._targets.discard(where)

    async def _restore_into(
        self, req: RestoreRequest, record: CheckpointRecord, saved: _Saved, namespace: str, name: str, uid: str,
        where: str, handler: str, entry: Entry, phase: list[str], progress: ProgressFn,
    ) -> RestoredPod:

        if str(req.options.get("allow-host-access", "false")).lower() not in ("true", "1", "yes", ""):
            host_access_refusal(record.id, saved)
        phase[0] = "preflight"
        progress(Progress("preflight", message=where))
        await self.preflight(record, saved, req.source)

        phase[0] = "sandbox"
        entry.data.update({"checkpoint": record.id, "pod": where})
        self.journal.write(entry)
        pod_config = (
            target_pod_config(saved, namespace, name, uid, record.id) if req.pod_config is None
            else with_restored_from(req.pod_config, record.id)
        )
        progress(Progress("sandbox", 0, len(saved.containers), message=where))
        # Read and verify every file while containerd makes the sandbox.
        staging = os.path.join(self.settings.work_dir, f"restore-{entry.op_id}")
        os.makedirs(staging, mode=0o700)
        try:
            unpack = asyncio.create_task(
                asyncio.to_thread(self.unpack, record, staging, req.source), name=f"unpack {record.id[:19]}"
            )
            try:
                pod_id = await self.cri.run_pod(pod_config, handler)
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
                                          namespace, name, uid, entry, phase, progress)
        finally:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, staging, True))

    def unpack(self, record: CheckpointRecord, staging: str, source: Store | None = None) -> None:
        store = source or self.store
        try:
            store.materialize(record.id, staging, prefix="containers")
            if any(f.path == "pod/devshm.tar" for f in record.files):
                store.materialize(record.id, staging, prefix="pod/devshm.tar")
        except errors.DataLoss as exc:
            raise errors.DataLoss(f"checkpoint {record.id} failed verification, not restoring it: {exc}") from exc

    async def _containers(
        self, req: RestoreRequest, record: CheckpointRecord, saved: _Saved, staging: str, pod_id: str,
        pod_config: dict[str, Any], where: str, namespace: str, name: str, uid: str, entry: Entry,
        phase: list[str], progress: ProgressFn,
    ) -> RestoredPod:
        created: list[tuple[str, str]] = []
        for i, (cname, cfg, _spec) in enumerate(saved.containers):
            phase[0] = f"create {cname}"
            if req.container_configs is not None:
                ccfg = dict(req.container_configs[cname])
            else:
                ccfg = dict(cfg["config"])
                ccfg["metadata"] = {"name": cname, "attempt": 0}
            cid = await self.cri.create_container(pod_id, ccfg, pod_config)
            plan_dir = os.path.join(self.settings.plans_dir, cid)
            entry.data["plans"].append(plan_dir)
            self.journal.write(entry)
            await asyncio.to_thread(
                self.write_plan, record, staging, cname, plan_dir, where, saved.options + tuple(sorted(req.options))
            )
            created.append((cname, cid))
            progress(Progress("create", i + 1, len(saved.containers), message=cname))

        started = False
        if req.start:
            for i, (cname, cid) in enumerate(created):
                phase[0] = f"start {cname}"
                try:
                    await self.cri.start_container(cid)
                except errors.AgentError as exc:
                    raise type(exc)(f"restore of pod {where}, container {cname}: {exc}") from exc
                progress(Progress("start", i + 1, len(created), message=cname))
            started = True
        log.info("checkpoint %s restored as pod %s (%s)", record.id, where, pod_id[:13],
                 extra={"pod": where, "checkpoint": record.id, "phase": "restored"})
        # Success: the journal entry goes, so recovery leaves the pod alone.
        entry.data = {}
        return RestoredPod(pod_id, namespace, name, uid, record.id, tuple(created), started)

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
        tmp = os.path.join(self.settings.work_dir, "cpuinfo-" + secrets.token_hex(4))
        os.makedirs(tmp, mode=0o700)
        try:
            await asyncio.to_thread((source or self.store).materialize, record.id, tmp, prefix="pod/cpuinfo")
            try:
                await self.criu.cpuinfo_check(os.path.join(tmp, "pod", "cpuinfo"))
            except RuntimeFailure as exc:
                raise errors.FailedPrecondition(
                    f"restore of {record.id}: this node's CPU lacks features the checkpoint's processes use: "
                    + "; ".join(exc.decisive)
                ) from exc
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

    def write_plan(
        self, record: CheckpointRecord, staging: str, cname: str, plan_dir: str, where: str, options: tuple[str, ...]
    ) -> None:
        """Move a container's verified files from staging into its plan dir (renames only)."""
        os.makedirs(plan_dir, mode=0o700)
        src = os.path.join(staging, "containers", cname)
        os.replace(os.path.join(src, "checkpoint"), os.path.join(plan_dir, "images"))
        if os.path.isdir(os.path.join(src, "predump")):
            os.replace(os.path.join(src, "predump"), os.path.join(plan_dir, "predump"))
            os.symlink("../predump", os.path.join(plan_dir, "images", "parent"))
        for fname in ("rootfs-diff.tar", "deleted.files", "opaque.dirs"):
            if os.path.exists(os.path.join(src, fname)):
                os.replace(os.path.join(src, fname), os.path.join(plan_dir, fname))
        plan = {"version": 1, "checkpoint": record.id, "pod": where, "container": cname, "options": list(options)}
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
