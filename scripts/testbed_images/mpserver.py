#!/usr/bin/python3
"""mpserver: a multi-process Python server, a test workload for the Debian image of scripts/testbed.

    mpserver [--port P] [--workers N] [--shm-mib M] [--db PATH]

Installed as /usr/local/bin/mpserver (mode 0755) in the Debian test image.
Python 3 standard library only. It holds the kinds of state a multi-process
server has, so that a restored one can be told from a restarted one:

- `started = time.time()` is taken first thing;
- M MiB (default 32) of POSIX shared memory (multiprocessing.shared_memory,
  /dev/shm/mpserver), filled deterministically: its MiB i is
  SHAKE-256(b"mpserver-shm:%d" % i); the resource tracker process that
  multiprocessing starts for it runs beside the workers;
- a sqlite database in WAL mode (--db, default /var/lib/mp/mp.db, table
  `work(id INTEGER PRIMARY KEY, n INTEGER, worker INTEGER, digest TEXT)`),
  one connection held open by the server and one by each worker;
- a multiprocessing Pool of N workers (default 3, forked after the shared
  memory and the database exist); each worker sees the shared memory through
  the mapping it inherited;
- HTTP on 0.0.0.0:P (default 8080; http.server.ThreadingHTTPServer, one
  request per connection):

      GET /work?n=K   runs a task in the pool: it reads the 1 MiB window of the
                      shared memory at offset (K * 65536) mod (size - 1 MiB),
                      writes a row (K, its pid, the window's sha256) and commits.
                      200 {"id": <row id>, "n": K, "worker": <pid>, "digest": "<hex>"}
      GET /state      200 {"started": <float>, "pid": <int>, "workers": [<pid>, ...],
                           "shm_name": "mpserver", "shm_bytes": <int>,
                           "shm_sha256": "<hex>", "rows": <int>,
                           "rows_sha256": "<hex>", "journal_mode": "wal",
                           "requests": <int>}
      GET /state?upto=I  the same, with rows and rows_sha256 over the rows of
                      id <= I only
      GET /healthz    200 ok

  rows_sha256 is the sha256 of "id n worker digest\\n" for each row in id
  order. Worker pids are what os.getpid() says in the workers, so pids inside
  the container's PID namespace.

One line on stdout when it is ready. SIGTERM and SIGINT exit 0 (PID 1 of a
container gets no default handlers). It must run as root in the container:
CRIU cannot dump another user's process on machines without CAP_SYS_RESOURCE.
The database's WAL (POSIX locks, a shared mapping of its -shm file) needs
CRIU's --file-locks, node-agent's default.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before anything else: the process's own record of its start

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socketserver  # noqa: E402
import sqlite3  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402
from multiprocessing import shared_memory  # noqa: E402
from typing import Any  # noqa: E402
from urllib.parse import parse_qs, urlsplit  # noqa: E402

SHM_NAME = "mpserver"
WINDOW = 1 << 20
STRIDE = 1 << 16

# Set in the server before the pool forks; the workers inherit them.
SHM: shared_memory.SharedMemory | None = None
DB_PATH = ""
# Each worker's own connection, opened in init_worker.
CONN: sqlite3.Connection | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpserver", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8080, help="TCP port on 0.0.0.0 (default %(default)s)")
    p.add_argument("--workers", type=int, default=3, help="processes in the pool (default %(default)s)")
    p.add_argument("--shm-mib", type=int, default=32, help="MiB of POSIX shared memory (default %(default)s)")
    p.add_argument("--db", default="/var/lib/mp/mp.db", help="sqlite database (default %(default)s)")
    args = p.parse_args(argv)
    if args.workers < 1 or args.shm_mib < 2 or not 0 < args.port < 65536:
        p.error("--workers must be >= 1, --shm-mib >= 2, --port 1..65535")
    return args


def fill(buf: memoryview) -> None:
    for i, off in enumerate(range(0, len(buf), 1 << 20)):
        n = min(1 << 20, len(buf) - off)
        buf[off:off + n] = hashlib.shake_256(b"mpserver-shm:%d" % i).digest(n)


def connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    return conn


def init_worker() -> None:
    global CONN
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    CONN = connect(DB_PATH)


def work(n: int) -> dict[str, Any]:
    """A task: hash a window of the shared memory, record it as a row."""
    assert SHM is not None and CONN is not None
    off = (n * STRIDE) % (SHM.size - WINDOW)
    digest = hashlib.sha256(SHM.buf[off:off + WINDOW]).hexdigest()
    pid = os.getpid()
    CONN.execute("BEGIN IMMEDIATE")
    try:
        cur = CONN.execute("INSERT INTO work (n, worker, digest) VALUES (?, ?, ?)", (n, pid, digest))
        CONN.execute("COMMIT")
    except BaseException:
        CONN.execute("ROLLBACK")
        raise
    return {"id": cur.lastrowid, "n": n, "worker": pid, "digest": digest}


class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        global SHM, DB_PATH
        try:  # what a killed predecessor left in this pod's /dev/shm
            stale = shared_memory.SharedMemory(name=SHM_NAME)
            stale.close()
            stale.unlink()
        except FileNotFoundError:
            pass
        SHM = shared_memory.SharedMemory(name=SHM_NAME, create=True, size=args.shm_mib << 20)
        fill(SHM.buf)
        self.shm = SHM
        DB_PATH = args.db
        os.makedirs(os.path.dirname(os.path.abspath(args.db)), exist_ok=True)
        self.conn = connect(args.db)
        self.conn.execute("CREATE TABLE IF NOT EXISTS work (id INTEGER PRIMARY KEY, n INTEGER, worker INTEGER, "
                          "digest TEXT)")
        self.journal_mode = self.conn.execute("PRAGMA journal_mode").fetchone()[0]
        self.lock = threading.Lock()
        self.requests = 0
        self.pool = multiprocessing.get_context("fork").Pool(args.workers, initializer=init_worker)

    def workers(self) -> list[int]:
        return sorted(p.pid for p in self.pool._pool)  # type: ignore[attr-defined]

    def state(self, upto: int | None) -> dict[str, Any]:
        with self.lock:
            self.requests += 1
            requests = self.requests
            sql = "SELECT id, n, worker, digest FROM work" + (" WHERE id <= ?" if upto is not None else "") + " ORDER BY id"
            rows = self.conn.execute(sql, () if upto is None else (upto,)).fetchall()
        h = hashlib.sha256()
        for row in rows:
            h.update(("%d %d %d %s\n" % row).encode())
        return {"started": STARTED, "pid": os.getpid(), "workers": self.workers(), "shm_name": self.shm.name,
                "shm_bytes": self.shm.size, "shm_sha256": hashlib.sha256(self.shm.buf).hexdigest(),
                "rows": len(rows), "rows_sha256": h.hexdigest(), "journal_mode": self.journal_mode,
                "requests": requests, **({"upto": upto} if upto is not None else {})}


class HTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer without its reverse lookup of the address it binds
    (socket.getfqdn), which waits out the resolver's timeout in a pod that
    reaches no name server."""

    daemon_threads = True

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)


def handler_for(server: Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
            pass

        def _send(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, obj: object) -> None:
            self._send(200, (json.dumps(obj) + "\n").encode(), "application/json")

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            try:
                if url.path == "/healthz":
                    self._send(200, b"ok")
                elif url.path == "/work":
                    self._json(server.pool.apply(work, (int(query.get("n", ["0"])[0]),)))
                elif url.path == "/state":
                    upto = query.get("upto")
                    self._json(server.state(int(upto[0]) if upto else None))
                else:
                    self._send(404, b"not found\n")
            except ValueError as exc:
                self._send(400, f"{exc}\n".encode())

    return Handler


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def stop(_signum: int, _frame: object) -> None:
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server = Server(args)
    http = HTTPServer(("0.0.0.0", args.port), handler_for(server))
    print(f"mpserver: pid {os.getpid()}, workers {server.workers()}, {args.shm_mib} MiB of shared memory, "
          f"sqlite {server.journal_mode}, serving on :{args.port} {time.time() - STARTED:.3f}s after start",
          flush=True)
    http.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
