"""Undo until done: what a failed restore created goes, however long the runtime takes to answer.

A checkpoint's entry is held to the same rule: it stays until every
container it froze is thawed and its scratch directory is gone
(`undo_checkpoint`).

A restore's journal entry names what it created, or is about to: before
RunPodSandbox the new sandbox's namespace, name and UID and the restore's
mark (the `RESTORE_OP` annotation, its journal ID); the sandbox's ID once
it is known; each plan directory. When the restore fails (or its agent
died: `recovery`), the entry is marked `undo` and the removal runs. The
entry stays until every sandbox it names is removed (or the runtime answers
NotFound) and every plan is gone. A sandbox whose ID never came back (the
answer to RunPodSandbox was lost: the agent or containerd died during the
call) is found by listing the pods; its containers go with it.

A removal that fails (containerd down or restarting) is retried with
backoff while the agent runs (`Undoer.run`, the daemon's `undo-retry`
task: `RETRY_FIRST` seconds, doubling up to `RETRY_MAX`), and again at each
start. Rule: an entry whose undo has not begun belongs to the operation in
flight, and an entry whose writer is another live process belongs to that
process: neither is ever undone here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from typing import Any, Iterable, Mapping

from criu_bridge import freezer, mountinfo
from criu_bridge.errors import BridgeError
from criu_bridge.freezer import Freezer
from node_agent import errors
from node_agent.config.schema import Settings
from node_agent.cri import CriClient
from node_agent.cri.types import Pod
from node_agent.journal import Entry, Journal

log = logging.getLogger(__name__)

# The restore that made a sandbox: its journal entry's ID, as a sandbox annotation.
RESTORE_OP = "node-agent.io/restore-op"
# The first retry of a pending undo comes after RETRY_FIRST seconds; each
# later one waits twice as long as the one before, at most RETRY_MAX.
RETRY_FIRST = 1.0
RETRY_MAX = 30.0


def sandbox_record(pod_config: Mapping[str, Any], op_id: str) -> dict[str, str]:
    """What finds a restore's sandbox when its ID never came back: metadata and the restore's mark."""
    meta = pod_config.get("metadata") or {}
    return {"namespace": str(meta.get("namespace") or ""), "name": str(meta.get("name") or ""),
            "uid": str(meta.get("uid") or ""), "op": op_id}


def made_by(pod: Pod, record: Mapping[str, Any]) -> bool:
    """Is `pod` the sandbox that the restore of `record` (`sandbox_record`) asked for?"""
    return (bool(record.get("op")) and pod.annotations.get(RESTORE_OP) == record.get("op")
            and pod.namespace == record.get("namespace") and pod.name == record.get("name")
            and pod.uid == record.get("uid"))


async def undo_restore(cri: CriClient, data: Mapping[str, Any], timeout: float) -> list[str]:
    """Remove every sandbox and plan a restore's journal `data` names; returns what is left, each saying why.

    Empty when nothing is left: each sandbox removed, or unknown to the
    runtime (NotFound); each plan directory gone. Every step is tried, and
    each runtime call is bounded by `timeout`.
    """
    left: list[str] = []
    pods = [p for p in data.get("sandboxes", []) if isinstance(p, str) and p]
    record = data.get("sandbox")
    if isinstance(record, Mapping) and record.get("op"):
        try:
            async with asyncio.timeout(timeout):
                listed = await cri.list_pods()
            pods += [p.id for p in listed if made_by(p, record) and p.id not in pods]
        except (errors.AgentError, TimeoutError) as exc:
            left.append(f"cannot list the pods to find sandbox {record.get('namespace')}/{record.get('name')}: "
                        f"{exc or 'timed out'}")
    for pod_id in pods:
        try:
            async with asyncio.timeout(timeout):
                with contextlib.suppress(errors.NotFound):
                    await cri.stop_pod(pod_id)
                await cri.remove_pod(pod_id)
        except errors.NotFound:
            pass
        except (errors.AgentError, TimeoutError) as exc:
            left.append(f"sandbox {pod_id[:13]}: {exc or f'no answer within {timeout:g}s'}")
    for plan_dir in data.get("plans", []):
        if isinstance(plan_dir, str) and os.path.isabs(plan_dir):
            if why := await asyncio.to_thread(remove_dir, plan_dir):
                left.append(f"plan {why}")
    return left


def remove_dir(path: str) -> str:
    """Remove the directory `path` of an operation, mounts that CRIU left in it first; "" when it is gone, else why."""
    stuck = mountinfo.detach_below(path) if os.path.isdir(path) else []
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return ""
    return f"{path} could not be removed" + (f" ({'; '.join(stuck)})" if stuck else "")


def undo_checkpoint(data: Mapping[str, Any], work_dir: str) -> list[str]:
    """Thaw every container a checkpoint's journal `data` froze and remove its scratch directory; what is left.

    Empty when nothing is left: each freezer thawed (or gone with its
    container) and the scratch directory, when it lies under `work_dir`, gone.
    """
    left: list[str] = []
    for arg in data.get("freezers", []):
        try:
            fz = Freezer.from_arg(str(arg))
            freezer.thaw(fz)
            if freezer.state(fz) != "THAWED":
                left.append(f"container cgroup {fz.path} is still frozen")
        except FileNotFoundError:
            pass  # the container is gone, and its cgroup with it
        except (OSError, BridgeError) as exc:
            left.append(f"cannot thaw {arg}: {exc}")
    raw = data.get("work")
    if isinstance(raw, str) and os.path.realpath(raw).startswith(os.path.realpath(work_dir) + os.sep):
        if why := remove_dir(raw):
            left.append(f"scratch directory {why}")
    return left


class Undoer:
    """Undoes failed restores (and unfinished checkpoints) until done: the first attempt at once, then retries (`run`)."""

    def __init__(self, settings: Settings, cri: CriClient, journal: Journal, *,
                 first: float = RETRY_FIRST, most: float = RETRY_MAX) -> None:
        self.settings = settings
        self.cri = cri
        self.journal = journal
        self.first = first
        self.most = most
        self._busy: set[str] = set()  # entries whose undo is running now
        self._due: dict[str, tuple[float, float]] = {}  # op_id -> (next attempt, monotonic; its backoff)
        self._tries: dict[str, int] = {}  # op_id -> attempts that failed
        self._wake = asyncio.Event()

    async def undo(self, entry: Entry) -> bool:
        """Mark `entry`'s undo as begun and try it; True when done (the entry is gone).

        An entry that is not in the journal is done: a restore that never
        wrote its entry created nothing, and one removed meanwhile was undone.
        An entry whose undo runs already (another call) is left to it.
        """
        if entry.op_id in self._busy:
            return False
        if not self.journal.holds(entry):
            return True
        self._busy.add(entry.op_id)
        try:
            if not entry.data.get("undo"):
                entry.data["undo"] = True  # from here on, nothing else acts on this entry
                try:
                    self.journal.write(entry)
                except OSError as exc:  # the removal is tried all the same; the next start finds the entry
                    log.warning("undo of %s %s: cannot mark its journal entry: %s", entry.kind, entry.op_id, exc,
                                extra={"phase": "undo"})
            if entry.kind == "checkpoint":
                left = await asyncio.to_thread(undo_checkpoint, entry.data, self.settings.work_dir)
            else:
                left = await undo_restore(self.cri, entry.data, self.settings.timeouts.cleanup)
        finally:
            self._busy.discard(entry.op_id)
        pod = entry.data.get("pod", "?")
        tries = self._tries.pop(entry.op_id, 0) + 1
        if not left:
            self.journal.remove(entry)
            self._due.pop(entry.op_id, None)
            log.info("undo of %s %s (pod %s) done: %s (attempt %d)", entry.kind, entry.op_id, pod,
                     "its containers are thawed and its scratch space removed" if entry.kind == "checkpoint"
                     else "its sandboxes and plans are removed", tries, extra={"phase": "undo", "pod": pod})
            return True
        self._tries[entry.op_id] = tries
        backoff = self._later(entry.op_id)
        log.warning("undo of %s %s (pod %s) pending (attempt %d): %s; retrying in %gs", entry.kind, entry.op_id, pod,
                    tries, "; ".join(left), backoff, extra={"phase": "undo", "pod": pod})
        return False

    def _later(self, op_id: str) -> float:
        """Schedule the next attempt at `op_id`, with backoff; returns the wait."""
        _, backoff = self._due.get(op_id, (0.0, 0.0))
        backoff = min(self.most, backoff * 2) if backoff else self.first
        self._due[op_id] = (time.monotonic() + backoff, backoff)
        self._wake.set()
        return backoff

    async def remove_sandbox(self, pod_id: str, where: str) -> bool:
        """Remove a sandbox that no restore's entry names yet (a Pod restore's, failed after RunPodSandbox)."""
        entry = Entry("restore", data={"pod": where, "sandboxes": [pod_id], "plans": [], "undo": True})
        self.journal.write(entry)
        return await self.undo(entry)

    def owns(self, entry: Entry) -> bool:
        """A restore or checkpoint entry whose undo has begun, written by this process or by one that is gone."""
        return (entry.kind in ("restore", "checkpoint") and bool(entry.data.get("undo"))
                and (entry.written_by_me() or not entry.writer_alive()))

    async def run(self) -> None:
        """Retry every pending undo with backoff until it is done; runs until cancelled (at shutdown)."""
        while True:
            self._wake.clear()
            entries = [e for e in await asyncio.to_thread(self.journal.pending) if self.owns(e)]
            known = {e.op_id for e in entries} | self._busy
            for op_id in [o for o in self._due if o not in known]:
                del self._due[op_id]  # done meanwhile
                self._tries.pop(op_id, None)
            now = time.monotonic()
            for e in entries:
                if e.op_id in self._busy:
                    continue  # its first attempt runs now; a failure schedules the next
                at, _ = self._due.setdefault(e.op_id, (now, 0.0))
                if at <= now:
                    try:
                        await self.undo(e)
                    except Exception:  # noqa: BLE001 - logged; retried like any other failure
                        log.exception("undo of %s %s failed; retrying in %gs", e.kind, e.op_id, self._later(e.op_id))
            await self._sleep(min((at for at, _ in self._due.values()), default=None))

    async def _sleep(self, until: float | None) -> None:
        """Until the monotonic time `until` (forever when None), or until an undo becomes pending."""
        timeout = None if until is None else max(0.0, until - time.monotonic())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wake.wait()

    def pending(self) -> Iterable[str]:
        """The journal IDs of the undos waiting for a retry."""
        return tuple(self._due)
