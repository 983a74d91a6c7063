"""`node-agent serve`: wiring, start-up recovery, serving, staged shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import shutil
import signal
import sys
from typing import Any, Callable

import grpc

from criu_bridge import wrapper
from criu_bridge.rpc import CriuClient
from node_agent import errors
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.api.agent import AgentServicer
from node_agent.checkpointing import POD_ANNOTATION, Checkpointer
from node_agent.config import Settings
from node_agent.cri import CriClient
from node_agent.journal import Journal
from node_agent.recovery import recover
from node_agent.restoring import Restorer
from node_agent.store import Store

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
    wrapper.install(s.wrapper_path, python=sys.executable, runc=resolve_runc(s), plans_dir=s.plans_dir)
    return s.wrapper_path


def _listen_unix(server: grpc.aio.Server, path: str) -> None:
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)
    server.add_insecure_port("unix://" + path)


def _secure_socket(path: str, group: str) -> None:
    gid = -1
    if group:
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    os.chown(path, 0, gid)
    os.chmod(path, 0o660)


async def serve(s: Settings) -> None:
    prepare_dirs(s)
    install_wrapper(s)
    store = Store(s.store)
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
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20)])
        policy = retention_policy(s)

        def gc(dry_run: bool = False) -> Any:
            return store.gc(policy, dry_run=dry_run)

        pb_grpc.add_NodeAgentServicer_to_server(  # type: ignore[no-untyped-call]
            AgentServicer(checkpointer, restorer, store, gc), server
        )
        _listen_unix(server, s.socket)
        await server.start()
        _secure_socket(s.socket, s.socket_group)
        log.info("serving on unix://%s (CRI %s)", s.socket, s.cri_endpoint)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        gc_task = (
            asyncio.create_task(periodic_gc(s, gc), name="periodic-gc") if s.retention.gc_interval > 0 else None
        )
        await stop.wait()
        log.info("shutting down")
        if gc_task is not None:
            gc_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gc_task
        # Let operations in flight finish their cleanup (thaw, remove).
        await server.stop(grace=s.timeouts.cleanup)
    finally:
        await cri.close()
