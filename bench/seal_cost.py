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
import hashlib
import os
import resource
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402

from node_agent.store import DEFAULT_CHUNK_SIZE, Store, codec, sealing  # noqa: E402

MiB = 1 << 20


def best(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def each(fn: Callable[[bytes, bytes], object], chunks: list[bytes], digests: list[bytes]) -> Callable[[], None]:
    """One pass of `fn` over every chunk, each result dropped at once (as the store's workers do)."""
    def go() -> None:
        for c, d in zip(chunks, digests):
            fn(c, d)
    return go


def steps(chunks: list[bytes], key: sealing.SealKey, repeat: int) -> list[tuple[str, float]]:
    digests = [hashlib.sha256(c).digest() for c in chunks]
    # Random chunks are stored as they are: the sealed bytes are the plaintext, whose digest the
    # store's pipeline hands the seal (its key derives from it), as here.
    sealed = [key.seal(sealing.CHUNK, c, d, data_digest=d) for c, d in zip(chunks, digests)]
    aes = AESGCM(secrets.token_bytes(32))
    nonce = secrets.token_bytes(12)
    return [
        ("probe and encode (codec.encode)", best(repeat, each(lambda c, d: codec.encode(c), chunks, digests))),
        ("sha256 of the stored bytes (clear too)",
         best(repeat, each(lambda c, d: hashlib.sha256(c).digest(), chunks, digests))),
        ("sealed only: sha256 of the plaintext", best(repeat, each(lambda c, d: sealing.plain_digest(c), chunks, digests))),
        ("sealed only: AES-256-GCM encrypt alone",
         best(repeat, each(lambda c, d: aes.encrypt(nonce, c, b""), chunks, digests))),
        ("sealed only: a copy of the chunk", best(repeat, each(lambda c, d: bytes(memoryview(c)), chunks, digests))),
        ("sealed only: SealKey.seal whole",
         best(repeat, each(lambda c, d: key.seal(sealing.CHUNK, c, d, data_digest=d),
                           chunks, digests))),
        ("restore: SealKey.open whole", best(repeat, each(lambda s, d: key.open(sealing.CHUNK, s, d), sealed, digests))),
    ]


def cpu() -> tuple[float, float]:
    """This process's user and system CPU time, every thread."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def spent(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return b[0] - a[0], b[1] - a[1]


def store_round(work: Path, src: Path, key: sealing.SealKey | None,
                repeat: int) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """(wall, user CPU, system CPU) seconds of the fastest checkpoint and of the fastest materialize."""
    ring = sealing.StaticKeyring([key] if key else [])
    ins, outs = [], []
    for i in range(repeat):
        store = Store(str(work / f"store-{i}"), keys=ring)
        t0, c0 = time.perf_counter(), cpu()
        with store.writer(seal=key) as w:
            w.add_file("f", str(src))
            rec = w.commit({})
        t1, c1 = time.perf_counter(), cpu()
        dest = work / f"dest-{i}"
        dest.mkdir()
        store.materialize(rec.id, str(dest))
        t2, c2 = time.perf_counter(), cpu()
        ins.append((t1 - t0, *spent(c0, c1)))
        outs.append((t2 - t1, *spent(c1, c2)))
        shutil.rmtree(dest)
        shutil.rmtree(work / f"store-{i}")
        os.sync()
    return min(ins), min(outs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/seal_cost.py", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--mib", type=int, default=1024, help="MiB of random content (default 1024)")
    ap.add_argument("--repeat", type=int, default=3, help="take the best of this many (default 3)")
    ap.add_argument("--dir", default=None, help="where the temporary directory goes")
    args = ap.parse_args(argv)
    if args.mib < 1 or args.repeat < 1:
        ap.error("--mib and --repeat must be positive")
    key = sealing.SealKey("bench-1", secrets.token_bytes(32), "bench")
    n = max(1, args.mib * MiB // DEFAULT_CHUNK_SIZE)
    chunks = [os.urandom(DEFAULT_CHUNK_SIZE) for _ in range(n)]
    gib = n * DEFAULT_CHUNK_SIZE / (1 << 30)
    print(f"{n} chunks of {DEFAULT_CHUNK_SIZE // 1024} KiB ({gib * 1024:.0f} MiB), one thread, best of {args.repeat}:")
    for what, secs in steps(chunks, key, args.repeat):
        print(f"  {what:42} {secs:6.3f} s  ({secs / gib:.3f} s per GiB)", flush=True)
    del chunks
    with tempfile.TemporaryDirectory(prefix="seal-bench-", dir=args.dir) as tmp:
        work = Path(tmp)
        src = work / "random.img"
        with open(src, "wb") as fh:
            for _ in range(args.mib):
                fh.write(os.urandom(MiB))
        print(f"a store on {os.cpu_count()} cores, one file of {args.mib} MiB, best of {args.repeat}:")
        for label, k in (("clear", None), ("sealed", key)):
            w, m = store_round(work, src, k, args.repeat)
            print(f"  {label:7} checkpoint (commit durable) {w[0]:6.3f} s (CPU user {w[1]:.2f} s, system "
                  f"{w[2]:.2f} s), materialize {m[0]:6.3f} s (CPU user {m[1]:.2f} s, system {m[2]:.2f} s)",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
