"""The agent's own validation pass over a config document, and the checks that relate values.

`decode` walks the schema (`node_agent.config.schema`) over a parsed
document, plain builtins: every mapping's keys, every value's type, bounds
and choices, down to list items and the entries of named groups, and builds
the Structs from what passed. A refusal names the exact key
(`registry.token-realms`, `encryption.key-sources[0].file`,
`restore.trusted-keys['ns'][1]`) and is worded by `node_agent.config.messages`;
building the Structs cannot fail after the walk. `validate` adds the checks
that relate values to each other and to the node (absolute paths, the
listeners' addresses, the encryption and restore rules) and runs on flags too.
No I/O.
"""

from __future__ import annotations

import os
import types
from typing import Annotated, Any, Literal, Mapping, TypeVar, cast, get_args, get_origin
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta, Struct

from node_agent.authz import parse_rules
from node_agent.config.messages import Problem, Takes, refusal, shown, taken
from node_agent.config.schema import Address, FrozenMap, Rules, Settings, TokenRealms
from node_agent.errors import InvalidArgument
from node_agent.names import ENV_NAME_RE, KEY_ID_RE

T = TypeVar("T")


def decode(data: Any, kind: type[T], within: str = "") -> T:
    """`data` (a parsed document, or the section `within`) as `kind`; InvalidArgument names the failing key."""
    return cast(T, _value(data, kind, within))


# ---- the walk over the schema ---------------------------------------------------


def _key(within: str, name: str) -> str:
    return f"{within}.{name}" if within else name


def _wrong(key: str, value: Any, takes: Takes, **words: Any) -> InvalidArgument:
    what = taken(takes, **words)
    if not key:
        return refusal(Problem.TOP_WRONG_VALUE, takes=what, got=shown(value))
    return refusal(Problem.WRONG_VALUE, key=key, takes=what, got=shown(value))


def _value(value: Any, annotation: Any, key: str) -> Any:
    """`value` as `annotation` takes it, or InvalidArgument naming `key`."""
    bounds: tuple[Meta, ...] = ()
    if get_origin(annotation) is Annotated:
        annotation, *metas = get_args(annotation)
        bounds = tuple(m for m in metas if isinstance(m, Meta))
    origin = get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, Struct):
        return _section(value, annotation, key)
    if annotation is float:
        return _number(value, bounds, key)
    if annotation is int:
        return _integer(value, bounds, key)
    if annotation is bool:
        if not isinstance(value, bool):
            raise _wrong(key, value, Takes.BOOLEAN)
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise _wrong(key, value, Takes.STRING)
        return value
    if origin is Literal:
        choices = get_args(annotation)
        if not isinstance(value, str) or value not in choices:
            raise _wrong(key, value, Takes.ONE_OF, choices=tuple(map(str, choices)))
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple, set, frozenset)):
            raise _wrong(key, value, Takes.LIST)
        item = get_args(annotation)[0]
        return tuple(_value(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is types.UnionType and set(get_args(annotation)) == {bool, type(None)}:
        if value is not None and not isinstance(value, bool):
            raise _wrong(key, value, Takes.BOOLEAN_OR_NULL)
        return value
    if annotation is Address:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise _wrong(key, value, Takes.ADDRESS)
        return Address(value)
    if annotation is TokenRealms:
        if not isinstance(value, (list, tuple)):
            raise _wrong(key, value, Takes.HOSTS)
        return TokenRealms(dict.fromkeys(token_realm_host(v) for v in value))
    if annotation is Rules:
        return Rules(parse_rules(value))
    if isinstance(annotation, type) and issubclass(annotation, FrozenMap):
        return _named(value, annotation, key)
    raise NotImplementedError(f"the schema type {annotation!r} (at {key!r}) has no check")


def _section(value: Any, kind: type[Struct], key: str) -> Struct:
    """A mapping as the Struct `kind`: each key one of its fields (with dashes), in the document's order."""
    if not isinstance(value, Mapping):
        raise _wrong(key, value, Takes.MAPPING)
    fields = {f.encode_name: f for f in msgspec.structs.fields(kind)}
    given: dict[str, Any] = {}
    for name, item in value.items():
        if not isinstance(name, str):
            raise refusal(Problem.KEY_NOT_STRING, key=key) if key else refusal(Problem.TOP_KEY_NOT_STRING)
        f = fields.get(name)
        if f is None:
            raise refusal(Problem.UNKNOWN_KEY, key=_key(key, name), known=", ".join(sorted(fields)))
        given[f.name] = _value(item, f.type, _key(key, name))
    return kind(**given)


def _named(value: Any, kind: type[FrozenMap], key: str) -> FrozenMap:
    """A mapping of names (non-empty strings) to values of `kind.item_type`."""
    if not isinstance(value, Mapping):
        raise _wrong(key, value, Takes.MAPPING)
    items: dict[str, Any] = {}
    for name, item in value.items():
        if not isinstance(name, str) or not name:
            raise refusal(Problem.NAME_NOT_STRING, key=key, got=shown(name))
        items[name] = _value(item, kind.item_type, f"{key}[{name!r}]")
    return kind(items)


def _inside(number: float, bounds: tuple[Meta, ...]) -> bool:
    return all(
        (m.gt is None or number > m.gt) and (m.ge is None or number >= m.ge)
        and (m.lt is None or number < m.lt) and (m.le is None or number <= m.le)
        for m in bounds
    )


def _number(value: Any, bounds: tuple[Meta, ...], key: str) -> float:
    """A finite number (an integer is taken as one); NaN is inside no bounds."""
    takes = (Takes.POSITIVE_NUMBER if any(m.gt == 0 for m in bounds)
             else Takes.NON_NEGATIVE_NUMBER if any(m.ge == 0 for m in bounds) else Takes.NUMBER)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong(key, value, takes)
    try:
        number = float(value)
    except OverflowError:
        raise _wrong(key, value, takes) from None
    if not _inside(number, bounds):
        raise _wrong(key, value, takes)
    return number


def _integer(value: Any, bounds: tuple[Meta, ...], key: str) -> int:
    least = next((m.ge for m in bounds if m.ge is not None), None)
    takes = Takes.INTEGER if least is None else Takes.NON_NEGATIVE_INTEGER if least == 0 else Takes.INTEGER_AT_LEAST
    if isinstance(value, bool) or not isinstance(value, int) or not _inside(value, bounds):
        raise _wrong(key, value, takes, least=least or 0)
    return int(value)


# ---- values with a syntax of their own ------------------------------------------


def token_realm_host(value: Any, what: str = "registry.token-realms") -> str:
    """`host`, `host:port`, `[v6]` or `[v6]:port` as `host:port` (port 443 when not given), lowercase."""
    if (not isinstance(value, str) or not value or not value.isascii()
            or any(c in "/?#@%\\" or not c.isprintable() or c.isspace() for c in value)):
        raise refusal(Problem.NOT_REALM, key=what, value=value)
    try:
        parts = urlsplit("https://" + value)
        port = parts.port
    except ValueError:
        raise refusal(Problem.NOT_REALM, key=what, value=value) from None
    host = parts.hostname
    if not host or port == 0:
        raise refusal(Problem.NOT_REALM, key=what, value=value)
    return f"[{host}]:{port or 443}" if ":" in host else f"{host}:{port or 443}"


def host_port(value: str, *, default_host: str = "", what: str = "listen") -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT`, or `PORT`/`:PORT` with `default_host`."""
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "", value
    host = host.strip("[]") or default_host
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise refusal(Problem.NOT_HOST_PORT, key=what, value=value)
    return host, int(port)


# ---- checks beyond types -----------------------------------------------------------


def validate(s: Settings) -> Settings:
    """`s` if its values agree with each other and the node, else InvalidArgument."""
    for name in ("socket", "store", "runc_root", "sysfs_root", "kubelet_root", "pod_log_root"):
        if not os.path.isabs(getattr(s, name)):
            raise refusal(Problem.NOT_ABSOLUTE, key=name.replace("_", "-"), value=getattr(s, name))
    if not s.cri_endpoint.startswith(("unix://", "unix:")) and ":" not in s.cri_endpoint:
        raise refusal(Problem.NOT_CRI_ENDPOINT, value=s.cri_endpoint)
    if s.cri_listen and not (s.cri_listen.startswith("unix:///") and len(s.cri_listen) > len("unix:///")):
        raise refusal(Problem.NOT_CRI_LISTEN, value=s.cri_listen)
    if s.wrapper_python and not os.path.isabs(s.wrapper_python):
        raise refusal(Problem.NOT_ABSOLUTE, key="wrapper-python", value=s.wrapper_python)
    if not s.runtime_handler or not all(c.isalnum() or c in "-_." for c in s.runtime_handler):
        raise refusal(Problem.NOT_HANDLER_NAME, value=s.runtime_handler)
    _validate_security(s)
    return _validate_listeners(s)


def _validate_security(s: Settings) -> None:
    for i, source in enumerate(s.encryption.key_sources):
        key = f"encryption.key-sources[{i}]"
        given = [k for k in ("file", "secret", "exec") if getattr(source, k)]
        if len(given) != 1:
            raise refusal(Problem.KEY_SOURCE_COUNT, key=key, given=", ".join(given) or "none")
        path = source.file or source.secret
        if path and not os.path.isabs(path):
            raise refusal(Problem.NOT_ABSOLUTE, key=f"{key}.{given[0]}", value=path)
        if source.exec and not os.path.isabs(source.exec[0]):
            raise refusal(Problem.KEY_SOURCE_COMMAND, key=key)
        if source.env and not source.exec:
            raise refusal(Problem.KEY_SOURCE_ENV, key=key)
        for name in source.env:
            if not ENV_NAME_RE.fullmatch(name):
                raise refusal(Problem.ENV_NAME, key=key, value=name)
    owner: dict[str, str] = {}
    for name, members in s.encryption.domains.items():
        if not KEY_ID_RE.fullmatch(name):
            raise refusal(Problem.DOMAIN_NAME, value=name)
        for ns in members:
            if ns in owner:
                raise refusal(Problem.DOMAIN_OVERLAP, value=ns, first=owner[ns], second=name)
            owner[ns] = name
    if s.signing.key_file and not os.path.isabs(s.signing.key_file):
        raise refusal(Problem.NOT_ABSOLUTE, key="signing.key-file", value=s.signing.key_file)
    for ns, keys in s.restore.trusted_keys.items():
        for key in keys:
            if not (key.startswith("ed25519:") or os.path.isabs(key)):
                raise refusal(Problem.TRUSTED_KEY, namespace=ns, value=key)


def _validate_listeners(s: Settings) -> Settings:
    if s.listen:
        host_port(s.listen)
        missing = [k for k in ("tls_cert", "tls_key", "tls_client_ca") if not getattr(s, k)]
        if missing:
            raise refusal(Problem.LISTEN_WITHOUT_TLS, value=s.listen,
                          missing=", ".join(k.replace("_", "-") for k in missing))
    if s.health_listen:
        host_port(s.health_listen, default_host="127.0.0.1", what="health-listen")
    if s.metrics_listen:
        host_port(s.metrics_listen, default_host="127.0.0.1", what="metrics-listen")
    return s
