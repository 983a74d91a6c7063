"""What sealing costs the store, step by step (bench/seal_cost.py's measurement)."""


from __future__ import annotations

import argparse
import hashlib
import os
import resource
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from node_agent.store import DEFAULT_CHUNK_SIZE, Store, codec, sealing

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


def main(args: argparse.Namespace) -> int:
    """bench/seal_cost.py once its arguments are parsed."""
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
