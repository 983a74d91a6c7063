"""`node-agent serve`: wiring, start-up recovery, serving, bounded shutdown.

One agent per store: `serve` holds `<store>/run/agent.lock` (`agentlock`)
from before it touches anything until it returns, and refuses to start while
another process serves its local or `cri-listen` socket. Restores whose undo
failed (the runtime did not answer) are retried by the `undo-retry` task
(`undoing.Undoer.run`) while the agent runs, and again at the next start.

On SIGTERM every listener stops taking calls at once; calls in flight get
`timeouts.cleanup` seconds, then are cancelled (thawing and removing what
they made); lazy restores let go of their helpers (`Restorer.shutdown`);
then what is left of the cleanup gets what remains of a fixed budget
(`timeouts.cleanup` + `_SHUTDOWN_MARGIN` in all). A worker thread still
blocked then (a registry that stopped answering) is abandoned: the process
exits anyway, and a pod can never stay frozen by it, since the freeze
watchdog thaws every pod whose agent is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from criu_bridge import wrapper
from criu_bridge.rpc import CriuClient
from node_agent import agentlock, errors, runtime_handler, signing
from node_agent import sdnotify
from node_agent.api.agent import AgentServicer
from node_agent.api.listeners import Listeners
from node_agent.api.unix_sockets import check_socket_free
from node_agent.checkpointing import Checkpointer
from node_agent.config.schema import Settings
from node_agent.cri import CriClient
from node_agent.journal import Journal
from node_agent.keys import Keys
from node_agent.metrics import Metrics
from node_agent.podformat import POD_ANNOTATION
from node_agent.recovery import gc_plans, recover
from node_agent.rekeying import Rekeyer
from node_agent.restoring import Restorer
from node_agent.store import Store
from node_agent.transfers import Transfers
from node_agent.undoing import Undoer

if TYPE_CHECKING:
    from node_agent.devices.monitor import DeviceMonitor

log = logging.getLogger(__name__)

# What the shutdown may take beyond `timeouts.cleanup`; the exit comes
# within it (the process needs a moment to end after the budget is spent).
_SHUTDOWN_MARGIN = 3.0
_WORKER_PREFIX = "agent-worker"


def retention_policy(s: Settings) -> Any:
    from node_agent.store import RetentionPolicy

    r = s.retention
    return RetentionPolicy(
        max_per_group=r.max_per_pod or None,
        group_annotation=POD_ANNOTATION,
        max_total_bytes=r.max_total_bytes or None,
        max_age_seconds=float(r.max_age_seconds) if r.max_age_seconds else None,
    )


async def periodic_gc(s: Settings, gc: Callable[..., Any]) -> None:
    """Collect garbage every `retention.gc-interval` seconds (never fatal)."""
    while True:
        await asyncio.sleep(s.retention.gc_interval)
        try:
            report = await asyncio.to_thread(gc)
            if report.removed_checkpoints or report.removed_blobs:
                log.info("gc removed %d checkpoint(s) and %d blob(s), freed %d bytes",
                         len(report.removed_checkpoints), len(report.removed_blobs), report.bytes_freed,
                         extra={"phase": "gc"})
        except Exception:  # noqa: BLE001 - logged; the next round tries again
            log.exception("periodic gc failed")


async def periodic_sweep(s: Settings, cri: CriClient, endpoint: Any) -> None:
    """Every `retention.plan-sweep-interval` seconds: plans of removed containers, expired Pod staging (never fatal)."""
    while True:
        await asyncio.sleep(s.retention.plan_sweep_interval)
        try:
            await gc_plans(s, cri)
            if endpoint is not None:
                await endpoint.sweep()
        except Exception:  # noqa: BLE001 - logged; the next round tries again
            log.exception("periodic sweep of restore plans failed")


def prepare_dirs(s: Settings) -> None:
    os.makedirs(s.store, mode=0o700, exist_ok=True)
    os.chmod(s.store, 0o700)
    for d in (s.journal_dir, s.work_dir, s.plans_dir, s.logs_dir, s.bin_dir):
        os.makedirs(d, mode=0o700, exist_ok=True)


def resolve_runc(s: Settings) -> str:
    path = s.runc if os.path.isabs(s.runc) else shutil.which(s.runc)
    if not path:
        raise errors.FailedPrecondition(f"runc binary {s.runc!r} not found on PATH")
    return path


def install_wrapper(s: Settings) -> str:
    """Write the restore handler's runtime launcher; returns its path."""
    wrapper.install(s.wrapper_path, python=s.wrapper_python or sys.executable, runc=resolve_runc(s), plans_dir=s.plans_dir)
    return s.wrapper_path


async def start_devices(s: Settings, metrics: Metrics) -> DeviceMonitor | None:
    """The device monitor (docs/devices.md), started; None when `devices.enabled` is false."""
    if not s.devices.enabled:
        return None
    from node_agent.devices.monitor import DeviceMonitor, kube_client

    try:
        kube, status = kube_client(s)
    except errors.AgentError as exc:
        log.warning("device taints: %s", exc, extra={"phase": "devices"})
        kube, status = None, f"error: {exc}"
    monitor = DeviceMonitor(s, kube=kube, kube_status=status)
    log.info("device monitor for node %s: sysfs %s, DeviceTaintRules %s", monitor.node, s.sysfs_root, status,
             extra={"phase": "devices"})
    metrics.device_health = monitor.counts
    metrics.device_taints = monitor.tainted
    monitor.start()
    return monitor


class _Running:
    """A background service's task and how to stop it."""

    def __init__(self, task: asyncio.Task[None], stop: Callable[[], Awaitable[None]]) -> None:
        self.task = task
        self._stop = stop

    async def stop(self) -> None:
        await self._stop()
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def start_podcheckpoints(s: Settings, checkpointer: Checkpointer, transfers: Transfers, store: Store) -> _Running | None:
    """The PodCheckpoint controller (docs/podcheckpoints.md), started; None when `podcheckpoints.enabled` is false
    or there are no cluster credentials (said in the log)."""
    if not s.podcheckpoints.enabled:
        return None
    from node_agent.podcheckpoints.controller import PodCheckpoints
    from node_agent.podcheckpoints.node import NodeAgent
    from node_agent.podcheckpoints.resolve import cluster

    try:
        found = cluster(s)
    except errors.AgentError as exc:
        found = str(exc)
    if isinstance(found, str):
        log.error("podcheckpoints: enabled, but %s: not watching PodCheckpoints", found,
                  extra={"phase": "podcheckpoints"})
        return None
    kube, node = found
    controller = PodCheckpoints(kube, node,
                                NodeAgent(s, checkpointer, transfers, store),
                                resync=s.podcheckpoints.resync_interval,
                                node_gone_grace=s.podcheckpoints.node_gone_grace)
    log.info("podcheckpoints: taking the PodCheckpoints of node %s's pods (%s)", node, kube.creds.server,
             extra={"phase": "podcheckpoints"})
    return _Running(asyncio.create_task(controller.run(), name="podcheckpoints"), controller.stop)


async def serve(s: Settings, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` (SIGTERM or SIGINT when None), holding the store's agent lock throughout.

    A second agent on the same store, or one whose sockets another process
    serves, is refused here, before anything is touched.
    """
    lock = agentlock.take(s.store)
    try:
        check_socket_free(s.socket, "local socket")
        if s.cri_listen:
            check_socket_free(s.cri_listen.removeprefix("unix://"), "cri-listen socket")
        await _serve_locked(s, stop)
    finally:
        lock.release()


async def _serve_locked(s: Settings, stop: asyncio.Event | None) -> None:
    prepare_dirs(s)
    if not s.wrapper_python:  # else install-handler wrote it for the host
        install_wrapper(s)
    keys = await asyncio.to_thread(Keys, s.encryption)  # a KMS plugin runs at start: off the event loop
    for line in await asyncio.to_thread(keys.describe):
        log.info("encryption key source %s", line)
    if s.signing.key_file:  # a key that cannot sign fails the start, not the first checkpoint
        log.info("checkpoints are signed by %s", signing.signer_for(s.signing.key_file).key_id)
    store = Store(s.store, keys=keys, chunk_size=s.chunk_size)
    from node_agent.registry.fetching import RemoteBlobs

    remote = RemoteBlobs(store, settings=s.registry, min_free=s.min_free_bytes)
    store.origins.fetcher = remote  # chunks that lazy pulls left in their registries
    store.origins.fetch_lanes = s.registry.connections
    report = await asyncio.to_thread(store.recover)
    log.info("store at %s: %s", s.store, report)
    journal = Journal(s.journal_dir)
    cri = CriClient(s.cri_endpoint, timeout=s.timeouts.cri_call)
    criu = CriuClient(s.criu, timeout=s.timeouts.criu_rpc)
    undoer = Undoer(s, cri, journal)
    try:
        n = await recover(s, journal, cri, undoer)
        if n:
            log.warning("recovered %d unfinished operation(s)", n)
        metrics = Metrics()
        metrics.store_size = store.usage
        metrics.store_free = store.free_bytes
        metrics.min_free_bytes = s.min_free_bytes
        checkpointer = Checkpointer(s, cri, store, journal, criu, metrics, keys=keys, undoer=undoer)
        rekeyer = Rekeyer(s, store, keys)
        restorer = Restorer(s, cri, store, journal, criu, metrics, undoer=undoer)
        policy = retention_policy(s)

        def gc(dry_run: bool = False) -> Any:
            return store.gc(policy, dry_run=dry_run)

        devices = await start_devices(s, metrics)
        transfers = Transfers(s, store, seal_for=checkpointer.seal_key, remote=remote)
        servicer = AgentServicer(checkpointer, restorer, store, gc, transfers=transfers, devices=devices, rekeyer=rekeyer)
        listeners = Listeners(s, servicer, metrics)
        server = listeners.root_server()
        await listeners.bind(server)
        await server.start()
        await listeners.start()
        cri_listener = None
        if s.cri_listen:
            from node_agent.api.cri_endpoint import CriListener

            cri_listener = CriListener(s.cri_listen, checkpointer, restorer, store)
            try:
                await cri_listener.start()
            except BaseException:
                await asyncio.shield(listeners.stop(server, grace=0))
                raise
        log.info("serving on unix://%s (CRI %s)", s.socket, s.cri_endpoint)
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
        await check_handler_at_start(s, cri)
        restorer.lazy.prepare()  # a page source started ahead of the first restore
        sdnotify.ready(f"serving on unix://{s.socket}")
        gc_task = (
            asyncio.create_task(periodic_gc(s, gc), name="periodic-gc") if s.retention.gc_interval > 0 else None
        )
        sweep_task = (
            asyncio.create_task(periodic_sweep(s, cri, cri_listener.endpoint.pods if cri_listener else None),
                                name="periodic-sweep") if s.retention.plan_sweep_interval > 0 else None
        )
        undo_task = asyncio.create_task(undoer.run(), name="undo-retry")  # pending undos, until done
        podcheckpoints = start_podcheckpoints(s, checkpointer, transfers, store)
        await stop.wait()
        deadline = time.monotonic() + s.timeouts.cleanup + _SHUTDOWN_MARGIN
        log.info("shutting down: calls in flight get %gs", s.timeouts.cleanup)
        sdnotify.stopping("stopping: letting operations in flight finish")
        for task in (gc_task, sweep_task, undo_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # Every listener stops at once: calls in flight get the grace period,
        # then are cancelled, which thaws and removes what they made.
        stops = [listeners.stop(server, grace=s.timeouts.cleanup)]
        if cri_listener is not None:
            stops.append(cri_listener.stop(grace=s.timeouts.cleanup))
        if devices is not None:
            stops.append(devices.stop())
        if podcheckpoints is not None:
            stops.append(podcheckpoints.stop())
        await asyncio.gather(*stops, return_exceptions=True)
        await restorer.shutdown()
        await _settle_tasks(deadline)
    finally:
        await cri.close()
        await asyncio.to_thread(remote.close)  # the blobs fetched last land in the store


async def _settle_tasks(deadline: float) -> None:
    """Wait until `deadline` for the tasks still running (cleanup of cancelled calls); cancel the rest."""
    me = asyncio.current_task()
    pending = {t for t in asyncio.all_tasks() if t is not me and not t.done()}
    if not pending:
        return
    done, left = await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
    for t in left:
        coro = t.get_coro()
        log.warning("shutdown: %s (%s) did not finish in time; cancelled", t.get_name(),
                    getattr(coro, "__qualname__", coro))
        t.cancel()
    if left:
        await asyncio.wait(left, timeout=1.0)


def check_handler_at_start(s: Settings, cri: CriClient) -> Any:
    """Warn at start when the restore handler does not serve this agent (restores would be refused)."""

    async def check() -> None:
        try:
            problems = (await runtime_handler.inspect(cri, s.runtime_handler)).problems(s)
        except errors.AgentError as exc:
            log.warning("cannot check the restore handler %r yet: %s", s.runtime_handler, exc,
                        extra={"phase": "handler"})
            return
        if problems:
            log.warning("restores will be refused: %s; fix: %s", "; ".join(problems), runtime_handler.fix_command(s),
                        extra={"phase": "handler"})
        else:
            log.info("restore handler %r serves this agent's plans (%s)", s.runtime_handler, s.plans_dir,
                     extra={"phase": "handler"})

    return check()


def run(s: Settings) -> int:
    """Serve until SIGTERM or SIGINT; the process's exit status.

    Worker threads get a pool of our own, so that the exit need not wait for
    one that is blocked: past the shutdown's budget, it is abandoned (logged)
    and the process ends all the same.
    """
    loop = asyncio.new_event_loop()
    pool = ThreadPoolExecutor(thread_name_prefix=_WORKER_PREFIX)
    loop.set_default_executor(pool)
    started = [0.0]
    try:
        loop.run_until_complete(_serve_timed(s, started))
    finally:
        try:
            _cancel_rest(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            end = (started[0] or time.monotonic()) + s.timeouts.cleanup + _SHUTDOWN_MARGIN
            busy = [t for t in threading.enumerate() if t.name.startswith(_WORKER_PREFIX)]
            for t in busy:
                t.join(max(0.0, end - time.monotonic()))
            for t in busy:
                t.join(0.1)  # an idle worker ends as soon as it sees the shutdown
            frames = sys._current_frames()
            stuck = [f"{t.name} in {_where(frames.get(t.ident or 0))}" for t in busy if t.is_alive()]
            loop.close()
    if stuck:
        log.warning("shutdown: abandoning %d worker thread(s) still blocked (%s); exiting", len(stuck),
                    ", ".join(stuck))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


async def _serve_timed(s: Settings, started: list[float]) -> None:
    stop_seen = asyncio.Event()

    def mark() -> None:
        if not started[0]:
            started[0] = time.monotonic()
        stop_seen.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, mark)
    await serve(s, stop_seen)


def _where(frame: Any) -> str:
    """The innermost frame of ours a blocked thread is in, for the log."""
    found = "?"
    while frame is not None:
        code = frame.f_code
        if "node_agent" in code.co_filename or "criu_bridge" in code.co_filename:
            return f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"
        if found == "?":
            found = f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"
        frame = frame.f_back
    return found


def _cancel_rest(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.wait(tasks, timeout=1.0))
