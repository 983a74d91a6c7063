"""The agent's lazy restores: whether a restore goes lazily, and the sessions of its containers.

The restorer asks `LazyRestores.wanted` once per restore, stages the
checkpoint (`staging`) and, for each container whose plan is written,
calls `start`. That gives the page source what it reads from:

* the store's hold on the checkpoint's blobs (`Store.hold`), so that
  removing the checkpoint meanwhile leaves them in place until every page
  is in; or, for a checkpoint in a caller's directory (CRI RestorePod),
  hard links to its blobs in the plan directory (`SOURCE_STORE`), since the
  caller may delete that directory once the call returns;
* for a lazily pulled checkpoint, its origin in the registry and the
  remembered password for it (`registry.fetching`).

Each session is tracked until its transfer ends; when one of a lazily
pulled checkpoint ends well, the store is asked whether every blob is in
now (`Origins.settle`). A restore that fails cancels the sessions it
started; an agent that stops ends the sessions not connected yet and lets
the others go on alone (`shutdown`).

Before a restore of a lazily pulled checkpoint connects, `prefetch` fetches
its chunks from the registry in the order the restore reads them; the first
of its sessions to connect ends that (`prefetch`), and so does the agent's
stop.

When a connected container's memory cannot be restored, its whole pod's
restored containers are stopped (`kill.stop_pod`, through the restorer's
records of the pod, `node_agent.replicas`): the pod's other sessions are
failed with it, those not started yet end so that their StartContainer
fails. `report` says how every recorded replica is doing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

from criu_bridge.wrapper import FAILED, RESTORED
from node_agent import errors
from node_agent.config.schema import Settings
from node_agent.lazy.kill import kill_container, stop_pod
from node_agent.lazy.prefetch import Prefetch
from node_agent.lazy.session import LazySession
from node_agent.lazy.source import DONE_FILE, FAILED_FILE
from node_agent.lazy.spare import Spare
from node_agent.lazy.staging import Memory
from node_agent.lazy.support import lazy_restore_support
from node_agent.replicas import ReplicaState, Replicas, sibling_reason
from node_agent.store import CheckpointRecord, Store
from node_agent.store.sealing import SealKey

log = logging.getLogger(__name__)

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

    origin = store.origins.get(checkpoint_id)
    fetcher = store.origins.fetcher
    if origin is None or not isinstance(fetcher, RemoteBlobs):
        return origin, {}
    key = repository_key(str(origin["reference"]))
    return origin, ({key: fetcher.passwords[key]} if key in fetcher.passwords else {})


class LazyRestores:
    def __init__(self, settings: Settings, replicas: Replicas | None = None) -> None:
        self.settings = settings
        self.replicas = replicas if replicas is not None else Replicas(settings.replicas_dir)
        self._support: tuple[bool, str] | None = None
        self._warned = False
        # Sessions started by each restore in flight (by journal op), for its undo.
        self._by_op: dict[str, list[LazySession]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Every session whose helpers still run.
        self._sessions: set[LazySession] = set()
        # A page source started ahead, for the next session (`prepare`).
        self.spare = Spare()
        # The fetches ahead of restores of lazily pulled checkpoints, by checkpoint (`prefetch`).
        self._prefetches: dict[str, Prefetch] = {}

    def prepare(self) -> None:
        """Keep a page source started ahead (`spare`) unless lazy restore is set to ``never``. Whether CRIU and
        the kernel allow it is learnt at the first restore (`supported`): where they do not, the spare goes."""
        if self.settings.lazy_restore == "auto":
            self.spare.prepare()

    async def supported(self) -> tuple[bool, str]:
        """Whether this CRIU and kernel can restore lazily (`criu check --feature uffd-noncoop`), and why not."""
        if self._support is None:
            self._support = await asyncio.to_thread(lazy_restore_support, self.settings.criu, 30.0)
            if not self._support[0]:
                await self.spare.close()  # no restore here goes through a page source
        return self._support

    async def wanted(self, asked: bool | None, record: CheckpointRecord) -> bool:
        """Whether a restore goes lazily: `asked` (None: the node's default), possible here, and for this checkpoint."""
        if asked is not None:
            if not asked:
                return False
        elif self.settings.lazy_restore != "auto":
            return False
        if _predumped(record):
            log.info("checkpoint %s has pre-dumped memory: restoring it in full", record.id)
            return False
        ok, why = await self.supported()
        if not ok and not self._warned:
            self._warned = True
            log.warning("lazy restore is not available here (criu check --feature uffd-noncoop: %s): "
                        "restores read all memory before the containers start", why)
        return ok

    async def filled(self, asked: bool | None, record: CheckpointRecord) -> bool:
        """Whether a restore asked to be full (`asked` False) fills the memory through the page source.

        Its processes then resume only once every page is in, each chunk
        verified first: one pass over the memory, where staging it into the
        plan's images first reads and writes it all before CRIU reads it
        again. Not where lazy restore is impossible, or set to `never` on
        this node, or for pre-dumped memory: those stage it as before.
        """
        if asked is not False or self.settings.lazy_restore != "auto" or _predumped(record):
            return False
        ok, _why = await self.supported()
        return ok

    async def start(
        self, op_id: str, store: Store, record: CheckpointRecord, where: str, cname: str, container_id: str,
        plan_dir: str, *, callers: bool, exists: Callable[[], Awaitable[bool | None]], filled: bool = False,
        memory: Memory | None = None,
    ) -> None:
        """Start the helpers of one container whose plan is written; `callers`: `store` is a caller's;
        `filled`: a full restore through the page source (`filled`); `memory`: what CRIU places itself,
        as the restore read it (`staging`), written into the plan when the wrapper asks."""
        origin, passwords = _remote_access(store, record.id)
        # The page source holds the blobs it serves until its pages are
        # in: a hold in our store, or links to a caller's checkpoint.
        private = None
        if callers:
            private = await asyncio.to_thread(_private_source, store, record, plan_dir, where, cname)
        hold = await asyncio.to_thread(store.hold, record) if private is None else None
        seal_key = await asyncio.to_thread(_seal_key, store, record)  # a KMS plugin may run: off the event loop
        replica = self.replicas.get(container_id)
        session = LazySession(self.settings, where, cname, container_id, record.id, plan_dir,
                              store.root if private is None else private.root,
                              origin=origin, passwords=passwords, hold=hold,
                              private_store=private is not None, exists=exists,
                              seal_key=seal_key, sandbox=replica.sandbox if replica is not None else "",
                              pod_failed=self._pod_failed, filled=filled, spare=self.spare,
                              on_connected=partial(self.stop_prefetch, record.id, "the page source took over"),
                              memory=memory if memory is not None else Memory(store, record))
        self._by_op.setdefault(op_id, []).append(session)
        await session.start()
        self._track(session, store)

    def prefetch(self, store: Store, record: CheckpointRecord, what: str) -> None:
        """Fetch the chunks a lazy pull left in the registry ahead of `record`'s restore (`prefetch`), unless
        that is under way or `registry.prefetch` is off; nothing for a checkpoint whose blobs are all in `store`."""
        for cid in [c for c, p in self._prefetches.items() if not p.running]:
            del self._prefetches[cid]
        if not self.settings.registry.prefetch or record.id in self._prefetches or store.origins.get(record.id) is None:
            return
        ahead = Prefetch(store, record, store.origins.fetch_lanes, what, self.settings.min_free_bytes)
        self._prefetches[record.id] = ahead
        ahead.start()

    def stop_prefetch(self, checkpoint_id: str, why: str) -> None:
        """End the fetches ahead of `checkpoint_id`'s restore, if any: those under way end by themselves."""
        ahead = self._prefetches.get(checkpoint_id)
        if ahead is not None:
            ahead.stop(why)

    async def failure(self, op_id: str, container_id: str, wait: float, *,
                      early: bool = False) -> errors.AgentError | None:
        """Why the lazy transfer of `container_id` in restore `op_id` failed, as the restore's error (None if it
        did not): DATA_LOSS for a chunk that failed verification, else UNAVAILABLE; `early`: see
        `LazySession.failure`."""
        for session in self._by_op.get(op_id, []):
            if session.container_id == container_id:
                why = await session.failure(wait, early=early)
                if why:
                    return errors.DataLoss(why) if "digest mismatch" in why else errors.Unavailable(why)
        return None

    def done(self, op_id: str) -> None:
        """The restore `op_id` succeeded: its sessions go on by themselves."""
        self._by_op.pop(op_id, None)

    async def cancel(self, op_id: str) -> None:
        """The restore `op_id` failed: end the sessions it started."""
        for session in self._by_op.pop(op_id, []):
            await session.cancel()

    async def shutdown(self) -> None:
        """The agent stops: end the helpers of containers not started yet; let running transfers go on alone."""
        sessions = list(self._sessions)
        await asyncio.gather(*(
            s.detach() if s.connected else
            s.end("the agent stopped before the container was started, so its page source is gone; "
                  "restore the checkpoint again")
            for s in sessions
        ), return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for ahead in self._prefetches.values():
            ahead.stop("the agent stops")
        for ahead in self._prefetches.values():  # a fetch under way ends (bounded by registry.io-timeout)
            await asyncio.to_thread(ahead.wait)
        await self.spare.close()

    async def _pod_failed(self, session: LazySession, reason: str) -> int:
        """A connected container's memory cannot be restored: stop its pod's restored containers, it first.

        Returns how many of its own processes were killed. The pod's other
        sessions are failed before their processes die (a transfer that
        ends because its processes were killed is no success); those not
        started yet end, so that their StartContainer fails with the reason.
        """
        replica = self.replicas.get(session.container_id)
        if replica is None:  # not recorded (restored before the records): this container alone
            return await asyncio.to_thread(kill_container, self.settings.runc_root, session.container_id,
                                           plan_dir=session.plan_dir)
        others = [s for s in self._sessions if s is not session and s.sandbox == replica.sandbox]
        for other in others:
            other.stopped_with(sibling_reason(replica, reason))
        killed = await asyncio.to_thread(stop_pod, self.replicas, self.settings.runc_root, replica, reason,
                                         plans_dir=self.settings.plans_dir)
        await asyncio.gather(*(o.end(f"{sibling_reason(replica, reason)}; restore the pod again")
                               for o in others if not o.connected), return_exceptions=True)
        return killed.get(session.container_id, 0)

    def report(self, runtime: Mapping[str, str] | None) -> list[ReplicaState]:
        """How every recorded replica is doing (blocking: reads plans).

        ``runtime``: the state of each container by ID as CRI lists it (None
        when not known now). A replica whose container is gone is left out,
        unless its restore failed: the failure stays listed with its pod.
        """
        progress = {s.container_id: s.progress for s in self._sessions}
        out = []
        for rep in self.replicas.all():
            plan = os.path.join(self.settings.plans_dir, rep.container_id)
            there = runtime.get(rep.container_id, "") if runtime is not None else None
            shown = "" if there is None else there.removeprefix("CONTAINER_").lower() or "removed"
            reason = self.replicas.failure(rep) or _mark(plan, FAILED_FILE) or _mark(plan, FAILED)
            pages, total = progress.get(rep.container_id) or (0, 0)
            if reason is not None:
                state = "failed"
            elif there == "" or not os.path.isdir(plan):
                continue  # gone: no longer a replica
            elif there == "CONTAINER_EXITED":
                state = "exited"
            elif rep.lazy and (done := _done(plan)) is not None:
                state, (pages, total) = "done", done
            elif not os.path.exists(os.path.join(plan, RESTORED)):
                state = "created"
            else:
                state = "paging-in" if rep.lazy else "running"
            out.append(ReplicaState(rep, state, reason or "", pages, total, shown))
        return out

    def _track(self, session: LazySession, store: Store) -> None:
        self._sessions.add(session)

        async def forget() -> None:
            try:
                outcome = await session.wait()
            finally:
                self._sessions.discard(session)
            if outcome.ok and store.origins.get(session.checkpoint_id) is not None:
                try:
                    if await asyncio.to_thread(store.origins.settle, session.checkpoint_id):
                        log.info("checkpoint %s: every blob is in the store now", session.checkpoint_id,
                                 extra={"checkpoint": session.checkpoint_id})
                except errors.AgentError as exc:
                    log.warning("checkpoint %s: %s", session.checkpoint_id, exc)

        task = asyncio.create_task(forget(), name=f"lazy done {session.container_id[:13]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _predumped(record: CheckpointRecord) -> bool:
    """Whether the checkpoint's memory is a pre-dump chain (restored from the plan's images only)."""
    return any("/predump/" in f.path for f in record.files)


def _seal_key(store: Store, record: CheckpointRecord) -> SealKey | None:
    """The key the page source needs to open an encrypted checkpoint's chunks."""
    if not record.key_id:
        return None
    key = store.keys.key(record.key_id) if store.keys is not None else None
    if key is None:
        raise errors.FailedPrecondition(
            f"checkpoint {record.id} is encrypted with key id {record.key_id}, which no configured key source has"
        )
    return key


def _mark(plan: str, name: str) -> str | None:
    """A failure mark in a plan (the wrapper's refusal, a page source that ended), or None."""
    try:
        with open(os.path.join(plan, name), encoding="utf-8", errors="replace") as fh:
            return fh.read(8192).strip() or None
    except OSError:
        return None


def _done(plan: str) -> tuple[int, int] | None:
    """(pages, total) of a finished transfer (``lazy.done``), or None while it goes on."""
    try:
        with open(os.path.join(plan, DONE_FILE), encoding="utf-8") as fh:
            doc = json.loads(fh.read(8192))
        return int(doc.get("pages", 0)), int(doc.get("total", 0))
    except (OSError, ValueError, AttributeError, TypeError):
        return None
