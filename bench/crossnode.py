#!/usr/bin/env python3
"""The cross-node table: a model server's replica on another node, each path until its first correct answer.

    .venv/bin/python bench/crossnode.py [--sizes 256,1024] [--runs 3] [--out bench/crossnode.json]
                                        [--write-docs] [--docs-only] [--keep] [--bed na-xnode]
                                        [--workdir DIR] [--settle 1] [--containerd PATH]

As root. It brings up four test beds, BED-a to BED-d (four nodes, each with its own containerd, store and
agent), a loopback origin registry and a pull-through cache of it as the targets' mirror. For each size of
the model server's weights (--sizes, MiB) it checkpoints the server on A, pushes the checkpoint to the
origin, and then, in every run (--runs; medians reported): a cold start on B, the default restore on A,
the CLI path on B (`pull --lazy`, then restore), the Pod path on B (a Pod annotated restore-from, the
kubelet's CRI calls), a fan-out through an empty cache (C, then B and D at once, with the bytes the
origin served), and full pull and push against the registry's own GET bound. It prints the tables and the
targets, writes every raw sample to --out and, with --write-docs, regenerates docs/benchmarks.md (its
"crossnode" block from --out). Everything it creates (pods, checkpoints, registries, the beds unless
--keep, their work dirs) is removed at the end, also on errors and signals. The measurement is
bench/scenarios/crossnode.py; docs/benchmarks.md says how each number is measured.
"""

from __future__ import annotations

import argparse
import os
import sys

from bench.report.crossnode import CROSSNODE_JSON
from bench.scenarios.crossnode import DEFAULT_BED
from bench.scenarios.crossnode import main as run_crossnode
from testbed.bed import CONTAINERD2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/crossnode.py", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--sizes", default="256,1024", help="MiB of model weights, one image each (default 256,1024)")
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs per size (default 3)")
    ap.add_argument("--out", default=str(CROSSNODE_JSON),
                    help=f"JSON with every raw sample (default {CROSSNODE_JSON}; a trial run: another path)")
    ap.add_argument("--write-docs", action="store_true", help="regenerate docs/benchmarks.md with --out's results")
    ap.add_argument("--docs-only", action="store_true", help="measure nothing: regenerate docs/benchmarks.md")
    ap.add_argument("--keep", action="store_true", help="leave the test beds (and their stores) in place")
    ap.add_argument("--bed", default=DEFAULT_BED, help=f"prefix of the four beds' names (default {DEFAULT_BED})")
    ap.add_argument("--workdir", help="the nodes' agent configs, stores and scratch, a folder each "
                                      "(default /var/lib/node-agent-bench/BED-a ... BED-d)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of quiet between operations (default 1)")
    ap.add_argument("--containerd", default=CONTAINERD2, help=f"the beds' containerd binary (default {CONTAINERD2})")
    args = ap.parse_args(argv)
    try:
        args.sizes = sorted({int(s) for s in str(args.sizes).split(",") if s.strip()})
    except ValueError:
        ap.error("--sizes: comma-separated MiB, e.g. 256,1024")
    if not args.sizes or min(args.sizes) < 1 or args.runs < 1 or args.settle < 0:
        ap.error("--sizes and --runs must be positive, --settle not negative")
    if not args.docs_only and not os.access(args.containerd, os.X_OK):
        ap.error(f"--containerd {args.containerd}: not an executable (scripts/install-host installs 2.1)")
    # The harness's environment, one per node: its own bed, no attaching, the first size's image at start.
    args.attach, args.agent_pid, args.answer_sizes = None, None, args.sizes[:1]
    return args


def main(argv: list[str] | None = None) -> int:
    return run_crossnode(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
