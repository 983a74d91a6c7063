"""Metrics: what the checkpointer and restorer report, rendered and served over a real socket."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node_agent import errors
from node_agent.metrics import Metrics, instrumented, serve_metrics


class Worker:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    @instrumented("checkpoint")
    async def checkpoint(self, frozen_ms: float, fail: BaseException | None = None) -> Any:
        await asyncio.sleep(0.01)
        if fail is not None:
            raise fail
        return SimpleNamespace(metadata={"frozen_ms": frozen_ms}, stored_size=1000)

    @instrumented("restore")
    async def restore(self) -> Any:
        return object()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, parsed by prometheus_client's own parser."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(text: str, name: str, **labels: str) -> float:
    found = samples(text).get((name, frozenset(labels.items())))
    assert found is not None, f"no {name}{labels} in\n{text}"
    return found


async def test_reports_are_rendered() -> None:
    m = Metrics()
    m.store_size = lambda: 12345
    w = Worker(m)
    rec = await w.checkpoint(42.0)
    m.observe_ingest(rec, 300)
    await w.checkpoint(3000.0)
    await w.restore()
    with pytest.raises(errors.FailedPrecondition):
        await w.checkpoint(1.0, errors.FailedPrecondition("busy"))
    with pytest.raises(asyncio.CancelledError):
        await w.checkpoint(1.0, asyncio.CancelledError())
    text = m.render()
    assert sample(text, "node_agent_checkpoint_duration_seconds_count") == 2
    assert sample(text, "node_agent_checkpoint_duration_seconds_sum") > 0.02
    assert sample(text, "node_agent_checkpoint_frozen_seconds_count") == 2
    assert sample(text, "node_agent_checkpoint_frozen_seconds_sum") == pytest.approx(3.042)
    assert sample(text, "node_agent_checkpoint_frozen_seconds_bucket", le="0.05") == 1
    assert sample(text, "node_agent_checkpoint_frozen_seconds_bucket", le="+Inf") == 2
    assert sample(text, "node_agent_checkpoint_bytes_written_total") == 300
    assert sample(text, "node_agent_checkpoint_bytes_deduplicated_total") == 700
    assert sample(text, "node_agent_restore_duration_seconds_count") == 1
    assert sample(text, "node_agent_failures_total", operation="checkpoint", reason="FAILED_PRECONDITION") == 1
    assert sample(text, "node_agent_failures_total", operation="checkpoint", reason="CANCELLED") == 1
    assert sample(text, "node_agent_store_size_bytes") == 12345
    assert sample(text, "node_agent_devices", health="healthy") == 0
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["node_agent_checkpoint_duration_seconds"] == "histogram"
    assert types["node_agent_checkpoints"] == "counter" and types["node_agent_store_size_bytes"] == "gauge"


def test_the_process_collectors_report_and_no_created_series_are_exposed() -> None:
    m = Metrics()
    m.observe_failure("restore", TimeoutError())
    text = m.render()
    names = {name for name, _ in samples(text)}
    assert sample(text, "process_resident_memory_bytes") > 0 and sample(text, "process_open_fds") > 0
    assert "process_cpu_seconds_total" in names and "python_info" in names
    assert not [n for n in names if n.endswith("_created")]
    assert sample(text, "node_agent_failures_total", operation="restore", reason="DEADLINE_EXCEEDED") == 1


def test_each_instance_has_a_registry_of_its_own() -> None:
    a, b = Metrics(), Metrics()
    a.observe_restore(None, 1.0)
    assert sample(a.render(), "node_agent_restores_total") == 1
    assert sample(b.render(), "node_agent_restores_total") == 0
    assert a.registry is not b.registry


def test_a_store_that_cannot_be_measured_leaves_the_gauge_out() -> None:
    m = Metrics()

    def broken() -> int:
        raise OSError("gone")

    m.store_size = broken
    assert "node_agent_store_size_bytes" not in m.render()


def test_the_store_space_and_tainted_devices_are_gauges() -> None:
    m = Metrics()
    text = m.render()
    assert "node_agent_store_free_bytes" not in text and "node_agent_store_min_free_bytes" not in text
    assert {effect: sample(text, "node_agent_devices_tainted", effect=effect)
            for effect in ("None", "NoSchedule", "NoExecute")} == {"None": 0, "NoSchedule": 0, "NoExecute": 0}
    m.store_free = lambda: 5 << 30
    m.min_free_bytes = 1 << 30
    m.device_taints = lambda: {"None": 1, "NoSchedule": 2, "NoExecute": 0}
    text = m.render()
    assert sample(text, "node_agent_store_free_bytes") == 5 << 30
    assert sample(text, "node_agent_store_min_free_bytes") == 1 << 30
    assert sample(text, "node_agent_devices_tainted", effect="NoSchedule") == 2

    def broken() -> int:
        raise OSError("gone")

    m.store_free = broken
    assert "node_agent_store_free_bytes " not in m.render()


async def test_exporter_serves_prometheus_text() -> None:
    m = Metrics()
    m.observe_ingest(SimpleNamespace(stored_size=10), 4)
    server = await serve_metrics(m, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    def get(path: str) -> tuple[int, str, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                return r.status, r.headers["Content-Type"], r.read().decode()
        except urllib.error.HTTPError as exc:
            status = exc.code
            exc.close()
            return status, "", ""

    try:
        status, ctype, body = await asyncio.to_thread(get, "/metrics")
        assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
        assert sample(body, "node_agent_checkpoint_bytes_deduplicated_total") == 6
        assert (await asyncio.to_thread(get, "/nothing"))[0] == 404
    finally:
        server.close()
        await server.wait_closed()


async def test_a_failure_is_logged_with_its_pod_and_reason(caplog: pytest.LogCaptureFixture) -> None:
    from node_agent.logconfig import JsonFormatter

    class Runner:
        metrics = Metrics()

        @instrumented("checkpoint")
        async def checkpoint(self, req: Any) -> Any:
            raise errors.NotFound("pod prod/web not found")

    with pytest.raises(errors.NotFound):
        await Runner().checkpoint(SimpleNamespace(pod="prod/web"))
    (rec,) = [r for r in caplog.records if r.name == "node_agent.metrics"]
    doc = json.loads(JsonFormatter().format(rec))
    assert (doc["op"], doc["pod"], doc["reason"]) == ("checkpoint", "prod/web", "NOT_FOUND")
    assert "pod prod/web not found" in doc["msg"]
