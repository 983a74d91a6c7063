"""What bounds a lazy restore's transfer: the page source's stages, each alone (bench/lazy_throughput.py's
measurement)."""


from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from bench.harness.machine import memory_given_back
from bench.scenarios.crossnode_paths import CpuLog, get_bound
from criu_bridge import resumegate
from node_agent.config.loading import from_mapping
from node_agent.config.schema import RegistrySettings
from node_agent.lazy import uffd
from node_agent.lazy.remote import memory_chunks
from node_agent.lazy.chunks import ChunkCache
from node_agent.lazy.fault_handler import Handler
from node_agent.lazy.restores import LazyRestores
from node_agent.lazy.source import Source, accept_restore
from node_agent.lazy.staging import read_memory
from node_agent.registry import Credentials, pull, push
from node_agent.registry.fetching import RemoteBlobs
from node_agent.store import DEFAULT_CHUNK_SIZE, Store
from testbed.lazyimages import LAZY, PAGE, UFFD_PROCESS, mm_image, pagemap_image
from testbed.registry import Registry

PAGES_PATH = "containers/c/checkpoint/pages-1.img"
Span = tuple[float, float]
"""When a stage began (monotonic seconds), and how long it took."""


class _Remote:
    """The checkpoint pushed to a loopback docker-registry, and pulled from it lazily (its pages left there) by
    as many stores as asked for: each reads them from the registry as a page source on another node would."""

    def __init__(self, registry: Registry, store: Store, cid: str, tag: str = "pages") -> None:
        self.registry = registry
        self.settings = RegistrySettings()
        self.reference = registry.ref(f"bench/lazy:{tag}")
        push(store, cid, self.reference, Credentials(plain_http=True), settings=self.settings)
        self.blobs = [(c.digest, c.stored_size) for c in store.get(cid).entry(PAGES_PATH).chunks]

    def pulled(self, root: Path) -> tuple[Store, str, dict[str, object]]:
        """A new store at ``root`` with the checkpoint pulled lazily, able to fetch its pages; its id, its origin."""
        store = Store(root)
        report = pull(store, self.reference, Credentials(plain_http=True), settings=self.settings,
                      defer=functools.partial(memory_chunks, store))
        store.origins.fetcher = RemoteBlobs(store, settings=self.settings, retry_for=60.0)
        store.origins.fetch_lanes = self.settings.connections
        origin = store.origins.get(report.checkpoint_id)
        assert origin is not None, "the lazy pull recorded no origin"
        return store, report.checkpoint_id, origin


def _get(remote: _Remote) -> Span:
    """The registry's own bound: every chunk read by a bare client over as many connections, and discarded."""
    bound = get_bound(remote.registry, "bench/lazy", remote.blobs, remote.settings.connections, 60)
    return bound["m0"], bound["s"]


def _pull(remote: _Remote, root: Path) -> Span:
    """A full pull of the registry's checkpoint into a new store at ``root`` (every chunk fetched and kept)."""
    t = time.monotonic()
    pull(Store(root), remote.reference, Credentials(plain_http=True), settings=remote.settings)
    return t, time.monotonic() - t


def _read_verify(store: Store, cid: str, size: int, remote: _Remote | None = None, root: Path | None = None) -> Span:
    """The pages file read through the page source's chunk cache, from ``store``, or, with ``remote``, from a
    new lazy pull of the registry's checkpoint at ``root``."""
    lanes = 1
    if remote is not None and root is not None:
        store, cid, origin = remote.pulled(root)
        lanes = remote.settings.connections
    entry = store.get(cid).entry(PAGES_PATH)
    with ThreadPoolExecutor(max(2, os.cpu_count() or 2, lanes)) as pool:  # as the page source sizes it
        fetch = store.origins.fetch_for(cid) if remote is not None else None
        cache = ChunkCache(store.chunks, cid, entry, pool, fetch, read_ahead=lanes)
        t = time.monotonic()
        for _piece in cache.pieces(0, size):
            pass
        return t, time.monotonic() - t


def _copy(size: int) -> Span:
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
        return t, time.monotonic() - t
    finally:
        os.close(fd)
        libc.munmap(addr, size)


@contextlib.contextmanager
def _uffd_process(root: Path, pages: int) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    """A process as CRIU's restore leaves one (testbed/lazyimages.py's UFFD_PROCESS) with ``pages`` pages of
    memory missing at the address it reports, and a work dir under ``root``; both gone afterwards."""
    proc = subprocess.Popen([sys.executable, str(UFFD_PROCESS), "42", str(pages)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    work = Path(tempfile.mkdtemp(dir=root))
    try:
        yield proc, int(proc.stdout.readline(), 16), work
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
        shutil.rmtree(work, ignore_errors=True)


def _plan_images(images: Path, addr: int, pages: int) -> None:
    """Task 42's pagemap and memory map in a restore plan's ``images``: ``pages`` lazy pages at ``addr``."""
    images.mkdir(parents=True)
    (images / "pagemap-42.img").write_bytes(pagemap_image([(addr, pages, LAZY)]))
    (images / "mm-42.img").write_bytes(mm_image([(addr, addr + pages * PAGE)]))


def _handler(root: Path, pages: int, read: bool, remote: _Remote | None = None) -> Span:
    """The fault handler filling a process of ``pages`` pages from a store of its own, or, with ``remote``,
    from a new lazy pull of the registry's checkpoint."""
    with _uffd_process(root, pages) as (proc, addr, work):
        assert proc.stdin is not None and proc.stdout is not None
        if remote is None:
            store = Store(work / "store")
            with store.writer() as w:
                w.add_bytes(PAGES_PATH, os.urandom(pages * PAGE))
                cid, origin, lanes = w.commit({"kind": "bench"}).id, None, 1
        else:
            store, cid, origin = remote.pulled(work / "store")
            lanes = remote.settings.connections
        images = work / "images"
        _plan_images(images, addr, pages)
        source = Source(store, cid, "c", str(images), origin, lanes=lanes)
        handler = Handler(source.maps, source.files, str(images), lambda fd, task: None)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(work / "s"))
        listener.listen(1)
        took: list[Span] = []

        def serve() -> None:
            conn = accept_restore(listener, 30)
            t = time.monotonic()
            handler.run(conn)
            took.append((t, time.monotonic() - t))
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


def _startup(root: Path, spare: bool) -> tuple[Span, float]:
    """A restore's page source until it serves, started as a new process or taken from a spare started ahead
    (`node_agent.lazy.spare`): from the session's start to the restored process's connection, made at once,
    being taken; and the CPU seconds the source used over it."""
    return asyncio.run(_startup_async(root, spare))


async def _startup_async(root: Path, spare: bool) -> tuple[Span, float]:
    pages = 256
    with _uffd_process(root, pages) as (proc, addr, work):
        assert proc.stdin is not None and proc.stdout is not None
        settings = from_mapping({"store": str(work / "s"), "runc-root": str(work / "r")})
        lazy = LazyRestores(settings)
        store = Store(settings.store)
        with store.writer() as w:
            w.add_bytes(PAGES_PATH, os.urandom(pages * PAGE))
            w.add_bytes("containers/c/checkpoint/pagemap-42.img", pagemap_image([(addr, pages, LAZY)]))
            record = w.commit({"kind": "bench"})
        plan = Path(settings.plans_dir) / "c0ffee"
        _plan_images(plan / "images", addr, pages)
        before = 0.0
        if spare:
            lazy.spare.prepare()
            while (pid := lazy.spare.pid) is None:
                await asyncio.sleep(0.01)
            before = await _settled(pid)

        async def exists() -> bool:
            return True

        t = time.monotonic()
        await lazy.start("op", store, record, "bench/startup", "c", "c0ffee", str(plan), callers=False,
                         exists=exists, memory=read_memory(store, record, ("c",))["c"])
        session = lazy._by_op["op"][0]
        work_dir = plan / "work"
        assert await asyncio.to_thread(resumegate.ask, str(work_dir / resumegate.MEMORY_SOCKET_NAME)) == "ok"
        proc.stdin.write(f"connect {work_dir / 'lazy-pages.socket'}\n")
        proc.stdin.flush()
        while not session.connected:
            await asyncio.sleep(0.001)
        took = time.monotonic() - t
        assert session._source is not None
        used = _cpu_seconds(session._source.pid) - before
        assert await asyncio.to_thread(proc.stdout.readline) == "ok\n"
        assert (await session.wait()).ok
        await lazy.shutdown()
        return (t, took), used


async def _settled(pid: int) -> float:
    """A spare's CPU seconds once it idles on its socket (its imports done): asleep, its CPU time unchanged."""
    spare = psutil.Process(pid)
    last, same = -1.0, 0
    while same < 5:
        await asyncio.sleep(0.05)
        now = _cpu_seconds(pid)
        same = same + 1 if now == last and spare.status() == psutil.STATUS_SLEEPING else 0
        last = now
    return last


def _cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def main(args: argparse.Namespace) -> int:
    """bench/lazy_throughput.py once its arguments are parsed."""
    size = args.mib << 20
    given_back = memory_given_back()
    root = Path(tempfile.mkdtemp(prefix="na-lazy-throughput-"))
    rows: dict[str, list[tuple[float, dict[str, float | None]]]] = {}
    startup: dict[str, list[tuple[Span, float]]] = {}
    try:
        pages = os.urandom(size)
        sizes = args.chunk_sizes or [DEFAULT_CHUNK_SIZE]
        stores: dict[int, tuple[Store, str]] = {}
        for chunk_size in sizes:
            store = Store(root / f"store-{chunk_size}", chunk_size=chunk_size)
            with store.writer() as w:
                w.add_bytes(PAGES_PATH, pages)
                stores[chunk_size] = (store, w.commit({"kind": "bench"}).id)
        store, cid = stores[sizes[0]]
        with contextlib.ExitStack() as stack:
            registry = stack.enter_context(Registry(root / "registry")) if args.registry else None
            remotes = {n: _Remote(registry, *stores[n], tag=f"chunks-{n}") for n in sizes} if registry else {}
            cpu = CpuLog(watch=registry.cpu_seconds if registry is not None else None)
            cpu.start()
            stack.callback(cpu.stop)

            def timed(name: str, stage: Callable[[], Span]) -> None:
                """One stage's seconds, with the machine's CPU busy share over them and the registry's share."""
                start, took = stage()
                rows.setdefault(name, []).append((took, cpu.span(start, start + took)))

            for n in range(args.runs):  # interleaved
                for how in ("new process", "the spare"):
                    startup.setdefault(how, []).append(_startup(root, how == "the spare"))
                timed("read + verify", lambda: _read_verify(store, cid, size))
                timed("UFFDIO_COPY", lambda: _copy(size))
                timed("handler, idle", lambda: _handler(root, size // PAGE, read=False))
                timed("handler, read", lambda: _handler(root, size // PAGE, read=True))
                for chunk_size, remote in remotes.items():
                    of = f", {_mib(chunk_size)} chunks" if len(remotes) > 1 else ""
                    local, local_id = stores[chunk_size]
                    timed(f"registry: GET{of}", lambda: _get(remote))
                    timed(f"registry: full pull{of}", lambda: _pull(remote, root / f"full-{n}"))
                    timed(f"registry: read + verify{of}",
                          lambda: _read_verify(local, local_id, size, remote, root / f"pulled-{n}"))
                    timed(f"registry: handler, read{of}",
                          lambda: _handler(root, size // PAGE, read=True, remote=remote))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.mib} MiB of incompressible pages, median of {args.runs} interleaved runs, {os.cpu_count()} cores; "
          f"chunks of {', '.join(_mib(n) for n in sizes)} on average")
    now = memory_given_back()
    if given_back is not None and now is not None:
        print(f"the host took back {now - given_back:.1f} GiB of freed memory meanwhile (free page reporting)")
    print("CPU busy: of all cores, over the stage; registry: the share of all cores the registry took")
    width = max(24, *(len(name) for name in rows))
    print(f"{'stage':<{width}}  {'seconds':>8}  {'MB/s':>8}  {'CPU busy':>8}  {'registry':>8}")
    for name, samples in rows.items():
        med = statistics.median(took for took, _ in samples)
        shares = [_median_pct([c[key] for _, c in samples]) for key in ("cpu_busy", "registry_cpu")]
        print(f"{name:<{width}}  {med:8.3f}  {size / med / 1e6:8.0f}  {shares[0]:>8}  {shares[1]:>8}")
    print("page source start-up, from the session's start until it serves a restore that connects at once: "
          "seconds, and the source's CPU seconds meanwhile")
    for how, got in startup.items():
        print(f"  {how:<12}  {statistics.median(span[1] for span, _ in got):6.3f} s  "
              f"{statistics.median(used for _, used in got):5.2f} CPU s")
    return 0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def _median_pct(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):.0%}" if known else "-"
