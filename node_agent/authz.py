"""The authorization policy of the mutual-TLS listener.

Who may call which `nodeagent.v1.NodeAgent` method for pods in which
namespaces. Pure data and matching: no I/O and no gRPC here; the servicer
reads the peer's certificate and asks.

A rule names client identities, methods and namespaces; a call is allowed
when one rule names the caller, the method and the namespace. An identity
is written as the certificate subject's common name (`CN=autoscaler`), the
full subject (`CN=autoscaler,O=ops`) or a subject alternative name's value
(`spiffe://cluster/ns/ops/sa/checkpointer`, `ctl.example`, `ops@example`).
`*` stands for every authenticated client, every method or every namespace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from node_agent.errors import InvalidArgument

ANY = "*"
METHODS = frozenset({
    "Checkpoint", "Restore", "ListCheckpoints", "InspectCheckpoint", "RemoveCheckpoint", "VerifyCheckpoint",
    "GarbageCollect", "Push", "Pull", "Export", "Import", "ListDevices", "WatchDevices",
})


@dataclass(frozen=True)
class Identity:
    """A client as its certificate presents it."""

    common_name: str = ""
    subject: str = ""
    sans: tuple[str, ...] = ()

    def names(self) -> frozenset[str]:
        out = set(self.sans)
        if self.common_name:
            out.add("CN=" + self.common_name)
        if self.subject:
            out.add(self.subject)
        return frozenset(out)

    def __str__(self) -> str:
        for san in self.sans:
            if "://" in san:
                return san
        if self.common_name:
            return "CN=" + self.common_name
        return self.subject or (self.sans[0] if self.sans else "an anonymous client")


@dataclass(frozen=True)
class Rule:
    identities: tuple[str, ...]
    methods: tuple[str, ...]
    namespaces: tuple[str, ...]

    def names(self, who: Identity) -> bool:
        return ANY in self.identities or not who.names().isdisjoint(self.identities)

    def covers(self, method: str) -> bool:
        return ANY in self.methods or method in self.methods


@dataclass(frozen=True)
class Policy:
    rules: tuple[Rule, ...] = ()

    def may_call(self, who: Identity, method: str) -> bool:
        """Whether some rule lets `who` call `method` at all (in some namespace)."""
        return any(r.names(who) and r.covers(method) for r in self.rules)

    def namespaces(self, who: Identity, method: str) -> frozenset[str]:
        """The namespaces `who` may call `method` for; contains `*` for all of them."""
        out: set[str] = set()
        for r in self.rules:
            if r.names(who) and r.covers(method):
                out.update(r.namespaces)
        return frozenset(out)

    def allows(self, who: Identity, method: str, namespace: str) -> bool:
        """Whether `who` may call `method` for `namespace`; `*` asks for every namespace at once."""
        allowed = self.namespaces(who, method)
        return ANY in allowed or (namespace != ANY and namespace in allowed)


def _strings(where: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list) or not value:
        raise InvalidArgument(f"config key {where!r}: expected a non-empty list of strings, got {value!r}")
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise InvalidArgument(f"config key {where!r}: every entry must be a non-empty string, got {item!r}")
    return tuple(v.strip() for v in value)


def parse_rules(value: Any) -> tuple[Rule, ...]:
    """The `authorization:` config list; unknown keys and method names are errors."""
    if not isinstance(value, list):
        raise InvalidArgument(f"config key 'authorization': expected a list of rules, got {value!r}")
    rules = []
    for i, item in enumerate(value):
        where = f"authorization[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidArgument(f"config key {where!r}: expected a mapping, got {item!r}")
        unknown = set(item) - {"identities", "methods", "namespaces"}
        if unknown:
            raise InvalidArgument(
                f"unknown config key '{where}.{sorted(unknown)[0]}' (known: identities, methods, namespaces)"
            )
        for key in ("identities", "methods", "namespaces"):
            if key not in item:
                raise InvalidArgument(f"config key '{where}' lacks {key!r}")
        methods = _strings(f"{where}.methods", item["methods"])
        bad = [m for m in methods if m != ANY and m not in METHODS]
        if bad:
            raise InvalidArgument(
                f"config key '{where}.methods': unknown method {bad[0]!r} (known: {', '.join(sorted(METHODS))}, *)"
            )
        rules.append(Rule(
            identities=_strings(f"{where}.identities", item["identities"]),
            methods=methods,
            namespaces=_strings(f"{where}.namespaces", item["namespaces"]),
        ))
    return tuple(rules)
