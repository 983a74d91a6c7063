"""The API's one method table (`authz.METHODS`): held to the service descriptor, enforced on every listener.

Real servers on real sockets, as the daemon makes them (`Listeners`): the
root and socket-group servers on their private Unix sockets, the mutual-TLS
listener on loopback, and the public socket for a group member. Behind them a
servicer records what reaches it, so each method of the service is seen
allowed, refused or scoped (and pinned) exactly as the table says.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator, Callable, Iterator

import grpc
import pytest

from node_agent import authz
from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.api.listeners import Listeners
from node_agent.config.loading import from_mapping
from node_agent.cri.types import Pod
from node_agent.errors import InvalidArgument
from node_agent.store import Store

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests/unit is not a package: make the repository's tests/ importable
    sys.path.insert(0, str(REPO))

from tests.pki import Leaf, Pki  # noqa: E402

SERVICE = pb.DESCRIPTOR.services_by_name["NodeAgent"]
GID = 4242
WEB = Pod("cd" * 32, "web", "prod", "u2", 0, "SANDBOX_READY", 0)
DNS = Pod("ab" * 32, "dns", "kube-system", "u1", 0, "SANDBOX_READY", 0)
NODE_PATH = "/root-only/secret"
AUTHORIZATION = [
    {"identities": ["CN=admin"], "methods": ["*"], "namespaces": ["*"]},
    {"identities": ["CN=prod-ops"], "methods": ["*"], "namespaces": ["prod"]},
    {"identities": ["CN=lister"], "methods": ["ListCheckpoints"], "namespaces": ["*"]},
    {"identities": ["CN=rekeyer"], "methods": ["RekeyCheckpoint"], "namespaces": ["prod"]},
    {"identities": ["CN=archivist"], "methods": ["Export", "Import"], "namespaces": ["prod"]},
    {"identities": ["CN=streamer"], "methods": ["ExportArchive", "ImportArchive"], "namespaces": ["prod"]},
]
OK = grpc.StatusCode.OK
DENIED = grpc.StatusCode.PERMISSION_DENIED


# ---- the table against the service descriptor ---------------------------------------------------


def _field_type(message: Any, dotted: str) -> Any:
    """The descriptor of a dotted field of a message type (KeyError when there is none)."""
    *parents, last = dotted.split(".")
    for part in parents:
        message = message.fields_by_name[part].message_type
    return message.fields_by_name[last]


def test_the_table_is_the_service() -> None:
    """Every method of the service has an entry and every entry is a method; the fields it names exist."""
    assert sorted(m.name for m in SERVICE.methods) == sorted(authz.METHODS)
    for m in SERVICE.methods:
        entry = authz.METHODS[m.name]
        assert entry.name == m.name
        fields = [entry.ref, entry.target, *(p.field for p in entry.paths)]
        for name in filter(None, fields):
            f = _field_type(m.input_type, name)
            assert f.type == f.TYPE_STRING and not f.is_repeated, (m.name, name)
        assert bool(entry.ref) == (entry.scope in (authz.Scope.POD, authz.Scope.CHECKPOINT)), m.name
        assert entry.target or entry.scope is not authz.Scope.TARGET, m.name
        assert all(g in authz.METHODS and g != m.name for g in entry.granted_by), m.name
        assert {p.access for p in entry.paths} <= {"read", "write"}, m.name
    # What the rest of this file and docs/security.md rely on, spelled out.
    assert {n for n, e in authz.METHODS.items() if e.paths} == {
        "Push", "Pull", "Export", "Import", "ExportArchive", "ImportArchive"}
    assert {n for n, e in authz.METHODS.items() if e.scope in (authz.Scope.NODE, authz.Scope.AFTERWARDS)} == {
        "GarbageCollect", "ListDevices", "WatchDevices", "Pull"}
    assert authz.METHODS["RekeyCheckpoint"].scope is authz.Scope.CHECKPOINT
    assert {n for n, e in authz.METHODS.items() if e.scope is authz.Scope.LISTING} == {"ListCheckpoints", "ListRestores"}
    for name in ("ListCheckpoints", "ListRestores"):  # the listing's items and their namespace field exist
        items, namespace = authz.METHODS[name].listing
        listed = SERVICE.methods_by_name[name].output_type.fields_by_name[items]
        assert listed.is_repeated and listed.message_type.fields_by_name[namespace].type == listed.TYPE_STRING


def test_docs_list_every_method_for_tls_and_for_the_socket_group() -> None:
    text = (REPO / "docs" / "security.md").read_text()
    tls = text[text.index("Which namespace a call is about:"):text.index("### The local socket")]
    group = text[text.index("#### What a member of the socket group can and cannot do"):
                 text.index("### Answers that do not tell what exists")]
    for name in authz.METHODS:
        assert f"`{name}`" in tls, f"docs/security.md: the TLS table lacks {name}"
        assert f"`{name}`" in group, f"docs/security.md: the socket group's table lacks {name}"


def test_rules_name_the_tables_methods() -> None:
    rules = from_mapping({"authorization": [
        {"identities": ["CN=a"], "methods": ["RekeyCheckpoint", "ExportArchive", "ImportArchive"],
         "namespaces": ["prod"]},
    ]}).authorization
    policy, who = authz.Policy(rules), authz.Identity(common_name="a")
    assert policy.allows(who, "RekeyCheckpoint", "prod") and not policy.allows(who, "RekeyCheckpoint", "dev")
    # The streamed forms do not grant the path forms; the path forms grant the streamed ones.
    assert not policy.may_call(who, "Export") and not policy.may_call(who, "Import")
    export = authz.Policy(from_mapping({"authorization": [
        {"identities": ["CN=a"], "methods": ["Export"], "namespaces": ["*"]}]}).authorization)
    assert export.may_call(who, "ExportArchive") and not export.may_call(who, "ImportArchive")
    for bad in ("Rekey", "rekeycheckpoint", "NodeAgent/Checkpoint"):
        with pytest.raises(InvalidArgument, match=f"unknown method '{bad}'.*RekeyCheckpoint"):
            from_mapping({"authorization": [{"identities": ["CN=a"], "methods": [bad], "namespaces": ["*"]}]})


# ---- real listeners in front of a recording servicer ----------------------------------------------


def _reply(method: Any, store: Store) -> Any:
    out = getattr(pb, method.output_type.name)()
    if method.name == "ListCheckpoints":
        for rec in store.list():
            out.checkpoints.add(id=rec.id, pod_namespace=rec.metadata["pod"]["namespace"])
    if method.name == "ListRestores":
        for rec in store.list():
            out.restores.add(checkpoint_id=rec.id, pod_namespace=rec.metadata["pod"]["namespace"])
    return out


def _recording(method: Any) -> Callable[..., Any]:
    if method.client_streaming:
        async def stream_in(self: Recorder, requests: AsyncIterator[Any], context: Any) -> Any:
            first = None
            async for r in requests:
                first = r if first is None else first
            self.calls.append((method.name, first))
            return _reply(method, self.store)
        return stream_in
    if method.server_streaming:
        async def stream_out(self: Recorder, request: Any, context: Any) -> AsyncIterator[Any]:
            self.calls.append((method.name, request))
            yield _reply(method, self.store)
        return stream_out

    async def unary(self: Recorder, request: Any, context: Any) -> Any:
        self.calls.append((method.name, request))
        return _reply(method, self.store)
    return unary


class Recorder(pb_grpc.NodeAgentServicer):
    """Every method of the service: records the request (a client stream's first message) and answers empty."""

    def __init__(self, store: Store) -> None:
        async def list_pods() -> list[Pod]:
            return [WEB, DNS]

        self.store = store
        self.checkpointer = SimpleNamespace(cri=SimpleNamespace(list_pods=list_pods))
        self.calls: list[tuple[str, Any]] = []


for _m in SERVICE.methods:
    setattr(Recorder, _m.name, _recording(_m))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Node:
    """The listeners of one agent, with a root and a socket-group server and the TLS listener."""

    def __init__(self, root: Path, pki: Pki) -> None:
        self.pki = pki
        leaf = pki.server()
        self.port = free_port()
        self.settings = from_mapping({
            "store": str(root / "store"), "socket": str(root / "agent.sock"), "socket-group": str(GID),
            "listen": f"127.0.0.1:{self.port}", "tls-cert": leaf.cert, "tls-key": leaf.key,
            "tls-client-ca": pki.ca, "authorization": AUTHORIZATION,
        })
        self.store = Store(self.settings.store)
        self.records = {ns: self._commit(ns) for ns in ("prod", "kube-system")}
        self.recorder = Recorder(self.store)

    def _commit(self, namespace: str) -> Any:
        with self.store.writer() as w:
            w.add_bytes("pod/x", namespace.encode())
            return w.commit({"pod": {"namespace": namespace, "name": "web", "id": "0" * 64}})

    async def __aenter__(self) -> Node:
        self.listeners = Listeners(self.settings, self.recorder, None)  # type: ignore[arg-type]
        self.server = self.listeners.root_server()
        await self.listeners.bind(self.server)
        await self.server.start()
        await self.listeners.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.listeners.stop(self.server, grace=1)

    def root(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel("unix://" + self.listeners.backend)

    def group(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel("unix://" + self.listeners.group_backend)

    def tls(self, cn: str) -> grpc.aio.Channel:
        key, cert = self.pki.client(cn, cn).pem()
        creds = grpc.ssl_channel_credentials(self.pki.ca_pem(), key, cert)
        return grpc.aio.secure_channel(f"localhost:{self.port}", creds)

    def taken(self) -> list[tuple[str, Any]]:
        calls, self.recorder.calls[:] = list(self.recorder.calls), []
        return calls


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "ca")


@pytest.fixture
async def node(tmp_path: Path, pki: Pki) -> AsyncIterator[Node]:
    async with Node(tmp_path, pki) as n:
        yield n


def request(name: str, fields: dict[str, str]) -> Any:
    """The request (a client stream's first message) of `name` with the (dotted) fields set."""
    msg = getattr(pb, SERVICE.methods_by_name[name].input_type.name)()
    for dotted, value in fields.items():
        *parents, last = dotted.split(".")
        target = msg
        for part in parents:
            target = getattr(target, part)
        setattr(target, last, value)
    return msg


async def call(channel: grpc.aio.Channel, name: str, req: Any) -> tuple[grpc.StatusCode, str, Any]:
    """The status, details and last answer of one call of `name` (a client stream sends `req`, then one more)."""
    method = SERVICE.methods_by_name[name]
    fn = getattr(pb_grpc.NodeAgentStub(channel), name)  # type: ignore[no-untyped-call]

    async def stream() -> AsyncIterator[Any]:
        yield req
        yield type(req)()

    answer = None
    try:
        result = fn(stream() if method.client_streaming else req, timeout=30)
        if method.server_streaming:
            async for answer in result:
                pass
        else:
            answer = await result
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or "", None
    return OK, "", answer


def naming(node: Node, name: str, *, ckpt: str = "prod", pod: str = "", target: str = "",
           paths: bool = False) -> dict[str, str]:
    """The fields of a request of `name` that name things: a checkpoint (by ID prefix) or pod, a target, paths."""
    entry = authz.METHODS[name]
    fields: dict[str, str] = {}
    if entry.scope is authz.Scope.CHECKPOINT:
        fields[entry.ref] = node.records[ckpt].id[7:19] if ckpt in node.records else ckpt
    if entry.scope is authz.Scope.POD:
        fields[entry.ref] = pod or WEB.id[:12]
    if entry.target and target:
        fields[entry.target] = target
    if paths:
        fields.update({p.field: NODE_PATH for p in entry.paths})
    return fields


def pinned(node: Node, name: str, fields: dict[str, str]) -> dict[str, str]:
    """`fields` as the servicer gets them over TLS: the pod or checkpoint pinned to its full ID."""
    entry = authz.METHODS[name]
    if entry.scope is authz.Scope.CHECKPOINT:
        return {**fields, entry.ref: node.records["prod"].id}
    if entry.scope is authz.Scope.POD:
        return {**fields, entry.ref: WEB.id}
    return fields


async def test_root_calls_every_method_as_asked(node: Node) -> None:
    async with node.root() as ch:
        for name in authz.METHODS:
            fields = naming(node, name, target="kube-system", paths=True)
            code, details, _ = await call(ch, name, request(name, fields))
            assert code == OK, (name, details)
            assert node.taken() == [(name, request(name, fields))], name  # as asked: nothing pinned


async def test_the_socket_group_calls_every_method_but_the_path_forms(node: Node) -> None:
    async with node.group() as ch:
        for name, entry in authz.METHODS.items():
            fields = naming(node, name, target="kube-system")
            code, details, _ = await call(ch, name, request(name, fields))
            assert code == OK, (name, details)
            assert node.taken() == [(name, request(name, fields))], name
            for path in entry.paths:
                code, details, _ = await call(ch, name, request(name, {**fields, path.field: NODE_PATH}))
                assert code == DENIED, (name, path.field)
                assert details == (f"a member of the socket group may not have the agent {path.access} {NODE_PATH} "
                                   f"(it would do so as root); {path.instead}")
                assert node.taken() == [], name
        code, details, _ = await call(ch, "Export", request("Export", {"checkpoint_id": "x", "output_path": "/o.tar"}))
        assert (code, details) == (DENIED, (
            "a member of the socket group may not have the agent write /o.tar (it would do so as root); "
            "`node-agent export` and `node-agent import` stream the archive through the socket instead"))
        creds = {"reference": "r/x:1", "credentials.ca_file": "/etc/shadow"}
        code, details, _ = await call(ch, "Pull", request("Pull", creds))
        assert code == DENIED and details.endswith("the CLI sends the CA file's contents instead"), details


async def test_tls_every_method_for_a_client_of_every_namespace(node: Node) -> None:
    async with node.tls("admin") as ch:
        for name in authz.METHODS:
            fields = naming(node, name, target="prod", paths=True)
            code, details, _ = await call(ch, name, request(name, fields))
            assert code == OK, (name, details)
            assert node.taken() == [(name, request(name, pinned(node, name, fields)))], name


async def test_tls_every_method_scoped_to_one_namespace(node: Node) -> None:
    kube = node.records["kube-system"].id
    missing = "sha256:" + ("f" * 63 if not kube.endswith("f") else "e" * 63) + "0"
    who = "CN=prod-ops"
    async with node.tls("prod-ops") as ch:
        for name, entry in authz.METHODS.items():
            scope = entry.scope
            if scope in (authz.Scope.NODE, authz.Scope.AFTERWARDS):
                code, details, _ = await call(ch, name, request(name, naming(node, name)))
                assert (code, details) == (DENIED, f"{who} may not call {name} for every namespace"), name
            if scope is authz.Scope.TARGET:
                fields = naming(node, name, target="prod")
                assert (await call(ch, name, request(name, fields)))[:2] == (OK, ""), name
                assert node.taken() == [(name, request(name, fields))], name
                for target, where in (("kube-system", "namespace 'kube-system'"), ("", "every namespace")):
                    code, details, _ = await call(ch, name, request(name, naming(node, name, target=target)))
                    assert (code, details) == (DENIED, f"{who} may not call {name} for {where}"), name
            if scope is authz.Scope.CHECKPOINT:
                fields = naming(node, name, target="prod")
                code, details, _ = await call(ch, name, request(name, fields))
                assert code == OK, (name, details)
                assert node.taken() == [(name, request(name, pinned(node, name, fields)))], name
                # Another namespace's checkpoint is NOT_FOUND, exactly as one that does not exist.
                there = await call(ch, name, request(name, naming(node, name, ckpt=kube)))
                absent = await call(ch, name, request(name, naming(node, name, ckpt=missing)))
                assert there[:2] == (grpc.StatusCode.NOT_FOUND, f"checkpoint {kube} not found"), name
                assert absent[:2] == (grpc.StatusCode.NOT_FOUND, f"checkpoint {missing} not found"), name
                if entry.target:
                    code, details, _ = await call(ch, name, request(name, naming(node, name, target="kube-system")))
                    assert (code, details) == (DENIED, f"{who} may not call {name} for namespace 'kube-system'")
            if scope is authz.Scope.POD:
                for ref in ("prod/web", WEB.id[:10]):
                    code, details, _ = await call(ch, name, request(name, naming(node, name, pod=ref)))
                    assert code == OK, (name, ref, details)
                    assert node.taken() == [(name, request(name, {entry.ref: WEB.id}))], name
                code, details, _ = await call(ch, name, request(name, naming(node, name, pod="kube-system/dns")))
                assert (code, details) == (DENIED, f"{who} may not call {name} for namespace 'kube-system'")
                there = await call(ch, name, request(name, naming(node, name, pod=DNS.id[:10])))
                absent = await call(ch, name, request(name, naming(node, name, pod="ef" * 5)))
                assert there[0] == absent[0] == grpc.StatusCode.NOT_FOUND, (there, absent)
                assert there[1].replace(DNS.id[:10], "<ref>") == absent[1].replace("ef" * 5, "<ref>")
            if scope is authz.Scope.LISTING:
                items, namespace = entry.listing
                code, details, answer = await call(ch, name, request(name, {}))
                assert code == OK and [getattr(c, namespace) for c in getattr(answer, items)] == ["prod"], details
                assert node.taken() == [(name, request(name, {}))]
                code, details, _ = await call(ch, name, request(name, {entry.target: "kube-system"}))
                assert (code, details) == (DENIED, f"{who} may not call {name} for namespace 'kube-system'")
            assert node.taken() == [], name  # nothing refused reached the servicer


async def test_tls_a_method_no_rule_grants_is_refused(node: Node) -> None:
    async with node.tls("lister") as ch:
        for name in authz.METHODS:
            code, details, _ = await call(ch, name, request(name, naming(node, name, target="prod")))
            if name == "ListCheckpoints":
                assert code == OK, details
            else:
                assert (code, details) == (DENIED, f"CN=lister may not call {name}"), name
        assert [n for n, _ in node.taken()] == ["ListCheckpoints"]


async def test_rekey_over_tls_with_and_without_a_rule(node: Node) -> None:
    prod, kube = node.records["prod"].id, node.records["kube-system"].id
    async with node.tls("rekeyer") as ch:
        code, details, _ = await call(ch, "RekeyCheckpoint", pb.RekeyCheckpointRequest(checkpoint_id=prod[7:20],
                                                                                      replace=True))
        assert code == OK, details
        assert node.taken() == [("RekeyCheckpoint", pb.RekeyCheckpointRequest(checkpoint_id=prod, replace=True))]
        code, details, _ = await call(ch, "RekeyCheckpoint", pb.RekeyCheckpointRequest(checkpoint_id=kube))
        assert (code, details) == (grpc.StatusCode.NOT_FOUND, f"checkpoint {kube} not found")
        code, details, _ = await call(ch, "InspectCheckpoint", pb.InspectCheckpointRequest(checkpoint_id=prod))
        assert (code, details) == (DENIED, "CN=rekeyer may not call InspectCheckpoint")
    async with node.tls("admin") as ch:
        code, details, _ = await call(ch, "RekeyCheckpoint", pb.RekeyCheckpointRequest(checkpoint_id=kube))
        assert code == OK, details
    async with node.tls("lister") as ch:
        code, details, _ = await call(ch, "RekeyCheckpoint", pb.RekeyCheckpointRequest(checkpoint_id=prod))
        assert (code, details) == (DENIED, "CN=lister may not call RekeyCheckpoint")
    assert [n for n, _ in node.taken()] == ["RekeyCheckpoint"]


async def test_a_rule_naming_a_path_form_grants_its_streamed_form_only(node: Node) -> None:
    prod = node.records["prod"].id
    async with node.tls("archivist") as ch:
        assert (await call(ch, "ExportArchive", pb.ExportRequest(checkpoint_id=prod)))[0] == OK
        head = pb.ImportChunk(header=pb.ImportRequest(namespace="prod"))
        assert (await call(ch, "ImportArchive", head))[0] == OK
    async with node.tls("streamer") as ch:
        assert (await call(ch, "ExportArchive", pb.ExportRequest(checkpoint_id=prod)))[0] == OK
        code, details, _ = await call(ch, "Export", pb.ExportRequest(checkpoint_id=prod, output_path="/o.tar"))
        assert (code, details) == (DENIED, "CN=streamer may not call Export")
        code, details, _ = await call(ch, "Import", pb.ImportRequest(input_path="/i.tar", namespace="prod"))
        assert (code, details) == (DENIED, "CN=streamer may not call Import")
    assert [n for n, _ in node.taken()] == ["ExportArchive", "ImportArchive", "ExportArchive"]


async def test_a_method_the_table_lacks_is_refused_on_every_listener(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(authz, "METHODS", {n: e for n, e in authz.METHODS.items() if n != "GarbageCollect"})
    for channel in (node.root(), node.group(), node.tls("admin")):
        async with channel as ch:
            code, details, _ = await call(ch, "GarbageCollect", pb.GarbageCollectRequest())
            assert (code, details) == (DENIED, "/nodeagent.v1.NodeAgent/GarbageCollect is not in the agent's "
                                               "method table")
            assert (await call(ch, "ListDevices", pb.ListDevicesRequest()))[0] == OK
    assert [n for n, _ in node.taken()] == ["ListDevices"] * 3


# ---- the public socket: a group member meets the group's gate ------------------------------------

MEMBER_CALL = """
import sys, grpc
from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb, nodeagent_pb2_grpc as g
with grpc.insecure_channel("unix://" + sys.argv[1]) as ch:
    stub = g.NodeAgentStub(ch)
    for call in (lambda: stub.GarbageCollect(pb.GarbageCollectRequest(dry_run=True), timeout=30),
                 lambda: stub.Import(pb.ImportRequest(input_path=sys.argv[2]), timeout=30)):
        try:
            call()
            print("OK")
        except grpc.RpcError as exc:
            print(exc.code().name, exc.details())
"""


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory others may traverse (pytest's tmp dirs are root-only)."""
    d = tempfile.mkdtemp(prefix="na-table-")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


async def test_a_group_member_on_the_public_socket_meets_the_groups_gate(open_dir: Path, pki: Pki) -> None:
    assert os.geteuid() == 0, "this test runs a peer as another user (setpriv), so it needs root"
    import asyncio

    async with Node(open_dir, pki) as node:
        member = ["setpriv", "--reuid=nobody", "--regid=nogroup", f"--groups={GID}"]

        def run(*who: str) -> list[str]:
            cp = subprocess.run([*who, sys.executable, "-c", MEMBER_CALL, node.settings.socket, NODE_PATH],
                                capture_output=True, text=True, timeout=120, cwd=REPO)
            assert cp.returncode == 0, cp.stderr
            return cp.stdout.splitlines()

        lines = await asyncio.to_thread(run, *member)
        assert lines[0] == "OK" and lines[1].startswith("PERMISSION_DENIED a member of the socket group"), lines
        assert node.taken() == [("GarbageCollect", pb.GarbageCollectRequest(dry_run=True))]
        assert await asyncio.to_thread(run) == ["OK", "OK"]  # root: the path form too
        assert [n for n, _ in node.taken()] == ["GarbageCollect", "Import"]
