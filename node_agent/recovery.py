"""Start-up recovery: finish what a previous agent process left undone.

For each journal entry: a checkpoint is thawed, its runc/CRIU helpers are
waited out (then killed) and its scratch files removed; a restore has its
sandboxes and plans removed (`undoing`: an entry whose removal fails stays,
and the daemon's undo retrier takes it over). Then lazy-restore helpers that
serve no transfer in flight are ended (`lazy.strays`), and stray scratch dirs
and plans whose container is gone are cleared. Nothing here is published, so
nothing here can leave a half-written checkpoint listed.

What recovery never does: undo an entry whose writer still runs (same PID
and start time: another agent process on this store), clear the scratch
space or end lazy helpers while such a writer exists, or kill a process that
is not one of a checkpoint's helpers: those are the runc processes its entry
recorded (PID and start time), their descendants, and runc or CRIU processes
holding its scratch directory (`watchdog.is_helper_program`), never a
node-agent process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

from criu_bridge import freezer
from criu_bridge.freezer import Freezer
from criu_bridge.watchdog import alive, descendants, holders, proc_argv
from node_agent import errors
from node_agent.config.schema import Settings
from node_agent.cri import CriClient
from node_agent.journal import Journal
from node_agent.lazy import strays
from node_agent.undoing import Undoer, remove_dir

log = logging.getLogger(__name__)


def _thaw(args: list[str]) -> None:
    for arg in args:
        try:
            freezer.thaw(Freezer.from_arg(arg))
        except (OSError, Exception) as exc:  # a container that is gone needs nothing
            log.debug("thaw %s: %s", arg, exc)


def _settle_helpers(helpers: list[dict[str, int]], freezers: list[str], work: str, grace: float) -> None:
    """Wait for a dead agent's runc/CRIU helpers to end, thawing meanwhile; then kill.

    The helpers: those the entry recorded (PID and start time), their
    descendants, and runc or CRIU holding the scratch directory `work`;
    never a node-agent process.
    """
    tracked = {int(h["pid"]): int(h["start"]) for h in helpers if h.get("start") is not None}

    def follow() -> None:
        descendants(tracked)
        tracked.update(holders(work))
        for pid in [p for p in tracked if _is_agent(p)]:
            del tracked[pid]

    follow()
    end = time.monotonic() + grace
    while time.monotonic() < end:
        _thaw(freezers)
        follow()
        if not any(alive(p, s) for p, s in tracked.items()):
            break
        time.sleep(0.05)
    for pid, start in tracked.items():
        if alive(pid, start) and not _is_agent(pid):
            log.warning("killing leftover checkpoint helper %d (%s)", pid, " ".join(proc_argv(pid)[:2]) or "?")
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    time.sleep(0.05)
    _thaw(freezers)


def _is_agent(pid: int) -> bool:
    """This process, or any node-agent process (never a helper, whatever it holds)."""
    if pid == os.getpid():
        return True
    argv = proc_argv(pid)
    return any(os.path.basename(a).startswith("node-agent") or a.startswith("node_agent") for a in argv[:3])


async def recover(settings: Settings, journal: Journal, cri: CriClient, undoer: Undoer | None = None) -> int:
    """Undo every operation a previous agent process left unfinished; returns how many there were.

    A restore whose removal fails now (the runtime does not answer) keeps
    its entry, marked `undo`: `undoer` (the daemon's, whose retrier then
    takes it over) retries it.
    """
    undoer = undoer or Undoer(settings, cri, journal)
    entries = []
    owners: set[int] = set()
    for entry in journal.pending():
        if entry.writer_alive() and not entry.written_by_me():
            owners.add(entry.pid)
            log.warning("leaving journal entry %s (%s of pod %s) alone: its writer, pid %d, still runs",
                        entry.op_id, entry.kind, entry.data.get("pod", "?"), entry.pid, extra={"phase": "recovery"})
        else:
            entries.append(entry)
    for entry in entries:
        data = entry.data
        log.warning("recovering unfinished %s %s (%s)", entry.kind, entry.op_id, data.get("pod", "?"),
                    extra={"phase": "recovery", "pod": data.get("pod", "")})
        if entry.kind == "checkpoint":
            freezers = [str(f) for f in data.get("freezers", [])]
            raw = data.get("work")
            work = raw if isinstance(raw, str) and os.path.realpath(raw).startswith(
                os.path.realpath(settings.work_dir) + os.sep) else ""
            await asyncio.to_thread(
                _settle_helpers, list(data.get("helpers", [])), freezers, work, settings.timeouts.cleanup
            )
            await undoer.undo(entry)  # thawed, its scratch space removed; else kept, and retried
        elif entry.kind == "restore":
            await undoer.undo(entry)  # kept, and retried, while the runtime does not answer
        else:
            journal.remove(entry)
    if owners:
        log.warning("agent process(es) %s still run with operations on this store: their scratch space and lazy-"
                    "restore helpers are left alone", ", ".join(str(p) for p in sorted(owners)),
                    extra={"phase": "recovery"})
    else:
        # Scratch space is only ever used by an operation in flight: none is now.
        if os.path.isdir(settings.work_dir):
            for name in os.listdir(settings.work_dir):
                remove_dir(os.path.join(settings.work_dir, name))
        await end_stray_helpers(settings, cri)
    await gc_plans(settings, cri)
    return len(entries)


async def end_stray_helpers(settings: Settings, cri: CriClient) -> None:
    """End this agent's lazy-restore helpers unless their container runs the process restored from its plan."""
    found = await asyncio.to_thread(strays.helpers, settings.plans_dir)
    if not found:
        return
    try:
        containers = {c.id: c for c in await cri.list_containers()}
    except errors.AgentError as exc:
        log.warning("cannot list containers to check %d lazy-restore helper(s); they end by themselves after "
                    "timeouts.lazy-start: %s", len(found), exc)
        return
    reasons: dict[str, str] = {}
    for cid in {h.container_id for h in found}:
        c = containers.get(cid)
        if c is None:
            reasons[cid] = "its container is gone"
        elif c.state == "CONTAINER_CREATED":
            reasons[cid] = ("the agent stopped before the container was started, so its page source is gone; "
                            "restore the checkpoint again")
        elif not c.running or not os.path.exists(os.path.join(settings.plans_dir, cid, "restored")):
            reasons[cid] = f"its container is {c.state.removeprefix('CONTAINER_').lower()}"
    ended = await asyncio.to_thread(strays.end, found, reasons, settings.plans_dir)
    kept = len({h.container_id for h in found}) - len(reasons)
    if ended or kept:
        log.info("lazy-restore helpers of a previous agent: %d ended, %d container(s) still paging in",
                 len(ended), kept, extra={"phase": "recovery"})


async def gc_plans(settings: Settings, cri: CriClient) -> list[str]:
    """Remove restore plans whose container no longer exists; returns their container IDs.

    At start-up, and every `retention.plan-sweep-interval` seconds while the
    agent runs: a container removed without the agent hearing of it (through
    containerd directly, or while the agent was down) leaves a plan that
    holds plaintext. The plans are listed before the containers: a plan is
    written only after its container exists, so one listed first whose
    container is missing from the later list is gone for good, never one of
    a restore in flight.
    """
    if not os.path.isdir(settings.plans_dir):
        return []
    names = os.listdir(settings.plans_dir)
    if not names:
        return []
    try:
        live = {c.id for c in await cri.list_containers()}
    except errors.AgentError as exc:
        log.warning("cannot list containers to clean restore plans: %s", exc)
        return []
    gone = []
    for name in names:
        cid = name.removesuffix(".materialize")
        if cid not in live:
            if why := await asyncio.to_thread(remove_dir, os.path.join(settings.plans_dir, name)):
                log.warning("cannot remove the restore plan %s", why, extra={"phase": "sweep"})
            else:
                gone.append(cid)
    if gone:
        log.info("removed the restore plans of %d container(s) that no longer exist: %s", len(gone),
                 ", ".join(c[:13] for c in gone), extra={"phase": "sweep"})
    return gone
