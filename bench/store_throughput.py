#!/usr/bin/env python3
"""The checkpoint store's own throughput on this machine: one file in, one file out.

    .venv/bin/python bench/store_throughput.py [--mib 256] [--kinds random,zeros,mixed] [--dir DIR]

Needs no test bed and no root. For each kind of content it writes a file of
that many MiB, checkpoints it into a fresh store (chunking, hashing,
compressing, and the commit's fsyncs) and materializes it again, and prints
MB/s for both and the bytes stored. `random` cannot be compressed or
deduplicated, `zeros` is nothing but duplicates, `mixed` takes turns of
random, zero and text MiB like a memory image. The numbers follow the disk
and the cores, so they are printed, never checked; docs/store.md shows a
measured table. Everything it writes lies in a temporary directory under
--dir (default: the system's), removed at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node_agent.store import Store  # noqa: E402

MiB = 1 << 20
TEXT = b"".join(b"%08d some regular text\n" % i for i in range(MiB // 24 + 1))[:MiB]


def block(kind: str, i: int) -> bytes:
    """The `i`th MiB of a file of `kind`."""
    if kind == "mixed":
        kind = ("random", "zeros", "text")[i % 3]
    return os.urandom(MiB) if kind == "random" else bytes(MiB) if kind == "zeros" else TEXT


def measure(work: Path, kind: str, mib: int) -> str:
    src = work / f"{kind}.img"
    with open(src, "wb") as fh:
        for i in range(mib):
            fh.write(block(kind, i))
    store = Store(str(work / f"store-{kind}"))
    t0 = time.perf_counter()
    with store.writer() as w:
        w.add_file("f", str(src))
        rec = w.commit({})
    t1 = time.perf_counter()
    dest = work / f"dest-{kind}"
    dest.mkdir()
    store.materialize(rec.id, str(dest))
    t2 = time.perf_counter()
    size = mib * MiB
    return (f"{kind:7} {mib} MiB on {os.cpu_count()} cores: checkpoint {size / (t1 - t0) / 1e6:.0f} MB/s, "
            f"materialize {size / (t2 - t1) / 1e6:.0f} MB/s, stored {rec.stored_size / MiB:.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/store_throughput.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="size of each file (default 256)")
    ap.add_argument("--kinds", default="random,zeros", help="comma-separated: random, zeros, mixed (default random,zeros)")
    ap.add_argument("--dir", default=None, help="where the temporary directory goes")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    if bad := [k for k in kinds if k not in ("random", "zeros", "mixed")]:
        ap.error(f"unknown kind {bad[0]!r}")
    with tempfile.TemporaryDirectory(prefix="store-bench-", dir=args.dir) as work:
        for kind in kinds:
            print(measure(Path(work), kind, args.mib), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
