#!/usr/bin/python3
"""torchserver: a PyTorch model server, a test workload for the torch image of scripts/testbed.

    torchserver --weights /opt/torchmodel/weights.npy --port 8080

Installed as /usr/local/bin/torchserver (mode 0755) in the torch test image,
which holds Debian's python3-torch with OpenBLAS. Python 3 standard library,
numpy and torch. Its cold start is a framework server's:

- `started = time.time()` is taken first thing, so a restored process can be
  told from a restarted one by its own account;
- torch is imported;
- the weights file (a .npy of float32 rows of 1024, a multiple of 1024 rows,
  written when the image was built) is read with np.load;
- the model, one torch.nn.Linear of 1024 x 1024 without bias per 1024 rows,
  is built without initialising its parameters (torch.nn.utils.skip_init) and
  filled by load_state_dict from torch.from_numpy views of the rows. The
  numpy copy is then dropped, so each layer's weight lives in an allocation
  of its own, as a framework's parameters do;
- the model is traced with torch.jit.trace and the trace run twice (warm-up);
- then it serves HTTP on 0.0.0.0:PORT (daemon threads):

      GET /predict?x=N  200 {"answer": <float>, "started": <float>, "pid": <int>,
                             "requests": <int>, "params_bytes": <int>,
                             "layers": <int>, "threads": <int>}
      GET /count        200 {"requests": <int>, "handling": <int>}: the
                        /predict answers so far and the /predict requests
                        being worked on now; it neither waits for a forward
                        pass nor counts as a request
      GET /digest       200 {"params_sha256": "<hex>"}: the sha256 of the
                        parameters' bytes, layer after layer (the .npy file's
                        data after its header), computed now from memory
      GET /healthz      200 ok

  No digest is taken at start-up: a real server does not hash its weights,
  and its cold start would be the slower for it.

  The answer is the sum of y, where y = v(x) passed through every layer as
  tanh(W y / 32), and v(x) is derived from x alone: every request reads every
  parameter. One forward pass runs at a time, on torch's intra-op threads, so
  the same process answers the same x with the same float. requests counts
  the /predict answers so far (this one included).

One line on stdout when it is ready (import, load, trace and warm-up times).
SIGTERM and SIGINT exit 0. It must run as root in the container: CRIU cannot
dump another user's process on machines without CAP_SYS_RESOURCE.
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
from typing import Any  # noqa: E402
from urllib.parse import parse_qs, urlsplit  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

IMPORTED = time.time()
WIDTH = 1024  # each layer maps 1024 inputs to 1024 outputs; its weight is 1024 rows of the file
SCALE = 1.0 / 32.0  # keeps tanh out of saturation for weights in +-[2**-15, 2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchserver", description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="/opt/torchmodel/weights.npy",
                   help="a .npy of float32, rows of 1024 (default %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="TCP port on 0.0.0.0 (default %(default)s)")
    args = p.parse_args(argv)
    if not 0 < args.port < 65536:
        p.error("--port must be 1..65535")
    return args


class Stack(torch.nn.Module):
    """Linear layers of WIDTH x WIDTH, each followed by tanh(. * SCALE)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.utils.skip_init(torch.nn.Linear, WIDTH, WIDTH, bias=False) for _ in range(layers))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            y = torch.tanh(layer(y) * SCALE)
        return y


def load(path: str) -> Stack:
    w = np.load(path, mmap_mode=None, allow_pickle=False)
    if w.dtype != np.float32 or w.ndim != 2 or w.shape[1] != WIDTH or w.shape[0] % WIDTH or not w.shape[0]:
        raise SystemExit(f"torchserver: {path} must hold float32 rows of {WIDTH}, a multiple of {WIDTH} of them, "
                         f"not {w.dtype} {w.shape}")
    layers = w.shape[0] // WIDTH
    model = Stack(layers)
    rows = torch.from_numpy(w)
    model.load_state_dict({f"layers.{i}.weight": rows[i * WIDTH:(i + 1) * WIDTH] for i in range(layers)})
    del rows, w  # the file's copy goes; each layer keeps its own
    model.eval()
    return model


def digest(model: Stack) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(memoryview(p.detach().numpy()).cast("B"))
    return h.hexdigest()


def features(x: float) -> torch.Tensor:
    k = np.arange(WIDTH, dtype=np.float64)
    return torch.from_numpy(np.cos(k * (0.001 * (x + 1.0))).astype(np.float32)).reshape(1, WIDTH)


class State:
    def __init__(self, model: Stack) -> None:
        self.model = model
        self.layers = len(model.layers)
        self.nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        with torch.no_grad():
            self.traced = torch.jit.trace(model, features(0.0))
        self.lock = threading.Lock()  # one forward pass at a time
        self.count_lock = threading.Lock()
        self.requests = 0
        self.handling = 0

    def answer(self, x: float) -> float:
        v = features(x)
        with self.lock, torch.no_grad():
            return float(self.traced(v).double().sum())


class Server(ThreadingHTTPServer):
    """ThreadingHTTPServer without its reverse lookup of the bound address at bind time
    (socket.getfqdn), which with no name server reachable holds the listen() back."""

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

        def _json(self, obj: dict[str, Any]) -> None:
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
                with state.count_lock:
                    state.handling += 1
                ans = state.answer(x)
                with state.count_lock:
                    state.handling -= 1
                    state.requests += 1
                    n = state.requests
                self._json({"answer": ans, "started": STARTED, "pid": os.getpid(), "requests": n,
                            "params_bytes": state.nbytes, "layers": state.layers, "threads": torch.get_num_threads()})
            elif url.path == "/count":
                with state.count_lock:
                    self._json({"requests": state.requests, "handling": state.handling})
            elif url.path == "/digest":
                with state.lock:
                    self._json({"params_sha256": digest(state.model)})
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
    model = load(args.weights)
    t1 = time.time()
    state = State(model)
    t2 = time.time()
    state.answer(0.0)
    state.answer(1.0)  # warm-up: the trace's first runs optimise it
    t3 = time.time()
    server = Server(("0.0.0.0", args.port), handler_for(state))
    print(f"torchserver: pid {os.getpid()}, torch {torch.__version__} imported in {IMPORTED - STARTED:.3f}s, "
          f"{state.layers} layers ({state.nbytes >> 20} MiB) loaded in {t1 - t0:.3f}s, "
          f"trace {t2 - t1:.3f}s, warm-up {t3 - t2:.3f}s, {torch.get_num_threads()} threads, "
          f"serving on :{args.port} {time.time() - STARTED:.3f}s after start", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
