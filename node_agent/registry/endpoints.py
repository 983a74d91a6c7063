"""Where a repository is reached, and with which login: the node's registry hosts and logins, and a request's own.

Rule: every transfer (a pull, a push, a lazy fetch) asks ``RegistryAccess.endpoints`` for its endpoints and
sends each request through a ``Route``, which tries them in order: the mirrors of the node's ``hosts.toml``
that may do what the request needs (``resolve`` for a tag, ``pull``, ``push``), then the registry's own
server; a host containerd would try over HTTPS and then plain HTTP is two endpoints. A login goes only to the
host it belongs to: a request's own credentials (and its CA, plain-HTTP and skip-verify options) to the
registry its reference names; the node's logins (``registry.credentials-file``) to each host by that host's
own entry there, and only where the caller lets them be used (``node_logins``: a Pod's restore names its
reference itself, so there it is ``restore.pod-credentials``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from node_agent.config.schema import RegistrySettings
from node_agent.errors import (
    AgentError,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from node_agent.registry.auth import Credentials, TokenCache
from node_agent.registry.dockerconfig import Login, NodeCredentials
from node_agent.registry.hosts import RegistryHost, filter_hosts, registry_hosts
from node_agent.registry.reference import Reference
from node_agent.registry.transport import Session

log = logging.getLogger(__name__)

T = TypeVar("T")

FALLBACK: tuple[type[AgentError], ...] = (
    Unavailable, DeadlineExceeded, NotFound, Unauthenticated, PermissionDenied, DataLoss, FailedPrecondition,
    InvalidArgument,
)
"""A host's failures after which the next host is tried (not a full disk, a cancellation or a bug of ours)."""

UNREACHABLE: tuple[type[AgentError], ...] = (Unavailable, DeadlineExceeded)
"""A host's failures after which a route passes it over for ``PASS_OVER`` seconds (each request would wait)."""

PASS_OVER = 30.0


@dataclass(frozen=True)
class Endpoint:
    """One host to try for a repository, with the credentials (login and TLS options) to use there."""

    host: RegistryHost
    creds: Credentials

    @property
    def name(self) -> str:
        return f"{self.host.scheme}://{self.host.host}"


class RegistryAccess:
    """The node's registry configuration: containerd's hosts directories and the kubelet-format logins file.

    Either may be empty (none). One per pair of paths (``of``), so the logins file is read again only when it
    changes.
    """

    _known: dict[tuple[str, str], RegistryAccess] = {}
    _known_lock = threading.Lock()

    def __init__(self, config_path: str = "", credentials_file: str = "") -> None:
        self.config_path = config_path
        self.logins = NodeCredentials(credentials_file) if credentials_file else None

    @classmethod
    def of(cls, settings: RegistrySettings | None) -> RegistryAccess:
        """The access of the agent's ``registry:`` settings (its defaults when None)."""
        settings = settings or RegistrySettings()
        key = (settings.config_path, settings.credentials_file)
        with cls._known_lock:
            found = cls._known.get(key)
            if found is None:
                found = cls._known[key] = cls(*key)
            return found

    def image_login(self, image: str) -> Login | None:
        """The node's login for a container image's registry, as the kubelet would send it with PullImage."""
        return self.logins.lookup(image) if self.logins is not None else None

    def hosts(self, ref: Reference) -> list[RegistryHost]:
        """The hosts configured for ``ref``'s registry, in order (containerd's default where nothing is configured)."""
        return registry_hosts(ref.registry, self.config_path)

    def endpoints(self, ref: Reference, need: str, given: Credentials, *, node_logins: bool = True) -> list[Endpoint]:
        """Where to send ``ref``'s requests that ``need`` ``resolve``, ``pull`` or ``push``, in order.

        ``given`` (a request's own credentials and options) applies to the registry's own server; with
        ``node_logins``, a host without a login from ``given`` gets the node's for it, if any.
        """
        hosts = filter_hosts(self.hosts(ref), need)
        if not hosts:
            raise FailedPrecondition(
                f"registry {ref.registry}: no host in the registry hosts configuration ({self.config_path}) "
                f"may {need}")
        out: list[Endpoint] = []
        for host in hosts:
            if host.is_proxy:
                creds = Credentials(plain_http=host.scheme == "http")
            else:
                host = _as_given(host, given)
                creds = replace(given, plain_http=given.plain_http or host.scheme == "http")
            if not creds.has_login and node_logins and self.logins is not None:
                login = self.logins.lookup(f"{host.host}/{ref.repository}")
                if login is not None:
                    creds = replace(creds, username=login.username, password=login.password)
            out.append(Endpoint(host, creds))
            if host.http_fallback:
                out.append(Endpoint(replace(host, scheme="http", http_fallback=False),
                                    replace(creds, plain_http=True)))
        return out


def _as_given(host: RegistryHost, given: Credentials) -> RegistryHost:
    """The registry's own server as a request's options change it: plain HTTP only, or verified with its CA."""
    if given.plain_http:
        return replace(host, scheme="http", http_fallback=False)
    if given.ca_file or given.ca_pem:
        return replace(host, skip_verify=False, http_fallback=False)
    return host


class Route:
    """Sessions to one repository's endpoints; each request is tried at them in order until one answers.

    A host that could not be reached (``UNREACHABLE``) is passed over by the route's requests for the next
    ``PASS_OVER`` seconds, unless no other is left. When every host fails, the last one's error is raised, naming the others' failures.
    One route serves one thread at a time; ``lane`` makes another for another thread, sharing its tokens.
    """

    def __init__(
        self,
        ref: Reference,
        endpoints: list[Endpoint],
        *,
        actions: str,
        settings: RegistrySettings | None = None,
        timeout: float | None = None,
        tokens: TokenCache | None = None,
    ) -> None:
        if not endpoints:
            raise FailedPrecondition(f"registry {ref.registry}: no host to send requests to")
        self.ref = ref
        self.endpoints = endpoints
        self._actions = actions
        self._settings = settings
        self._timeout = timeout
        self.tokens = tokens or TokenCache()
        self._sessions: dict[int, Session] = {}
        self._down: dict[int, float] = {}  # endpoint -> until when it is passed over

    def session(self, index: int = 0) -> Session:
        found = self._sessions.get(index)
        if found is None:
            ep = self.endpoints[index]
            found = self._sessions[index] = Session(
                self.ref, ep.creds, actions=self._actions, settings=self._settings, timeout=self._timeout,
                host=ep.host, tokens=self.tokens)
        return found

    def run(self, fn: Callable[[Session], T]) -> T:
        """``fn`` at the first endpoint that does not fail it (see ``FALLBACK``)."""
        now = time.monotonic()
        order = [i for i in range(len(self.endpoints)) if self._down.get(i, 0.0) <= now] or [len(self.endpoints) - 1]
        failed: list[tuple[Endpoint, AgentError]] = []
        for n, index in enumerate(order):
            try:
                return fn(self.session(index))
            except FALLBACK as exc:
                if isinstance(exc, UNREACHABLE):
                    self._down[index] = time.monotonic() + PASS_OVER
                if n == len(order) - 1:
                    if not failed:
                        raise
                    raise _with_earlier(exc, failed) from exc
                failed.append((self.endpoints[index], exc))
                log.info("%s: %s failed (%s); trying %s", self.ref, self.endpoints[index].name, exc.code,
                         self.endpoints[order[n + 1]].name)
        raise AssertionError("unreachable")

    def lane(self) -> Route:
        """Another route to the same endpoints, for another thread, sharing this one's tokens."""
        return Route(self.ref, self.endpoints, actions=self._actions, settings=self._settings, timeout=self._timeout,
                     tokens=self.tokens)

    def close(self) -> None:
        for session in self._sessions.values():
            session.close()
        self._sessions.clear()

    def __enter__(self) -> Route:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _with_earlier(exc: AgentError, failed: list[tuple[Endpoint, AgentError]]) -> AgentError:
    """An error of ``exc``'s kind that also names the failures before it."""
    earlier = "; ".join(f"{ep.name}: {e.code}: {e}" for ep, e in failed)
    return type(exc)(f"{exc} (tried first: {earlier})")
