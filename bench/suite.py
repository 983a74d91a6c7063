"""bench/run.py's measurements: its scenarios in order on one environment, and what it writes at the end.

A scenario is a module of bench/scenarios/ with `run(bench)`, which writes
its part of `bench.results`; a new one joins the run by a line in SCENARIOS
(memhog workloads, skipped by --answer-only) or MODEL (the model server).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench.harness.base import log
from bench.harness.machine import REPO, machine_info
from bench.harness.main import guarded, not_root, write_docs, write_json
from bench.harness.ops import Bench
from bench.report import results, tables, targets
from bench.scenarios import checkpoint, firstanswer, native, podcut, store

Scenario = Callable[[Bench], None]
SCENARIOS: tuple[Scenario, ...] = (checkpoint.run, podcut.run, store.run, native.run)
MODEL: tuple[Scenario, ...] = (firstanswer.run,)


def measure(bench: Bench) -> dict[str, Any]:
    """Every scenario, in order, on `bench` (set up): the raw samples."""
    args = bench.args
    bench.results = {"single": {}, "restore": {}, "warmup": {}}
    bench.op_timeout = min(600.0, 120.0 + max(args.sizes + args.native_sizes + [args.pair * 2]) * 0.4)
    started = time.time()
    # Other work on the machine shows here first: the load averages at the start and the end.
    bench.results["loadavg"] = {"start": [round(x, 2) for x in os.getloadavg()]}
    for scenario in (() if args.answer_only else SCENARIOS) + MODEL:
        scenario(bench)
    bench.results["loadavg"]["end"] = [round(x, 2) for x in os.getloadavg()]
    bench.results["elapsed_s"] = round(time.time() - started, 1)
    return bench.results


def main(args: argparse.Namespace) -> int:
    """bench/run.py once its arguments are parsed."""
    out = Path(args.out)
    if args.docs_only:
        loaded = results.load(out)
        if loaded is None:
            print(f"bench: {args.out} holds no results", file=sys.stderr)
            return 1
        write_docs(loaded)
        return 0
    refused = not_root()
    if refused is not None:
        return refused
    machine = machine_info(REPO)
    bench = Bench(args)

    def announce() -> None:
        log(f"containerd {machine['containerd']} ({machine['containerd_binary']}), runc {machine['runc']}")

    rc, samples = guarded(bench, machine, lambda: measure(bench), announce=announce)
    if rc != 0:
        return rc
    doc = targets.build(args, machine, samples)
    # The file keeps the latest run of every containerd version; this run replaces its own.
    merged = results.merge(results.load(out), doc)
    write_json(out, merged)
    sys.stdout.write(tables.text_tables(doc))
    others = [k for k in merged["runs"] if k != merged["latest"]]
    log(f"raw samples: {out}" + (f" (also kept there: containerd {', '.join(others)})" if others else ""))
    if args.write_docs:
        write_docs(merged)
    return 0
