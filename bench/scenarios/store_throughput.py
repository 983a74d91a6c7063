"""The checkpoint store's own throughput: one file in, one file out (bench/store_throughput.py's measurement)."""


from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from node_agent.store import Store

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


def main(args: argparse.Namespace) -> int:
    """bench/store_throughput.py once its arguments are parsed."""
    kinds = args.kinds.split(",")
    with tempfile.TemporaryDirectory(prefix="store-bench-", dir=args.dir) as work:
        for kind in kinds:
            print(measure(Path(work), kind, args.mib), flush=True)
    return 0
