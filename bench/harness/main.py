"""The one way a benchmark runs: as root, on its environment, cleaned up whatever happens; and what it writes.

`guarded` sets the environment up, runs the measurement and always removes
what it created: on success, on a failure (reported as one line, or with its
traceback when unexpected) and on SIGINT/SIGTERM (a second signal does not
cut the clean-up short). `write_json` and `write_docs` are the results'
files: the raw samples, and docs/benchmarks.md's generated blocks.
`standalone` is the whole run of a benchmark with a results file of its own
(bench/crossnode.py, bench/framework.py), and `run_facts` what every such
run records about itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from bench.harness.base import BenchError, log
from bench.harness.env import Env
from bench.harness.machine import REPO, bed_info, machine_info, memory_given_back, tree_digest
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


def run_facts(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`measure()`'s results with the run's own facts: the load averages at its start and its end, how long
    it took, and the memory the host took back meanwhile (free page reporting)."""
    start = [round(x, 2) for x in os.getloadavg()]
    given_back = memory_given_back()
    started = time.time()
    out = measure()
    out["loadavg"] = {"start": start, "end": [round(x, 2) for x in os.getloadavg()]}
    out["elapsed_s"] = round(time.time() - started, 1)
    now = memory_given_back()
    if given_back is not None and now is not None:
        out["memory_given_back_gib"] = round(now - given_back, 1)
    return out


def standalone(args: Any, env: Env, measure: Callable[[], dict[str, Any]],
               build: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]],
               text: Callable[[dict[str, Any]], str], docs_from: Callable[[Path], int]) -> int:
    """A benchmark with a results file of its own (`args.out`): as root, `measure` guarded on `env`, the
    record `build` makes of the machine and the samples written there and printed (`text`), and, with
    `args.write_docs`, docs/benchmarks.md from it (`docs_from`); `args.docs_only`: only the docs."""
    if args.docs_only:
        return docs_only()
    refused = not_root()
    if refused is not None:
        return refused
    machine = machine_info(REPO)

    def before() -> None:
        machine["node_agent_tree"] = tree_digest(REPO)

    rc, samples = guarded(env, machine, measure, before=before, agent_log_on_error=True)
    if rc != 0:
        return rc
    doc = build(machine, samples)
    out = Path(args.out)
    write_json(out, doc)
    sys.stdout.write(text(doc))
    log(f"raw samples: {out}")
    return docs_from(out) if args.write_docs else 0


def docs_with(crossnode: dict[str, Any] | None = None, framework: dict[str, Any] | None = None) -> int:
    """docs/benchmarks.md from the committed results, with `crossnode` and `framework` (where given) in place
    of those benchmarks' committed files."""
    merged = results.load(results.RESULTS_JSON)
    if merged is None:
        log("bench/results.json holds no results of bench/run.py: docs/benchmarks.md not written")
        return 1
    docs.write(merged, encryption.load(), image_check.load(), crossnode=crossnode, framework=framework)
    log(f"wrote {docs.DOCS}")
    return 0
