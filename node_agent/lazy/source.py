"""The page source: serves one restored container's memory from the store, by offset.

The agent starts one per lazily restored container, as its own process, so
that pages keep flowing if the agent itself goes away mid-transfer. It
takes a listening TCP socket on 127.0.0.1 (inherited), waits for the
container's ``criu lazy-pages`` daemon to connect, and answers its
page-server requests (see `protocol`) from the checkpoint's chunks: each
chunk is read, verified against its digest and decoded when first needed,
and the next chunks of the same file are read ahead in threads.

Nothing but the daemon the agent started may read the pages: a connection
whose socket does not belong to that process is refused.

Control channel (inherited Unix stream socket), JSON lines to the agent:

* ``{"event": "connected"}`` with the accepted connection attached
  (SCM_RIGHTS): the agent keeps a duplicate, so the daemon never sees the
  connection close while the container still runs. Serving starts once
  the agent answers ``ok``.
* ``{"event": "done", ...}`` after the daemon's close: every page is in.
* ``{"event": "error", "message": ...}``: serving is impossible (a bad or
  missing chunk, a protocol violation). The connection stays open until
  the agent answers ``killed`` (it has killed the container) or goes away.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final

from node_agent import podformat
from node_agent.config import parse_registry
from node_agent.errors import AgentError
from node_agent.lazy import background, pagemap, protocol
from node_agent.lazy.kill import kill_container
from node_agent.registry.fetching import RemoteBlobs
from node_agent.store import Store
from node_agent.store.blobs import BlobStore
from node_agent.store.manifest import Chunk, FileEntry
from node_agent.store.reading import read_or_fetch

log = logging.getLogger("node_agent.lazy.source")

CACHE_CHUNKS: Final = 12
READ_AHEAD: Final = 3


class SourceError(Exception):
    """Serving cannot go on."""


class ChunkCache:
    """Verified, decoded chunks of one file: a small LRU plus read-ahead in threads."""

    def __init__(
        self, blobs: BlobStore, checkpoint_id: str, entry: FileEntry, pool: ThreadPoolExecutor,
        fetch: Callable[[Chunk], None] | None = None,
    ) -> None:
        self.blobs = blobs
        self.fetch = fetch
        self.checkpoint_id = checkpoint_id
        self.entry = entry
        self.offsets = [c.offset for c in entry.chunks]
        self.pool = pool
        self.lock = threading.Lock()
        self.cache: OrderedDict[int, Future[bytes]] = OrderedDict()

    def _load(self, index: int) -> bytes:
        chunk = self.entry.chunks[index]
        try:
            return read_or_fetch(self.blobs, chunk, self.fetch)
        except AgentError as exc:
            raise SourceError(
                f"checkpoint {self.checkpoint_id}: {self.entry.path} at offset {chunk.offset}: {exc}"
            ) from exc

    def _future(self, index: int) -> Future[bytes]:
        with self.lock:
            fut = self.cache.get(index)
            if fut is None:
                fut = self.pool.submit(self._load, index)
                self.cache[index] = fut
                while len(self.cache) > CACHE_CHUNKS:
                    self.cache.popitem(last=False)
            else:
                self.cache.move_to_end(index)
            return fut

    def chunk(self, index: int) -> bytes:
        data = self._future(index).result()
        for ahead in range(index + 1, min(index + 1 + READ_AHEAD, len(self.entry.chunks))):
            self._future(ahead)
        return data

    def read(self, offset: int, size: int) -> list[memoryview]:
        """``size`` bytes at ``offset``, as views into the cached chunks."""
        if offset < 0 or offset + size > self.entry.size:
            raise SourceError(f"{self.entry.path}: range {offset}+{size} is outside the file ({self.entry.size} bytes)")
        parts: list[memoryview] = []
        pos, end = offset, offset + size
        while pos < end:
            index = bisect.bisect_right(self.offsets, pos) - 1
            c = self.entry.chunks[index]
            data = self.chunk(index)
            if len(data) != c.size:
                raise SourceError(f"{self.entry.path}: chunk at {c.offset} decoded to {len(data)} bytes, not {c.size}")
            stop = min(c.size, end - c.offset)
            parts.append(memoryview(data)[pos - c.offset : stop])
            pos = c.offset + stop
        return parts


def socket_inode(peer: tuple[str, int], local: tuple[str, int]) -> int | None:
    """The inode of the TCP socket on this host whose local end is ``peer`` and remote end ``local``."""

    def enc(addr: tuple[str, int]) -> str:
        packed = socket.inet_aton(addr[0])
        return f"{int.from_bytes(packed, 'little'):08X}:{addr[1]:04X}"

    want_local, want_remote = enc(peer), enc(local)
    with open("/proc/net/tcp", encoding="ascii") as fh:
        next(fh, None)
        for line in fh:
            f = line.split()
            if len(f) > 9 and f[1] == want_local and f[2] == want_remote:
                return int(f[9])
    return None


def owned_by(pid: int, inode: int) -> bool:
    """Whether process ``pid`` has socket ``inode`` open."""
    target = f"socket:[{inode}]"
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}") == target:
                return True
        except OSError:
            continue
    return False


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """Exactly ``n`` bytes, or None at a clean end of stream."""
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            if buf:
                raise SourceError(f"the lazy-pages daemon closed the connection mid-request ({len(buf)} of {n} bytes)")
            return None
        buf += got
    return bytes(buf)


def send_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    while parts:
        sent = sock.sendmsg(parts[:512])
        while sent and parts:
            if sent >= len(parts[0]):
                sent -= len(parts[0])
                parts.pop(0)
            else:
                parts[0] = parts[0][sent:]
                sent = 0


class Source:
    def __init__(
        self, store: Store, checkpoint_id: str, container: str, images: str, origin: dict[str, object] | None = None,
    ) -> None:
        record = store.held(checkpoint_id)  # the agent handed this process a hold on it
        self.checkpoint_id = record.id
        self.maps = pagemap.load_dir(images)
        self.pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="page-source")
        self.files: dict[int, ChunkCache] = {}
        self.total = 0
        for task, pm in self.maps.items():
            path = podformat.image_path(container, pm.pages_file)
            entry = record.entry(path)
            if entry.size != pm.pages_size:
                raise SourceError(f"{path} holds {entry.size} bytes, its pagemap accounts for {pm.pages_size}")
            self.files[task] = ChunkCache(store.blobs, record.id, entry, self.pool, store.origins.fetch_for(record.id, origin))
            self.total += pm.lazy_pages
        self.served = 0
        self.requests = 0

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def answer(self, conn: socket.socket, nr_pages: int, vaddr: int, task: int) -> None:
        pm = self.maps.get(task)
        ext = pm.find(vaddr) if pm is not None else None
        if pm is None or ext is None or not ext.lazy or vaddr % pagemap.PAGE_SIZE:
            raise SourceError(f"the daemon asked for pages the checkpoint does not hold lazily: task {task}, {vaddr:#x}")
        n = min(nr_pages, (ext.end - vaddr) // pagemap.PAGE_SIZE)
        if n <= 0:
            raise SourceError(f"the daemon asked for {nr_pages} pages at {vaddr:#x} of task {task}")
        parts = self.files[task].read(ext.offset + (vaddr - ext.vaddr), n * pagemap.PAGE_SIZE)
        header = protocol.HEADER.pack(protocol.reply_cmd(pagemap.PE_PRESENT | pagemap.PE_LAZY), n, vaddr, task)
        send_parts(conn, [memoryview(header), *parts])
        self.served += n
        self.requests += 1

    def serve(self, conn: socket.socket) -> bool:
        """Answer requests until the daemon says it is done (True) or disconnects (False)."""
        while True:
            raw = recv_exact(conn, protocol.HEADER.size)
            if raw is None:
                return False
            cmd, nr_pages, vaddr, dst = protocol.HEADER.unpack(raw)
            op = cmd & protocol.PS_CMD_MASK
            if op == protocol.PS_IOV_GET:
                self.answer(conn, nr_pages, vaddr, dst)
            elif cmd in (protocol.PS_IOV_CLOSE, protocol.PS_IOV_FORCE_CLOSE):
                conn.sendall(protocol.STATUS.pack(0))
                return True
            else:
                raise SourceError(f"unexpected page-server command {cmd:#x} from the lazy-pages daemon")


def _tell(ctrl: socket.socket, event: dict[str, object], fds: list[int] | None = None) -> None:
    data = (json.dumps(event) + "\n").encode()
    try:
        if fds:
            socket.send_fds(ctrl, [data], fds)
        else:
            ctrl.sendall(data)
    except OSError:
        pass  # the agent is gone; serving goes on without it


def _read_json_line(ctrl: socket.socket, timeout: float) -> dict[str, object]:
    ctrl.settimeout(timeout)
    buf = b""
    try:
        while not buf.endswith(b"\n") and len(buf) < 1 << 16:
            got = ctrl.recv(1)
            if not got:
                break
            buf += got
    except OSError:
        pass
    finally:
        ctrl.settimeout(None)
    try:
        doc = json.loads(buf or b"{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _wait_for(ctrl: socket.socket, word: bytes, timeout: float | None) -> bool:
    ctrl.settimeout(timeout)
    try:
        buf = b""
        while not buf.endswith(b"\n"):
            got = ctrl.recv(64)
            if not got:
                return False
            buf += got
        return buf.strip() == word
    except OSError:
        return False
    finally:
        ctrl.settimeout(None)


def accept_peer(listener: socket.socket, peer_pid: int, timeout: float) -> socket.socket:
    """The first connection that comes from the daemon ``peer_pid``; others are refused.

    When none comes in time (the container was never started, or removed),
    the daemon is stopped too: nothing is left waiting.
    """
    deadline = time.monotonic() + timeout
    while True:
        listener.settimeout(max(0.0, deadline - time.monotonic()))
        try:
            conn, addr = listener.accept()
        except TimeoutError:
            _stop_daemon(peer_pid)
            raise SourceError(f"no restore connected within {timeout:g}s") from None
        conn.settimeout(None)
        inode = socket_inode(addr, listener.getsockname())
        if inode is not None and owned_by(peer_pid, inode):
            return conn
        log.warning("refused a page-server connection from %s:%s: not the lazy-pages daemon (pid %d)",
                    addr[0], addr[1], peer_pid)
        conn.close()


def _stop_daemon(pid: int) -> None:
    """SIGKILL the lazy-pages daemon ``pid`` (only if it still is one)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            args = fh.read().split(b"\0")
        if b"lazy-pages" in args:
            os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="node-agent-page-source")
    p.add_argument("--store", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--container", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--peer-pid", type=int, required=True)
    p.add_argument("--listen-fd", type=int, required=True)
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--runc-root", required=True)
    p.add_argument("--container-id", required=True)
    p.add_argument("--start-timeout", type=float, default=600.0)
    # The store's hold on the checkpoint's blobs (its lease, inherited),
    # kept until this process is done: see Store.hold.
    p.add_argument("--hold-fd", type=int, default=-1)
    p.add_argument("--hold-dir", default="")
    # --store is this process's own (hard links in the restore plan): remove it at the end.
    p.add_argument("--private-store", action="store_true")
    args = p.parse_args(argv)
    background.lower(os.getpid())  # like its daemon: the transfer yields to foreground work
    logging.basicConfig(level=logging.INFO, format="%(asctime)s page-source %(levelname)s %(message)s")
    ctrl = socket.socket(fileno=args.control_fd)
    listener = socket.socket(fileno=args.listen_fd)
    conn: socket.socket | None = None
    source: Source | None = None
    try:
        # First line from the agent: what this process may not take from its
        # command line (a lazily pulled checkpoint's origin, as the agent read
        # it when the restore began, and the password for its registry).
        config = _read_json_line(ctrl, 30)
        store = Store(args.store)
        given = config.get("passwords")
        passwords = {str(k): str(v) for k, v in given.items()} if isinstance(given, dict) else {}
        registry = config.get("registry")
        store.origins.fetcher = RemoteBlobs(store, passwords=passwords,
                                    settings=parse_registry(registry) if isinstance(registry, dict) else None)
        origin = config.get("origin")
        if not (isinstance(origin, dict) and isinstance(origin.get("reference"), str)):
            origin = None
        source = Source(store, args.checkpoint, args.container, args.images, origin)
        conn = accept_peer(listener, args.peer_pid, args.start_timeout)
        listener.close()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        _tell(ctrl, {"event": "connected"}, [conn.fileno()])
        if not _wait_for(ctrl, b"ok", 30):
            # The agent is gone: serve on alone rather than fail the restore.
            log.warning("the agent did not answer; serving the pages without it")
        start = time.monotonic()
        complete = source.serve(conn)
        if not complete:
            raise SourceError(f"the lazy-pages daemon disconnected after {source.served} of {source.total} pages")
        took = time.monotonic() - start
        log.info("served %d of %d lazy pages in %d requests, %.2fs", source.served, source.total, source.requests, took)
        _tell(ctrl, {"event": "done", "pages": source.served, "total": source.total,
                     "requests": source.requests, "seconds": round(took, 3)})
        # The daemon closes its end after our status; wait for that (bounded).
        conn.settimeout(5)
        try:
            conn.recv(1)
        except OSError:
            pass
        return 0
    except (SourceError, AgentError, pagemap.PagemapError, OSError) as exc:
        served = source.served if source is not None else 0
        message = f"{exc} (after {served} pages)"
        log.error("%s", message)
        _tell(ctrl, {"event": "error", "message": message})
        # Keep the connection open until the container is dead, so that no
        # page fault is ever answered with a zero page: the agent kills it,
        # or, when the agent is gone, this process does.
        if not _wait_for(ctrl, b"killed", None):
            kill_container(args.runc_root, args.container_id)
        return 1
    finally:
        if conn is not None:
            conn.close()
        if source is not None:
            source.close()
        _end_hold(args.store, args.hold_dir, args.hold_fd)
        if args.private_store and os.path.isfile(os.path.join(args.store, "oci-layout")):
            shutil.rmtree(args.store, ignore_errors=True)


def _end_hold(store_root: str, hold_dir: str, fd: int) -> None:
    """Remove the hold's directory (only one under the store's ``ingest/``), then drop its lease."""
    ingest = os.path.join(os.path.abspath(store_root), "ingest")
    if hold_dir and os.path.dirname(os.path.abspath(hold_dir)) == ingest and not os.path.islink(hold_dir):
        shutil.rmtree(hold_dir, ignore_errors=True)
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
