#!/usr/bin/env python3
"""node-agent against bare runc and CRIU, on a private containerd node.

    .venv/bin/python bench/run.py [--sizes 64,256,1024] [--runs 5] [--pair 512]
                                  [--repeat-mib 256] [--warmup 1] [--out bench/results.json]
                                  [--write-docs] [--note TEXT] [--quick] [--keep]
                                  [--bed NAME] [--attach AGENT_CONFIG] [--containerd PATH]
                                  [--native-sizes 256,1024] [--no-native] [--docs-only]
                                  [--answer-sizes 256,2048] [--answer-runs N] [--answer-large-runs N]
                                  [--answer-replicas N] [--no-answer] [--answer-only]

As root. It brings up a test bed (scripts/testbed, name from --bed or
NODE_AGENT_BENCH_BED, default na-bench) on the containerd binary --containerd
(default: 2.1 from /opt/node-agent/containerd-2; /usr/bin/containerd is the
system's) with the agent's restore handler, starts the agent, and on pods of
memhog (a process holding N MiB of live memory and printing `tick N` every
5 ms) measures, in interleaved runs after an untimed warm-up round:

  * checkpoints: the agent's CLI, bare `runc checkpoint --leave-running`, and
    `runc checkpoint` followed by `tar | zstd -1 -T0` into a fsynced file,
    with each one's frozen window taken from the ticker's CRI log;
  * a pod of two containers: the agent's pod-wide cut against the two bare
    dumps one after the other;
  * restores: the agent's `restore --start` against the same restore plan
    (the checkpoint's images already unpacked in a local directory) handed to
    the same runtime handler through plain CRI calls;
  * the store bytes a repeated checkpoint of an unchanged workload adds, and
    the agent's peak RSS during the largest checkpoint;
  * on containerd 2.x, against containerd's own CRI path (bench/scenarios/native.py):
    CheckpointContainer into an archive, and the restore of that archive
    through CreateContainer in a fresh sandbox, on fresh random memory;
  * time to first answer (bench/scenarios/firstanswer.py): a numpy model server from
    the bed's Debian image (weights of --answer-sizes MiB, one bed image per
    size) restored with the agent's default and with --full, against the
    same plan from local disk and a cold start, each until its first answer
    over HTTP, timed from the moment the request reaches the agent (or
    RunPodSandbox), the CLI's start-up excluded and measured on its own; at
    the smallest size also N replicas one after another, all kept running.

It prints the tables, writes every raw sample as JSON (--out, which keeps the
latest run of every other containerd version too) and, with --write-docs,
rewrites docs/benchmarks.md's generated blocks with all of them. Everything
it creates (pods, checkpoints, archives, the loopback registry and its image,
temporary directories, the test bed unless --keep) is removed, also on errors
and on SIGINT/SIGTERM. docs/benchmarks.md says how each number is measured.
The measurements are bench/suite.py's scenarios (bench/scenarios/), on the
environment of bench/harness/.
"""

from __future__ import annotations

import argparse
import os
import sys

from bench.report.results import RESULTS_JSON
from bench.suite import main as run_suite
from testbed.bed import CONTAINERD2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--sizes", default="64,256,1024", help="MiB held by the one-container pods (default 64,256,1024)")
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs per workload (default 5)")
    ap.add_argument("--pair", type=int, default=512, help="MiB per container of the two-container pod (default 512)")
    ap.add_argument("--repeat-mib", type=int, default=256, help="MiB of the unchanged workload checkpointed repeatedly")
    ap.add_argument("--out", default=str(RESULTS_JSON), help="JSON with every raw sample")
    ap.add_argument("--write-docs", action="store_true", help="rewrite docs/benchmarks.md's generated blocks with these results")
    ap.add_argument("--note", default="", help="a line for docs/benchmarks.md about the conditions of this run")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 16 MiB, one run of each, short pauses")
    ap.add_argument("--keep", action="store_true", help="leave the test bed (and the store) in place")
    ap.add_argument("--bed", default=os.environ.get("NODE_AGENT_BENCH_BED", "na-bench"),
                    help="test bed name (default $NODE_AGENT_BENCH_BED or na-bench)")
    ap.add_argument("--workdir", help="agent config, store and scratch (default /var/lib/node-agent-bench/BED)")
    ap.add_argument("--attach", metavar="AGENT_CONFIG",
                    help="use the running test bed --bed and the agent already serving with this config "
                         "(neither is restarted or removed; peak RSS is then since that agent's start)")
    ap.add_argument("--agent-pid", type=int, help="with --attach: the agent's pid (default: found by its config)")
    ap.add_argument("--replicas", type=int, default=None,
                    help="lazy replicas stamped out from the largest size's checkpoint (default 10; --quick 2)")
    ap.add_argument("--settle", type=float, default=None, help="seconds of quiet between operations (default 1)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed rounds of every operation on each workload before the runs (default 1)")
    ap.add_argument("--containerd", default=CONTAINERD2,
                    help=f"the containerd binary of the test bed (default {CONTAINERD2}; the system's: "
                         "/usr/bin/containerd); with --attach, the bed's own")
    ap.add_argument("--native-sizes", default="256,1024",
                    help="MiB of fresh random memory for the comparison with containerd's own CRI checkpoint "
                         "and restore (containerd 2.x; default 256,1024; --quick 16)")
    ap.add_argument("--no-native", action="store_true", help="skip the comparison with containerd's own path")
    ap.add_argument("--answer-sizes", default="256,2048",
                    help="MiB of model weights for the time-to-first-answer table, one bed image each (default "
                         "256,2048; --quick 64; with --attach only the bed's own weights are measured)")
    ap.add_argument("--answer-runs", type=int, default=None,
                    help="interleaved first-answer runs below 1024 MiB of weights (default --runs)")
    ap.add_argument("--answer-large-runs", type=int, default=1,
                    help="interleaved first-answer runs at 1024 MiB of weights and more (default 1)")
    ap.add_argument("--answer-replicas", type=int, default=None,
                    help="replicas of the smallest model checkpoint restored one after another, all kept "
                         "running (default 10; --quick 2)")
    ap.add_argument("--no-answer", action="store_true", help="skip the time-to-first-answer table")
    ap.add_argument("--answer-only", action="store_true", help="measure only the time-to-first-answer table")
    ap.add_argument("--docs-only", action="store_true",
                    help="measure nothing: rewrite docs/benchmarks.md from the runs in --out")
    args = ap.parse_args(argv)
    try:
        args.sizes = sorted({int(s) for s in str(args.sizes).split(",") if s.strip()})
        args.native_sizes = sorted({int(s) for s in str(args.native_sizes).split(",") if s.strip()})
        args.answer_sizes = sorted({int(s) for s in str(args.answer_sizes).split(",") if s.strip()})
    except ValueError:
        ap.error("--sizes, --native-sizes, --answer-sizes: comma-separated MiB, e.g. 64,256,1024")
    if args.quick:
        explicit = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        if "--sizes" not in explicit:
            args.sizes = [16]
        if "--native-sizes" not in explicit:
            args.native_sizes = [16]
        if "--runs" not in explicit:
            args.runs = 1
        if "--pair" not in explicit:
            args.pair = 16
        if "--repeat-mib" not in explicit:
            args.repeat_mib = 16
        if "--answer-sizes" not in explicit:
            args.answer_sizes = [64]
    if args.settle is None:
        args.settle = 0.1 if args.quick else 1.0
    if args.replicas is None:
        args.replicas = 2 if args.quick else 10
    if args.answer_replicas is None:
        args.answer_replicas = 2 if args.quick else 10
    if args.answer_runs is None:
        args.answer_runs = args.runs
    if args.no_answer:
        if args.answer_only:
            ap.error("--no-answer and --answer-only exclude each other")
        args.answer_sizes = []
    if args.answer_sizes and (min(args.answer_sizes) < 1 or args.answer_runs < 1 or args.answer_large_runs < 1
                              or args.answer_replicas < 0):
        ap.error("--answer-sizes, --answer-runs, --answer-large-runs must be positive, --answer-replicas not negative")
    if args.warmup is None:
        args.warmup = 0 if args.quick else 1
    if args.warmup < 0:
        ap.error("--warmup must not be negative")
    if not args.sizes or min(args.sizes) < 1 or args.runs < 1 or args.pair < 1 or args.repeat_mib < 1:
        ap.error("sizes, runs, pair and repeat-mib must be positive")
    if not args.no_native and (not args.native_sizes or min(args.native_sizes) < 1):
        ap.error("--native-sizes must be positive")
    if not args.attach and args.containerd and not os.access(args.containerd, os.X_OK):
        ap.error(f"--containerd {args.containerd}: not an executable (scripts/install-host installs 1.7 and 2.1)")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_suite(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
