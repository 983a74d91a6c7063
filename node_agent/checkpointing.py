"""The pod-wide cut: select, freeze all, capture all, thaw all, publish.

Sees dataclasses only (CRI data from `node_agent.cri`, files from the
store); never protobuf. The pod is never left frozen: a detached watchdog is
armed before the first freeze and thaws the pod if this process dies or
stalls; every path out of the freeze window thaws, shielded from
cancellation; the journal lets start-up recovery finish the job. Room on the
store's disk is asked for before the freeze, and a disk that fills is said so
(`diskspace`). `Checkpointer` is the long-lived service; each checkpoint is
a `CheckpointRun`, which holds that operation's state (its pod, phase,
targets, what is frozen, the thaw, the scratch dir, the journal entry) and
whose methods are its steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from criu_bridge import freezer, mountinfo, tcp
from criu_bridge import watchdog as wd
from criu_bridge.errors import BridgeError, RuntimeFailure
from criu_bridge.freezer import Freezer
from criu_bridge.rootfs.capture import capture_diff
from criu_bridge.rpc import CriuClient
from criu_bridge.runtime import CHECKPOINT_OPTIONS, CheckpointFlags, Runc, reap
from node_agent import devshm, diskspace, errors, podformat, signing
from node_agent.admission import CheckpointOptions, parse_checkpoint_options, require_checkpoint
from node_agent.config.schema import Settings
from node_agent.cri import ContainerDetail, CriClient, Pod, PodDetail
from node_agent.cri.pods import resolve_pod
from node_agent.journal import Entry, Journal
from node_agent.undoing import Undoer, undo_checkpoint
from node_agent.keys import Keys
from node_agent.metrics import Metrics, instrumented
from node_agent.podformat import manifest_annotations
from node_agent.progress import Progress, ProgressFn, no_progress
from node_agent.store import CheckpointRecord, Store
from node_agent.store.sealing import SealKey
from node_agent.turns import Turns

log = logging.getLogger(__name__)

GPU_DEVICE_PREFIXES = ("/dev/nvidia", "/dev/dri", "/dev/kfd")


@dataclass(frozen=True)
class CheckpointRequest:
    pod: str
    containers: Sequence[str] = ()
    # Parsed by the entry path (`admission.parse_checkpoint_options`); the defaults when none were given.
    options: CheckpointOptions = field(default_factory=lambda: parse_checkpoint_options({}))
    # Where the checkpoint is published: the agent's own store when None
    # (CRI CheckpointPod writes a self-contained store in the caller's directory).
    store: Store | None = None
    # The pod, resolved and admitted by the entry path (CRI CheckpointPod, before it
    # touches the caller's directory): neither resolved nor admitted again.
    resolved: Pod | None = None
    # Who asked, when it is an object the agent answers for (a PodCheckpoint: kind, namespace, name, uid):
    # kept in the checkpoint's metadata, so that the agent finds its checkpoint again after a restart.
    requested_by: Mapping[str, str] | None = None


def gpu_devices(spec: Mapping[str, Any]) -> list[str]:
    """GPU device nodes a container's OCI spec gives it (devices or mounts)."""
    found = []
    for dev in (spec.get("linux") or {}).get("devices") or []:
        path = str(dev.get("path", ""))
        if path.startswith(GPU_DEVICE_PREFIXES):
            found.append(path)
    for m in spec.get("mounts") or []:
        for key in ("destination", "source"):
            path = str(m.get(key, ""))
            if path.startswith(GPU_DEVICE_PREFIXES):
                found.append(path)
                break
    return sorted(set(found))


def _rfc3339(ts: float | None = None) -> str:
    return dt.datetime.fromtimestamp(ts or time.time(), dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class _Target:
    detail: ContainerDetail
    freezer: Freezer
    upperdir: str
    dir: str  # this container's directory in the work tree

    @property
    def name(self) -> str:
        return self.detail.container.name

    @property
    def id(self) -> str:
        return self.detail.container.id


class Checkpointer:
    """The checkpoint service: long-lived clients, the pod turns and the node's settings; a `CheckpointRun` per call."""

    def __init__(
        self, settings: Settings, cri: CriClient, store: Store, journal: Journal, criu: CriuClient, metrics: Metrics,
        keys: Keys | None = None, undoer: Undoer | None = None,
    ) -> None:
        self.settings = settings
        self.cri = cri
        self.store = store
        # Where each namespace's encryption key comes from (None: checkpoints stay in the clear).
        self.keys = keys
        self.journal = journal
        self.undoer = undoer or Undoer(settings, cri, journal)  # what a failed cleanup leaves, until done
        self.criu = criu
        self.runc = Runc(settings.runc, settings.runc_root)
        self.turns = Turns(max_waiting=8)
        self._mem_track: bool | None = None
        self.metrics = metrics

    async def want_pre_dump(self, wish: bool | None, pod: Pod) -> bool:
        """Pre-dump where the kernel tracks dirty memory; say once when it can't."""
        mode = self.settings.pre_dump
        if wish is False or (wish is None and mode == "never"):
            return False
        if self._mem_track is None:
            try:
                self._mem_track = bool((await self.criu.features()).get("mem_track"))
            except BridgeError as exc:
                log.warning("cannot ask CRIU about dirty memory tracking (%s); dumping without pre-dump", exc)
                self._mem_track = False
            if not self._mem_track:
                log.warning(
                    "the kernel does not track dirty memory (criu check --feature mem_dirty_track): "
                    "checkpoints dump all memory while the pod is frozen"
                )
        if self._mem_track:
            return True
        if wish is True or mode == "always":
            raise errors.FailedPrecondition(
                f"checkpoint of pod {pod.ref}: pre-dump was asked for, but this kernel does not track dirty memory "
                "(CONFIG_MEM_SOFT_DIRTY is off); retry without it"
            )
        return False

    @instrumented("checkpoint")
    async def checkpoint(
        self, req: CheckpointRequest, *, timeout: float | None = None, progress: ProgressFn = no_progress
    ) -> CheckpointRecord:
        timeout = timeout if timeout is not None else self.settings.timeouts.checkpoint
        run = CheckpointRun(self, req, progress)
        try:
            async with asyncio.timeout(timeout):
                return await run.run()
        except TimeoutError as exc:
            raise errors.DeadlineExceeded(
                f"checkpoint of pod {run.pod_ref}: the deadline ({timeout:g}s) passed during {run.phase}; "
                "the pod was resumed and nothing was kept"
            ) from exc

    def seal_key(self, namespace: str) -> SealKey | None:
        """The key the namespace's checkpoints are sealed under (None: not encrypted)."""
        return self.keys.seal_key(namespace) if self.keys is not None else None

    def _ingest(self, work: str, meta: dict[str, Any], store: Store | None = None) -> CheckpointRecord:
        seal = self.seal_key(str(meta["pod"]["namespace"]))
        with (store or self.store).writer(seal=seal) as w:
            w.add_tree("", work)
            record = w.commit(meta, annotations=manifest_annotations(meta))
            # Signed right after the publish; a failure removes it again and fails the checkpoint.
            signing.sign_published(self.settings.signing.key_file, store or self.store, record.id)
            self.metrics.observe_ingest(record, w.bytes_written)
            return record


class CheckpointRun:
    """One checkpoint of one pod: its state from the request to the published record, and its steps.

    `phase` is the step under way, as errors and a passed deadline name
    it. Whatever the run freezes it thaws (`thawing`: the thaw tasks, which
    outlive a cancelled call), and its journal entry goes once its scratch
    dir and frozen cgroups are gone, or the undoer retries.
    """

    # Set by the steps, in order: the pod (resolved), what is checkpointed, the journal entry and its scratch dir.
    pod: Pod
    pod_detail: PodDetail
    entry: Entry
    work: str

    def __init__(self, service: Checkpointer, req: CheckpointRequest, progress: ProgressFn) -> None:
        self.service = service
        self.settings = service.settings
        self.req = req
        self.progress = progress
        self.phase = "resolve"
        self.pod_ref = req.pod  # how errors name the pod: the request's words until it is resolved
        self.flags: CheckpointFlags = req.options.flags  # tcp-close added where a container holds connections
        self.pre_dump = False
        self.targets: list[_Target] = []
        self.thawing: list[asyncio.Future[None]] = []  # the thaw, as a task of its own
        self.helpers: list[asyncio.subprocess.Process] = []  # runc and CRIU while they dump
        self.tcp_closed: list[str] = []  # containers dumped with --tcp-close
        self.frozen_ms = 0.0
        self.dump_ms: dict[str, float] = {}

    async def run(self) -> CheckpointRecord:
        """Resolve and admit the pod, then checkpoint it in its turn."""
        pod = self.req.resolved
        if pod is None:
            pod = await resolve_pod(self.service.cri, self.req.pod)
            self.pod_ref = pod.ref
            # The node's policy for the pod's namespace, before anything is frozen or written.
            require_checkpoint(self.settings, pod)
        self.pod, self.pod_ref = pod, pod.ref
        # A broken key source refuses before the pod is touched (a KMS plugin may run: off the event loop).
        await asyncio.to_thread(self.service.seal_key, pod.namespace)
        self.phase = "waiting for an earlier operation on the pod"
        turns = self.service.turns
        if turns.busy(pod.id):
            self.progress(Progress("queued", message=f"pod {pod.ref} is busy; waiting"))
        async with turns.turn(pod.id, f"checkpoint of pod {pod.ref}"):
            self.phase = "resolve"
            self.pre_dump = await self.service.want_pre_dump(self.req.options.pre_dump, pod)
            return await self._checkpoint()

    async def select(self) -> list[ContainerDetail]:
        """The containers to checkpoint: the request's, or every running one; none with GPU devices."""
        pod, wanted, cri = self.pod, self.req.containers, self.service.cri
        containers = [c for c in await cri.list_containers(pod.id) if c.pod_id == pod.id]
        if wanted:
            if len(set(wanted)) != len(wanted):
                raise errors.InvalidArgument(f"pod {pod.ref}: duplicate containers in {list(wanted)}")
            chosen = []
            for w in wanted:
                match = [c for c in containers if w in (c.name, c.id)] or [
                    c for c in containers if len(w) >= 6 and c.id.startswith(w)
                ]
                live = [c for c in match if c.running] or match
                if not live:
                    raise errors.NotFound(f"pod {pod.ref} has no container {w!r}")
                if not live[0].running:
                    raise errors.FailedPrecondition(
                        f"pod {pod.ref}: container {live[0].name} is {live[0].state.removeprefix('CONTAINER_').lower()}, not running"
                    )
                chosen.append(live[0])
        else:
            chosen = [c for c in containers if c.running]
            if not chosen:
                raise errors.FailedPrecondition(f"pod {pod.ref} has no running container")
        if len({c.name for c in chosen}) != len(chosen):
            raise errors.InvalidArgument(f"pod {pod.ref}: the selection names one container twice")
        details = [await cri.container_status(c.id) for c in chosen]
        for d in details:
            if not d.container.running or d.pid <= 0:
                raise errors.FailedPrecondition(f"pod {pod.ref}: container {d.container.name} is not running")
            gpus = gpu_devices(d.spec)
            if gpus:
                raise errors.FailedPrecondition(
                    f"pod {pod.ref}: container {d.container.name} uses GPU device nodes ({', '.join(gpus)}); "
                    "CRIU cannot capture device memory, so the pod was not paused"
                )
        return details

    async def _checkpoint(self) -> CheckpointRecord:
        """Select, journal, pre-dump, cut, ingest; the cleanup runs whatever happens, shielded."""
        pod, s, svc = self.pod, self.settings, self.service
        self.progress(Progress("resolve", message=f"pod {pod.ref}"))
        details = await self.select()
        self.pod_detail = await svc.cri.pod_status(pod.id)
        total = len(details)
        self.entry = entry = Entry("checkpoint")
        self.work = work = os.path.join(s.work_dir, entry.op_id)
        for d in details:
            try:
                fz = freezer.freezer_of(d.pid)
                upper = mountinfo.upperdir_of(d.pid)
            except BridgeError as exc:
                raise errors.FailedPrecondition(f"pod {pod.ref}, container {d.container.name}: {exc}") from exc
            self.targets.append(_Target(d, fz, upper, os.path.join(work, podformat.container_dir(d.container.name))))
        # Room for it, before anything is frozen or written: its memory by its cgroups, plus min-free-bytes.
        room = await asyncio.to_thread(diskspace.require, pod.ref, [t.freezer for t in self.targets],
                                       (self.req.store or svc.store, svc.store), s.min_free_bytes)
        shm = devshm.shm_source(details[0].spec)
        entry.data = {
            "pod": pod.ref,
            "pod_id": pod.id,
            "work": work,
            "freezers": [t.freezer.to_arg() for t in self.targets],
            "containers": [t.id for t in self.targets],
            "helpers": [],
        }
        svc.journal.write(entry)
        try:
            os.makedirs(work, mode=0o700)
            os.makedirs(os.path.join(work, podformat.POD_CPUINFO_DIR))
            for t in self.targets:
                os.makedirs(os.path.join(t.dir, podformat.IMAGES_DIR))
                os.makedirs(os.path.join(t.dir, "work"))
            self.phase = "criu cpuinfo dump"
            await svc.criu.cpuinfo_dump(os.path.join(work, podformat.POD_CPUINFO_DIR))
            criu_version = (await svc.criu.version()).text

            if self.pre_dump:
                self.phase = "pre-dump"
                await self.pre_dump_all()

            self.phase = "freeze"
            await self.cut(shm)
            if self.tcp_closed:  # recorded: the restore must ask CRIU for it too
                self.flags = replace(self.flags, tcp_close=True)
            log.info(
                "pod %s frozen for %.1f ms", pod.ref, self.frozen_ms,
                extra={"pod": pod.ref, "phase": "thaw", "frozen_ms": round(self.frozen_ms, 1)},
            )

            self.phase = "ingest"
            self.progress(Progress("ingest", total, total, message="storing"))
            meta = self.metadata(criu_version)
            meta["pre_dump"] = self.pre_dump
            self.write_config_files()
            record = await asyncio.to_thread(svc._ingest, work, meta, self.req.store)
            self.progress(Progress("done", total, total, record.size, record.size, record.id))
            log.info("checkpoint %s of pod %s published", record.id, pod.ref, extra={"pod": pod.ref, "checkpoint": record.id, "phase": "publish"})
            return record
        except Exception as exc:  # a full disk, wherever it struck, is said as such (with CRIU's reason)
            if (full := await asyncio.to_thread(diskspace.exhausted, exc, pod.ref, self.phase, room)) is None:
                raise
            raise full from exc
        finally:
            # One cleanup task that outlives this call if it is cancelled again.
            await asyncio.shield(asyncio.ensure_future(self.finish()))

    async def finish(self) -> None:
        """The cleanup: the thaw (it waits out runc and CRIU), the scratch files, then the journal entry.

        The entry goes once nothing is left; else the undoer retries until it is.
        """
        for t in self.thawing:
            with contextlib.suppress(BaseException):
                await t
        if await asyncio.to_thread(undo_checkpoint, self.entry.data, self.settings.work_dir):
            await self.service.undoer.undo(self.entry)
        else:
            self.service.journal.remove(self.entry)

    async def cut(self, shm: str | None) -> None:
        """Freeze every target, capture each, thaw every target; sets `frozen_ms` and `dump_ms` (per container).

        The thaw runs as its own task, kept in `thawing`, so that it finishes
        even if this call is cancelled twice. Unless the checkpoint asked for
        `tcp-established`, a container that holds TCP connections once frozen
        is dumped with CRIU's --tcp-close (its restore gets them closed; the
        source keeps them), and its name goes into `tcp_closed`.
        """
        pod, targets, entry, flags = self.pod, self.targets, self.entry, self.flags
        total = len(targets)
        s = self.settings
        os.makedirs(s.logs_dir, mode=0o700, exist_ok=True)
        guard = await asyncio.to_thread(
            wd.arm, [t.freezer for t in targets], max_freeze=s.timeouts.max_freeze,
            log_path=os.path.join(s.logs_dir, "watchdog.log"), work_dir=self.work,
        )
        entry.data["watchdog"] = guard.pid
        self.service.journal.write(entry)
        done = 0
        ok = False
        t_freeze = time.monotonic()
        freezing: asyncio.Future[list[BaseException | None]] | None = None
        try:
            self.progress(Progress("freeze", 0, total, message=f"freezing {total} container(s)"))
            # Each freeze runs in a thread, which a cancelled call cannot stop: the thaw waits for all of
            # them (a freeze still under way would freeze its container again after the thaw).
            freezing = asyncio.ensure_future(asyncio.gather(
                *(asyncio.to_thread(freezer.freeze, t.freezer) for t in targets), return_exceptions=True))
            for result in await asyncio.shield(freezing):
                if result is not None:
                    raise result
            self.phase = "dump"
            self.progress(Progress("dump", 0, total))
            log.debug("pod %s: %d container(s) frozen, dumping", pod.ref, total, extra={"pod": pod.ref, "phase": "dump"})

            async def dump(t: _Target) -> None:
                nonlocal done

                async def started(pid: int) -> None:
                    guard.follow(pid)
                    entry.data["helpers"].append({"pid": pid, "start": wd.proc_starttime(pid)})
                    await asyncio.to_thread(self.service.journal.write, entry)

                t0 = time.monotonic()
                t_flags = flags
                if not flags.tcp_established:
                    held = await asyncio.to_thread(lambda: tcp.held_connections(tcp.cgroup_pids(t.freezer.path)))
                    if held:
                        # Only then: CRIU records a dump's --tcp-close in its inventory and refuses to
                        # restore the images without the option, so on every dump it would keep other
                        # runtimes (containerd's own restore of an export) from restoring any checkpoint.
                        t_flags = replace(flags, tcp_close=True)
                        self.tcp_closed.append(t.name)
                        log.info("pod %s, container %s: %d TCP connection(s) held; the restore gets them closed: %s",
                                 pod.ref, t.name, len(held), "; ".join(held[:5]),
                                 extra={"pod": pod.ref, "phase": "dump"})
                diff = asyncio.to_thread(
                    capture_diff, t.upperdir,
                    os.path.join(t.dir, "rootfs-diff.tar"), os.path.join(t.dir, "deleted.files"),
                )
                try:
                    await asyncio.gather(
                        self.service.runc.checkpoint(
                            t.id, image_dir=os.path.join(t.dir, podformat.IMAGES_DIR),
                            work_dir=os.path.join(t.dir, "work"), flags=t_flags,
                            parent=f"../{podformat.PREDUMP_DIR}" if self.pre_dump else None,
                            on_start=started, procs=self.helpers,
                        ),
                        diff,
                    )
                except RuntimeFailure as exc:
                    kept = self.keep_log(t.name, exc.log_path)
                    raise errors.FailedPrecondition(
                        f"checkpoint of pod {pod.ref}, container {t.name}, phase {exc.phase}: "
                        + "; ".join(exc.decisive or [exc.message])
                        + _hint(exc.decisive)
                        + (f" (full CRIU log: {kept})" if kept else "")
                    ) from exc
                except BridgeError as exc:
                    raise errors.FailedPrecondition(f"checkpoint of pod {pod.ref}, container {t.name}: {exc}") from exc
                self.dump_ms[t.name] = (time.monotonic() - t0) * 1000
                done += 1
                self.progress(Progress("dump", done, total, message=t.name))

            jobs = [dump(t) for t in targets]
            if shm:
                jobs.append(devshm.capture(shm, self.work))
            await _gather_all(jobs)
            ok = True
        finally:
            # Thaw first, whatever happened; then wait out helpers on failure.
            thaw = asyncio.ensure_future(self.thaw(guard, ok, freezing))
            self.thawing.append(thaw)
            await asyncio.shield(thaw)
        self.frozen_ms = (time.monotonic() - t_freeze) * 1000
        self.progress(Progress("thaw", total, total, message=f"frozen {self.frozen_ms:.0f} ms"))

    async def pre_dump_all(self) -> None:
        """Copy memory while the pod runs; the frozen dump then takes only dirty pages."""
        self.progress(Progress("pre-dump", 0, len(self.targets)))

        async def one(t: _Target) -> None:
            try:
                await self.service.runc.checkpoint(
                    t.id, image_dir=os.path.join(t.dir, podformat.PREDUMP_DIR), work_dir=os.path.join(t.dir, "work-predump"),
                    flags=self.flags, pre_dump=True,
                )
            except RuntimeFailure as exc:
                raise errors.FailedPrecondition(
                    f"checkpoint of pod {self.pod.ref}, container {t.name}, phase {exc.phase}: "
                    + "; ".join(exc.decisive or [exc.message])
                ) from exc

        await _gather_all([one(t) for t in self.targets])

    async def thaw(self, guard: wd.Armed, ok: bool, freezing: asyncio.Future[Any] | None = None) -> None:
        """Thaw every target, once every freeze under way (`freezing`) has ended; after a failure, once more
        when runc and CRIU are gone (the watchdog meanwhile)."""
        if freezing is not None:
            await asyncio.wait([freezing])

        def thaw(t: _Target) -> None:
            try:
                freezer.thaw(t.freezer)
            except OSError as exc:
                log.warning("cannot thaw container %s: %s", t.name, exc.strerror)

        async def thaw_all() -> None:
            # All at once: a thaw can take tens of milliseconds, and every
            # container of the pod waits for the last one.
            await asyncio.gather(*(asyncio.to_thread(thaw, t) for t in self.targets))

        await thaw_all()
        if ok:
            guard.stand_down()
        else:
            # CRIU re-freezes a cgroup it found frozen when it finishes; the
            # watchdog keeps thawing until runc and CRIU are gone.
            guard.release()
            for proc in self.helpers:
                await reap(proc, grace=self.settings.timeouts.cleanup)
            await thaw_all()
        await asyncio.to_thread(guard.wait, 5.0)

    def keep_log(self, name: str, path: str | None) -> str | None:
        """A copy of CRIU's log under logs/, for people; where it cannot be made (a full disk), None and a warning."""
        if not path or not os.path.exists(path):
            return None
        dest = os.path.join(self.settings.logs_dir, self.entry.op_id, f"{name}-{os.path.basename(path)}")
        try:
            os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
            shutil.copyfile(path, dest)
        except OSError as exc:
            log.warning("cannot keep CRIU's log %s as %s: %s", path, dest, exc.strerror or exc)
            with contextlib.suppress(OSError):
                os.unlink(dest)
            return None
        return dest

    def metadata(self, criu_version: str) -> dict[str, Any]:
        pod = self.pod
        return {
            "kind": podformat.METADATA_KIND,
            "version": 1,
            "created": _rfc3339(),
            "node": socket.gethostname(),
            "pod": {
                "id": pod.id, "name": pod.name, "namespace": pod.namespace, "uid": pod.uid,
                "runtime_handler": pod.runtime_handler,
            },
            "containers": [
                {
                    "name": t.name, "id": t.id, "image": t.detail.container.image,
                    "image_ref": t.detail.container.image_ref,
                    "dump_ms": round(self.dump_ms.get(t.name, 0.0), 1),
                }
                for t in self.targets
            ],
            "frozen_ms": round(self.frozen_ms, 1),
            "options": self.flags.as_options(),
            "criu_version": criu_version,
        } | ({"requested_by": dict(self.req.requested_by)} if self.req.requested_by else {})

    def write_config_files(self) -> None:
        def dump(path: str, obj: Any) -> None:
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(obj, fh, sort_keys=True, indent=1)

        pod_detail = self.pod_detail
        dump(os.path.join(self.work, podformat.POD_CONFIG), {"config": pod_detail.config, "runtime_handler": pod_detail.pod.runtime_handler})
        for t in self.targets:
            d = t.detail
            dump(os.path.join(t.dir, podformat.CONFIG_DUMP), {
                "id": d.container.id, "name": d.container.name,
                "rootfsImage": d.container.image, "rootfsImageRef": d.container.image_ref,
                "rootfsImageName": d.container.image, "runtime": "runc",
                "createdTime": _rfc3339(d.container.created_ns / 1e9), "checkpointedTime": _rfc3339(),
                "config": d.config, "log_path": d.log_path,
            })
            dump(os.path.join(t.dir, podformat.SPEC_DUMP), d.spec)
            # The final images point at the pre-dump through a `parent` link;
            # restore puts it back (the store keeps files and dirs only).
            parent = os.path.join(t.dir, podformat.IMAGES_DIR, "parent")
            if os.path.islink(parent):
                os.unlink(parent)
            shutil.rmtree(os.path.join(t.dir, "work-predump"), ignore_errors=True)
            # CRIU's own log and statistics are part of the checkpoint; the scratch dir is not.
            wdir = os.path.join(t.dir, "work")
            if os.path.exists(os.path.join(wdir, "dump.log")):
                os.replace(os.path.join(wdir, "dump.log"), os.path.join(t.dir, podformat.DUMP_LOG))
            if os.path.exists(os.path.join(wdir, "stats-dump")):  # the images dir is where readers look
                os.replace(os.path.join(wdir, "stats-dump"), os.path.join(t.dir, podformat.IMAGES_DIR, "stats-dump"))
            shutil.rmtree(wdir, ignore_errors=True)


def _hint(lines: Sequence[str]) -> str:
    """CRIU suggests its own flags; say how to pass them through node-agent."""
    text = " ".join(lines)
    found = [f"--option {name}=true" for name, flag in CHECKPOINT_OPTIONS.items() if flag in text]
    return f" [retry with {', '.join(found)} to allow it]" if found else ""


async def _gather_all(jobs: list[Any]) -> None:
    """Run all jobs; on the first failure wait for the rest, then raise it."""
    results = await asyncio.gather(*jobs, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
