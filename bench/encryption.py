#!/usr/bin/env python3
"""The cost of encryption at rest: the same checkpoints and restores with and without it, on one agent.

    .venv/bin/python bench/encryption.py [--runs 3] [--out bench/encryption.json] [--write-docs] [--keep]
                                         [--bed na-bench-enc] [--workdir DIR] [--mib 1024] [--repeat-mib 256]
                                         [--answer-mib 256] [--warmup 1] [--settle 1] [--quiet-wait 60]
                                         [--containerd PATH] [--note TEXT] [--docs-only]

As root. It brings up one test bed (scripts/testbed, --bed, default
na-bench-enc) and one agent whose config has an `encryption` section: a
keyring file with one key for the domain `benchteam`, which holds the
namespaces `bench` and `bench-r`. Pods in `bench` are therefore checkpointed
encrypted (AES-256-GCM, chunks and config blob) and restored into
`bench-r`; the same pods in `plain` (restored into `plain-r`) are in no
domain with a key and stay in the clear. The two variants differ only by
namespace: same agent, same store, same settings, same workload. In every
run the clear variant goes first, then the encrypted one (for the 1 GiB pod:
the clear checkpoint, its restore and its removal, then the same encrypted,
so no checkpoint directly follows another one), after untimed warm-up
rounds (--warmup), each round started once the machine is nearly
idle (waiting at most --quiet-wait seconds); every figure is the median
over --runs:

  * a memhog pod of --mib MiB (default 1024): the agent's checkpoint until it
    returns (durable), its frozen window from the ticker's CRI log (and the
    agent's frozen_ms), then the full `restore --start` of that checkpoint
    until running (the harness's agent_checkpoint and agent_restore); each
    checkpoint is removed before the next one, so every one stores the
    whole workload;
  * the store bytes a repeated checkpoint of an unchanged memhog of
    --repeat-mib MiB (default 256) adds, the previous one still stored
    (as bench/run.py's repeat measurement);
  * the first answer of a restored numpy model server with --answer-mib MiB
    of weights (default 256): the agent's Restore with start and no lazy
    option, until its first answer (bench/scenarios/firstanswer.py's "default" column),
    each replica checked to be the checkpointed process.

Every checkpoint is checked from outside: `checkpoints inspect` must show the
key id for the encrypted variant and none for the clear one, and every blob
the checkpoint added to the store must start with the sealed-blob header
(`NAS2`) for the encrypted variant, but for its manifest (a JSON document,
never sealed); the clear variant adds no sealed blob. It prints the medians
and the ratios (encrypted / clear, limit 1.15x; repeated-checkpoint growth,
limit 5%), writes every raw sample to --out and, with --write-docs, regenerates
docs/benchmarks.md (its "encryption" block from bench/encryption.json).
Everything it creates (pods, checkpoints, the bed unless --keep, its work
dir) is removed at the end, also on errors and on SIGINT/SIGTERM. The
measurement is bench/scenarios/encryption.py.
"""

from __future__ import annotations

import argparse
import os
import sys

from bench.report.results import ENCRYPTION_JSON
from bench.scenarios.encryption import DEFAULT_BED
from bench.scenarios.encryption import main as run_encryption
from testbed.bed import CONTAINERD2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/encryption.py", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs of each measurement (default 3)")
    ap.add_argument("--out", default=str(ENCRYPTION_JSON), help="JSON with every raw sample")
    ap.add_argument("--write-docs", action="store_true",
                    help="regenerate docs/benchmarks.md (its Encryption section from --out, the rest from "
                         "bench/results.json)")
    ap.add_argument("--docs-only", action="store_true", help="measure nothing: regenerate docs/benchmarks.md")
    ap.add_argument("--keep", action="store_true", help="leave the test bed (and the store) in place")
    ap.add_argument("--bed", default=DEFAULT_BED, help=f"test bed name (default {DEFAULT_BED})")
    ap.add_argument("--workdir", help="agent config, keyring, store and scratch (default /var/lib/node-agent-bench/BED)")
    ap.add_argument("--containerd", default=CONTAINERD2, help=f"the test bed's containerd binary (default {CONTAINERD2})")
    ap.add_argument("--mib", type=int, default=1024, help="MiB of the memhog pod checkpointed and restored (default 1024)")
    ap.add_argument("--repeat-mib", type=int, default=256,
                    help="MiB of the unchanged memhog checkpointed repeatedly (default 256)")
    ap.add_argument("--answer-mib", type=int, default=256,
                    help="MiB of the model server's weights (the bed's image; default 256)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds before the runs (default 1)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of quiet between operations (default 1)")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="before each round, wait at most this many seconds for a nearly idle machine (default 60; "
                         "0: do not wait)")
    ap.add_argument("--note", default="", help="a line for docs/benchmarks.md about the conditions of this run")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.warmup < 0 or min(args.mib, args.repeat_mib, args.answer_mib) < 1:
        ap.error("--runs and the sizes must be positive, --warmup not negative")
    if not args.docs_only and not os.access(args.containerd, os.X_OK):
        ap.error(f"--containerd {args.containerd}: not an executable (scripts/install-host installs it)")
    # What the harness's Bench reads: its own bed, the model image's size, no attached agent.
    args.attach = None
    args.agent_pid = None
    args.answer_sizes = [args.answer_mib]
    return args


def main(argv: list[str] | None = None) -> int:
    return run_encryption(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
