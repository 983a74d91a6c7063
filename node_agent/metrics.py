"""Prometheus metrics: what the checkpointer and restorer report, and the exporter.

`Metrics` is a small in-process registry (counters, histograms, gauges
computed at scrape time) rendered in the Prometheus text exposition format
0.0.4. The checkpointer and restorer report into it through `instrumented`
and `observe_ingest`; `serve_metrics` answers `GET /metrics` on a TCP port.
Observing takes a lock and does no I/O; rendering runs the gauge callbacks
(the store's size) in a thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
import time
from typing import Any, Awaitable, Callable, Mapping, TypeVar, cast

from node_agent import errors

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

# Seconds; checkpoints and restores take from a fraction of a second to minutes.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Seconds a pod stays frozen.
FROZEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DEVICE_HEALTH = ("healthy", "degraded", "unhealthy", "unmonitored")


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    esc = {k: v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in labels.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(esc.items())) + "}"


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.buckets, math.inf), self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{_num(bound)}"}} {running}')
        out.append(f"{name}_sum {_num(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    """The agent's metrics; safe to call from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.checkpoint_seconds = _Histogram(DURATION_BUCKETS)
        self.frozen_seconds = _Histogram(FROZEN_BUCKETS)
        self.restore_seconds = _Histogram(DURATION_BUCKETS)
        self.bytes_written = 0
        self.bytes_deduplicated = 0
        self.checkpoints = 0
        self.restores = 0
        self.failures: dict[tuple[str, str], int] = {}
        self.store_size: Callable[[], int] | None = None
        # Measuring the store walks its blobs: at most once per this many seconds.
        self.store_size_ttl = 10.0
        self._size: tuple[float, int] | None = None
        self.device_health: Callable[[], Mapping[str, int]] = lambda: {h: 0 for h in DEVICE_HEALTH}

    # ---- reports -----------------------------------------------------------

    def observe_checkpoint(self, record: Any, seconds: float) -> None:
        """A checkpoint was published after `seconds`; its frozen window is in its metadata."""
        meta = getattr(record, "metadata", None) or {}
        frozen_ms = meta.get("frozen_ms") if isinstance(meta, Mapping) else None
        with self._lock:
            self.checkpoints += 1
            self.checkpoint_seconds.observe(seconds)
            if isinstance(frozen_ms, (int, float)) and not isinstance(frozen_ms, bool):
                self.frozen_seconds.observe(frozen_ms / 1000.0)

    def observe_ingest(self, record: Any, new_bytes: int) -> None:
        """A checkpoint's content went into the store: `new_bytes` were new, the rest of its stored size was there already."""
        stored = int(getattr(record, "stored_size", 0) or 0)
        with self._lock:
            self.bytes_written += max(new_bytes, 0)
            self.bytes_deduplicated += max(stored - new_bytes, 0)

    def observe_restore(self, result: Any, seconds: float) -> None:
        with self._lock:
            self.restores += 1
            self.restore_seconds.observe(seconds)

    def observe_failure(self, operation: str, exc: BaseException) -> str:
        """A failed operation, counted by the gRPC status code it maps to (returned)."""
        reason = failure_reason(exc)
        with self._lock:
            key = (operation, reason)
            self.failures[key] = self.failures.get(key, 0) + 1
        return reason

    # ---- exposition --------------------------------------------------------

    def render(self) -> str:
        """The text exposition; calls the gauge callbacks (blocking: run it in a thread)."""
        size: int | None = None
        now = time.monotonic()
        if self._size is not None and now - self._size[0] < self.store_size_ttl:
            size = self._size[1]
        elif self.store_size is not None:
            try:
                size = self.store_size()
                self._size = (now, size)
            except Exception as exc:  # noqa: BLE001 - a scrape shows what it can
                log.warning("cannot measure the store for metrics: %s", exc)
        devices = dict(self.device_health())
        out: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")

        with self._lock:
            family("node_agent_checkpoint_duration_seconds", "histogram", "Time from request to published checkpoint.")
            out += self.checkpoint_seconds.lines("node_agent_checkpoint_duration_seconds")
            family("node_agent_checkpoint_frozen_seconds", "histogram", "How long each checkpointed pod stayed frozen.")
            out += self.frozen_seconds.lines("node_agent_checkpoint_frozen_seconds")
            family("node_agent_checkpoint_bytes_written_total", "counter",
                   "Stored bytes of checkpoint content that were new to the store.")
            out.append(f"node_agent_checkpoint_bytes_written_total {self.bytes_written}")
            family("node_agent_checkpoint_bytes_deduplicated_total", "counter",
                   "Stored bytes of checkpoint content the store already held.")
            out.append(f"node_agent_checkpoint_bytes_deduplicated_total {self.bytes_deduplicated}")
            family("node_agent_checkpoints_total", "counter", "Checkpoints published.")
            out.append(f"node_agent_checkpoints_total {self.checkpoints}")
            family("node_agent_restore_duration_seconds", "histogram", "Time from request to restored pod.")
            out += self.restore_seconds.lines("node_agent_restore_duration_seconds")
            family("node_agent_restores_total", "counter", "Restores completed.")
            out.append(f"node_agent_restores_total {self.restores}")
            family("node_agent_failures_total", "counter", "Failed operations by operation and gRPC status code.")
            for (op, reason), n in sorted(self.failures.items()):
                out.append(f"node_agent_failures_total{_labels({'operation': op, 'reason': reason})} {n}")
        if size is not None:
            family("node_agent_store_size_bytes", "gauge", "Bytes used by the store's blobs.")
            out.append(f"node_agent_store_size_bytes {size}")
        family("node_agent_devices", "gauge", "Devices by health.")
        for health in sorted(devices):
            out.append(f"node_agent_devices{_labels({'health': health})} {devices[health]}")
        return "\n".join(out) + "\n"


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
                status, ctype, body = "200 OK", "text/plain; version=0.0.4; charset=utf-8", text.encode()
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
