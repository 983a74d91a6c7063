"""containerd's registry hosts: the ``hosts.toml`` directories under CRI's ``config_path``, read as containerd 1.7/2.x.

For a registry ``host:port`` the first of ``host_port_/``, ``host:port/`` and ``_default/`` that exists under a
root of ``config_path`` (conventionally /etc/containerd/certs.d; like containerd, several roots may be given,
separated by ':') is the registry's directory. Its ``hosts.toml`` names the hosts to try, in order: each
``[host."URL"]`` table in file order (the mirrors), then the ``server`` (when the file names none: the registry
itself, https://registry-1.docker.io for docker.io). A directory without ``hosts.toml``, or with an empty one, is
read in Docker's certs.d layout (``*.crt`` CA files, ``*.cert`` client certificates with their ``*.key``); no
directory at all leaves the registry alone, over https, trusted for everything (a loopback registry too:
containerd's implicit skip-verify and plain-HTTP fallback for loopback are not followed).

Rule: the files are the operator's, shared with containerd, and read as hostile input. The registry name is
checked (``host[:port]`` only) before it becomes part of a path, so nothing outside ``config_path`` is looked
up for it. Where containerd logs a file it cannot decode and falls back to the certs.d layout, this raises
InvalidArgument naming the file and the key: a host list silently different from the operator's is worse than
a failed transfer. Keys this agent does not know are ignored (logged at debug level); ``proxy`` is accepted
with a warning, as this agent does not use it. Nothing here opens a connection or reads a certificate.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import stat
import threading
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from node_agent.errors import FailedPrecondition, InvalidArgument
from node_agent.registry.reference import HTTP_TOKEN, is_printable, parse_reference, show
from node_agent.store.files import read_upto

log = logging.getLogger(__name__)

HOSTS_FILE = "hosts.toml"
DEFAULT_DIRECTORY = "_default"
MAX_HOSTS_FILE = 1 << 20
"""Largest hosts.toml read."""

CAPABILITIES = frozenset({"pull", "resolve", "push", "referrers"})
"""What a host may be trusted with (containerd 2.2 added ``referrers``; an entry naming none gets them all)."""

DOCKER_HUB = "docker.io"
DOCKER_HUB_SERVER = "registry-1.docker.io"

_KNOWN_KEYS = frozenset(
    {"capabilities", "ca", "client", "skip_verify", "header", "override_path", "dial_timeout", "proxy"}
)
_ROOT_ONLY_KEYS = frozenset({"server", "host"})
_HEADER_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")
# Go's time.ParseDuration: a sign, then one or more decimal numbers each with a unit.
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)", re.ASCII)
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

_proxy_warned: set[str] = set()
_proxy_lock = threading.Lock()


@dataclass(frozen=True)
class RegistryHost:
    """One host to try for a registry, as containerd would configure it.

    ``host`` is the netloc as written (``host``, ``host:port``, ``[v6]:port``); ``path`` the API root
    (``/v2``, or what the URL says under ``override_path``). ``client_certs`` are (certificate, key) pairs, the
    key ``""`` when it is in the certificate's file. ``http_fallback``: try HTTPS first and, when the TLS
    handshake fails, the same request over plain HTTP (containerd's rule for an ``http://`` host given TLS
    settings). ``dial_timeout`` is in seconds, ``None`` when the
    file sets none (``0``: no limit). ``namespace`` is the registry the hosts were looked up for.
    """

    scheme: str
    host: str
    path: str
    capabilities: frozenset[str]
    ca_files: tuple[str, ...] = ()
    client_certs: tuple[tuple[str, str], ...] = ()
    skip_verify: bool = False
    headers: tuple[tuple[str, str], ...] = ()
    is_mirror: bool = False
    dial_timeout: float | None = None
    http_fallback: bool = False
    namespace: str = ""

    def can(self, capability: str) -> bool:
        """Whether this host may be used for ``capability`` (``pull``, ``resolve``, ``push``, ``referrers``)."""
        return capability in self.capabilities

    @property
    def is_proxy(self) -> bool:
        """Whether this host is not the registry itself (containerd then sends ``?ns=<registry>``)."""
        if not self.namespace or self.namespace == self.host:
            return False
        return not (self.namespace == DOCKER_HUB and self.host == DOCKER_HUB_SERVER)

    def url(self, api_path: str) -> str:
        """The URL of ``api_path`` (what follows the API root: ``/<repository>/manifests/<tag>``) at this host.

        A host that is not the registry itself gets ``ns=<registry>`` added to the query, as containerd sends it.
        """
        target, _, query = api_path.partition("?")
        url = f"{self.scheme}://{self.host}{self.path.rstrip('/')}/{target.lstrip('/')}"
        params = [query] if query else []
        if self.is_proxy:
            params.append(f"ns={quote(self.namespace, safe='')}")
        return url + "?" + "&".join(params) if params else url


def filter_hosts(hosts: Iterable[RegistryHost], *needed: str) -> list[RegistryHost]:
    """The hosts trusted with every capability in ``needed``, in order (a tag is resolved only by ``resolve`` ones)."""
    unknown = sorted(set(needed) - CAPABILITIES)
    if unknown:
        raise InvalidArgument(f"unknown registry host capability {unknown[0]!r}")
    return [h for h in hosts if all(h.can(c) for c in needed)]


def registry_hosts(registry: str, config_path: str) -> list[RegistryHost]:
    """The hosts to try for ``registry`` (``host[:port]`` of an image reference), in order: mirrors, then the server."""
    check_registry_name(registry)
    directory = host_directory(registry, config_path)
    if directory is None:
        entries: list[_Entry] = [(None, _Settings())]
    else:
        log.debug("registry %s: hosts from %s", registry, directory)
        entries = _load_directory(directory)
    last = len(entries) - 1
    return [_finish(where, settings, registry, i < last) for i, (where, settings) in enumerate(entries)]


def check_registry_name(registry: str) -> None:
    """Raise InvalidArgument unless ``registry`` is ``host[:port]`` of an image reference (no path, no '..')."""
    if not isinstance(registry, str) or not registry or "/" in registry or "\\" in registry:
        raise InvalidArgument(f"registry {show(registry)} is not host[:port]")
    try:
        parse_reference(f"{registry}/r")
    except InvalidArgument:
        raise InvalidArgument(f"registry {show(registry)} is not host[:port]") from None


def host_directory(registry: str, config_path: str) -> str | None:
    """The directory holding ``registry``'s configuration (its ``hosts.toml``) under ``config_path``, or None."""
    check_registry_name(registry)
    if "\0" in config_path:
        raise InvalidArgument("registry hosts: config_path holds a NUL")
    for root in (r for r in config_path.split(":") if r):
        for name in _directory_names(registry):
            candidate = os.path.join(os.path.abspath(root), name)
            try:
                info = os.stat(candidate)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise FailedPrecondition(f"registry hosts: cannot look at {candidate}: {exc.strerror}") from None
            if not stat.S_ISDIR(info.st_mode):
                raise InvalidArgument(f"registry hosts: {candidate} is not a directory")
            return candidate
    return None


def _directory_names(registry: str) -> list[str]:
    # containerd's hostDirectory: the last ':' (when not the first character) becomes '_<port>_'.
    names = []
    colon = registry.rfind(":")
    if colon > 0:
        names.append(f"{registry[:colon]}_{registry[colon + 1:]}_")
    return [*names, registry, DEFAULT_DIRECTORY]


@dataclass(frozen=True)
class _Settings:
    """What one table of hosts.toml (or a certs.d directory) says, apart from the host's URL."""

    capabilities: frozenset[str] = CAPABILITIES
    ca_files: tuple[str, ...] = ()
    client_certs: tuple[tuple[str, str], ...] = ()
    skip_verify: bool = False
    headers: tuple[tuple[str, str], ...] = ()
    override_path: bool = False
    dial_timeout: float | None = None
    # containerd's "explicit TLS": ca given (even empty), a client pair, or skip_verify set either way.
    explicit_tls: bool = False


_Url = tuple[str, str, str]
"""A host's scheme, netloc and API root."""
_Entry = tuple[_Url | None, _Settings]
"""A host to try: its URL (None: the registry's default server) and its settings."""


def _load_directory(directory: str) -> list[_Entry]:
    path = os.path.join(directory, HOSTS_FILE)
    data = _read_hosts_file(path)
    if not data:
        return [(None, _certs_d(directory))]
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise InvalidArgument(f"{path} is not UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{path} is not valid TOML: {exc}") from None
    return _parse_hosts(doc, path, directory)


def _read_hosts_file(path: str) -> bytes:
    """The file's bytes; empty when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return b""
    except OSError as exc:
        raise FailedPrecondition(f"cannot read {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"{path} is not a regular file")
        if info.st_size > MAX_HOSTS_FILE:
            raise InvalidArgument(f"{path} is larger than {MAX_HOSTS_FILE} bytes")
        data = read_upto(fd, MAX_HOSTS_FILE + 1)
    except OSError as exc:
        raise FailedPrecondition(f"cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_HOSTS_FILE:
        raise InvalidArgument(f"{path} is larger than {MAX_HOSTS_FILE} bytes")
    return data


def _certs_d(directory: str) -> _Settings:
    """Docker's certs.d layout: ``*.crt`` CA files, ``*.cert`` client certificates with a ``*.key`` beside them."""
    try:
        with os.scandir(directory) as it:
            files = sorted((e.name for e in it if not e.is_dir(follow_symlinks=False)), key=os.fsencode)
    except FileNotFoundError:
        files = []
    except OSError as exc:
        raise FailedPrecondition(f"cannot list {directory}: {exc.strerror}") from None
    cas = tuple(os.path.join(directory, name) for name in files if name.endswith(".crt"))
    pairs = []
    for name in files:
        if name.endswith(".cert"):
            key = os.path.join(directory, name[: -len(".cert")] + ".key")
            try:
                os.stat(key)
            except FileNotFoundError:
                key = ""
            except OSError as exc:
                raise FailedPrecondition(f"cannot look at {key}: {exc.strerror}") from None
            pairs.append((os.path.join(directory, name), key))
    return _Settings(ca_files=cas, client_certs=tuple(pairs), explicit_tls=bool(cas or pairs))


def _parse_hosts(doc: Mapping[str, Any], path: str, base: str) -> list[_Entry]:
    entries: list[_Entry] = []
    hosts = doc.get("host", {})
    if not isinstance(hosts, Mapping):
        raise InvalidArgument(f"{path}: key host must be a table of host URLs, not {_kind(hosts)}")
    for url, table in hosts.items():
        name = f'host."{url}"'
        if not url:
            raise InvalidArgument(f"{path}: key {name} names no host")
        if not isinstance(table, Mapping):
            raise InvalidArgument(f"{path}: key {name} must be a table, not {_kind(table)}")
        for key in table:
            if key not in _KNOWN_KEYS:
                log.debug("%s: ignoring unknown key %s.%s", path, name, key)
        settings = _settings(table, path, base, f"{name}.")
        entries.append((_split_url(url, settings.override_path, path, name), settings))
    for key in doc:
        if key not in _KNOWN_KEYS and key not in _ROOT_ONLY_KEYS:
            log.debug("%s: ignoring unknown key %s", path, key)
    server = doc.get("server", "")
    if not isinstance(server, str):
        raise InvalidArgument(f"{path}: key server must be a string, not {_kind(server)}")
    settings = _settings(doc, path, base, "")
    entries.append((_split_url(server, settings.override_path, path, "server") if server else None, settings))
    return entries


def _kind(value: object) -> str:
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return {bool: "a boolean", str: "a string", int: "an integer", float: "a float"}.get(type(value), "a date or time")


def _settings(table: Mapping[str, Any], path: str, base: str, prefix: str) -> _Settings:
    """One table's settings; ``prefix`` names the table in messages (``host."URL".`` or nothing for the root)."""

    def fail(key: str, what: str) -> InvalidArgument:
        return InvalidArgument(f"{path}: key {prefix}{key} {what}")

    if "proxy" in table:
        with _proxy_lock:
            first = path not in _proxy_warned
            _proxy_warned.add(path)
        if first:
            log.warning("%s: key %sproxy is not used by node-agent; its registry requests go direct", path, prefix)

    capabilities = CAPABILITIES
    names = table.get("capabilities", [])
    if not isinstance(names, list):
        raise fail("capabilities", f"must be an array of strings, not {_kind(names)}")
    for c in names:
        if not isinstance(c, str):
            raise fail("capabilities", f"must hold strings, not {_kind(c)}")
    if names:
        lowered = frozenset(c.lower() for c in names)
        unknown = sorted(lowered - CAPABILITIES)
        if unknown:
            raise fail("capabilities", f"names an unknown capability {show(unknown[0])}")
        capabilities = lowered

    def file_path(key: str, value: object) -> str:
        if not isinstance(value, str):
            raise fail(key, f"must hold strings, not {_kind(value)}")
        if not value or "\0" in value:
            raise fail(key, "holds an empty path or a path with NUL")
        return value if os.path.isabs(value) else os.path.normpath(os.path.join(base, value))

    explicit = "ca" in table or "skip_verify" in table
    ca = table.get("ca", [])
    if isinstance(ca, str):
        ca_files: tuple[str, ...] = (file_path("ca", ca),)
    elif isinstance(ca, list):
        ca_files = tuple(file_path("ca", c) for c in ca)
    else:
        raise fail("ca", f"must be a string or an array of strings, not {_kind(ca)}")

    client = table.get("client", [])
    pairs: list[tuple[str, str]] = []
    for item in client if isinstance(client, list) else [client]:
        if isinstance(item, str):
            pairs.append((file_path("client", item), ""))
        elif isinstance(item, list) and len(item) == 2:
            cert, key = item
            key_path = "" if key == "" else file_path("client", key)
            pairs.append((file_path("client", cert), key_path))
        else:
            raise fail("client", "must be a path, an array of paths or an array of [certificate, key] pairs")
    explicit = explicit or bool(pairs)

    skip_verify = table.get("skip_verify", False)
    override_path = table.get("override_path", False)
    for key, flag in (("skip_verify", skip_verify), ("override_path", override_path)):
        if not isinstance(flag, bool):
            raise fail(key, f"must be a boolean, not {_kind(flag)}")

    timeout = table.get("dial_timeout", "")
    if not isinstance(timeout, str):
        raise fail("dial_timeout", f"must be a duration string like \"1s\", not {_kind(timeout)}")
    dial_timeout = _duration(timeout) if timeout else None
    if timeout and dial_timeout is None:
        raise fail("dial_timeout", f"is not a non-negative duration like \"500ms\" or \"1m30s\": {show(timeout)}")

    return _Settings(
        capabilities=capabilities,
        ca_files=ca_files,
        client_certs=tuple(pairs),
        skip_verify=skip_verify,
        headers=_headers(table.get("header", {}), fail),
        override_path=override_path,
        dial_timeout=dial_timeout,
        explicit_tls=explicit,
    )


def _headers(header: object, fail: Callable[[str, str], InvalidArgument]) -> tuple[tuple[str, str], ...]:
    if not isinstance(header, Mapping):
        raise fail("header", f"must be a table, not {_kind(header)}")
    out: list[tuple[str, str]] = []
    for name, value in header.items():
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise fail(f"header.{name}", f"must be a string or an array of strings, not {_kind(value)}")
        if HTTP_TOKEN.fullmatch(name) is None:
            raise fail(f"header.{show(name)}", "is not an HTTP header name")
        for v in values:
            if _HEADER_VALUE.fullmatch(v) is None:
                raise fail(f"header.{name}", "holds a control character")
            out.append((name, v))
    return tuple(out)


def _duration(text: str) -> float | None:
    """Seconds in a Go duration (``300ms``, ``1m30s``, ``0``); None when malformed or negative."""
    body = text[1:] if text.startswith("+") else text
    if body == "0":
        return 0.0
    total, pos = 0.0, 0
    while pos < len(body):
        m = _DURATION_PART.match(body, pos)
        if m is None:
            return None
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    return total if body else None


def _split_url(text: str, override_path: bool, path: str, key: str) -> tuple[str, str, str]:
    """``(scheme, netloc, API root)`` of a host URL; one without a scheme is https, as in containerd."""

    def fail(what: str) -> InvalidArgument:
        return InvalidArgument(f"{path}: key {key}: {what}")

    if not is_printable(text):
        raise fail(f"{show(text)} has spaces, control or non-ASCII characters")
    if not text.lower().startswith(("http://", "https://")):
        if "://" in text:
            raise fail(f"{show(text)}: only http:// and https:// hosts are supported")
        text = "https://" + text
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError:
        raise fail(f"{show(text)} is not a valid URL") from None
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise fail("the URL must not hold credentials")
    if not parts.hostname:
        raise fail(f"{show(text)} names no host")
    if parts.query or parts.fragment or text.endswith(("?", "#")):
        raise fail(f"{show(text)} must not have a query or fragment")
    # Go's path.Clean, then "/v2" appended unless the path ends with it or override_path says it is the root.
    root = posixpath.normpath(parts.path) if parts.path else ""
    root = "" if root.strip("/") == "" else "/" + root.lstrip("/")
    if not override_path and not root.endswith("/v2"):
        root += "/v2"
    return parts.scheme, parts.netloc, root


def _port_of(host: str) -> str:
    """The port of ``host:port`` / ``[v6]:port`` as Go's net.SplitHostPort finds it; ``""`` when there is none."""
    if host.startswith("["):
        rest = host[host.find("]") + 1 :]
        return rest[1:] if rest.startswith(":") else ""
    return host.partition(":")[2] if host.count(":") == 1 else ""


def _finish(where: _Url | None, s: _Settings, registry: str, is_mirror: bool) -> RegistryHost:
    skip_verify, explicit = s.skip_verify, s.explicit_tls
    if where is not None:
        scheme, host, root = where
        capabilities = s.capabilities
    else:
        # No `server`: the registry itself, trusted with everything (the table's capabilities do not apply).
        root, capabilities, host, scheme = "/v2", CAPABILITIES, registry, "https"
        if registry == DOCKER_HUB:
            host = DOCKER_HUB_SERVER
        # containerd also trusts a loopback registry with nothing configured without verifying it, and falls
        # back to plain HTTP there; this agent does not: a loopback registry is HTTPS, verified, unless the
        # operator's hosts.toml (or a request's plain-http) says otherwise.
    fallback = False
    if scheme == "http" and explicit and _port_of(host) != "80":
        # containerd: an http host given TLS settings tries HTTPS first, then plain HTTP.
        scheme, fallback = "https", True
    return RegistryHost(
        scheme=scheme,
        host=host,
        path=root,
        capabilities=capabilities,
        ca_files=s.ca_files,
        client_certs=s.client_certs,
        skip_verify=skip_verify,
        headers=s.headers,
        is_mirror=is_mirror,
        dial_timeout=s.dial_timeout,
        http_fallback=fallback,
        namespace=registry,
    )

