"""The fake HTTP servers tests run (``FakeServer``: a registry, a token server or a CDN that the real
registry never is) and their answers: whole, raw, or trickled.

``LoopbackServer`` is what each of the test bed's HTTP servers is built on (``FakeServer``, the token
server of testbed/registry.py, the unit tests' own): a threaded HTTP/1.1 server on a loopback address,
every request answered by one callable, without an access log.

Standard library only.
"""

from __future__ import annotations

import socket
import socketserver
import ssl
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Protocol


class ServerTLS(Protocol):
    """What serves HTTPS (testbed/registry.py's ``Certificates``)."""

    def server_context(self) -> ssl.SSLContext: ...


def answer(handler: BaseHTTPRequestHandler, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None) -> None:
    """A whole answer at once (no body for HEAD); Content-Length unless ``headers`` name one."""
    handler.send_response(status)
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    if "Content-Length" not in (headers or {}):
        handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if handler.command != "HEAD" and body:
        handler.wfile.write(body)


def head_bytes(status: int, headers: Mapping[str, str]) -> bytes:
    """A status line and headers, as sent on the wire."""
    reason = {200: "OK", 201: "Created", 202: "Accepted", 307: "Temporary Redirect", 401: "Unauthorized"}.get(status, "X")
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode("latin-1")


def trickle(handler: BaseHTTPRequestHandler, data: bytes, stopping: threading.Event, *, rate: float, piece: int = 1) -> None:
    """Write ``data`` in ``piece``-byte writes at ``rate`` bytes per second, until done, the peer goes, or ``stopping``."""
    interval = piece / rate
    for start in range(0, len(data), piece):
        handler.wfile.write(data[start : start + piece])
        if stopping.wait(interval):
            break
    handler.close_connection = True


class _Handler(BaseHTTPRequestHandler):
    """Every request, whatever its method, to the server's ``respond``; no access log."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.server.respond(self)

    do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_GET


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, respond: Callable[[BaseHTTPRequestHandler], None], rcvbuf: int) -> None:
        self.respond = respond
        self.host = host
        self.rcvbuf = rcvbuf
        super().__init__((host, 0), _Handler, bind_and_activate=False)

    def server_bind(self) -> None:
        # Not HTTPServer's: it looks the address up in DNS (127.0.0.2 has no name).
        if self.rcvbuf:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.host, int(self.server_address[1])


class LoopbackServer:
    """A threaded HTTP/1.1 server on a loopback address: ``respond(handler)`` answers every request (any method).

    The port is bound at once (``host``, ``port`` and ``netloc`` say where); the server listens from the
    start, or with ``listen=False`` only from ``start`` (until then connections are refused), and answers
    from ``start`` to ``stop``. ``tls`` serves HTTPS; ``rcvbuf`` shrinks the receive buffer of accepted
    connections (a peer that reads slowly). ``name`` names the thread that serves.
    """

    def __init__(
        self,
        respond: Callable[[BaseHTTPRequestHandler], None],
        *,
        host: str = "127.0.0.1",
        tls: ServerTLS | None = None,
        rcvbuf: int = 0,
        listen: bool = True,
        name: str = "test-http",
    ) -> None:
        self._httpd = _Server(host, respond, rcvbuf)
        try:
            self._httpd.server_bind()
            self._listening = listen
            if listen:
                self._httpd.server_activate()
            if tls is not None:
                self._httpd.socket = tls.server_context().wrap_socket(self._httpd.socket, server_side=True)
        except BaseException:
            self._httpd.server_close()
            raise
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self.netloc = f"{host}:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name=name, daemon=True)
        self._started = False

    def start(self) -> None:
        """Listen, if not yet, and answer requests in a thread of its own."""
        if not self._listening:
            self._httpd.server_activate()
            self._listening = True
        self._thread.start()
        self._started = True

    def stop(self) -> None:
        """Stop answering (if started) and close the port."""
        if self._started:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
        self._httpd.server_close()


class FakeServer(LoopbackServer):
    """A small HTTP/1.1 server on a loopback address playing a registry, a token server or a CDN.

    ``serve(handler)`` answers every request (any method); ``seen`` records
    each one as ``(method, target, headers)``, the target with its query.
    ``stopping`` (given, or its own) is set when the server closes, so that
    an answer that takes its time (``trickle``) ends with it. ``tls`` serves HTTPS with the test
    CA's certificate for 127.0.0.1 and localhost; ``rcvbuf`` shrinks the
    receive buffer of accepted connections (a peer that reads slowly).
    """

    def __init__(
        self,
        serve: Callable[[BaseHTTPRequestHandler], None],
        *,
        host: str = "127.0.0.1",
        tls: ServerTLS | None = None,
        rcvbuf: int = 0,
        stopping: threading.Event | None = None,
    ) -> None:
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.stopping = stopping or threading.Event()
        self._serve = serve
        super().__init__(self._respond, host=host, tls=tls, rcvbuf=rcvbuf, name="test-fake-http")
        self.start()

    def _respond(self, handler: BaseHTTPRequestHandler) -> None:
        self.seen.append((handler.command, handler.path, dict(handler.headers.items())))
        try:
            self._serve(handler)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, ssl.SSLError):
            handler.close_connection = True

    def close(self) -> None:
        self.stopping.set()
        self.stop()

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
