"""The API's method table and the authorization policy of the mutual-TLS listener.

`METHODS` is the one table of the `nodeagent.v1.NodeAgent` service: for every
method, the names a rule grants it by, how the namespace it acts in is found
(`Scope`), and the request fields that name a path on the node. Every
listener's calls pass one gate driven by it (`node_agent.api.gate`):

- root on the local socket: every method, in every form;
- a member of the socket group: every method, but a call that sets one of
  its method's `paths` fields is refused (the agent would open the path as
  root);
- a client over mutual TLS: what the `authorization:` rules grant, in the
  namespaces they name, the namespace found as the method's `Scope` says.

A unit test holds the table to the service descriptor: a method without an
entry fails the suite, and a method the table does not know is refused on
every listener.

A rule names client identities, methods and namespaces; a call is allowed
when one rule names the caller, the method and the namespace. An identity
is written as the certificate subject's common name (`CN=autoscaler`), the
full subject (`CN=autoscaler,O=ops`) or a subject alternative name's value
(`spiffe://cluster/ns/ops/sa/checkpointer`, `ctl.example`, `ops@example`).
`*` stands for every authenticated client, every method or every namespace.
Pure data and matching: no I/O and no gRPC here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping

from node_agent.errors import InvalidArgument

ANY = "*"


class Scope(enum.Enum):
    """How the namespace a call acts in is found (what a TLS rule's `namespaces` are checked against)."""

    # The pod the `ref` field names: a `namespace/name` is checked as written,
    # before any lookup; a sandbox ID (or prefix) is resolved among the pods of
    # the caller's namespaces; the call is then pinned to the sandbox ID.
    POD = "pod"
    # The checkpoint the `ref` field names, resolved among the checkpoints of
    # the caller's namespaces (another namespace's is NOT_FOUND, exactly as one
    # that does not exist); the call is then pinned to its full ID.
    CHECKPOINT = "checkpoint"
    # The answer lists things of namespaces (checkpoints, restored containers):
    # it keeps only those of the caller's namespaces.
    LISTING = "listing"
    # The namespace the `target` field names; `*` when it names none.
    TARGET = "target"
    # The node's, not a namespace's: the rule must cover `*`.
    NODE = "node"
    # Known only after the call (what a pull brings in): the rule must cover `*`.
    AFTERWARDS = "afterwards"


@dataclass(frozen=True)
class NodePath:
    """A request field that names a path on the node, which the agent would open as root."""

    field: str
    access: str  # "read" or "write"
    instead: str  # what a caller who may not name paths does instead


@dataclass(frozen=True)
class Method:
    """One method of `nodeagent.v1.NodeAgent`: how it is authorized on every listener.

    Field names are the request message's (for a client-streaming method,
    its first message's), dotted into sub-messages.
    """

    name: str
    scope: Scope
    # The field naming the pod (POD) or the checkpoint (CHECKPOINT).
    ref: str = ""
    # A field naming a namespace: checked too when set (for TARGET: `*` when empty).
    target: str = ""
    # Further names a rule grants this method by (a rule naming `Export`, which
    # writes any path, grants the streamed `ExportArchive` too).
    granted_by: tuple[str, ...] = ()
    # Fields that name a path on the node: refused to the socket group when set.
    paths: tuple[NodePath, ...] = ()
    # LISTING: the answer's repeated field, and the field of each item that names its namespace.
    listing: tuple[str, str] = ("checkpoints", "pod_namespace")

    def names(self) -> tuple[str, ...]:
        """The names a rule grants this method by (its own first)."""
        return (self.name, *self.granted_by)


_STREAM_INSTEAD = "`node-agent export` and `node-agent import` stream the archive through the socket instead"
_CA_FILE = NodePath("credentials.ca_file", "read", "the CLI sends the CA file's contents instead")

METHODS: Mapping[str, Method] = {m.name: m for m in (
    Method("Checkpoint", Scope.POD, ref="pod"),
    Method("Restore", Scope.CHECKPOINT, ref="checkpoint_id", target="namespace"),
    Method("ListCheckpoints", Scope.LISTING, target="pod_namespace"),
    Method("InspectCheckpoint", Scope.CHECKPOINT, ref="checkpoint_id"),
    Method("RemoveCheckpoint", Scope.CHECKPOINT, ref="checkpoint_id"),
    Method("VerifyCheckpoint", Scope.CHECKPOINT, ref="checkpoint_id"),
    Method("RekeyCheckpoint", Scope.CHECKPOINT, ref="checkpoint_id"),
    Method("GarbageCollect", Scope.NODE),
    Method("ListRestores", Scope.LISTING, target="pod_namespace", listing=("restores", "pod_namespace")),
    Method("Push", Scope.CHECKPOINT, ref="checkpoint_id", paths=(_CA_FILE,)),
    Method("Pull", Scope.AFTERWARDS, paths=(_CA_FILE,)),
    Method("Export", Scope.CHECKPOINT, ref="checkpoint_id",
           paths=(NodePath("output_path", "write", _STREAM_INSTEAD),)),
    Method("Import", Scope.TARGET, target="namespace", paths=(NodePath("input_path", "read", _STREAM_INSTEAD),)),
    Method("ExportArchive", Scope.CHECKPOINT, ref="checkpoint_id", granted_by=("Export",),
           paths=(NodePath("output_path", "write", _STREAM_INSTEAD),)),
    Method("ImportArchive", Scope.TARGET, target="header.namespace", granted_by=("Import",),
           paths=(NodePath("header.input_path", "read", _STREAM_INSTEAD),)),
    Method("ListDevices", Scope.NODE),
    Method("WatchDevices", Scope.NODE),
)}


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
        """Whether the rule grants `method` (by its name, a name that grants it, or `*`)."""
        entry = METHODS.get(method)
        return entry is not None and (ANY in self.methods or not set(entry.names()).isdisjoint(self.methods))


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
