"""One HTTP/1.1 connection to one origin, each socket operation within a request's deadline.

Rule: only ``transport`` opens these, and it keeps them. A ``Connection``
connects, shakes hands, sends and receives through its ``Pace``: each
operation gets ``io-timeout``, cut to what is left of the request's
``Deadline``, and none starts once that has passed (``Overdue``). A response's
status line, headers and body are read one receive at a time, each ending
within its timeout with what came, so a peer that trickles bytes is stopped
by the deadline too; a large read of a body is one receive the kernel fills
(``WHOLE_ABOVE``). URLs the registry sends are
parsed here (``origin_of``), and only http(s) ones without credentials pass.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import ipaddress
import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

from node_agent.errors import DeadlineExceeded, InvalidArgument

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

WHOLE_ABOVE = io.DEFAULT_BUFFER_SIZE
"""A raw read larger than a response's buffer is the buffered reader taking body bytes its caller asked for, which
the peer sends (or closes before): it is received whole (``_receive_whole``)."""

SEND_PIECE = 64 << 10
"""Bytes handed to one socket send: a stalled peer is noticed within one piece."""


@dataclass(frozen=True)
class Origin:
    """Scheme, host and port: what a kept-alive connection and the registry's credentials are bound to."""

    scheme: str
    host: str
    port: int

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def origin_of(url: str) -> Origin:
    """The origin of an absolute http(s) URL; InvalidArgument for anything else."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise InvalidArgument("malformed URL from the registry") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(f"the registry sent a URL with scheme {parts.scheme[:16]!r}; only http(s) is followed")
    if parts.username is not None or parts.password is not None:
        raise InvalidArgument("the registry sent a URL with credentials in it")
    return Origin(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80))


def request_target(url: str) -> str:
    """The request target (path and query) of an absolute URL."""
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def path_only(url: str) -> str:
    """A URL without its query, for messages and logs."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def host_port(origin: Origin) -> str:
    """``host:port`` of an origin, the port always named (``[v6]:port`` for IPv6)."""
    return f"[{origin.host}]:{origin.port}" if ":" in origin.host else f"{origin.host}:{origin.port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_stale(exc: BaseException) -> bool:
    return isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, http.client.BadStatusLine))


class NetError(Exception):
    """Carries a socket or HTTP failure out of ``net``, apart from every other error."""

    def __init__(self, exc: OSError | http.client.HTTPException) -> None:
        super().__init__(str(exc))
        self.exc = exc


_T = TypeVar("_T")


def net(fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)``, its socket or HTTP failure raised as a NetError."""
    try:
        return fn(*args)
    except (OSError, http.client.HTTPException) as exc:
        raise NetError(exc) from exc


class Deadline:
    """When one request must be over (monotonic clock); for its error, the request and the rule that set the bound."""

    def __init__(self, seconds: float, rule: str, what: str) -> None:
        self.seconds = seconds
        self.rule = rule
        self.what = what
        self.at = time.monotonic() + seconds

    def within(self, outer: Deadline | None) -> Deadline:
        """This deadline, or ``outer``'s when that comes first (a token fetched for a request)."""
        if outer is None or outer.at >= self.at:
            return self
        capped = Deadline(outer.seconds, outer.rule, f"{self.what} (for {outer.what})")
        capped.at = outer.at
        return capped

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def error(self, where: str) -> DeadlineExceeded:
        return DeadlineExceeded(f"{where}: {self.what}: not finished within {self.seconds:g}s ({self.rule})")


class Overdue(TimeoutError):
    """A socket operation refused or cut short by the request's deadline."""

    def __init__(self, deadline: Deadline) -> None:
        super().__init__(f"past the deadline of {deadline.seconds:g}s")
        self.deadline = deadline


class Pace:
    """A connection's clock: each socket operation gets ``io_timeout``, cut to what is left of ``deadline``."""

    def __init__(self, io_timeout: float) -> None:
        self.io_timeout = io_timeout
        self.deadline: Deadline | None = None

    @contextlib.contextmanager
    def op(self, sock: socket.socket | None) -> Iterator[float]:
        """Around one socket operation: its timeout (set on ``sock``, and yielded); Overdue if the deadline ends it."""
        timeout, bound = self.io_timeout, None
        deadline = self.deadline
        if deadline is not None:
            left = deadline.remaining()
            if left <= 0:
                raise Overdue(deadline)
            if left < timeout:
                timeout, bound = left, deadline
        if sock is not None:
            sock.settimeout(timeout)
        try:
            yield timeout
        except TimeoutError as exc:
            if bound is not None and not isinstance(exc, Overdue):
                raise Overdue(bound) from exc
            raise


class _SocketReader(io.RawIOBase):
    """The raw stream under a response: one receive per read, each through the connection's pace (a large one
    received whole, over plain TCP).

    It holds ``file`` (the socket's own file, which ``http.client`` made)
    until it is closed: like that file, it keeps the socket open for the
    rest of the response after the connection itself was closed.
    """

    def __init__(self, sock: socket.socket, pace: Pace, file: io.BufferedReader) -> None:
        super().__init__()
        self._sock = sock
        self._pace = pace
        self._file = file

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()

    def readinto(self, buffer: WriteableBuffer) -> int:
        size = memoryview(buffer).nbytes
        if size <= WHOLE_ABOVE or isinstance(self._sock, ssl.SSLSocket):
            with self._pace.op(self._sock):
                return self._sock.recv_into(buffer)
        with self._pace.op(None) as timeout:
            return _receive_whole(self._sock, buffer, size, timeout)


def _receive_whole(sock: socket.socket, buffer: WriteableBuffer, size: int, timeout: float) -> int:
    """One receive of ``size`` bytes that returns once all of them came (or the peer closed, or ``timeout``
    passed with some of them: then those): the kernel gathers the arrivals, not a receive each."""
    micros = max(1, int(timeout * 1_000_000))  # 0 would be no timeout at all
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", *divmod(micros, 1_000_000)))
    try:
        return sock.recv_into(buffer, size, socket.MSG_WAITALL)
    except BlockingIOError:
        raise TimeoutError("timed out") from None


def _response_class(pace: Pace) -> type[http.client.HTTPResponse]:
    class PacedResponse(http.client.HTTPResponse):
        """A response whose status line, headers and body are read through ``pace``.

        ``http.client`` reads them through a buffered file that loops over
        receives; one receive per raw read lets the deadline stop a peer
        that sends a byte at a time.
        """

        def __init__(
            self, sock: socket.socket, debuglevel: int = 0, method: str | None = None, url: str | None = None
        ) -> None:
            super().__init__(sock, debuglevel, method, url)
            self.fp = io.BufferedReader(_SocketReader(sock, pace, self.fp))

    return PacedResponse


class Connection(http.client.HTTPConnection):
    """HTTP, or HTTPS with ``tls``, to one origin; every socket operation goes through ``pace``."""

    def __init__(self, origin: Origin, io_timeout: float, tls: ssl.SSLContext | None) -> None:
        super().__init__(origin.host, origin.port, timeout=io_timeout)
        self.default_port = 443 if tls is not None else 80  # the Host header names other ports only
        self.pace = Pace(io_timeout)
        self._tls = tls
        self.response_class = _response_class(self.pace)

    def connect(self) -> None:
        with self.pace.op(None) as timeout:
            self.timeout = timeout
            super().connect()
        if self._tls is not None:
            with self.pace.op(self.sock):  # the handshake as a whole is bounded by the socket's timeout
                self.sock = self._tls.wrap_socket(self.sock, server_hostname=self.host)

    def send(self, data: object) -> None:
        """Send bytes in pieces, each within the pace (http.client's own send is one sendall)."""
        if isinstance(data, str):
            data = data.encode("iso-8859-1")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"cannot send a {type(data).__name__}")
        if self.sock is None:
            self.connect()
        sock = self.sock
        view = memoryview(data).cast("B")
        while view:
            with self.pace.op(sock):
                sent = sock.send(view[:SEND_PIECE])
            view = view[sent:]


def start_request(conn: Connection, method: str, target: str, headers: dict[str, str], length: int) -> None:
    conn.putrequest(method, target, skip_accept_encoding=True)
    for name, value in headers.items():
        conn.putheader(name, value)
    if length or method in ("POST", "PUT", "PATCH"):
        conn.putheader("Content-Length", str(length))
    conn.endheaders()

