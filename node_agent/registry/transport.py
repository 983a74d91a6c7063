"""HTTP to one registry: connections, TLS, deadlines, auth, redirects, errors.

Rule: the only module here that opens sockets. Every request (one
``Session.request``: its redirects, auth retries and body; one token fetch)
has a deadline, ``request-timeout``, or for a blob of N bytes
``max(request-timeout, N / min-rate)``; every socket operation (connect, TLS
handshake, each send and each receive) gets ``io-timeout``, cut to what is
left of that deadline, and none starts once it has passed. Every network or
HTTP failure leaves as an ``AgentError`` naming the registry and repository.
Authorization goes to the registry's own origin only; a token realm is asked
(with basic credentials or without) only where ``realm_refusal`` allows it.
Query strings, which may carry signatures, and header values are never logged.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import ipaddress
import json
import logging
import math
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlencode, urljoin, urlsplit

from node_agent.config import RegistrySettings, token_realm_host
from node_agent.errors import (
    AgentError,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from node_agent.registry.auth import MAX_TOKEN_RESPONSE, Authenticator, Credentials
from node_agent.registry.reference import Reference

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)

CHUNK_SIZE = 1 << 20
"""Bytes per read from a response body or a blob being sent."""

MAX_ERROR_BODY = 64 << 10
"""Largest error body read for its message; larger ones are not read."""

MAX_REDIRECTS = 5

SEND_PIECE = 64 << 10
"""Bytes handed to one socket send: a stalled peer is noticed within one piece."""

_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class Resend(Exception):
    """A request whose streamed body was already used must be started again by its caller.

    Raised when a kept-alive connection turned out to be closed, or when the
    registry asked for (new) credentials after the body was sent.
    """


@dataclass(frozen=True)
class Origin:
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


def _target(url: str) -> str:
    """The request target (path and query) of an absolute URL."""
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def _path_only(url: str) -> str:
    """A URL without its query, for messages and logs."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def _host_port(origin: Origin) -> str:
    """``host:port`` of an origin, the port always named (``[v6]:port`` for IPv6)."""
    return f"[{origin.host}]:{origin.port}" if ":" in origin.host else f"{origin.host}:{origin.port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_stale(exc: BaseException) -> bool:
    return isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, http.client.BadStatusLine))


def _clean(text: str, limit: int = 300) -> str:
    """A registry-supplied string made safe and short for an error message."""
    text = "".join(ch if ch.isprintable() else " " for ch in text).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error_detail(body: bytes) -> str:
    """``CODE: message`` items of an OCI error body, or its first line of text."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("errors"), list):
        items = []
        for err in doc["errors"][:3]:
            if isinstance(err, dict):
                code, message = err.get("code"), err.get("message")
                items.append(_clean(f"{code if isinstance(code, str) else '?'}: {message if isinstance(message, str) else ''}", 200))
        if items:
            return "; ".join(items)
    line = body.decode("utf-8", "replace").strip().splitlines()[:1]
    return _clean(line[0], 200) if line else ""


def log_failure(logger: logging.Logger, op: str, ref: object, exc: BaseException) -> None:
    """One warning line for a push or pull that did not finish: the reference, and why (never a credential)."""
    name = str(ref) if isinstance(ref, Reference) else _clean(str(ref), 300)
    if isinstance(exc, DeadlineExceeded):
        how = "timed out"
    elif isinstance(exc, (Cancelled, KeyboardInterrupt, SystemExit, GeneratorExit)) or type(exc).__name__ == "CancelledError":
        how = "was cancelled"  # CancelledError: asyncio's or concurrent.futures', whichever reached this thread
    else:
        how = "failed"
    code = exc.code if isinstance(exc, AgentError) else type(exc).__name__
    detail = _clean(str(exc), 1000)
    logger.warning("%s of %s %s (%s)%s", op, name, how, code, f": {detail}" if detail else "", extra={"phase": op})


class _NetError(Exception):
    """Carries a socket or HTTP failure out of ``_net``, apart from every other error."""

    def __init__(self, exc: OSError | http.client.HTTPException) -> None:
        super().__init__(str(exc))
        self.exc = exc


_T = TypeVar("_T")


def _net(fn: Callable[..., _T], *args: object) -> _T:
    try:
        return fn(*args)
    except (OSError, http.client.HTTPException) as exc:
        raise _NetError(exc) from exc


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


class _Overdue(TimeoutError):
    """A socket operation refused or cut short by the request's deadline."""

    def __init__(self, deadline: Deadline) -> None:
        super().__init__(f"past the deadline of {deadline.seconds:g}s")
        self.deadline = deadline


class _Pace:
    """A connection's clock: each socket operation gets ``io_timeout``, cut to what is left of ``deadline``."""

    def __init__(self, io_timeout: float) -> None:
        self.io_timeout = io_timeout
        self.deadline: Deadline | None = None

    @contextlib.contextmanager
    def op(self, sock: socket.socket | None) -> Iterator[float]:
        """Around one socket operation: its timeout (set on ``sock``, and yielded); _Overdue if the deadline ends it."""
        timeout, bound = self.io_timeout, None
        deadline = self.deadline
        if deadline is not None:
            left = deadline.remaining()
            if left <= 0:
                raise _Overdue(deadline)
            if left < timeout:
                timeout, bound = left, deadline
        if sock is not None:
            sock.settimeout(timeout)
        try:
            yield timeout
        except TimeoutError as exc:
            if bound is not None and not isinstance(exc, _Overdue):
                raise _Overdue(bound) from exc
            raise


class _SocketReader(io.RawIOBase):
    """The raw stream under a response: one receive per read, each through the connection's pace.

    It holds ``file`` (the socket's own file, which ``http.client`` made)
    until it is closed: like that file, it keeps the socket open for the
    rest of the response after the connection itself was closed.
    """

    def __init__(self, sock: socket.socket, pace: _Pace, file: io.BufferedReader) -> None:
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
        with self._pace.op(self._sock):
            return self._sock.recv_into(buffer)


def _response_class(pace: _Pace) -> type[http.client.HTTPResponse]:
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


class _Connection(http.client.HTTPConnection):
    """HTTP, or HTTPS with ``tls``, to one origin; every socket operation goes through ``pace``."""

    def __init__(self, origin: Origin, io_timeout: float, tls: ssl.SSLContext | None) -> None:
        super().__init__(origin.host, origin.port, timeout=io_timeout)
        self.default_port = 443 if tls is not None else 80  # the Host header names other ports only
        self.pace = _Pace(io_timeout)
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


def _start_request(conn: _Connection, method: str, target: str, headers: dict[str, str], length: int) -> None:
    conn.putrequest(method, target, skip_accept_encoding=True)
    for name, value in headers.items():
        conn.putheader(name, value)
    if length or method in ("POST", "PUT", "PATCH"):
        conn.putheader("Content-Length", str(length))
    conn.endheaders()


@dataclass(frozen=True)
class Body:
    """A streamed request body of known length, read once."""

    length: int
    chunks: Iterable[bytes]


class Response:
    """An HTTP response; close it (or use ``with``) so its connection can be reused."""

    def __init__(self, session: Session, origin: Origin, conn: _Connection, raw: http.client.HTTPResponse, url: str) -> None:
        self._session = session
        self._origin = origin
        self._conn: _Connection | None = conn
        self._raw = raw
        self.url = url
        self.status = raw.status

    def __enter__(self) -> Response:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def header(self, name: str) -> str | None:
        return self._raw.getheader(name)

    def headers(self, name: str) -> list[str]:
        return self._raw.headers.get_all(name) or []

    @property
    def content_length(self) -> int | None:
        value = self.header("Content-Length")
        if value is None or not (value.isascii() and value.isdigit()) or len(value) > 18:
            return None
        return int(value)

    def read(self, limit: int, what: str) -> bytes:
        """The whole body; ResourceExhausted when it is longer than ``limit``."""
        length = self.content_length
        if length is not None and length > limit:
            self.close()
            raise ResourceExhausted(f"{self._session.where}: {what} is {length} bytes, more than the {limit} allowed")
        try:
            data = self._raw.read(limit + 1)
            if len(data) > limit:
                raise ResourceExhausted(f"{self._session.where}: {what} is more than the {limit} bytes allowed")
            if length is not None and len(data) < length:
                raise Unavailable(f"{self._session.where}: the connection closed {len(data)} bytes into {what}")
            if not self._raw.isclosed() and self._raw.read(1):
                raise ResourceExhausted(f"{self._session.where}: {what} is more than the {limit} bytes allowed")
        except (OSError, http.client.HTTPException) as exc:
            self._drop()
            raise self._session.map_error(exc, self._origin, what) from exc
        except BaseException:
            self._drop()
            raise
        self.close()
        return data

    def chunks(self, size: int, what: str) -> Iterator[bytes]:
        """Exactly ``size`` bytes of body, in pieces; errors if the body is shorter or longer."""
        length = self.content_length
        if length is not None and length != size:
            self.close()
            raise DataLoss(f"{self._session.where}: {what} is {length} bytes, not the {size} its descriptor says")
        remaining = size
        try:
            while remaining:
                data = self._raw.read(min(CHUNK_SIZE, remaining))
                if not data:
                    raise Unavailable(f"{self._session.where}: the connection closed {size - remaining} bytes into {what}")
                remaining -= len(data)
                yield data
            if not self._raw.isclosed() and self._raw.read(1):
                raise DataLoss(f"{self._session.where}: {what} is longer than the {size} bytes its descriptor says")
        except (OSError, http.client.HTTPException) as exc:
            self._drop()
            raise self._session.map_error(exc, self._origin, what) from exc
        except BaseException:
            self._drop()
            raise
        self.close()

    def error(self, what: str) -> AgentError:
        """The error for an unexpected status, with the registry's own message when it sent one."""
        detail = ""
        length = self.content_length
        if length is None or length <= MAX_ERROR_BODY:
            try:
                detail = _error_detail(self._raw.read(MAX_ERROR_BODY))
            except (OSError, http.client.HTTPException):
                pass
        self._drop()
        return self._session.status_error(self.status, what, detail)

    def close(self) -> None:
        """Give the connection back when the body was read to the end; drop it otherwise."""
        if self._conn is None:
            return
        if not self._raw.isclosed():
            length = self.content_length
            if length is not None and length <= MAX_ERROR_BODY:
                try:
                    self._raw.read()
                except (OSError, http.client.HTTPException):
                    pass
        if self._raw.isclosed() and not self._raw.will_close:
            self._session.release(self._origin, self._conn)
            self._conn = None
        else:
            self._drop()

    def _drop(self) -> None:
        if self._conn is not None:
            self._raw.close()
            self._conn.close()
            self._conn = None


def _positive(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise InvalidArgument(f"{what} must be a finite positive number, got {value!r}")
    return float(value)


class Session:
    """Requests to one repository of one registry, with the credentials to use there.

    ``settings`` (the agent's ``registry:`` section) bound each request and
    name the token realms besides the registry's own that may be asked;
    ``timeout``, when given, replaces its ``io-timeout``.
    """

    def __init__(
        self,
        ref: Reference,
        creds: Credentials,
        *,
        actions: str,
        settings: RegistrySettings | None = None,
        timeout: float | None = None,
    ) -> None:
        creds.check()
        settings = settings or RegistrySettings()
        self.request_timeout = _positive("registry.request-timeout", settings.request_timeout)
        self.min_rate = _positive("registry.min-rate", settings.min_rate)
        self.timeout = _positive("the registry timeout", settings.io_timeout if timeout is None else timeout)
        self.ref = ref
        self.creds = creds
        self.scheme = "http" if creds.plain_http else "https"
        self.base = f"{self.scheme}://{ref.registry}"
        self.origin = origin_of(self.base)
        self.where = f"registry {ref.registry}, repository {ref.repository}"
        self.token_realms = frozenset(
            _host_port(origin_of("https://" + token_realm_host(entry))) for entry in settings.token_realms
        )
        self._tls: ssl.SSLContext | None = None
        self._pool: dict[Origin, _Connection] = {}
        self._deadline: Deadline | None = None  # of the request in progress, for the tokens it fetches
        self.auth = Authenticator(ref.registry, ref.repository, creds, actions, self._fetch_token)
        if creds.plain_http and not _is_loopback(self.origin.host):
            log.warning("plain HTTP to registry %s, which is not on loopback", ref.registry)
        if creds.insecure_skip_verify:
            log.warning("not verifying the TLS certificate of registry %s", ref.registry)

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for conn in self._pool.values():
            conn.close()
        self._pool.clear()

    def url(self, path: str) -> str:
        """An absolute URL on the registry for ``/v2/...``."""
        return self.base + path

    # -- connections -------------------------------------------------------------------

    def tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            ctx = ssl.create_default_context()
            if self.creds.ca_file:
                try:
                    ctx.load_verify_locations(cafile=self.creds.ca_file)
                except FileNotFoundError:
                    raise InvalidArgument(f"CA file {self.creds.ca_file} does not exist") from None
                except (ssl.SSLError, OSError) as exc:
                    raise InvalidArgument(f"CA file {self.creds.ca_file} is not a usable PEM bundle: {exc}") from None
            if self.creds.ca_pem:
                try:
                    ctx.load_verify_locations(cadata=self.creds.ca_pem)
                except (ssl.SSLError, ValueError) as exc:
                    raise InvalidArgument(f"the registry CA bundle given is not a usable PEM bundle: {exc}") from None
            if self.creds.insecure_skip_verify:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            self._tls = ctx
        return self._tls

    def _connection(self, origin: Origin) -> tuple[_Connection, bool]:
        conn = self._pool.pop(origin, None)
        if conn is not None:
            return conn, True
        return _Connection(origin, self.timeout, self.tls_context() if origin.scheme == "https" else None), False

    def release(self, origin: Origin, conn: _Connection) -> None:
        old = self._pool.pop(origin, None)
        if old is not None:
            old.close()
        if len(self._pool) >= 4:
            first = next(iter(self._pool))
            self._pool.pop(first).close()
        self._pool[origin] = conn

    # -- errors ------------------------------------------------------------------------

    def map_error(self, exc: BaseException, origin: Origin, what: str) -> AgentError:
        """The AgentError for a network failure while doing ``what``."""
        if isinstance(exc, AgentError):
            return exc
        where = self.where if origin == self.origin else f"{self.where}: {origin.netloc}"
        if isinstance(exc, _Overdue):
            return exc.deadline.error(where)
        if isinstance(exc, ssl.SSLCertVerificationError):
            return FailedPrecondition(
                f"{where}: the TLS certificate of {origin.netloc} is not trusted ({exc.verify_message}); "
                "give the CA that signed it as the CA file"
            )
        if isinstance(exc, ssl.SSLError):
            hint = " (it may serve plain HTTP)" if exc.reason == "WRONG_VERSION_NUMBER" else ""
            return Unavailable(f"{where}: TLS with {origin.netloc} failed: {exc.reason or exc}{hint}")
        if isinstance(exc, TimeoutError):
            return DeadlineExceeded(f"{where}: {origin.netloc} did not answer within {self.timeout:g}s ({what})")
        if isinstance(exc, ConnectionRefusedError):
            return Unavailable(f"{where}: {origin.netloc} refused the connection; is the registry running there?")
        if isinstance(exc, socket.gaierror):
            return Unavailable(f"{where}: cannot resolve {origin.host}: {exc.strerror}")
        if isinstance(exc, http.client.HTTPException):
            return Unavailable(f"{where}: {origin.netloc} broke the HTTP exchange ({type(exc).__name__}, {what})")
        if isinstance(exc, OSError):
            return Unavailable(f"{where}: connection to {origin.netloc} failed ({what}): {exc.strerror or exc}")
        return Unavailable(f"{where}: {what} failed: {type(exc).__name__}")

    def status_error(self, status: int, what: str, detail: str) -> AgentError:
        """The AgentError for an HTTP status the caller did not expect."""
        text = f"{self.where}: {what}: HTTP {status}" + (f" ({detail})" if detail else "")
        if status == 401:
            return Unauthenticated(text)
        if status == 403:
            return PermissionDenied(text)
        if status == 404:
            return NotFound(text)
        if status in (413, 429):
            return ResourceExhausted(text)
        if status == 400 and "HTTP request to an HTTPS server" in detail:
            return FailedPrecondition(f"{self.where}: the registry speaks HTTPS; do not ask for plain HTTP")
        if status >= 500:
            return Unavailable(text)
        return FailedPrecondition(text)

    # -- requests ----------------------------------------------------------------------

    def deadline(self, what: str, size: int | None = None) -> Deadline:
        """A new request's deadline: ``request-timeout``; for ``size`` bytes of blob, the longer of that and ``size / min-rate``."""
        if size is None:
            return Deadline(self.request_timeout, "registry.request-timeout", what)
        return Deadline(
            max(self.request_timeout, size / self.min_rate),
            f"the longer of registry.request-timeout, {self.request_timeout:g}s, "
            f"and {size} bytes at registry.min-rate, {self.min_rate:g} bytes/s",
            what,
        )

    def request(
        self,
        method: str,
        url: str,
        what: str,
        *,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
        stream: Body | None = None,
        follow_redirects: bool = False,
        size: int | None = None,
    ) -> Response:
        """Send a request to the registry, answering its auth challenges and following redirects.

        A 401 from the registry is answered (and the request sent again) while
        the authenticator can do better; a streamed body cannot be sent twice,
        so there the authenticator is updated and Resend raised.

        Everything, up to the last byte of the response's body, is over by one
        deadline (``deadline``): that of a blob transfer when ``size`` (the
        body expected) or ``stream`` (the body sent) gives its length.
        """
        deadline = self.deadline(what, size if size is not None else stream.length if stream is not None else None)
        self._deadline = deadline
        try:
            return self._request(method, url, what, headers, body, stream, follow_redirects, deadline)
        finally:
            self._deadline = None

    def _request(
        self,
        method: str,
        url: str,
        what: str,
        headers: dict[str, str] | None,
        body: bytes | None,
        stream: Body | None,
        follow_redirects: bool,
        deadline: Deadline,
    ) -> Response:
        fresh = False
        redirects = 0
        current = url
        while True:
            origin = origin_of(current)
            send_headers = dict(headers or {})
            sent_auth = self.auth.header() if origin == self.origin else None
            if sent_auth is not None:
                send_headers["Authorization"] = sent_auth
            resp = self._send(origin, method, current, send_headers, body, stream, what, deadline)
            log.debug("%s %s -> %d", method, _path_only(current), resp.status)
            if resp.status == 401 and origin == self.origin:
                challenges = resp.headers("WWW-Authenticate")
                resp.close()
                self.auth.challenged(challenges, sent_auth, fresh)
                fresh = True
                if stream is not None:
                    raise Resend(what)
                continue
            if resp.status in _REDIRECTS and follow_redirects:
                location = resp.header("Location")
                resp.close()
                redirects += 1
                if not location or redirects > MAX_REDIRECTS:
                    raise Unavailable(f"{self.where}: {what}: too many redirects, or one without a Location")
                nxt = urljoin(current, location.strip())
                target = origin_of(nxt)
                if origin.scheme == "https" and target.scheme == "http" and not self.creds.plain_http:
                    raise FailedPrecondition(f"{self.where}: {what}: refusing a redirect from HTTPS to plain HTTP")
                current = nxt
                continue
            return resp

    def _send(
        self,
        origin: Origin,
        method: str,
        url: str,
        headers: dict[str, str],
        body: bytes | None,
        stream: Body | None,
        what: str,
        deadline: Deadline,
    ) -> Response:
        """One HTTP exchange, on a kept-alive connection when there is one, over by ``deadline``.

        Only socket and HTTP failures are mapped here; an error raised by a
        streamed body's source (the store, a progress callback) passes through
        as it is, and the connection is dropped. The response's body is read
        under the same deadline.
        """
        target = _target(url)
        length = len(body) if body is not None else stream.length if stream is not None else 0
        for attempt in (1, 2):
            conn, reused = self._connection(origin)
            conn.pace.deadline = deadline
            try:
                _net(_start_request, conn, method, target, headers, length)
                if body:
                    _net(conn.send, body)
                if stream is not None:
                    sent = 0
                    for chunk in stream.chunks:
                        sent += len(chunk)
                        if sent > stream.length:
                            raise Internal(f"{what}: the body is longer than its {stream.length} bytes")
                        _net(conn.send, chunk)
                    if sent != stream.length:
                        raise Internal(f"{what}: the body is {sent} bytes, not {stream.length}")
                raw = _net(conn.getresponse)
            except _NetError as failed:
                conn.close()
                exc = failed.exc
                if reused and _is_stale(exc):
                    if stream is None and attempt == 1:
                        log.debug("kept-alive connection to %s was closed; reconnecting", origin.netloc)
                        continue
                    if stream is not None:
                        raise Resend(what) from exc
                raise self.map_error(exc, origin, what) from exc
            except BaseException:
                conn.close()
                raise
            return Response(self, origin, conn, raw, url)
        raise AssertionError("unreachable")

    # -- tokens ------------------------------------------------------------------------

    def realm_refusal(self, realm: Origin) -> str | None:
        """Why the token realm at ``realm`` may not be asked, with credentials or without; None if it may.

        Over HTTPS: the registry's own host and port, or a ``host:port`` named
        in ``registry.token-realms``. Over plain HTTP: only the registry's own
        origin (scheme, host, port), on loopback, under plain-http.
        """
        own = _host_port(self.origin)
        if realm.scheme == "https":
            if _host_port(realm) == own or _host_port(realm) in self.token_realms:
                return None
            return (
                f"an HTTPS token realm is asked only at the registry's own host:port ({own}) or at a host:port "
                f"named in the agent's registry.token-realms setting; name {_host_port(realm)} there to trust it"
            )
        if realm == self.origin and self.creds.plain_http and _is_loopback(realm.host):
            return None
        return (
            "a plain-HTTP token realm is asked only when it is the registry's own origin "
            f"(http://{self.origin.netloc}), on loopback, under plain-http; anything else must be HTTPS"
        )

    def _fetch_token(self, realm: str, query: list[tuple[str, str]], authorization: str | None) -> bytes:
        """GET a bearer token from ``realm``, if ``realm_refusal`` allows asking it at all (else nothing is sent)."""
        origin = origin_of(realm)
        refusal = self.realm_refusal(origin)
        if refusal is not None:
            raise FailedPrecondition(f"{self.where}: refusing the token realm {_path_only(realm)}: {refusal}")
        if urlsplit(realm).fragment:
            raise InvalidArgument(f"{self.where}: the token realm has a fragment")
        url = realm + ("&" if urlsplit(realm).query else "?") + urlencode(query)
        headers = {"Accept": "application/json"}
        if authorization is not None:
            headers["Authorization"] = authorization
        what = f"getting a token from {_path_only(realm)}"
        resp = self._send(origin, "GET", url, headers, None, None, what, self.deadline(what).within(self._deadline))
        log.debug("GET %s -> %d", _path_only(realm), resp.status)
        if resp.status == 200:
            return resp.read(MAX_TOKEN_RESPONSE, "the token answer")
        if resp.status in (401, 403):
            resp.close()
            if authorization is None:
                raise Unauthenticated(f"{self.where}: the token server {_path_only(realm)} requires a username and password")
            if resp.status == 403:
                raise PermissionDenied(
                    f"{self.where}: the token server {_path_only(realm)} refused user {self.creds.username!r}"
                )
            raise Unauthenticated(
                f"{self.where}: the token server {_path_only(realm)} rejected the password of user {self.creds.username!r}"
            )
        raise resp.error(f"getting a token from {_path_only(realm)}")
