#!/usr/bin/env python3
"""What sealing costs the store on this machine, step by step: the CPU behind bench/encryption.py's figures.

    .venv/bin/python bench/seal_cost.py [--mib 1024] [--dir DIR] [--repeat 3]

Needs no test bed and no root. On N MiB of random content (memory pages
cannot be compressed) it times, on one thread and in the store's own chunk
size, each step a chunk goes through when it is stored: the compressibility
probe (`codec.encode`), the sha256 of the stored bytes (paid in the clear
too), and what sealing adds: the sha256 of the plaintext, the AES-256-GCM
encryption itself, and the copies around it (`SealKey.seal` whole); then
opening (`SealKey.open`) as a restore does. Then, with every core, it
checkpoints one file of N MiB into a fresh store in the clear and sealed
(the commit's fsyncs included) and materializes each again, as the agent's
ingest and a full restore do, with the CPU time they took. Each figure is
the best of --repeat. The
numbers follow the cores and the disk, so they are printed, never checked.
Everything it writes lies in a temporary directory under --dir, removed at
the end.
"""

from __future__ import annotations

import argparse
import sys

from bench.scenarios.seal_cost import main as measure


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/seal_cost.py", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--mib", type=int, default=1024, help="MiB of random content (default 1024)")
    ap.add_argument("--repeat", type=int, default=3, help="take the best of this many (default 3)")
    ap.add_argument("--dir", default=None, help="where the temporary directory goes")
    args = ap.parse_args(argv)
    if args.mib < 1 or args.repeat < 1:
        ap.error("--mib and --repeat must be positive")
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
