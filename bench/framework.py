#!/usr/bin/env python3
"""A framework's model server: the torch server's first answers, and restored memory's transfer rate against its bound.

    .venv/bin/python bench/framework.py [--runs 3] [--mib 1024] [--warmup 1] [--out bench/framework.json]
                                        [--write-docs] [--docs-only] [--keep] [--bed na-framework]
                                        [--workdir DIR] [--settle 1] [--containerd PATH]

As root. It brings up one test bed with the torch image, the Debian image (the numpy model server with --mib
MiB of weights) and memhog, starts the agent, and measures, in interleaved runs after --warmup untimed
rounds: the torch server's first answer after a cold start, the default restore and --full, each with the
page cache warm and emptied; and, for the torch server, the numpy server and memhog (--mib), the bytes of
process memory restored per second against a bound measured in the same run. It prints the tables and
the targets, writes every raw sample to --out and, with --write-docs, regenerates docs/benchmarks.md (its
"framework" block from bench/framework.json). Everything it creates is removed at the end, also on errors
and signals. The measurement is bench/scenarios/framework.py; docs/benchmarks.md says how each number is
measured.
"""

from __future__ import annotations

import argparse
import os
import sys

from bench.report.framework import FRAMEWORK_JSON
from bench.scenarios.framework import DEFAULT_BED, IMAGES
from bench.scenarios.framework import main as run_framework
from testbed.bed import CONTAINERD2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/framework.py", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs (default 3)")
    ap.add_argument("--mib", type=int, default=1024, help="MiB of the numpy server's weights and of memhog (default 1024)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds before the runs (default 1)")
    ap.add_argument("--out", default=str(FRAMEWORK_JSON),
                    help=f"JSON with every raw sample (default {FRAMEWORK_JSON}; a trial run: another path)")
    ap.add_argument("--write-docs", action="store_true", help="regenerate docs/benchmarks.md with bench/framework.json")
    ap.add_argument("--docs-only", action="store_true", help="measure nothing: regenerate docs/benchmarks.md")
    ap.add_argument("--keep", action="store_true", help="leave the test bed (and the store) in place")
    ap.add_argument("--bed", default=DEFAULT_BED, help=f"test bed name (default {DEFAULT_BED})")
    ap.add_argument("--workdir", help="agent config, store and scratch (default /var/lib/node-agent-bench/BED)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of quiet between operations (default 1)")
    ap.add_argument("--containerd", default=CONTAINERD2, help=f"the bed's containerd binary (default {CONTAINERD2})")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.mib < 1 or args.warmup < 0 or args.settle < 0:
        ap.error("--runs and --mib must be positive, --warmup and --settle not negative")
    if not args.docs_only and not os.access(args.containerd, os.X_OK):
        ap.error(f"--containerd {args.containerd}: not an executable (scripts/install-host installs 2.1)")
    # The harness's environment: its own bed with these images, the numpy server's weights at --mib.
    args.attach, args.agent_pid, args.answer_sizes, args.images = None, None, [args.mib], IMAGES
    return args


def main(argv: list[str] | None = None) -> int:
    return run_framework(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
