#!/usr/bin/python3
"""modelserver: a threaded numpy model server, a test workload for the Debian image of scripts/testbed.

    modelserver --weights /opt/model/weights.npy --port 8080 [--shm-mib 16] [--shm-path PATH]

Installed as /usr/local/bin/modelserver (mode 0755) in the Debian test image.
Python 3 standard library plus numpy only (Debian 12's python3-numpy, 1.24).
Its cold start is what a real model server's is: process start, then the
weights read fully into memory, then one warm-up pass, then the first answer.

- `started = time.time()` is taken first thing, so a restored process can be
  told from a restarted one by its own account;
- the weights (a .npy of float32, any shape) are read with np.load into
  anonymous memory (not mmap'd: a checkpoint holds them as the process's own
  pages), and weights_sha256 is the sha256 of their raw bytes (little-endian
  float32 in C order: the .npy file's data after its header);
- one warm-up pass runs over all of them;
- a cache file of --shm-mib MiB (default 16; 0 for none) is created in
  /dev/shm (--shm-path), filled deterministically (its 4 KiB page i is
  sha256(b"modelserver-cache:%d" % i) 128 times over), and held open for the
  process's life;
- then it serves HTTP on 0.0.0.0:PORT (http.server.ThreadingHTTPServer,
  daemon threads):

      GET /predict?x=N  200 {"answer": <float>, "started": <float>, "pid": <int>,
                             "requests": <int>, "weights_sha256": "<hex>",
                             "weights_bytes": <int>}
      GET /healthz      200 ok
      GET /cache        200 {"path": ..., "bytes": <int>, "sha256": "<hex>"}
                        (read back through the descriptor held open)

  The answer is u(x) . (W @ v(x)), W the weights as rows of 1024 floats (one
  4 KiB page each), v(x) and u(x) vectors derived from x alone: every request
  reads every weight page. The same process answers the same x with the same
  float; requests counts the /predict answers so far (this one included).

One line on stdout when it is ready (load, warm-up and cache times). SIGTERM
and SIGINT exit 0 (PID 1 of a container gets no default handlers). It must run
as root in the container: CRIU cannot dump another user's process on machines
without CAP_SYS_RESOURCE.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before anything else: the process's own record of its start

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socketserver  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402
from urllib.parse import parse_qs, urlsplit  # noqa: E402

import numpy as np  # noqa: E402

ROW = 1024  # floats per row of W: one 4 KiB page


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="modelserver", description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="/opt/model/weights.npy", help="a .npy of float32 (default %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="TCP port on 0.0.0.0 (default %(default)s)")
    p.add_argument("--shm-mib", type=int, default=16, help="MiB of the cache file in /dev/shm (default %(default)s)")
    p.add_argument("--shm-path", default="/dev/shm/modelserver.cache", help="the cache file (default %(default)s)")
    args = p.parse_args(argv)
    if args.shm_mib < 0 or not 0 < args.port < 65536:
        p.error("--shm-mib must not be negative, --port must be 1..65535")
    return args


class Model:
    """The weights, as rows of ROW floats plus a tail, and the answer over all of them."""

    def __init__(self, path: str) -> None:
        w = np.load(path, mmap_mode=None, allow_pickle=False)
        flat = np.ascontiguousarray(w, dtype=np.float32).reshape(-1)
        if flat.size == 0:
            raise SystemExit(f"modelserver: {path} holds no weights")
        self.flat = flat
        self.nbytes = int(flat.nbytes)
        self.sha256 = hashlib.sha256(memoryview(flat).cast("B")).hexdigest()
        rows = flat.size // ROW
        self.rows = flat[:rows * ROW].reshape(rows, ROW)
        self.tail = flat[rows * ROW:]

    def answer(self, x: float) -> float:
        """u(x) . (W @ v(x)) plus the tail's share, in float64 from float32 partial sums."""
        k = np.arange(ROW, dtype=np.float64)
        v = np.cos(k * (0.001 * (x + 1.0))).astype(np.float32)
        total = 0.0
        if self.rows.shape[0]:
            r = np.arange(self.rows.shape[0], dtype=np.float64)
            u = np.sin(r * (0.0007 * (x + 2.0)) + 0.5)
            total += float(np.dot(u, (self.rows @ v).astype(np.float64)))
        if self.tail.size:
            total += float(np.dot(self.tail.astype(np.float64), v[:self.tail.size].astype(np.float64)))
        return total


class Cache:
    """A file in /dev/shm, filled deterministically and held open."""

    BLOCK = 1 << 20

    def __init__(self, path: str, mib: int) -> None:
        self.path = path
        self.size = mib << 20
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        digest = hashlib.sha256()
        page = 0
        for off in range(0, self.size, self.BLOCK):
            chunk = b"".join(hashlib.sha256(b"modelserver-cache:%d" % (page + i)).digest() * 128
                             for i in range(self.BLOCK // 4096))
            page += self.BLOCK // 4096
            os.pwrite(self.fd, chunk, off)
            digest.update(chunk)
        self.sha256 = digest.hexdigest()

    def read_back(self) -> str:
        digest = hashlib.sha256()
        off = 0
        while off < self.size:
            chunk = os.pread(self.fd, min(self.BLOCK, self.size - off), off)
            if not chunk:
                break
            digest.update(chunk)
            off += len(chunk)
        return digest.hexdigest()


class State:
    def __init__(self, model: Model, cache: Cache | None) -> None:
        self.model = model
        self.cache = cache
        self.lock = threading.Lock()
        self.requests = 0


class Server(ThreadingHTTPServer):
    """ThreadingHTTPServer without its reverse lookup of the bound address at bind time
    (socket.getfqdn): with no name server reachable, as in a pod of the test bed, that
    lookup alone holds the listen() back for some 10 s."""

    daemon_threads = True

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)


def handler_for(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
            pass

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, obj: object) -> None:
            self._send(200, (json.dumps(obj) + "\n").encode(), "application/json")

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            url = urlsplit(self.path)
            if url.path == "/healthz":
                self._send(200, b"ok", "text/plain")
            elif url.path == "/predict":
                try:
                    x = float(parse_qs(url.query).get("x", ["0"])[0])
                except ValueError:
                    self._send(400, b"x must be a number\n", "text/plain")
                    return
                ans = state.model.answer(x)
                with state.lock:
                    state.requests += 1
                    n = state.requests
                self._json({"answer": ans, "started": STARTED, "pid": os.getpid(), "requests": n,
                            "weights_sha256": state.model.sha256, "weights_bytes": state.model.nbytes})
            elif url.path == "/cache" and state.cache is not None:
                self._json({"path": state.cache.path, "bytes": state.cache.size, "sha256": state.cache.read_back()})
            else:
                self._send(404, b"not found\n", "text/plain")

    return Handler


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def stop(_signum: int, _frame: object) -> None:
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    t0 = time.time()
    model = Model(args.weights)
    t1 = time.time()
    model.answer(0.0)  # the warm-up pass over every weight
    t2 = time.time()
    cache = Cache(args.shm_path, args.shm_mib) if args.shm_mib else None
    t3 = time.time()
    server = Server(("0.0.0.0", args.port), handler_for(State(model, cache)))
    t4 = time.time()  # listening
    print(f"modelserver: pid {os.getpid()}, {model.nbytes >> 20} MiB of weights loaded in {t1 - t0:.3f}s "
          f"(sha256 {model.sha256[:12]}), warm-up {t2 - t1:.3f}s, cache {args.shm_mib} MiB in {t3 - t2:.3f}s, "
          f"serving on :{args.port} {t4 - STARTED:.3f}s after start", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
