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
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from node_agent import errors
from node_agent.config import Settings
from node_agent.lazy.session import LazySession
from node_agent.lazy.support import lazy_restore_support
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
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._support: tuple[bool, str] | None = None
        self._warned = False
        # Sessions started by each restore in flight (by journal op), for its undo.
        self._by_op: dict[str, list[LazySession]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Every session whose helpers still run.
        self._sessions: set[LazySession] = set()

    async def supported(self) -> tuple[bool, str]:
        """Whether this CRIU and kernel can restore lazily (`criu check --feature uffd-noncoop`), and why not."""
        if self._support is None:
            self._support = await asyncio.to_thread(lazy_restore_support, self.settings.criu, 30.0)
        return self._support

    async def wanted(self, asked: bool | None, record: CheckpointRecord) -> bool:
        """Whether a restore goes lazily: `asked` (None: the node's default), possible here, and for this checkpoint."""
        if asked is not None:
            if not asked:
                return False
        elif self.settings.lazy_restore != "auto":
            return False
        if any("/predump/" in f.path for f in record.files):
            log.info("checkpoint %s has pre-dumped memory: restoring it in full", record.id)
            return False
        ok, why = await self.supported()
        if not ok and not self._warned:
            self._warned = True
            log.warning("lazy restore is not available here (criu check --feature uffd-noncoop: %s): "
                        "restores read all memory before the containers start", why)
        return ok

    async def start(
        self, op_id: str, store: Store, record: CheckpointRecord, where: str, cname: str, container_id: str,
        plan_dir: str, *, callers: bool, exists: Callable[[], Awaitable[bool | None]],
    ) -> None:
        """Start the helpers of one container whose plan is written; `callers`: `store` is a caller's."""
        origin, passwords = _remote_access(store, record.id)
        # The page source holds the blobs it serves until its pages are
        # in: a hold in our store, or links to a caller's checkpoint.
        private = None
        if callers:
            private = await asyncio.to_thread(_private_source, store, record, plan_dir, where, cname)
        hold = await asyncio.to_thread(store.hold, record) if private is None else None
        seal_key = await asyncio.to_thread(_seal_key, store, record)  # a KMS plugin may run: off the event loop
        session = LazySession(self.settings, where, cname, container_id, record.id, plan_dir,
                              store.root if private is None else private.root,
                              origin=origin, passwords=passwords, hold=hold,
                              private_store=private is not None, exists=exists,
                              seal_key=seal_key)
        self._by_op.setdefault(op_id, []).append(session)
        await session.start()
        self._track(session, store)

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
