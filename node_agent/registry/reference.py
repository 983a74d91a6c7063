"""Image references: ``host[:port]/path[:tag][@sha256:<hex>]``, parsed as hostile input.

The grammar is the distribution reference grammar, narrowed to what the agent
needs: the registry host is always named (there is no default registry), and
the only digest algorithm is sha256. What the other readers of registry names
(hosts.toml, the docker config) share with it lives here too: ``is_printable``,
``is_port``, and ``show`` for a hostile value in a message.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from node_agent.errors import InvalidArgument

MAX_REFERENCE_LENGTH = 1024
"""Longest reference text accepted, before any other check."""

MAX_NAME_LENGTH = 255
"""Longest repository path, as in the distribution grammar."""

_DOMAIN_COMPONENT = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_HOST = re.compile(rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*", re.ASCII)
_PORT = re.compile(r"[0-9]{1,5}", re.ASCII)
_PATH_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*", re.ASCII)
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", re.ASCII)
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}", re.ASCII)
_PRINTABLE = re.compile(r"[\x21-\x7e]+", re.ASCII)
HTTP_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+", re.ASCII)
"""An HTTP token (RFC 9110): a header's name, an authentication scheme or parameter name."""


def is_printable(text: str) -> bool:
    """Whether ``text`` is one or more printable ASCII characters: no space, control or non-ASCII character.

    What a reference, a docker config key, an image name and a hosts.toml URL are all made of.
    """
    return _PRINTABLE.fullmatch(text) is not None


def is_port(text: str) -> bool:
    """Whether ``text`` is a registry's port: one to five ASCII digits, a number from 1 to 65535."""
    return _PORT.fullmatch(text) is not None and 1 <= int(text) <= 65535


def show(value: object) -> str:
    """A short, printable rendering of a hostile value for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_digest(digest: str, what: str = "digest") -> str:
    """Return ``digest`` if it is ``sha256:`` and 64 lowercase hex digits, else raise InvalidArgument."""
    if not isinstance(digest, str) or _DIGEST.fullmatch(digest) is None:
        raise InvalidArgument(f"{what} {show(digest)} is not sha256:<64 lowercase hex digits>")
    return digest


def _check_registry(registry: str, text: str) -> None:
    if registry.startswith("["):
        close = registry.find("]")
        if close < 0:
            raise InvalidArgument(f"reference {show(text)}: unterminated IPv6 address in the registry host")
        literal, rest = registry[1:close], registry[close + 1 :]
        try:
            ipaddress.IPv6Address(literal)
        except ValueError:
            raise InvalidArgument(f"reference {show(text)}: {show(literal)} is not an IPv6 address") from None
        if "%" in literal:
            raise InvalidArgument(f"reference {show(text)}: zoned IPv6 addresses are not supported")
        if rest and not rest.startswith(":"):
            raise InvalidArgument(f"reference {show(text)}: bad registry host {show(registry)}")
        port = rest[1:] if rest else None
    else:
        host, sep, port_text = registry.partition(":")
        if _HOST.fullmatch(host) is None or len(host) > 253:
            raise InvalidArgument(f"reference {show(text)}: bad registry host {show(host)}")
        port = port_text if sep else None
    if port is not None:
        if not is_port(port):
            raise InvalidArgument(f"reference {show(text)}: bad registry port {show(port)}")


def _looks_like_registry(component: str) -> bool:
    return component == "localhost" or component.startswith("[") or "." in component or ":" in component


def _split(text: str) -> tuple[str, str, str | None, str | None]:
    if not isinstance(text, str):
        raise InvalidArgument(f"reference must be a string, not {type(text).__name__}")
    if not text:
        raise InvalidArgument("reference is empty")
    if len(text) > MAX_REFERENCE_LENGTH:
        raise InvalidArgument(f"reference is longer than {MAX_REFERENCE_LENGTH} characters")
    if not is_printable(text):
        raise InvalidArgument(f"reference {show(text)} has spaces, control or non-ASCII characters")
    rest, at, digest = text.partition("@")
    if at:
        check_digest(digest, f"reference {show(text)}: digest")
    registry, slash, path = rest.partition("/")
    if not slash or not _looks_like_registry(registry):
        raise InvalidArgument(f"reference {show(text)} must start with a registry host, like 127.0.0.1:5000/repo:tag")
    _check_registry(registry, text)
    # After the host, a ':' can only introduce the tag.
    repository, colon, tag = path.partition(":")
    if not repository:
        raise InvalidArgument(f"reference {show(text)} names no repository")
    if len(repository) > MAX_NAME_LENGTH:
        raise InvalidArgument(f"reference {show(text)}: repository is longer than {MAX_NAME_LENGTH} characters")
    for component in repository.split("/"):
        if _PATH_COMPONENT.fullmatch(component) is None:
            raise InvalidArgument(
                f"reference {show(text)}: repository component {show(component)} must be lowercase "
                "letters and digits, separated by '.', '_', '__' or '-'"
            )
    if colon and _TAG.fullmatch(tag) is None:
        raise InvalidArgument(f"reference {show(text)}: bad tag {show(tag)}")
    return registry, repository, (tag if colon else None), (digest if at else None)


@dataclass(frozen=True)
class Reference:
    """A parsed reference. ``registry`` is ``host``, ``host:port`` or ``[v6]:port``."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> Reference:
        """Parse and validate ``text``; InvalidArgument says what is wrong."""
        return cls(*_split(text))

    def __post_init__(self) -> None:
        # Built from parts, a Reference is checked like a parsed one.
        if _split(str(self)) != (self.registry, self.repository, self.tag, self.digest):
            raise InvalidArgument(f"reference parts do not form a reference: {show(str(self))}")

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag is not None:
            text += f":{self.tag}"
        if self.digest is not None:
            text += f"@{self.digest}"
        return text

    @property
    def name(self) -> str:
        """``registry/repository``, without tag or digest."""
        return f"{self.registry}/{self.repository}"

    def with_digest(self, digest: str) -> Reference:
        """The same name and tag, pinned to ``digest``."""
        return Reference(self.registry, self.repository, self.tag, check_digest(digest))


def parse_reference(text: str | Reference) -> Reference:
    """A Reference from text, or the Reference itself."""
    return text if isinstance(text, Reference) else Reference.parse(text)


def listed(reference: str | Reference, entries: Iterable[str]) -> bool:
    """Whether `reference` lies in one of `entries`: a registry (``host[:port]``) or a repository
    (``host[:port]/path``, which takes that repository and those below it).

    Registry names compare without case, repository paths exactly; an entry
    that is not a registry or repository name matches nothing.
    """
    ref = parse_reference(reference)
    for entry in entries:
        host, _, path = entry.strip().partition("/")
        if host.lower() != ref.registry.lower():
            continue
        path = path.strip("/")
        if not path or ref.repository == path or ref.repository.startswith(path + "/"):
            return True
    return False
