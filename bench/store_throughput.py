#!/usr/bin/env python3
"""The checkpoint store's own throughput on this machine: one file in, one file out.

    .venv/bin/python bench/store_throughput.py [--mib 256] [--kinds random,zeros,mixed] [--dir DIR]
        [--chunk-sizes 1024,4096] [--dirty 20]

Needs no test bed and no root. For each kind of content it writes a file of
that many MiB, checkpoints it into a fresh store (chunking, hashing,
compressing, and the commit's fsyncs) and materializes it again, and prints
MB/s for both and the bytes stored. `random` cannot be compressed or
deduplicated, `zeros` is nothing but duplicates, `mixed` takes turns of
random, zero and text MiB like a memory image. The numbers follow the disk
and the cores, so they are printed, never checked; docs/store.md shows a
measured table. ``--chunk-sizes`` (KiB) repeats each kind for stores cut at
those averages; ``--dirty N`` then checkpoints the file again after N of its
pages, spread evenly, changed one word each (a running process between two
checkpoints), and prints what that second checkpoint added to the store.
Everything it writes lies in a temporary directory under
--dir (default: the system's), removed at the end.
"""

from __future__ import annotations

import argparse
import sys

from bench.scenarios.store_throughput import main as measure


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/store_throughput.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="size of each file (default 256)")
    ap.add_argument("--kinds", default="random,zeros", help="comma-separated: random, zeros, mixed (default random,zeros)")
    ap.add_argument("--dir", default=None, help="where the temporary directory goes")
    ap.add_argument("--chunk-sizes", default="", help="KiB, comma-separated: the stores' chunking averages "
                    "(default: the store's own)")
    ap.add_argument("--dirty", type=int, default=0, help="pages changed before a second checkpoint (default 0: none)")
    args = ap.parse_args(argv)
    try:
        args.chunk_sizes = [int(n) << 10 for n in args.chunk_sizes.split(",") if n.strip()]
    except ValueError:
        ap.error(f"--chunk-sizes: not a list of KiB: {args.chunk_sizes!r}")
    kinds = args.kinds.split(",")
    if bad := [k for k in kinds if k not in ("random", "zeros", "mixed")]:
        ap.error(f"unknown kind {bad[0]!r}")
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
