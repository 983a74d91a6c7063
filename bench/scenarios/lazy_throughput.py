"""What bounds a lazy restore's transfer: the page source's stages, each alone (bench/lazy_throughput.py's
measurement)."""


from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from node_agent.lazy import uffd
from node_agent.lazy.chunks import ChunkCache
from node_agent.lazy.fault_handler import Handler
from node_agent.lazy.source import Source, accept_restore
from node_agent.store import Store
from testbed.lazyimages import LAZY, PAGE, UFFD_PROCESS, mm_image, pagemap_image

PAGES_PATH = "containers/c/checkpoint/pages-1.img"


def _read_verify(store: Store, cid: str, size: int) -> float:
    entry = store.get(cid).entry(PAGES_PATH)
    with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:  # as the page source sizes it
        cache = ChunkCache(store.chunks, cid, entry, pool)
        t = time.monotonic()
        for _piece in cache.pieces(0, size):
            pass
        return time.monotonic() - t


def _copy(size: int) -> float:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.syscall.restype = ctypes.c_long
    addr = libc.mmap(None, size, 3, 0x22, -1, 0)
    fd = libc.syscall(323, os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        api = (ctypes.c_uint64 * 3)(0xAA, 0, 0)
        assert libc.ioctl(fd, ctypes.c_ulong((3 << 30) | (24 << 16) | (0xAA << 8) | 0x3F), api) == 0
        reg = (ctypes.c_uint64 * 4)(addr, size, 1, 0)
        assert libc.ioctl(fd, ctypes.c_ulong((3 << 30) | (32 << 16) | (0xAA << 8) | 0x00), reg) == 0
        window = 1 << 20
        src = os.urandom(window)
        base = uffd.address_of(src)
        t = time.monotonic()
        for off in range(0, size, window):
            _n, err = uffd.copy(fd, addr + off, base, min(window, size - off))
            assert err == 0, os.strerror(err)
        return time.monotonic() - t
    finally:
        os.close(fd)
        libc.munmap(addr, size)


def _handler(root: Path, pages: int, read: bool) -> float:
    proc = subprocess.Popen([sys.executable, str(UFFD_PROCESS), "42", str(pages)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    work = Path(tempfile.mkdtemp(dir=root))
    try:
        addr = int(proc.stdout.readline(), 16)
        store = Store(work / "store")
        with store.writer() as w:
            w.add_bytes("containers/c/checkpoint/pagemap-42.img", pagemap_image([(addr, pages, LAZY)]))
            w.add_bytes(PAGES_PATH, os.urandom(pages * PAGE))
            record = w.commit({"kind": "bench"})
        images = work / "images"
        images.mkdir()
        (images / "pagemap-42.img").write_bytes(pagemap_image([(addr, pages, LAZY)]))
        (images / "mm-42.img").write_bytes(mm_image([(addr, addr + pages * PAGE)]))
        source = Source(store, record.id, "c", str(images))
        handler = Handler(source.maps, source.files, str(images), lambda fd, task: None)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(work / "s"))
        listener.listen(1)
        took: list[float] = []

        def serve() -> None:
            conn = accept_restore(listener, 30)
            t = time.monotonic()
            handler.run(conn)
            took.append(time.monotonic() - t)
            conn.close()

        th = threading.Thread(target=serve)
        th.start()
        proc.stdin.write(f"connect {work / 's'}\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ok"
        if read:
            proc.stdin.write(f"hash 0 {pages}\n")
            proc.stdin.flush()
            proc.stdout.readline()
        th.join()
        handler.close()
        source.close()
        listener.close()
        return took[0]
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
        shutil.rmtree(work, ignore_errors=True)


def main(args: argparse.Namespace) -> int:
    """bench/lazy_throughput.py once its arguments are parsed."""
    size = args.mib << 20
    root = Path(tempfile.mkdtemp(prefix="na-lazy-throughput-"))
    try:
        store = Store(root / "store")
        with store.writer() as w:
            w.add_bytes(PAGES_PATH, os.urandom(size))
            cid = w.commit({"kind": "bench"}).id
        rows: dict[str, list[float]] = {"read + verify": [], "UFFDIO_COPY": [], "handler, idle": [],
                                        "handler, read": []}
        for _ in range(args.runs):  # interleaved
            rows["read + verify"].append(_read_verify(store, cid, size))
            rows["UFFDIO_COPY"].append(_copy(size))
            rows["handler, idle"].append(_handler(root, size // PAGE, read=False))
            rows["handler, read"].append(_handler(root, size // PAGE, read=True))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.mib} MiB of incompressible pages, median of {args.runs} interleaved runs, {os.cpu_count()} cores")
    print(f"{'stage':<16}  {'seconds':>8}  {'MB/s':>8}")
    for name, times in rows.items():
        med = statistics.median(times)
        print(f"{name:<16}  {med:8.3f}  {size / med / 1e6:8.0f}")
    return 0
