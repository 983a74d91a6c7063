"""The fake HTTP servers tests run (``FakeServer``: a registry, a token server or a CDN that the real
registry never is) and their answers: whole, raw, or trickled.

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


class FakeServer:
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
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer.seen.append((self.command, self.path, dict(self.headers.items())))
                try:
                    serve(self)
                except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, ssl.SSLError):
                    self.close_connection = True

            do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def server_bind(self) -> None:
                # Not HTTPServer's: it looks the address up in DNS (127.0.0.2 has no name).
                if rcvbuf:
                    self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
                socketserver.TCPServer.server_bind(self)
                self.server_name, self.server_port = host, int(self.server_address[1])

        self._httpd = Server((host, 0), Handler)
        if tls is not None:
            self._httpd.socket = tls.server_context().wrap_socket(self._httpd.socket, server_side=True)
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self.netloc = f"{host}:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="test-fake-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
