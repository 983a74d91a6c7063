"""`node-agent serve`: wiring, start-up recovery, serving, staged shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
from typing import TYPE_CHECKING, Any, Callable

import grpc

from criu_bridge import wrapper
from criu_bridge.rpc import CriuClient
from node_agent import errors
from node_agent import sdnotify
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.api.agent import AgentServicer
from node_agent.api.listeners import SERVER_OPTIONS, Listeners
from node_agent.checkpointing import POD_ANNOTATION, Checkpointer
from node_agent.config import Settings
from node_agent.cri import CriClient
from node_agent.journal import Journal
from node_agent.metrics import Metrics
from node_agent.recovery import recover
from node_agent.restoring import Restorer
from node_agent.store import Store

if TYPE_CHECKING:
    from node_agent.devices.monitor import DeviceMonitor

log = logging.getLogger(__name__)


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
    monitor.start()
    return monitor


async def serve(s: Settings) -> None:
    prepare_dirs(s)
    if not s.wrapper_python:  # else install-handler wrote it for the host
        install_wrapper(s)
    store = Store(s.store)
    from node_agent.registry.fetching import RemoteBlobs

    store.fetcher = RemoteBlobs(store)  # chunks that lazy pulls left in their registries
    report = await asyncio.to_thread(store.recover)
    log.info("store at %s: %s", s.store, report)
    journal = Journal(s.journal_dir)
    cri = CriClient(s.cri_endpoint, timeout=s.timeouts.cri_call)
    criu = CriuClient(s.criu, timeout=s.timeouts.criu_rpc)
    try:
        n = await recover(s, journal, cri)
        if n:
            log.warning("recovered %d unfinished operation(s)", n)
        checkpointer = Checkpointer(s, cri, store, journal, criu)
        restorer = Restorer(s, cri, store, journal, criu)
        metrics = Metrics()
        metrics.store_size = store.usage
        checkpointer.metrics = restorer.metrics = metrics
        server = grpc.aio.server(options=SERVER_OPTIONS)
        policy = retention_policy(s)

        def gc(dry_run: bool = False) -> Any:
            return store.gc(policy, dry_run=dry_run)

        devices = await start_devices(s, metrics)
        servicer = AgentServicer(checkpointer, restorer, store, gc, devices=devices)
        pb_grpc.add_NodeAgentServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        listeners = Listeners(s, servicer, metrics)
        await listeners.bind(server)
        await server.start()
        await listeners.start()
        cri_listener = None
        if s.cri_listen:
            from node_agent.api.cri_endpoint import CriListener

            cri_listener = CriListener(s.cri_listen, checkpointer, restorer, store)
            await cri_listener.start()
        log.info("serving on unix://%s (CRI %s)", s.socket, s.cri_endpoint)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        sdnotify.ready(f"serving on unix://{s.socket}")
        gc_task = (
            asyncio.create_task(periodic_gc(s, gc), name="periodic-gc") if s.retention.gc_interval > 0 else None
        )
        await stop.wait()
        log.info("shutting down")
        sdnotify.stopping("stopping: letting operations in flight finish")
        if gc_task is not None:
            gc_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gc_task
        # Let operations in flight finish their cleanup (thaw, remove).
        if cri_listener is not None:
            await cri_listener.stop(grace=s.timeouts.cleanup)
        await listeners.stop(server, grace=s.timeouts.cleanup)
        if devices is not None:
            await devices.stop()
    finally:
        await cri.close()
