"""HTTP to one registry: connections, TLS, timeouts, auth, redirects, errors.

Rule: the only module here that opens sockets. Every socket operation (connect,
TLS handshake, each send and each receive) has the session's timeout. Every
network or HTTP failure leaves as an ``AgentError`` naming the registry and
repository. Authorization goes to the registry's own origin only (and basic
credentials to the token realm it names); query strings, which may carry
signatures, and header values are never logged.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import logging
import socket
import ssl
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar
from urllib.parse import urlencode, urljoin, urlsplit

from node_agent.errors import (
    AgentError,
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

log = logging.getLogger(__name__)

CHUNK_SIZE = 1 << 20
"""Bytes per read from a response body or a blob being sent."""

MAX_ERROR_BODY = 64 << 10
"""Largest error body read for its message; larger ones are not read."""

MAX_REDIRECTS = 5

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


def _start_request(conn: http.client.HTTPConnection, method: str, target: str, headers: dict[str, str], length: int) -> None:
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

    def __init__(
        self, session: Session, origin: Origin, conn: http.client.HTTPConnection, raw: http.client.HTTPResponse, url: str
    ) -> None:
        self._session = session
        self._origin = origin
        self._conn: http.client.HTTPConnection | None = conn
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


class Session:
    """Requests to one repository of one registry, with the credentials to use there."""

    def __init__(self, ref: Reference, creds: Credentials, *, timeout: float, actions: str) -> None:
        creds.check()
        if not timeout > 0:
            raise InvalidArgument("the registry timeout must be positive")
        self.ref = ref
        self.creds = creds
        self.timeout = timeout
        self.scheme = "http" if creds.plain_http else "https"
        self.base = f"{self.scheme}://{ref.registry}"
        self.origin = origin_of(self.base)
        self.where = f"registry {ref.registry}, repository {ref.repository}"
        self._tls: ssl.SSLContext | None = None
        self._pool: dict[Origin, http.client.HTTPConnection] = {}
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
            if self.creds.insecure_skip_verify:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            self._tls = ctx
        return self._tls

    def _connection(self, origin: Origin) -> tuple[http.client.HTTPConnection, bool]:
        conn = self._pool.pop(origin, None)
        if conn is not None:
            return conn, True
        if origin.scheme == "https":
            return http.client.HTTPSConnection(origin.host, origin.port, timeout=self.timeout, context=self.tls_context()), False
        return http.client.HTTPConnection(origin.host, origin.port, timeout=self.timeout), False

    def release(self, origin: Origin, conn: http.client.HTTPConnection) -> None:
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
    ) -> Response:
        """Send a request to the registry, answering its auth challenges and following redirects.

        A 401 from the registry is answered (and the request sent again) while
        the authenticator can do better; a streamed body cannot be sent twice,
        so there the authenticator is updated and Resend raised.
        """
        fresh = False
        redirects = 0
        current = url
        while True:
            origin = origin_of(current)
            send_headers = dict(headers or {})
            sent_auth = self.auth.header() if origin == self.origin else None
            if sent_auth is not None:
                send_headers["Authorization"] = sent_auth
            resp = self._send(origin, method, current, send_headers, body, stream, what)
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
    ) -> Response:
        """One HTTP exchange, on a kept-alive connection when there is one.

        Only socket and HTTP failures are mapped here; an error raised by a
        streamed body's source (the store, a progress callback) passes through
        as it is, and the connection is dropped.
        """
        target = _target(url)
        length = len(body) if body is not None else stream.length if stream is not None else 0
        for attempt in (1, 2):
            conn, reused = self._connection(origin)
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

    def _fetch_token(self, realm: str, query: list[tuple[str, str]], authorization: str | None) -> bytes:
        """GET a bearer token from ``realm``; basic credentials only over HTTPS (or plain HTTP when allowed)."""
        origin = origin_of(realm)
        if origin.scheme == "http" and not self.creds.plain_http:
            raise FailedPrecondition(f"{self.where}: the token realm {_path_only(realm)} is plain HTTP")
        if urlsplit(realm).fragment:
            raise InvalidArgument(f"{self.where}: the token realm has a fragment")
        url = realm + ("&" if urlsplit(realm).query else "?") + urlencode(query)
        headers = {"Accept": "application/json"}
        if authorization is not None:
            headers["Authorization"] = authorization
        resp = self._send(origin, "GET", url, headers, None, None, "getting a token")
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
