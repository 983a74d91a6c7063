"""Answers of the fake HTTP servers tests run (testbed/registry.py's FakeServer): whole, raw, or trickled.

Standard library only.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler


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
