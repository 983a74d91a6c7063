"""HTTP to one registry: connections kept alive, deadlines, auth, redirects, errors.

Rule: the only module here that opens sockets (through ``connection``). Every
request (one ``Session.request``: its redirects, auth retries and body; one
token fetch) has a deadline, ``request-timeout``, or for a blob of N bytes
``max(request-timeout, N / min-rate)``; every socket operation (connect, TLS
handshake, each send and each receive) gets ``io-timeout``, cut to what is
left of that deadline, and none starts once it has passed. Every network or
HTTP failure leaves as an ``AgentError`` naming the registry and repository
(``failures``). Authorization goes to the registry's own origin only; a token
realm is asked (with basic credentials or without) only where
``realm_refusal`` allows it. Query strings, which may carry signatures, and
header values are never logged.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import math
import ssl
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING
from urllib.parse import urlencode, urljoin, urlsplit

from node_agent import tls
from node_agent.config.schema import RegistrySettings
from node_agent.config.validation import token_realm_host
from node_agent.errors import (
    AgentError,
    DataLoss,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from node_agent.registry.auth import MAX_CA_PEM, MAX_TOKEN_RESPONSE, Authenticator, Credentials, TokenCache
from node_agent.registry.connection import (
    Connection,
    Deadline,
    NetError,
    Origin,
    host_port,
    is_loopback,
    is_stale,
    net,
    origin_of,
    path_only,
    request_target,
    start_request,
)
from node_agent.registry.failures import error_detail, network_error, status_error
from node_agent.registry.hosts import CAPABILITIES, RegistryHost
from node_agent.registry.reference import Reference

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

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
class Body:
    """A streamed request body of known length, read once."""

    length: int
    chunks: Iterable[bytes]


class Response:
    """An HTTP response; close it (or use ``with``) so its connection can be reused."""

    def __init__(self, session: Session, origin: Origin, conn: Connection, raw: http.client.HTTPResponse, url: str) -> None:
        self._session = session
        self._origin = origin
        self._conn: Connection | None = conn
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
        body = self.body(size, what)
        while piece := body.read(CHUNK_SIZE):
            yield piece

    def body(self, size: int, what: str) -> BodyReader:
        """A reader of exactly ``size`` bytes of body; DataLoss at once if the registry says it has another length."""
        length = self.content_length
        if length is not None and length != size:
            self.close()
            raise DataLoss(f"{self._session.where}: {what} is {length} bytes, not the {size} its descriptor says")
        return BodyReader(self, size, what)

    def error(self, what: str) -> AgentError:
        """The error for an unexpected status, with the registry's own message when it sent one."""
        detail = ""
        length = self.content_length
        if length is None or length <= MAX_ERROR_BODY:
            try:
                detail = error_detail(self._raw.read(MAX_ERROR_BODY))
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


class BodyReader:
    """Exactly ``size`` bytes of a response's body, read in pieces (``read``) or into the caller's buffers
    (``readinto``, which receives a large buffer in one go: ``connection``). A body that ends early is
    Unavailable, one longer than ``size`` DataLoss; the connection is given back after the last byte, and
    dropped on any failure."""

    def __init__(self, resp: Response, size: int, what: str) -> None:
        self._resp = resp
        self._size = size
        self._what = what
        self.remaining = size

    def read(self, most: int) -> bytes:
        """Up to ``most`` bytes (b"" once all came)."""
        if not self.remaining:
            return b""
        with self._guarded():
            data = self._resp._raw.read(min(most, self.remaining))
        self._arrived(len(data))
        return data

    def readinto(self, buffer: WriteableBuffer) -> int:
        """Fill ``buffer`` (up to what is left of the body); the bytes received (0 once all came)."""
        if not self.remaining:
            return 0
        view = memoryview(buffer).cast("B")[: self.remaining]
        with self._guarded():
            got = self._resp._raw.readinto(view)
        self._arrived(got)
        return got

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """Around a receive: a network failure leaves as the registry's error, and any failure drops the
        connection."""
        try:
            yield
        except (OSError, http.client.HTTPException) as exc:
            self._resp._drop()
            raise self._resp._session.map_error(exc, self._resp._origin, self._what) from exc
        except BaseException:
            self._resp._drop()
            raise

    def _arrived(self, got: int) -> None:
        raw = self._resp._raw
        if not got:
            self._resp._drop()
            raise Unavailable(f"{self._resp._session.where}: the connection closed {self._size - self.remaining} bytes "
                              f"into {self._what}")
        self.remaining -= got
        if self.remaining:
            return
        with self._guarded():
            extra = not raw.isclosed() and raw.read(1)
        if extra:
            self._resp._drop()
            raise DataLoss(f"{self._resp._session.where}: {self._what} is longer than the {self._size} bytes its "
                           "descriptor says")
        self._resp.close()


def _read_pem(path: str) -> str:
    """A CA bundle hosts.toml names, as text (a missing or unreadable one is the operator's error, named)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_CA_PEM + 1)
    except OSError as exc:
        raise InvalidArgument(f"the CA file {path} of the registry hosts configuration: {exc.strerror or exc}") from None
    if len(data) > MAX_CA_PEM:
        raise InvalidArgument(f"the CA file {path} of the registry hosts configuration is over {MAX_CA_PEM} bytes")
    return data.decode("ascii", "replace") + "\n"


def _positive(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise InvalidArgument(f"{what} must be a finite positive number, got {value!r}")
    return float(value)


class Session:
    """Requests to one repository of one registry, with the credentials to use there.

    ``settings`` (the agent's ``registry:`` section) bound each request and
    name the token realms besides the registry's own that may be asked;
    ``timeout``, when given, replaces its ``io-timeout``. ``host`` is where
    the requests go (a mirror of ``hosts.toml``; the registry itself when
    None), and ``tokens`` a bearer-token cache shared with the other
    sessions of the same transfer.
    """

    def __init__(
        self,
        ref: Reference,
        creds: Credentials,
        *,
        actions: str,
        settings: RegistrySettings | None = None,
        timeout: float | None = None,
        host: RegistryHost | None = None,
        tokens: TokenCache | None = None,
    ) -> None:
        creds.check()
        settings = settings or RegistrySettings()
        self.request_timeout = _positive("registry.request-timeout", settings.request_timeout)
        self.min_rate = _positive("registry.min-rate", settings.min_rate)
        self.timeout = _positive("the registry timeout", settings.io_timeout if timeout is None else timeout)
        self.ref = ref
        self.creds = creds
        if host is None:
            host = RegistryHost("http" if creds.plain_http else "https", ref.registry, "/v2", CAPABILITIES,
                                namespace=ref.registry)
        self.host = host
        self.origin = origin_of(f"{host.scheme}://{host.host}")
        self.where = f"registry {ref.registry}, repository {ref.repository}"
        if host.is_proxy:
            self.where += f", through {host.scheme}://{host.host}"
        self.token_realms = frozenset(
            host_port(origin_of("https://" + token_realm_host(entry))) for entry in settings.token_realms
        )
        self._tls: ssl.SSLContext | None = None
        self._pool: dict[Origin, Connection] = {}
        self._deadline: Deadline | None = None  # of the request in progress, for the tokens it fetches
        self.auth = Authenticator(ref.registry, ref.repository, creds, actions, self._fetch_token, tokens=tokens)
        if creds.plain_http and not is_loopback(self.origin.host):
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
        """An absolute URL at this session's host for the API path ``/v2/...`` (a mirror's own root and ``ns``)."""
        if not path.startswith("/v2/"):
            raise Internal(f"not a registry API path: {path[:80]!r}")
        return self.host.url(path[3:])

    # -- connections -------------------------------------------------------------------

    def tls_context(self) -> ssl.SSLContext:
        """The context for HTTPS: the system's CAs and the CA given, or no verification under insecure-skip-verify."""
        if self._tls is None:
            cert, key = self.host.client_certs[0] if self.host.client_certs else ("", "")
            try:
                trust = tls.Trust(
                    ca_file=self.creds.ca_file,
                    ca_pem="".join([self.creds.ca_pem, *(_read_pem(path) for path in self.host.ca_files)]),
                    keep_system_ca=True,
                    cert_file=cert,
                    key_file=key or cert,
                    insecure=self.creds.insecure_skip_verify or self.host.skip_verify,
                )
                self._tls = tls.client_context(trust, "registry")
            except tls.TrustError as exc:
                raise InvalidArgument(str(exc)) from None
        return self._tls

    def _connection(self, origin: Origin) -> tuple[Connection, bool]:
        conn = self._pool.pop(origin, None)
        if conn is not None:
            return conn, True
        return Connection(origin, self.timeout, self.tls_context() if origin.scheme == "https" else None), False

    def release(self, origin: Origin, conn: Connection) -> None:
        old = self._pool.pop(origin, None)
        if old is not None:
            old.close()
        if len(self._pool) >= 4:
            first = next(iter(self._pool))
            self._pool.pop(first).close()
        self._pool[origin] = conn

    # -- errors ------------------------------------------------------------------------

    def map_error(self, exc: BaseException, origin: Origin, what: str) -> AgentError:
        """The AgentError for a network failure with ``origin`` while doing ``what``."""
        where = self.where if origin == self.origin else f"{self.where}: {origin.netloc}"
        return network_error(exc, where, origin, self.timeout, what)

    def status_error(self, status: int, what: str, detail: str) -> AgentError:
        """The AgentError for an HTTP status the caller did not expect."""
        return status_error(self.where, status, what, detail)

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
            if origin == self.origin:
                for name, value in self.host.headers:  # hosts.toml's, below the request's own
                    if name.lower() not in {k.lower() for k in send_headers}:
                        send_headers[name] = value
            sent_auth = self.auth.header() if origin == self.origin else None
            if sent_auth is not None:
                send_headers["Authorization"] = sent_auth
            resp = self._send(origin, method, current, send_headers, body, stream, what, deadline)
            log.debug("%s %s -> %d", method, path_only(current), resp.status)
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
        target = request_target(url)
        length = len(body) if body is not None else stream.length if stream is not None else 0
        for attempt in (1, 2):
            conn, reused = self._connection(origin)
            conn.pace.deadline = deadline
            try:
                net(start_request, conn, method, target, headers, length)
                if body:
                    net(conn.send, body)
                if stream is not None:
                    sent = 0
                    for chunk in stream.chunks:
                        sent += len(chunk)
                        if sent > stream.length:
                            raise Internal(f"{what}: the body is longer than its {stream.length} bytes")
                        net(conn.send, chunk)
                    if sent != stream.length:
                        raise Internal(f"{what}: the body is {sent} bytes, not {stream.length}")
                raw = net(conn.getresponse)
            except NetError as failed:
                conn.close()
                exc = failed.exc
                if reused and is_stale(exc):
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
        own = host_port(self.origin)
        if realm.scheme == "https":
            if host_port(realm) == own or host_port(realm) in self.token_realms:
                return None
            return (
                f"an HTTPS token realm is asked only at the registry's own host:port ({own}) or at a host:port "
                f"named in the agent's registry.token-realms setting; name {host_port(realm)} there to trust it"
            )
        if realm == self.origin and self.creds.plain_http and is_loopback(realm.host):
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
            raise FailedPrecondition(f"{self.where}: refusing the token realm {path_only(realm)}: {refusal}")
        if urlsplit(realm).fragment:
            raise InvalidArgument(f"{self.where}: the token realm has a fragment")
        url = realm + ("&" if urlsplit(realm).query else "?") + urlencode(query)
        headers = {"Accept": "application/json"}
        if authorization is not None:
            headers["Authorization"] = authorization
        what = f"getting a token from {path_only(realm)}"
        resp = self._send(origin, "GET", url, headers, None, None, what, self.deadline(what).within(self._deadline))
        log.debug("GET %s -> %d", path_only(realm), resp.status)
        if resp.status == 200:
            return resp.read(MAX_TOKEN_RESPONSE, "the token answer")
        if resp.status in (401, 403):
            resp.close()
            if authorization is None:
                raise Unauthenticated(f"{self.where}: the token server {path_only(realm)} requires a username and password")
            if resp.status == 403:
                raise PermissionDenied(
                    f"{self.where}: the token server {path_only(realm)} refused user {self.creds.username!r}"
                )
            raise Unauthenticated(
                f"{self.where}: the token server {path_only(realm)} rejected the password of user {self.creds.username!r}"
            )
        raise resp.error(f"getting a token from {path_only(realm)}")
