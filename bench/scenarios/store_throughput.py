"""The checkpoint store's own throughput: one file in, one file out (bench/store_throughput.py's measurement)."""


from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from node_agent.store import DEFAULT_CHUNK_SIZE, Store

MiB = 1 << 20
PAGE = 4096
TEXT = b"".join(b"%08d some regular text\n" % i for i in range(MiB // 24 + 1))[:MiB]


def block(kind: str, i: int) -> bytes:
    """The `i`th MiB of a file of `kind`."""
    if kind == "mixed":
        kind = ("random", "zeros", "text")[i % 3]
    return os.urandom(MiB) if kind == "random" else bytes(MiB) if kind == "zeros" else TEXT


def measure(work: Path, kind: str, mib: int, chunk_size: int = DEFAULT_CHUNK_SIZE, dirty: int = 0) -> str:
    """One file of ``kind`` checkpointed into a fresh store cut at ``chunk_size`` and materialized again; with
    ``dirty``, checkpointed once more after that many of its pages, spread evenly, each had one word changed."""
    src = work / f"{kind}.img"
    if not src.exists():
        with open(src, "wb") as fh:
            for i in range(mib):
                fh.write(block(kind, i))
    store = Store(str(work / f"store-{kind}-{chunk_size}"), chunk_size=chunk_size)
    t0 = time.perf_counter()
    with store.writer() as w:
        w.add_file("f", str(src))
        rec = w.commit({})
    t1 = time.perf_counter()
    dest = work / f"dest-{kind}-{chunk_size}"
    dest.mkdir()
    store.materialize(rec.id, str(dest))
    t2 = time.perf_counter()
    size = mib * MiB
    line = (f"{kind:7} {mib} MiB on {os.cpu_count()} cores, chunks of {chunk_size / MiB:g} MiB on average "
            f"({len(rec.entry('f').chunks)}): checkpoint {size / (t1 - t0) / 1e6:.0f} MB/s, "
            f"materialize {size / (t2 - t1) / 1e6:.0f} MB/s, stored {rec.stored_size / MiB:.1f} MiB")
    if dirty:
        changed = dest / "f"
        pages = size // PAGE
        with open(changed, "r+b") as fh:
            for n in range(dirty):
                fh.seek((n * pages // dirty) * PAGE + PAGE // 2)
                word = fh.read(8)
                fh.seek(-8, os.SEEK_CUR)
                fh.write(bytes(b ^ 0xFF for b in word))
        before = store.usage()
        with store.writer() as w:
            w.add_file("f", str(changed))
            w.commit({"n": 2})
        added = store.usage() - before
        line += f"; {dirty} pages changed: the next checkpoint stores {added / MiB:.1f} MiB more ({added / size:.1%})"
    return line


def main(args: argparse.Namespace) -> int:
    """bench/store_throughput.py once its arguments are parsed."""
    kinds = args.kinds.split(",")
    with tempfile.TemporaryDirectory(prefix="store-bench-", dir=args.dir) as work:
        for kind in kinds:
            for chunk_size in args.chunk_sizes or [DEFAULT_CHUNK_SIZE]:
                print(measure(Path(work), kind, args.mib, chunk_size, args.dirty), flush=True)
    return 0
