"""The one way a benchmark runs: as root, on its environment, cleaned up whatever happens; and what it writes.

`guarded` sets the environment up, runs the measurement and always removes
what it created: on success, on a failure (reported as one line, or with its
traceback when unexpected) and on SIGINT/SIGTERM (a second signal does not
cut the clean-up short). `write_json` and `write_docs` are the results'
files: the raw samples, and docs/benchmarks.md's generated blocks.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from bench.harness.base import BenchError, log
from bench.harness.env import Env
from bench.harness.machine import bed_info
from bench.report import docs, encryption, image_check, results


def not_root() -> int | None:
    """2, and why, unless this runs as root; then the SIGTERM a run stops on, like SIGINT."""
    if os.geteuid() != 0:
        print("bench: needs root (it runs a private containerd)", file=sys.stderr)
        return 2

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    return None


def guarded(env: Env, machine: dict[str, Any], measure: Callable[[], dict[str, Any]],
            before: Callable[[], None] | None = None, announce: Callable[[], None] | None = None,
            agent_log_on_error: bool = False) -> tuple[int, dict[str, Any]]:
    """(exit status, results): `before` (if any), the environment's set-up (its test bed's containerd and runc
    added to `machine`), `announce`, then `measure`; `env.cleanup()` at the end in every case."""
    rc = 0
    out: dict[str, Any] = {}
    try:
        if before is not None:
            before()
        env.setup()
        machine.update(bed_info(env.b.info))
        if announce is not None:
            announce()
        out = measure()
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        rc = 130
    except (BenchError, TimeoutError) as exc:
        log(f"error: {exc}")
        rc = 1
    except Exception:  # noqa: BLE001 - reported, then cleaned up
        log("error:\n" + traceback.format_exc().rstrip())
        rc = 1
    finally:
        # Cleanup is bounded; a second signal must not cut it short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if agent_log_on_error and rc == 1 and env.bed is not None:
            tail = env.b.tail_log(15)
            if tail:
                log("the agent's last log lines:\n" + tail.rstrip())
        env.cleanup()
    return rc, out


def write_json(path: Path, doc: dict[str, Any], atomic: bool = True) -> None:
    """`doc` as indented JSON with sorted keys; `atomic`: through a temporary file renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    if not atomic:
        path.write_text(text)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_docs(merged: dict[str, Any]) -> None:
    """docs/benchmarks.md's generated blocks from `merged` (bench/results.json's layout) and from
    bench/encryption.json and bench/image_check.json."""
    docs.write(merged, encryption.load(), image_check.load())
    log(f"wrote {docs.DOCS} (containerd {', '.join(results.series_order(merged))})")


def docs_only() -> int:
    """Measures nothing: docs/benchmarks.md from the results files as they are."""
    merged = results.load(results.RESULTS_JSON)
    if merged is None:
        log("bench/results.json holds no results of bench/run.py: docs/benchmarks.md not written")
        return 1
    write_docs(merged)
    return 0
