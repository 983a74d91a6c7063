"""Registry credentials and the answers to ``WWW-Authenticate`` challenges.

No I/O here: the transport sends requests and hands challenges in; fetching a
bearer token goes through a callable it supplies. Secrets never appear in
``repr``, log records or error messages.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from node_agent.errors import InvalidArgument, PermissionDenied, Unauthenticated, Unavailable
from node_agent.registry.reference import HTTP_TOKEN

MAX_TOKEN_RESPONSE = 1 << 20
"""Largest token-server answer read."""

DEFAULT_TOKEN_LIFETIME = 60
"""Seconds a token lives when the server does not say (the distribution token spec's default)."""

_TOKEN_CHARS = re.compile(r"[A-Za-z0-9\-._~+/]+=*", re.ASCII)
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"', re.ASCII | re.DOTALL)
_SAFE_PARAM = re.compile(r"[\x20-\x7e]*", re.ASCII)
MAX_TOKEN_LENGTH = 1 << 16


MAX_CA_PEM = 1 << 20


@dataclass(frozen=True)
class Credentials:
    """How to reach and log in to a registry. ``repr`` hides the password."""

    username: str = ""
    password: str = field(default="", repr=False)
    ca_file: str = ""
    # The CA bundle itself (PEM), as a caller that may not name node paths sends it.
    ca_pem: str = ""
    plain_http: bool = False
    insecure_skip_verify: bool = False

    def check(self) -> None:
        """Raise InvalidArgument if the values cannot be sent (checked when a transfer starts)."""
        if ":" in self.username:
            raise InvalidArgument("registry username must not contain ':'")
        for what, value in (("username", self.username), ("password", self.password)):
            if any(ch in value for ch in "\r\n\0"):
                raise InvalidArgument(f"registry {what} must not contain CR, LF or NUL")
        if self.password and not self.username:
            raise InvalidArgument("a registry password needs a username")
        if len(self.ca_pem) > MAX_CA_PEM:
            raise InvalidArgument(f"a registry CA bundle must be at most {MAX_CA_PEM} bytes")

    @property
    def has_login(self) -> bool:
        return bool(self.username)

    def basic_header(self) -> str:
        """The ``Authorization`` value for HTTP basic auth."""
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode("ascii")


@dataclass(frozen=True)
class Challenge:
    """One challenge of a ``WWW-Authenticate`` header; the scheme is lowercased."""

    scheme: str
    params: dict[str, str]


def _skip_space(value: str, pos: int) -> int:
    while pos < len(value) and value[pos] in " \t":
        pos += 1
    return pos


def parse_challenges(values: Sequence[str]) -> list[Challenge]:
    """Parse ``WWW-Authenticate`` header values (RFC 7235 auth-params; token68 is skipped).

    Parsing stops quietly at the first malformed piece of a value, keeping what came before.
    """
    out: list[Challenge] = []
    for value in values:
        pos, n = 0, len(value)
        current: Challenge | None = None
        while pos < n:
            pos = _skip_space(value, pos)
            if pos < n and value[pos] == ",":
                pos += 1
                continue
            m = HTTP_TOKEN.match(value, pos)
            if m is None:
                break
            word, pos = m.group(0), m.end()
            after = _skip_space(value, pos)
            is_param = after < n and value[after] == "=" and not value.startswith("==", after)
            if current is not None and is_param:
                pos = _skip_space(value, after + 1)
                q = _QUOTED.match(value, pos)
                if q is not None:
                    param = re.sub(r"\\(.)", r"\1", q.group(1))
                    pos = q.end()
                else:
                    t = HTTP_TOKEN.match(value, pos)
                    if t is None:
                        break
                    param, pos = t.group(0), t.end()
                current.params.setdefault(word.lower(), param)
            elif current is not None and not current.params and after < n and value[after] == "=":
                pos = after  # a token68 right after the scheme
                while pos < n and value[pos] == "=":
                    pos += 1
            else:
                current = Challenge(word.lower(), {})
                out.append(current)
    return out


@dataclass
class _Token:
    value: str
    expires: float


def parse_token_response(body: bytes, realm: str) -> tuple[str, float]:
    """The token and its lifetime in seconds from a token server's JSON answer."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise Unavailable(f"token server {realm} sent an answer that is not JSON") from None
    if not isinstance(doc, dict):
        raise Unavailable(f"token server {realm} sent an answer that is not a JSON object")
    token = doc.get("token") or doc.get("access_token")
    if not isinstance(token, str) or not token:
        raise Unavailable(f"token server {realm} sent no token")
    if len(token) > MAX_TOKEN_LENGTH or _TOKEN_CHARS.fullmatch(token) is None:
        raise Unavailable(f"token server {realm} sent a malformed token")
    lifetime = doc.get("expires_in", DEFAULT_TOKEN_LIFETIME)
    if isinstance(lifetime, bool) or not isinstance(lifetime, int) or lifetime <= 0:
        lifetime = DEFAULT_TOKEN_LIFETIME
    return token, float(min(lifetime, 86400))


TokenFetcher = Callable[[str, list[tuple[str, str]], str | None], bytes]
"""``(realm, query, authorization or None) -> body``: GET the realm; raises on failure."""


_TokenKey = tuple[str, str, tuple[str, ...]]  # realm, service, scopes


class TokenCache:
    """Bearer tokens by (user, realm, service, scopes), shared by the sessions of one transfer (its lanes),
    so that one token serves them all; one token is fetched at a time."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.tokens: dict[tuple[str, _TokenKey], _Token] = {}


class Authenticator:
    """Answers a registry's challenges for one repository and remembers what worked.

    Basic: once challenged, every request to the registry carries the credentials.
    Bearer: tokens are cached per (realm, service, scopes) until they expire; a
    401 with a token drops it and fetches another; a 401 for a token just
    fetched is final. Which realms may be asked at all, with the credentials
    or without, is the fetcher's rule (``transport.Session.realm_refusal``):
    it refuses the others before anything is sent.
    """

    def __init__(
        self,
        registry: str,
        repository: str,
        creds: Credentials,
        actions: str,
        fetch: TokenFetcher,
        *,
        clock: Callable[[], float] = time.monotonic,
        tokens: TokenCache | None = None,
    ) -> None:
        self.registry = registry
        self.repository = repository
        self.creds = creds
        self.intent = f"repository:{repository}:{actions}"
        self.actions = actions
        self._fetch = fetch
        self._clock = clock
        self._basic = False
        self._cache = tokens or TokenCache()
        self._current: _TokenKey | None = None
        self.tokens_fetched = 0

    def _cached(self, key: _TokenKey) -> _Token | None:
        """A token for ``key`` that has not expired, this session's or another lane's."""
        token = self._cache.tokens.get((self.creds.username, key))
        return token if token is not None and token.expires > self._clock() else None

    def header(self) -> str | None:
        """The ``Authorization`` value to send to the registry now, if any."""
        if self._current is not None:
            with self._cache.lock:
                token = self._cached(self._current)
                # Expired: fetch a fresh one for the same scopes before sending.
                return "Bearer " + (token.value if token is not None else self._fetch_token(self._current))
        if self._basic:
            return self.creds.basic_header()
        return None

    def _what(self) -> str:
        return f"registry {self.registry}, repository {self.repository}"

    def challenged(self, values: Sequence[str], sent: str | None, fresh: bool) -> None:
        """Handle a 401. Returns when the request should be sent again; raises when it should not.

        ``sent`` is the Authorization value the refused request carried,
        ``fresh`` whether that value was obtained during this request.
        """
        challenges = parse_challenges(values)
        bearer = next((c for c in challenges if c.scheme == "bearer"), None)
        basic = next((c for c in challenges if c.scheme == "basic"), None)
        if bearer is not None:
            self._bearer(bearer, sent, fresh)
            return
        if basic is not None:
            if not self.creds.has_login:
                raise Unauthenticated(f"{self._what()}: the registry requires a username and password")
            if sent is not None and sent.startswith("Basic "):
                raise Unauthenticated(f"{self._what()}: the registry rejected the password of user {self.creds.username!r}")
            self._basic = True
            return
        if sent is None and not challenges:
            raise Unauthenticated(f"{self._what()}: the registry requires authentication but sent no challenge")
        raise Unauthenticated(f"{self._what()}: the registry refused the request (no supported auth scheme offered)")

    def _bearer(self, challenge: Challenge, sent: str | None, fresh: bool) -> None:
        realm = challenge.params.get("realm", "")
        if not realm:
            raise Unauthenticated(f"{self._what()}: bearer challenge without a realm")
        service = challenge.params.get("service", "")
        scopes: list[str] = []
        for scope in challenge.params.get("scope", "").split(" "):
            if scope and _SAFE_PARAM.fullmatch(scope) and scope not in scopes and not self._covers(scope):
                scopes.append(scope)
        if self.intent not in scopes:
            scopes.append(self.intent)
        key = (realm, service, tuple(scopes))
        if sent is not None and sent.startswith("Bearer ") and fresh:
            error = challenge.params.get("error", "")
            if error == "insufficient_scope" or not self.creds.has_login:
                if not self.creds.has_login:
                    raise Unauthenticated(f"{self._what()}: the registry requires a username and password")
                raise PermissionDenied(
                    f"{self._what()}: user {self.creds.username!r} may not {self.actions.replace(',', ' and ')} here"
                )
            raise Unauthenticated(f"{self._what()}: the registry rejected the token issued by {realm}")
        with self._cache.lock:
            token = self._cached(key)
            if token is None or sent == "Bearer " + token.value:  # none yet, or the very one refused: a new one
                self._fetch_token(key)
        self._current = key

    def _covers(self, scope: str) -> bool:
        """Whether the whole operation's scope already grants ``scope`` (the same repository, fewer actions): then
        one token serves every request of the operation, whichever scope a challenge named."""
        kind, _, rest = scope.partition(":")
        name, _, actions = rest.rpartition(":")
        return (kind == "repository" and name == self.repository
                and set(actions.split(",")) <= set(self.actions.split(",")))

    def _fetch_token(self, key: _TokenKey) -> str:
        realm, service, scopes = key
        query: list[tuple[str, str]] = []
        if service:
            query.append(("service", service))
        query.extend(("scope", s) for s in scopes)
        if self.creds.has_login:
            query.append(("account", self.creds.username))
        auth = self.creds.basic_header() if self.creds.has_login else None
        body = self._fetch(realm, query, auth)
        value, lifetime = parse_token_response(body, realm)
        self.tokens_fetched += 1
        margin = min(10.0, lifetime / 4)
        self._cache.tokens[(self.creds.username, key)] = _Token(value, self._clock() + lifetime - margin)
        return value
