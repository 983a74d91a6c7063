"""What every benchmark module shares: its log line, its error, waiting, the namespaces and scratch names."""

from __future__ import annotations

import sys
from typing import Any, Callable

from testbed.bed import wait_for

FAST_TICK_MS = 5
NS_SRC, NS_RESTORE, NS_STAGE = "bench", "bench-r", "bench-stage"
MARKER = ".node-agent-bench"
MODEL_MIB_ENV = "NODE_AGENT_MODEL_MIB"  # scripts/testbed up --model-mib
# Under the agent's store directory but not the checkpoint store itself:
# scratch, restore plans, logs, the journal, the runtime wrapper, writers in flight.
NOT_STORE = {"work", "plans", "logs", "journal", "bin", "ingest"}


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


class BenchError(Exception):
    """A failure reported as one line."""


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05,
               failure: str | None = None, error: type[Exception] = BenchError) -> Any:
    """testbed.bed.wait_for, failing with `error` (a BenchError unless given): `failure`, or that it timed out
    waiting for `what`."""
    try:
        return wait_for(pred, timeout=timeout, what=what, interval=interval)
    except AssertionError as exc:
        raise error(failure or f"timed out after {timeout:g}s waiting for {what}") from exc
