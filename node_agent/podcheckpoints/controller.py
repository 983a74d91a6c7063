"""The PodCheckpoint controller: each agent takes the PodCheckpoints of the pods on its own node.

One thread lists and watches every PodCheckpoint (`kubeapi`), lists again
after ``resync`` seconds, after a watch that ends in 410 Gone, and after an
API server that went away (with a growing pause); the event loop reconciles
each object it hears of:

* **New** (no status node): the Pod, as the API server has it, says where
  it runs. Only the agent of that node takes it: it adds the finalizer,
  writes ``Checkpointing`` with its node name (the claim; a version
  conflict means someone else wrote first, and the object is read again),
  checkpoints the pod through the agent's own `Checkpointer` (the node's
  policy applies as to any caller), pushes it when asked (to a registry
  `podcheckpoints.push-registries` lists, with the node's credentials),
  and writes ``Succeeded`` with the checkpoint's ID, size and frozen time,
  or ``Failed`` with the reason. A Pod that does not exist, or is another
  Pod than ``podUID`` names, fails the object, whichever agent sees it
  first.
* **Never twice.** The checkpoint records the object's UID in its
  metadata. An agent that restarts and finds an object it claimed looks
  for that checkpoint: found, it goes on (push, status); not found, the
  checkpoint never finished, the pod was resumed (`recovery`), and the
  object fails saying so. It is never checkpointed a second time.
* **Deleted** (a deletion timestamp and the finalizer): the agent that
  holds the checkpoint removes it from its store (only checkpoints whose
  metadata names this object's UID: the status is only as trustworthy as
  every agent), then removes the finalizer. When the status names a node
  that no longer exists (no Node object, for ``node-gone-grace`` seconds),
  any agent removes the finalizer.
* **Finished with a time to live**: once ``ttlSecondsAfterFinished`` has
  passed since its completion, the agent that holds it deletes the
  object, which removes the checkpoint as above. Pushed copies stay.

Status writes carry the object's resourceVersion; a conflict reads the
object again and tries again while it is still this agent's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import urllib.parse
from dataclasses import replace
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from node_agent import errors
from node_agent.kubeapi import Gone, KubeClient
from node_agent.podcheckpoints import model
from node_agent.podcheckpoints.model import (
    CHECKPOINTING, FAILED, FINALIZER, FINISHED, PUSHING, SUCCEEDED, PodCheckpoint, Status,
)
from node_agent.store.records import CheckpointRecord

log = logging.getLogger(__name__)

WATCH_SECONDS = 300
BACKOFF_FIRST, BACKOFF_MAX = 1.0, 30.0
WRITE_TRIES = 5


class Agent(Protocol):
    """What the controller needs of the agent on its node."""

    async def checkpoint(self, pc: PodCheckpoint) -> CheckpointRecord: ...

    async def push(self, record: CheckpointRecord, reference: str) -> str: ...

    def made_for(self, uid: str) -> list[CheckpointRecord]: ...

    def remove(self, record: CheckpointRecord) -> None: ...


class PodCheckpoints:
    """Takes this node's PodCheckpoints; `run` until `stop`."""

    def __init__(self, kube: KubeClient, node: str, agent: Agent, *, resync: float = 60.0,
                 node_gone_grace: float = 300.0, wall: Callable[[], float] = time.time) -> None:
        self.kube = kube
        self.node = node
        self.agent = agent
        self.resync = resync
        self.node_gone_grace = node_gone_grace
        self.wall = wall
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._working: dict[str, asyncio.Task[None]] = {}  # uid -> its take, resume or release
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._gone_since: dict[str, float] = {}  # node name -> when it was first found gone
        self._stopping = threading.Event()
        self._feeder: threading.Thread | None = None
        self.synced = asyncio.Event()  # the first list has been reconciled

    # ---- the feed: list, watch, list again ------------------------------------------------------

    def _feed(self, loop: asyncio.AbstractEventLoop) -> None:
        path = f"{model.API}/{model.PLURAL}"
        pause = BACKOFF_FIRST

        def post(item: tuple[str, Any]) -> None:
            loop.call_soon_threadsafe(self._queue.put_nowait, item)

        while not self._stopping.is_set():
            try:
                items, version = self.kube.list_all(path)
                post(("list", items))
                pause = BACKOFF_FIRST
                deadline = time.monotonic() + self.resync
                while not self._stopping.is_set() and time.monotonic() < deadline:
                    seconds = max(1, int(deadline - time.monotonic()))
                    for kind, obj in self.kube.watch(path, version, seconds=min(seconds, WATCH_SECONDS)):
                        version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                        if kind != "BOOKMARK":
                            post((kind, obj))
                        if self._stopping.is_set():
                            break
            except Gone as exc:
                log.info("podcheckpoints: %s; listing again", exc, extra={"phase": "podcheckpoints"})
            except RuntimeError:
                return  # the event loop closed: the agent is gone
            except Exception as exc:  # noqa: BLE001 - the API server away, or an answer it should not give
                log.warning("podcheckpoints: %s; listing again in %gs", exc, pause, extra={"phase": "podcheckpoints"})
                self._stopping.wait(pause)
                pause = min(pause * 2, BACKOFF_MAX)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._feeder = threading.Thread(target=self._feed, args=(loop,), name="podcheckpoints-watch", daemon=True)
        self._feeder.start()
        try:
            while True:
                kind, payload = await self._queue.get()
                objs = payload if kind == "list" else [payload]
                for obj in objs:
                    try:
                        await self.reconcile(obj, deleted=kind == "DELETED")
                    except errors.AgentError as exc:
                        log.warning("podcheckpoints: %s", exc, extra={"phase": "podcheckpoints"})
                if kind == "list":
                    self.synced.set()
        finally:
            self._stopping.set()
            for timer in self._timers.values():
                timer.cancel()

    async def stop(self) -> None:
        """Stop watching; work under way (a checkpoint, a push) ends as a cancelled operation ends: the pod is
        resumed, nothing half-made is kept, and the object is finished by this agent when it starts again."""
        self._stopping.set()
        tasks = list(self._working.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ---- one object -------------------------------------------------------------------------------

    async def reconcile(self, obj: Mapping[str, Any], *, deleted: bool = False) -> None:
        try:
            pc = model.parse(obj)
        except errors.InvalidArgument as exc:
            await self._refuse_unreadable(obj, exc)
            return
        if deleted:
            self._forget(pc.uid)
            return
        if pc.uid in self._working:
            return  # its task reads the object again when it needs to
        if pc.deleting:
            if FINALIZER in pc.finalizers:
                self._start(pc, self._release(pc))
            return
        if pc.status.phase in FINISHED:
            await self._expire(pc)
            return
        if pc.status.node and pc.status.node != self.node:
            return  # another node's
        if pc.status.node == self.node:
            self._start(pc, self._resume(pc))
            return
        placed = await self._pod_node(pc)
        if placed == self.node:
            self._start(pc, self._take(pc))

    def _start(self, pc: PodCheckpoint, work: Any) -> None:
        task = asyncio.create_task(work, name=f"podcheckpoint {pc.namespace}/{pc.name}")
        self._working[pc.uid] = task
        task.add_done_callback(functools.partial(self._done, pc))

    def _done(self, pc: PodCheckpoint, task: asyncio.Task[None]) -> None:
        """A task over: what happened to the object meanwhile (a deletion, say) is reconciled now."""
        if self._working.get(pc.uid) is task:
            del self._working[pc.uid]
        if task.cancelled():
            return
        if task.exception() is not None:
            log.warning("podcheckpoints: %s", task.exception(), extra={"phase": "podcheckpoints"})
        if not self._stopping.is_set():
            asyncio.ensure_future(self._requeue_now(pc))

    def _forget(self, uid: str) -> None:
        timer = self._timers.pop(uid, None)
        if timer is not None:
            timer.cancel()

    async def _pod_node(self, pc: PodCheckpoint) -> str:
        """The node the source Pod runs on ("" when it runs on none yet); a missing Pod, or another Pod than
        the one ``podUID`` names, fails the object here, whichever agent sees it first."""
        try:
            pod = await self._api("GET", f"/api/v1/namespaces/{pc.namespace}/pods/{_q(pc.spec.pod_name)}")
        except errors.NotFound:
            await self._finish(pc, model.with_status(pc, phase=FAILED, message=f"pod {pc.pod} does not exist"))
            return ""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if pc.spec.pod_uid and uid != pc.spec.pod_uid:
            await self._finish(pc, model.with_status(
                pc, phase=FAILED, message=f"pod {pc.pod} is now another pod (uid {uid}, not {pc.spec.pod_uid})"))
            return ""
        return str((pod.get("spec") or {}).get("nodeName") or "").lower()

    # ---- taking it ---------------------------------------------------------------------------------

    async def _take(self, pc: PodCheckpoint) -> None:
        held = await self._hold(pc)
        if held is None:
            return
        claimed = await self._write(held, model.with_status(
            held, phase=CHECKPOINTING, node=self.node, started=model.now_rfc3339(self.wall()), message=""))
        if claimed is None:
            return
        log.info("%s: checkpointing pod %s on this node", claimed.where, claimed.pod,
                 extra={"pod": claimed.pod, "phase": "podcheckpoints"})
        try:
            record = await self.agent.checkpoint(claimed)
        except errors.AgentError as exc:
            await self._finish(claimed, model.with_status(claimed, phase=FAILED, message=str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - the object says so, as the API would answer
            log.exception("%s: checkpoint of pod %s", claimed.where, claimed.pod)
            await self._finish(claimed, model.with_status(claimed, phase=FAILED, message=f"internal error: {exc!r}"))
            return
        await self._after_checkpoint(claimed, record)

    async def _resume(self, pc: PodCheckpoint) -> None:
        """An object this node claimed before the agent restarted (or that the agent is finishing)."""
        made = [r for r in await asyncio.to_thread(self.agent.made_for, pc.uid)]
        if not made:
            await self._finish(pc, model.with_status(
                pc, phase=FAILED, message=f"the node agent on {self.node} stopped while it checkpointed pod "
                                          f"{pc.pod}; the pod was resumed and nothing was kept: create another "
                                          "PodCheckpoint"))
            return
        await self._after_checkpoint(pc, made[0])

    async def _after_checkpoint(self, pc: PodCheckpoint, record: CheckpointRecord) -> None:
        frozen = record.metadata.get("frozen_ms") if isinstance(record.metadata, Mapping) else 0
        done = model.with_status(pc, checkpoint_id=record.id, stored_bytes=max(0, int(record.stored_size)),
                                 frozen_ms=int(frozen) if isinstance(frozen, (int, float)) else 0)
        if pc.spec.push and not pc.status.pushed:
            current = await self._write(pc, replace(done, phase=PUSHING))
            if current is None:
                return
            try:
                pushed = await self.agent.push(record, pc.spec.push)
            except errors.AgentError as exc:
                await self._finish(current, replace(
                    done, phase=FAILED, message=f"checkpoint {record.id} was taken, but its push to "
                                                f"{pc.spec.push} failed: {exc}"))
                return
            done = replace(done, pushed=pushed)
            pc = current
        await self._finish(pc, replace(done, phase=SUCCEEDED))

    async def _finish(self, pc: PodCheckpoint, status: Status) -> None:
        status = replace(status, completed=model.now_rfc3339(self.wall()))
        written = await self._write(pc, status)
        if written is not None:
            level = logging.INFO if status.phase == SUCCEEDED else logging.WARNING
            log.log(level, "%s: %s%s", written.where, status.phase,
                    f": {status.message}" if status.message else f" ({status.checkpoint_id})",
                    extra={"pod": written.pod, "checkpoint": status.checkpoint_id or None, "phase": "podcheckpoints"})
            await self._expire(written)

    async def _refuse_unreadable(self, obj: Mapping[str, Any], exc: errors.AgentError) -> None:
        """An object this agent cannot read: said in its status once (any agent may), never acted on."""
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
        status = obj.get("status") if isinstance(obj.get("status"), Mapping) else {}
        if not isinstance(meta, Mapping) or not meta.get("name") or not meta.get("namespace") or (
                isinstance(status, Mapping) and status.get("phase") == FAILED):
            return
        path = f"{model.API}/namespaces/{_q(str(meta['namespace']))}/{model.PLURAL}/{_q(str(meta['name']))}"
        body = dict(obj) | {"status": model.status_doc(
            Status(phase=FAILED, message=str(exc), completed=model.now_rfc3339(self.wall())),
            int(meta.get("generation") or 1) if isinstance(meta.get("generation"), int) else 1, self.wall())}
        with contextlib.suppress(errors.AgentError):  # a conflict: another agent said it first
            await self._api("PUT", path + "/status", body)

    # ---- writes ------------------------------------------------------------------------------------

    async def _api(self, method: str, path: str, body: Any = None) -> Any:
        return await asyncio.to_thread(self.kube.request, method, path, body)

    async def _fresh(self, pc: PodCheckpoint) -> PodCheckpoint | None:
        """The object as it is now, if it is still the same object (None once it is gone or replaced)."""
        try:
            now = model.parse(await self._api("GET", pc.path))
        except errors.NotFound:
            return None
        return now if now.uid == pc.uid else None

    async def _hold(self, pc: PodCheckpoint) -> PodCheckpoint | None:
        """The object with this agent's finalizer on it (added unless there), or None if it went."""
        for _ in range(WRITE_TRIES):
            if FINALIZER in pc.finalizers:
                return pc
            if pc.deleting:
                return None
            body = _with_meta(pc.raw, finalizers=[*pc.finalizers, FINALIZER])
            try:
                return model.parse(await self._api("PUT", pc.path, body))
            except errors.Aborted:
                fresh = await self._fresh(pc)
                if fresh is None or fresh.status.node not in ("", self.node):
                    return None
                pc = fresh
        raise errors.Aborted(f"{pc.where}: the object kept changing while the finalizer was added")

    async def _write(self, pc: PodCheckpoint, status: Status) -> PodCheckpoint | None:
        """Write ``status`` as the object's status; None if the object went or is no longer this agent's."""
        for _ in range(WRITE_TRIES):
            body = _with_meta(pc.raw) | {"status": model.status_doc(status, pc.generation, self.wall(),
                                                                    pc.raw.get("status"))}
            try:
                return model.parse(await self._api("PUT", pc.path + "/status", body))
            except errors.NotFound:
                return None
            except errors.Aborted:
                fresh = await self._fresh(pc)
                if fresh is None or fresh.status.node not in ("", self.node) or fresh.status.phase in FINISHED:
                    return None  # gone, another node's, or finished by another agent (a Pod that is gone)
                pc = fresh
        raise errors.Aborted(f"{pc.where}: the object kept changing while its status was written")

    # ---- deleting and expiring -----------------------------------------------------------------------

    async def _release(self, pc: PodCheckpoint) -> None:
        """A deleted object: its checkpoint goes from the store that holds it, then the finalizer."""
        holder = pc.status.node or await self._pod_holder(pc)
        if holder == self.node:
            for record in await asyncio.to_thread(self.agent.made_for, pc.uid):
                await asyncio.to_thread(self.agent.remove, record)
                log.info("%s deleted: checkpoint %s removed from this node's store", pc.where, record.id,
                         extra={"checkpoint": record.id, "phase": "podcheckpoints"})
        elif holder and not await self._node_gone(holder):
            return  # that node's agent removes it
        for _ in range(WRITE_TRIES):
            if FINALIZER not in pc.finalizers:
                return
            body = _with_meta(pc.raw, finalizers=[f for f in pc.finalizers if f != FINALIZER])
            try:
                await self._api("PUT", pc.path, body)
                return
            except errors.NotFound:
                return
            except errors.Aborted:
                fresh = await self._fresh(pc)
                if fresh is None:
                    return
                pc = fresh

    async def _pod_holder(self, pc: PodCheckpoint) -> str:
        """For an object no agent claimed: the source Pod's node, or "" when the Pod is gone (then any agent
        may let the object go: no checkpoint was taken for it)."""
        try:
            pod = await self._api("GET", f"/api/v1/namespaces/{pc.namespace}/pods/{_q(pc.spec.pod_name)}")
        except errors.NotFound:
            return ""
        return str((pod.get("spec") or {}).get("nodeName") or "").lower()

    async def _node_gone(self, node: str) -> bool:
        """Whether ``node`` has had no Node object for ``node_gone_grace`` seconds (as this agent has seen)."""
        try:
            await self._api("GET", f"/api/v1/nodes/{_q(node)}")
        except errors.NotFound:
            first = self._gone_since.setdefault(node, self.wall())
            if self.wall() - first >= self.node_gone_grace:
                return True
            self._later_for(node, first + self.node_gone_grace)
            return False
        self._gone_since.pop(node, None)
        return False

    def _later_for(self, node: str, when: float) -> None:
        """List again at ``when`` (the feed's next list reconciles every object)."""
        key = f"node:{node}"
        if key not in self._timers:
            loop = asyncio.get_running_loop()
            self._timers[key] = loop.call_later(max(0.0, when - self.wall()) + 0.01, self._relist, key)

    def _relist(self, key: str) -> None:
        self._timers.pop(key, None)
        asyncio.ensure_future(self._relist_now())

    async def _relist_now(self) -> None:
        try:
            items, _ = await asyncio.to_thread(self.kube.list_all, f"{model.API}/{model.PLURAL}")
        except errors.AgentError as exc:
            log.warning("podcheckpoints: %s", exc, extra={"phase": "podcheckpoints"})
            return
        self._queue.put_nowait(("list", items))

    async def _expire(self, pc: PodCheckpoint) -> None:
        """A finished object with a time to live: deleted once it has passed (by the agent that holds it)."""
        ttl = pc.spec.ttl_seconds
        finished = model.parse_time(pc.status.completed)
        if ttl is None or finished is None or pc.status.node not in ("", self.node):
            return
        if not pc.status.node and await self._pod_node_quiet(pc) not in ("", self.node):
            return
        due = finished + ttl
        if self.wall() < due:
            self._forget(pc.uid)
            loop = asyncio.get_running_loop()
            self._timers[pc.uid] = loop.call_later(due - self.wall() + 0.01, self._requeue, pc)
            return
        log.info("%s: its time to live (%ds) has passed: deleting it", pc.where, ttl, extra={"phase": "podcheckpoints"})
        with contextlib.suppress(errors.NotFound):
            await self._api("DELETE", pc.path)

    async def _pod_node_quiet(self, pc: PodCheckpoint) -> str:
        try:
            return await self._pod_holder(pc)
        except errors.AgentError:
            return "?"

    def _requeue(self, pc: PodCheckpoint) -> None:
        self._timers.pop(pc.uid, None)
        asyncio.ensure_future(self._requeue_now(pc))

    async def _requeue_now(self, pc: PodCheckpoint) -> None:
        try:
            fresh = await self._api("GET", pc.path)
        except errors.AgentError:
            return  # gone (its DELETED event says so), or the API is away: the next list brings it
        self._queue.put_nowait(("MODIFIED", fresh))


def _with_meta(raw: Mapping[str, Any], **meta: Any) -> dict[str, Any]:
    """The object to write back: its own fields, its resourceVersion, and ``meta`` changed."""
    out = {k: v for k, v in raw.items() if k != "status"}
    out["metadata"] = dict(raw.get("metadata") or {}) | meta
    return out


def _q(name: str) -> str:
    return urllib.parse.quote(name, safe="")
