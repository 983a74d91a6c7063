#!/usr/bin/env python3
"""The cost of the image check: restores until running, with and without it, interleaved on one agent.

    .venv/bin/python bench/image_check.py [--runs 5] [--out bench/image_check.json] [--write-docs] [--keep]
                                          [--bed na-bench-img] [--attach AGENT_CONFIG] [--workdir DIR]
                                          [--mib 256] [--tasks 64]
                                          [--warmup 1] [--settle 1] [--containerd PATH] [--docs-only]

As root. It brings up one test bed and one agent (the harness's Bench), and
checkpoints two pods: a memhog of --mib MiB (one task, the usual workload)
and a busybox shell with --tasks sleeping children (many tasks, so many core
and ids images: the check's worst case per byte). Then, in every run, each
checkpoint is restored twice with `restore --start --full` until its
container runs (the agent's call, then its ticker going on), once with the
restore wrapper as the agent installed it (the check on) and once with the
same wrapper whose check passes everything (the check off, a launcher this
benchmark writes in place of the agent's for that one restore: the product
has no switch to turn the check off). The order of the two alternates from
run to run. It also times the check alone (reading the images and holding
them to the config) on the plan each checkpoint gives. It prints the medians
and the ratio (on / off), writes the raw samples to --out and, with
--write-docs, regenerates docs/benchmarks.md. Everything it makes is removed
at the end, also on errors and signals. The measurement is
bench/scenarios/image_check.py.
"""

from __future__ import annotations

import argparse
import sys

from bench.report.results import IMAGE_CHECK_JSON
from bench.scenarios.image_check import DEFAULT_BED
from bench.scenarios.image_check import main as run_image_check
from testbed.bed import CONTAINERD2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/image_check.py", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs (default 5)")
    ap.add_argument("--out", default=str(IMAGE_CHECK_JSON), help="JSON with every raw sample")
    ap.add_argument("--write-docs", action="store_true", help="regenerate docs/benchmarks.md")
    ap.add_argument("--docs-only", action="store_true", help="measure nothing: regenerate docs/benchmarks.md")
    ap.add_argument("--keep", action="store_true", help="leave the test bed (and the store) in place")
    ap.add_argument("--bed", default=DEFAULT_BED, help=f"test bed name (default {DEFAULT_BED})")
    ap.add_argument("--attach", metavar="AGENT_CONFIG",
                    help="measure the agent already running with this config on the running bed --bed (no bed "
                         "of its own; the end-to-end suite's smoke run)")
    ap.add_argument("--agent-pid", type=int, help="with --attach: the agent's pid (default: found by its config)")
    ap.add_argument("--workdir", help="agent config, store and scratch (default /var/lib/node-agent-bench/BED)")
    ap.add_argument("--containerd", default=CONTAINERD2, help=f"the test bed's containerd binary (default {CONTAINERD2})")
    ap.add_argument("--mib", type=int, default=256, help="MiB of the memhog pod (default 256)")
    ap.add_argument("--tasks", type=int, default=64, help="sleeping children of the many-task pod (default 64)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds before the runs (default 1)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of quiet between operations (default 1)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.warmup < 0 or args.mib < 1 or args.tasks < 1:
        ap.error("--runs, --mib and --tasks must be positive, --warmup not negative")
    args.answer_sizes = []
    return args


def main(argv: list[str] | None = None) -> int:
    return run_image_check(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
