"""The store's pipeline keeps memory flat (its throughput is measured by bench/store_throughput.py)."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from node_agent.store import Store

MiB = 1 << 20
SPAWN = multiprocessing.get_context("spawn")
SIZE = 256 * MiB


def _write_mixed(path: Path, size: int) -> None:
    """Random, zero and text blocks: a memory image's mix of pages."""
    text = b"".join(b"%08d some regular text\n" % i for i in range(MiB // 24 + 1))[:MiB]
    with open(path, "wb") as fh:
        for i in range(size // MiB):
            fh.write((os.urandom(MiB), bytes(MiB), text)[i % 3])


def _measure(root: str, src: str, out: Any) -> None:
    """In a fresh process: checkpoint ``src`` and materialize it; report peak RSS growth and what was stored."""
    proc = psutil.Process()
    store = Store(root)
    baseline = proc.memory_info().rss
    peak = [baseline]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, name="rss-sampler")
    sampler.start()
    try:
        with store.writer() as w:
            w.add_file("f", src)
            rec = w.commit({})
        dest = os.path.join(root, "..", "dest-" + os.path.basename(src))
        os.mkdir(dest)
        store.materialize(rec.id, dest)
    finally:
        stop.set()
        sampler.join()
    out.put({"growth": peak[0] - baseline, "stored": rec.stored_size, "size": rec.size})


def _run(root: Path, src: Path) -> dict[str, Any]:
    out = SPAWN.Queue()
    proc = SPAWN.Process(target=_measure, args=(str(root), str(src), out), name="measure")
    proc.start()
    try:
        result: dict[str, Any] = out.get(timeout=300)
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    return result


def test_rss_stays_flat_while_checkpointing(tmp_path: Path) -> None:
    src = tmp_path / "mixed.img"
    _write_mixed(src, SIZE)
    result = _run(tmp_path / "store", src)
    with open(tmp_path / "dest-mixed.img" / "f", "rb") as a, open(src, "rb") as b:
        while True:
            x, y = a.read(8 * MiB), b.read(8 * MiB)
            assert x == y
            if not x:
                break
    assert result["growth"] < 100 * MiB, f"RSS grew by {result['growth'] >> 20} MiB"
    assert result["stored"] < SIZE * 0.6

