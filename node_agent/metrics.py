"""Prometheus metrics: what the checkpointer and restorer report, and the exporter.

`Metrics` keeps the agent's series in a `prometheus_client` registry of its
own (never the library's global one), beside the library's process and
platform collectors (`process_*`: memory, open fds, CPU; `python_info`). The
checkpointer and restorer report into it through `instrumented` and
`observe_ingest`; the store's size and free space, the devices by health
and the devices tainted are gauges computed at scrape time from callbacks. The exposition is the text format
0.0.4 without `_created` series. `serve_metrics` answers `GET /metrics` on a
TCP port from the agent's event loop, so it closes with the other listeners.
Observing does no I/O; rendering runs the callbacks (the store's size walks
its blobs) and belongs in a thread.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import time
from typing import Any, Awaitable, Callable, Iterator, Mapping, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from node_agent import errors

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

# Seconds; checkpoints and restores take from a fraction of a second to minutes.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Seconds a pod stays frozen.
FROZEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DEVICE_HEALTH = ("healthy", "degraded", "unhealthy", "unmonitored")
TAINT_EFFECTS = ("None", "NoSchedule", "NoExecute")


class Metrics:
    """The agent's metrics; safe to call from any thread.

    A `Collector` itself: it yields its registry's families without the
    `_created` samples (when each series began), which no dashboard of the
    agent reads and which would double the counters' output.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.checkpoint_seconds = Histogram(
            "node_agent_checkpoint_duration_seconds", "Time from request to published checkpoint.",
            buckets=DURATION_BUCKETS, registry=r)
        self.frozen_seconds = Histogram(
            "node_agent_checkpoint_frozen_seconds", "How long each checkpointed pod stayed frozen.",
            buckets=FROZEN_BUCKETS, registry=r)
        self.bytes_written = Counter(
            "node_agent_checkpoint_bytes_written", "Stored bytes of checkpoint content that were new to the store.",
            registry=r)
        self.bytes_deduplicated = Counter(
            "node_agent_checkpoint_bytes_deduplicated", "Stored bytes of checkpoint content the store already held.",
            registry=r)
        self.checkpoints = Counter("node_agent_checkpoints", "Checkpoints published.", registry=r)
        self.restore_seconds = Histogram(
            "node_agent_restore_duration_seconds", "Time from request to restored pod.",
            buckets=DURATION_BUCKETS, registry=r)
        self.restores = Counter("node_agent_restores", "Restores completed.", registry=r)
        self.failures = Counter(
            "node_agent_failures", "Failed operations by operation and gRPC status code.",
            ("operation", "reason"), registry=r)
        self.store_size: Callable[[], int] | None = None
        # Measuring the store walks its blobs: at most once per this many seconds.
        self.store_size_ttl = 10.0
        self._size: tuple[float, int] | None = None
        # The free space on the store's filesystem, and the floor the agent keeps free there (`min-free-bytes`).
        self.store_free: Callable[[], int] | None = None
        self.min_free_bytes: int | None = None
        self.device_health: Callable[[], Mapping[str, int]] = lambda: {h: 0 for h in DEVICE_HEALTH}
        # Devices the agent taints (DeviceTaintRules), by the strongest effect of their taints.
        self.device_taints: Callable[[], Mapping[str, int]] = lambda: {e: 0 for e in TAINT_EFFECTS}
        r.register(_Gauges(self))
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)

    # ---- reports -----------------------------------------------------------

    def observe_checkpoint(self, record: Any, seconds: float) -> None:
        """A checkpoint was published after `seconds`; its frozen window is in its metadata."""
        meta = getattr(record, "metadata", None) or {}
        frozen_ms = meta.get("frozen_ms") if isinstance(meta, Mapping) else None
        self.checkpoints.inc()
        self.checkpoint_seconds.observe(seconds)
        if isinstance(frozen_ms, (int, float)) and not isinstance(frozen_ms, bool):
            self.frozen_seconds.observe(frozen_ms / 1000.0)

    def observe_ingest(self, record: Any, new_bytes: int) -> None:
        """A checkpoint's content went into the store: `new_bytes` were new, the rest of its stored size was there already."""
        stored = int(getattr(record, "stored_size", 0) or 0)
        self.bytes_written.inc(max(new_bytes, 0))
        self.bytes_deduplicated.inc(max(stored - new_bytes, 0))

    def observe_restore(self, result: Any, seconds: float) -> None:
        self.restores.inc()
        self.restore_seconds.observe(seconds)

    def observe_failure(self, operation: str, exc: BaseException) -> str:
        """A failed operation, counted by the gRPC status code it maps to (returned)."""
        reason = failure_reason(exc)
        self.failures.labels(operation=operation, reason=reason).inc()
        return reason

    # ---- exposition --------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            kept = [s for s in family.samples if s.name != family.name + "_created"]
            if len(kept) != len(family.samples):
                family = copy.copy(family)  # a collector may hand out the same family each time
                family.samples = kept
            yield family

    def render(self) -> str:
        """The text exposition; calls the gauge callbacks (blocking: run it in a thread)."""
        return generate_latest(self).decode()

    def measured_store_size(self) -> int | None:
        """The store's size, measured at most once per `store_size_ttl`; None when it cannot be measured."""
        now = time.monotonic()
        if self._size is not None and now - self._size[0] < self.store_size_ttl:
            return self._size[1]
        if self.store_size is None:
            return None
        try:
            size = self.store_size()
        except Exception as exc:  # noqa: BLE001 - a scrape shows what it can
            log.warning("cannot measure the store for metrics: %s", exc)
            return None
        self._size = (now, size)
        return size


class _Gauges:
    """The gauges computed at scrape time: the store's size and free space (each left out when unknown), the
    floor kept free, devices by health and devices tainted."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        size = self.metrics.measured_store_size()
        if size is not None:
            yield GaugeMetricFamily("node_agent_store_size_bytes", "Bytes used by the store's blobs.", value=size)
        free = self._free()
        if free is not None:
            yield GaugeMetricFamily("node_agent_store_free_bytes",
                                    "Bytes free to the agent on the store's filesystem.", value=free)
        if self.metrics.min_free_bytes is not None:
            yield GaugeMetricFamily("node_agent_store_min_free_bytes",
                                    "Bytes every checkpoint and pull leaves free on the store's filesystem "
                                    "(min-free-bytes).", value=self.metrics.min_free_bytes)
        devices = GaugeMetricFamily("node_agent_devices", "Devices by health.", labels=("health",))
        for health, n in sorted(dict(self.metrics.device_health()).items()):
            devices.add_metric((health,), n)
        yield devices
        tainted = GaugeMetricFamily("node_agent_devices_tainted",
                                    "Devices the agent taints, by the strongest effect of their taints.",
                                    labels=("effect",))
        for effect, n in sorted(dict(self.metrics.device_taints()).items()):
            tainted.add_metric((effect,), n)
        yield tainted

    def _free(self) -> int | None:
        if self.metrics.store_free is None:
            return None
        try:
            return self.metrics.store_free()
        except Exception as exc:  # noqa: BLE001 - a scrape shows what it can
            log.warning("cannot measure the store's free space for metrics: %s", exc)
            return None


def failure_reason(exc: BaseException) -> str:
    """The gRPC status code name an exception ends a call with."""
    if isinstance(exc, errors.AgentError):
        return exc.code
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    if isinstance(exc, TimeoutError):
        return "DEADLINE_EXCEEDED"
    return "INTERNAL"


def instrumented(operation: str) -> Callable[[F], F]:
    """Time an `async` method of an object with a `metrics` attribute; report success or failure.

    `operation` is `checkpoint` or `restore`; the first argument is the
    request, whose pod or checkpoint goes into the failure's log record.
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        async def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            metrics: Metrics | None = getattr(self, "metrics", None)
            t0 = time.monotonic()
            try:
                result = await fn(self, *args, **kwargs)
            except BaseException as exc:
                reason = metrics.observe_failure(operation, exc) if metrics is not None else failure_reason(exc)
                req = args[0] if args else None
                log.warning(
                    "%s failed after %.1f s: %s: %s", operation, time.monotonic() - t0, reason, exc or type(exc).__name__,
                    extra={"op": operation, "reason": reason, "pod": getattr(req, "pod", None),
                           "checkpoint": getattr(req, "checkpoint_id", None)},
                )
                raise
            if metrics is not None:
                seconds = time.monotonic() - t0
                if operation == "checkpoint":
                    metrics.observe_checkpoint(result, seconds)
                else:
                    metrics.observe_restore(result, seconds)
            return result

        return cast(F, run)

    return wrap


# ---- the exporter ------------------------------------------------------------
# A few lines of asyncio rather than the library's threaded server: each
# request is bounded in size and time, and closing the listener ends it at
# once, within the daemon's shutdown, however slow its clients are.

_MAX_REQUEST = 8192


async def _answer(metrics: Metrics, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
            if len(head) > _MAX_REQUEST:
                raise ValueError("request too large")
            method, _, rest = head.decode("latin-1").partition(" ")
            path = rest.partition(" ")[0].partition("?")[0]
            if method not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"only GET\n"
            elif path in ("/metrics", "/"):
                text = await asyncio.to_thread(metrics.render)
                status, ctype, body = "200 OK", CONTENT_TYPE_PLAIN_0_0_4, text.encode()
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"see /metrics\n"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, ConnectionError, TimeoutError):
        pass
    finally:
        writer.close()
        try:
            async with asyncio.timeout(5):
                await writer.wait_closed()
        except (ConnectionError, TimeoutError):
            pass


async def serve_metrics(metrics: Metrics, host: str, port: int) -> asyncio.Server:
    """Start answering `GET /metrics` on host:port; close the returned server to stop."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer(metrics, reader, writer)

    server = await asyncio.start_server(handle, host, port, limit=_MAX_REQUEST)
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server
