"""The API's listeners against real sockets: mutual TLS, certificate reload, the policy, the local socket's peer check."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import tls_connection
from node_agent import authz
from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.api.agent import AgentServicer
from node_agent.api.listeners import Listeners
from node_agent.config.loading import from_mapping
from node_agent.errors import InvalidArgument
from node_agent.store import Store
from node_agent.transfers import Transfers

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests/unit is not a package: make the repository's tests/ importable
    sys.path.insert(0, str(REPO))

from tests.socket_probe import probe  # noqa: E402
from tests.pki import Leaf, Pki  # noqa: E402

# ---- the policy ----------------------------------------------------------------------

POLICY = [
    {"identities": ["spiffe://cluster/ns/ops/sa/checkpointer", "CN=autoscaler"],
     "methods": ["Checkpoint", "ListCheckpoints", "InspectCheckpoint"], "namespaces": ["staging", "prod"]},
    {"identities": ["CN=admin"], "methods": ["*"], "namespaces": ["*"]},
    {"identities": ["CN=mover"], "methods": ["Restore"], "namespaces": ["prod"]},
]


def test_policy_parses_and_matches_subject_and_sans() -> None:
    policy = authz.Policy(from_mapping({"authorization": POLICY}).authorization)
    spiffe = authz.Identity(common_name="x", sans=("spiffe://cluster/ns/ops/sa/checkpointer",))
    auto = authz.Identity(common_name="autoscaler", subject="CN=autoscaler")
    admin = authz.Identity(common_name="admin")
    other = authz.Identity(common_name="intruder", sans=("intruder.example",))
    assert policy.allows(spiffe, "Checkpoint", "prod") and policy.allows(auto, "InspectCheckpoint", "staging")
    assert not policy.allows(auto, "Checkpoint", "kube-system")
    assert not policy.allows(auto, "RemoveCheckpoint", "prod") and not policy.may_call(auto, "Restore")
    assert not policy.allows(auto, "ListCheckpoints", authz.ANY)
    assert policy.allows(admin, "GarbageCollect", authz.ANY) and policy.allows(admin, "Restore", "anything")
    assert not policy.may_call(other, "ListCheckpoints")
    assert str(spiffe) == "spiffe://cluster/ns/ops/sa/checkpointer" and str(auto) == "CN=autoscaler"


@pytest.mark.parametrize("bad, message", [
    ({"identities": ["CN=a"], "methods": ["Checkpoint"]}, "lacks 'namespaces'"),
    ({"identities": ["CN=a"], "methods": ["Checkpointt"], "namespaces": ["*"]}, "unknown method 'Checkpointt'"),
    ({"identities": "CN=a", "methods": ["*"], "namespaces": ["*"]}, "non-empty list"),
    ({"identities": ["CN=a"], "methods": ["*"], "namespaces": ["*"], "verbs": []}, "unknown config key"),
])
def test_policy_errors(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        from_mapping({"authorization": [bad]})


def test_listen_needs_all_tls_files() -> None:
    with pytest.raises(InvalidArgument, match="needs tls-key, tls-client-ca"):
        from_mapping({"listen": "127.0.0.1:9443", "tls-cert": "/x.pem"})
    with pytest.raises(InvalidArgument, match="health-listen must be HOST:PORT"):
        from_mapping({"health-listen": "localhost:http"})
    assert from_mapping({"health-listen": "8081"}).health_listen == "8081"
    assert from_mapping({"health-listen": 8081, "metrics-listen": "0.0.0.0:9100"}).health_listen == "8081"
    with pytest.raises(InvalidArgument, match="unknown config key 'listen-tls'.*authorization"):
        from_mapping({"listen-tls": "x"})


# ---- real listeners ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Agent:
    """The API servicer over a real store, behind the real listeners (no containerd: pods are not resolved)."""

    def __init__(self, root: Path, pki: Pki, server: Leaf, gid: int | None = None) -> None:
        self.root = root
        self.store = Store(root / "store")
        self.port, self.health_port = free_port(), free_port()
        self.settings = from_mapping({
            "store": str(root / "store"), "socket": str(root / "agent.sock"),
            "socket-group": "" if gid is None else str(gid),
            "listen": f"127.0.0.1:{self.port}", "tls-cert": server.cert, "tls-key": server.key,
            "tls-client-ca": pki.ca, "health-listen": str(self.health_port), "authorization": POLICY,
        })
        self.records = {
            ns: self._commit(ns) for ns in ("prod", "staging", "kube-system")
        }

    def _commit(self, namespace: str) -> Any:
        with self.store.writer() as w:
            w.add_bytes("pod/x", namespace.encode())
            return w.commit({"pod": {"namespace": namespace, "name": "web", "id": "0" * 64}})

    async def __aenter__(self) -> "Agent":
        checkpointer = SimpleNamespace(settings=self.settings, cri=None)
        transfers = Transfers(self.settings, self.store, seal_for=lambda namespace: None)
        self.servicer = AgentServicer(checkpointer, None, self.store, lambda dry_run=False: None,  # type: ignore[arg-type]
                                      transfers=transfers, rekeyer=None)  # type: ignore[arg-type]
        self.listeners = Listeners(self.settings, self.servicer, None)  # type: ignore[arg-type]
        self.server = self.listeners.root_server()
        await self.listeners.bind(self.server)
        await self.server.start()
        await self.listeners.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.listeners.stop(self.server, grace=1)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "ca")


@pytest.fixture
async def agent(tmp_path: Path, pki: Pki) -> AsyncIterator[Agent]:
    async with Agent(tmp_path, pki, pki.server()) as a:
        yield a


def tls_channel(agent: Agent, ca: Pki, client: Leaf | None) -> grpc.aio.Channel:
    key, cert = client.pem() if client else (None, None)
    creds = grpc.ssl_channel_credentials(ca.ca_pem(), key, cert)
    return grpc.aio.secure_channel(f"localhost:{agent.port}", creds)


async def health(channel: grpc.aio.Channel, service: str = "") -> int:
    async with channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return int(resp.status)


async def test_no_client_certificate_is_refused_at_the_handshake(agent: Agent, pki: Pki) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await health(tls_channel(agent, pki, None))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # The same at the TLS layer: the server ends the handshake with an alert.
    with pytest.raises((ssl.SSLError, ConnectionError)):
        with tls_connection(agent.port, pki.ca) as tls:
            tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            assert tls.recv(1) == b"", "the server answered a client without a certificate"
            raise ConnectionError("closed")


async def test_a_certificate_from_another_ca_is_refused(agent: Agent, pki: Pki, tmp_path: Path) -> None:
    rogue = Pki(tmp_path / "rogue", name="rogue CA")
    leaf = rogue.client("admin", "admin")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await health(tls_channel(agent, pki, leaf))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_health_and_reflection_on_tls_and_plaintext_health(agent: Agent, pki: Pki) -> None:
    client = pki.client("auto", "autoscaler")
    assert await health(tls_channel(agent, pki, client)) == health_pb2.HealthCheckResponse.SERVING
    assert await health(tls_channel(agent, pki, client), "nodeagent.v1.NodeAgent") == health_pb2.HealthCheckResponse.SERVING
    assert await health(grpc.aio.insecure_channel(f"127.0.0.1:{agent.health_port}")) == health_pb2.HealthCheckResponse.SERVING
    async with tls_channel(agent, pki, client) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name async for r in call for s in r.list_services_response.service}
    assert {"nodeagent.v1.NodeAgent", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


async def test_policy_limits_methods_and_namespaces(agent: Agent, pki: Pki) -> None:
    auto = pki.client("auto", "autoscaler")
    spiffe = pki.client("ctl", "controller", "URI:spiffe://cluster/ns/ops/sa/checkpointer")
    stranger = pki.client("stranger", "stranger", "DNS:stranger.example")
    prod, kube = agent.records["prod"], agent.records["kube-system"]
    async with tls_channel(agent, pki, auto) as ch:
        stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
        listed = await stub.ListCheckpoints(pb.ListCheckpointsRequest(), timeout=10)
        assert {c.pod_namespace for c in listed.checkpoints} == {"prod", "staging"}
        info = await stub.InspectCheckpoint(pb.InspectCheckpointRequest(checkpoint_id=prod.id), timeout=10)
        assert info.pod_namespace == "prod"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.InspectCheckpoint(pb.InspectCheckpointRequest(checkpoint_id=kube.id), timeout=10)
        # Another namespace's checkpoint is not found, exactly as one that does not exist.
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details() == f"checkpoint {kube.id} not found"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RemoveCheckpoint(pb.RemoveCheckpointRequest(checkpoint_id=prod.id), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert err.value.details() == "CN=autoscaler may not call RemoveCheckpoint"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListCheckpoints(pb.ListCheckpointsRequest(pod_namespace="kube-system"), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with tls_channel(agent, pki, spiffe) as ch:
        stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
        info = await stub.InspectCheckpoint(pb.InspectCheckpointRequest(checkpoint_id=prod.id[7:19]), timeout=10)
        assert info.id == prod.id
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GarbageCollect(pb.GarbageCollectRequest(dry_run=True), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "spiffe://cluster/ns/ops/sa/checkpointer" in (err.value.details() or "")
    async with tls_channel(agent, pki, stranger) as ch:
        stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListCheckpoints(pb.ListCheckpointsRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "stranger" in (err.value.details() or "")


async def test_restore_needs_both_the_source_and_the_target_namespace(agent: Agent, pki: Pki) -> None:
    mover = pki.client("mover", "mover")
    async with tls_channel(agent, pki, mover) as ch:
        stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
        for ckpt, target, code, details in (
            (agent.records["prod"], "staging", grpc.StatusCode.PERMISSION_DENIED,
             "CN=mover may not call Restore for namespace 'staging'"),
            (agent.records["kube-system"], "prod", grpc.StatusCode.NOT_FOUND,
             f"checkpoint {agent.records['kube-system'].id} not found"),
            (agent.records["kube-system"], "", grpc.StatusCode.NOT_FOUND,
             f"checkpoint {agent.records['kube-system'].id} not found"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Restore(pb.RestoreRequest(checkpoint_id=ckpt.id, namespace=target), timeout=10):
                    pass
            assert (err.value.code(), err.value.details()) == (code, details)


async def _answer(call: Any) -> tuple[Any, str]:
    try:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _masked(text: str, *secrets: str) -> str:
    for s in secrets:
        text = text.replace(s, "<ref>")
    return text


async def test_no_existence_oracle_across_namespaces(agent: Agent, pki: Pki) -> None:
    """What another namespace holds and what does not exist at all get the same answer."""
    from node_agent.cri.types import Pod

    pods = [Pod("ab" * 32, "web", "kube-system", "u1", 0, "SANDBOX_READY", 0),
            Pod("cd" * 32, "web", "prod", "u2", 0, "SANDBOX_READY", 0)]

    async def list_pods() -> list[Pod]:
        return pods

    agent.servicer.checkpointer.cri = SimpleNamespace(list_pods=list_pods)  # type: ignore[attr-defined]
    kube = agent.records["kube-system"].id
    missing = "sha256:" + ("f" * 63 if not kube.endswith("f") else "e" * 63) + "0"
    auto = pki.client("auto", "autoscaler")
    async with tls_channel(agent, pki, auto) as ch:
        stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
        pairs = [
            # checkpoints by full id and by prefix
            (lambda r: stub.InspectCheckpoint(pb.InspectCheckpointRequest(checkpoint_id=r), timeout=10), kube, missing),
            (lambda r: stub.InspectCheckpoint(pb.InspectCheckpointRequest(checkpoint_id=r), timeout=10),
             kube[7:17], missing[7:17]),
            # pods by sandbox ID, by ID prefix, and by namespace/name
            (lambda r: stub.Checkpoint(pb.CheckpointRequest(pod=r), timeout=10), "ab" * 32, "ef" * 32),
            (lambda r: stub.Checkpoint(pb.CheckpointRequest(pod=r), timeout=10), "abab", "efef"),
            (lambda r: stub.Checkpoint(pb.CheckpointRequest(pod=r), timeout=10), "kube-system/web", "kube-system/nope"),
        ]
        for call, there, absent in pairs:
            a = await _answer(lambda: call(there))
            b = await _answer(lambda: call(absent))
            assert a[0] != grpc.StatusCode.OK
            assert (a[0], _masked(a[1], there)) == (b[0], _masked(b[1], absent)), (there, a, b)


async def test_the_cli_talks_to_the_tls_listener(agent: Agent, pki: Pki) -> None:
    auto = pki.client("auto", "autoscaler")
    cli = [str(Path(sys.executable).parent / "node-agent"), "checkpoints", "ls", "-o", "json",
           "--server", f"localhost:{agent.port}", "--ca", pki.ca]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *extra], capture_output=True, text=True, timeout=60)

    cp = await asyncio.to_thread(run, "--cert", auto.cert, "--key", auto.key)
    assert cp.returncode == 0, cp.stderr
    assert sorted(c["pod_namespace"] for c in json.loads(cp.stdout)) == ["prod", "staging"]
    cp = await asyncio.to_thread(run)
    assert cp.returncode == 2 and "--server needs --cert, --key and --ca" in cp.stderr
    stranger = pki.client("stranger", "stranger")
    cp = await asyncio.to_thread(run, "--cert", stranger.cert, "--key", stranger.key)
    assert cp.returncode == 1 and cp.stderr.strip() == "node-agent: PERMISSION_DENIED: CN=stranger may not call ListCheckpoints"


def served_fingerprint(port: int, pki: Pki, client: Leaf) -> str:
    with tls_connection(port, pki.ca, client.cert, client.key) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der
    return hashlib.sha256(der).hexdigest()


def fingerprint(path: str) -> str:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(Path(path).read_text())).hexdigest()


async def test_a_renewed_certificate_is_picked_up_without_a_restart(agent: Agent, pki: Pki) -> None:
    client = pki.client("auto", "autoscaler")
    first = await asyncio.to_thread(served_fingerprint, agent.port, pki, client)
    assert first == fingerprint(agent.settings.tls_cert)
    renewed = pki.server("renewed")
    # Replace the files the way cert-manager and kubelet do: write aside, rename over.
    for src, dst in ((renewed.key, agent.settings.tls_key), (renewed.cert, agent.settings.tls_cert)):
        shutil.copyfile(src, dst + ".new")
        os.replace(dst + ".new", dst)
    second = await asyncio.to_thread(served_fingerprint, agent.port, pki, client)
    assert second == fingerprint(renewed.cert) != first
    assert await health(tls_channel(agent, pki, client)) == health_pb2.HealthCheckResponse.SERVING
    # A key that does not match (half of a renewal) keeps the last good pair.
    shutil.copyfile(pki.server("half").key, agent.settings.tls_key)
    assert await asyncio.to_thread(served_fingerprint, agent.port, pki, client) == second


# ---- the local socket ------------------------------------------------------------------


@pytest.fixture
def open_dir() -> Any:
    """A directory others may traverse (pytest's tmp dirs are root-only)."""
    d = tempfile.mkdtemp(prefix="na-auth-")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


async def test_local_socket_admits_root_and_the_group_only(open_dir: Path, pki: Pki,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    assert os.geteuid() == 0, "this test runs peers as other users (setpriv), so it needs root"
    gid = 4242
    async with Agent(open_dir, pki, pki.server(), gid=gid) as agent:
        sock = agent.settings.socket
        st = os.stat(sock)
        assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o660, 0, gid)
        nobody = ("--reuid=nobody", "--regid=nogroup", "--clear-groups")
        assert await asyncio.to_thread(probe, sock) == "OK"
        # The file mode keeps others out first ...
        assert (await asyncio.to_thread(probe, sock, *nobody)).startswith("UNAVAILABLE")
        # ... and the peer check refuses them even where the mode would let them in.
        os.chmod(sock, 0o666)
        refused = await asyncio.to_thread(probe, sock, *nobody)
        assert refused.startswith("PERMISSION_DENIED") and "admits only root and group 4242" in refused
        # A refused user cannot flood the log: one WARNING per uid per interval, then a count.
        with caplog.at_level(logging.WARNING, logger="node_agent.api.tls_files"):
            for _ in range(5):
                assert (await asyncio.to_thread(probe, sock, *nobody)).startswith("PERMISSION_DENIED")
        refusals = [r for r in caplog.records if "refused the local socket" in r.getMessage()]
        assert len(refusals) <= 1, [r.getMessage() for r in refusals]
        assert await asyncio.to_thread(probe, sock, "--reuid=nobody", "--regid=nogroup", f"--groups={gid}") == "OK"
        assert await asyncio.to_thread(probe, sock, "--reuid=nobody", f"--regid={gid}", "--clear-groups") == "OK"
        # The server's own socket is out of reach.
        assert os.stat(agent.listeners.directory).st_mode & 0o777 == 0o700


def test_unusable_tls_files_are_refused_at_start(pki: Pki) -> None:
    from node_agent.api.tls_files import CertificateFiles

    a, b = pki.server("a"), pki.server("b")
    with pytest.raises(InvalidArgument, match="not a matching PEM certificate and key"):
        CertificateFiles(a.cert, b.key, pki.ca)
    with pytest.raises(InvalidArgument, match="cannot read /nonexistent/ca.pem"):
        CertificateFiles(a.cert, a.key, "/nonexistent/ca.pem")
    assert CertificateFiles(a.cert, a.key, pki.ca).fetch() is None  # unchanged files: nothing new


async def test_device_methods_need_a_rule_for_every_namespace(agent: Agent, pki: Pki) -> None:
    admin, auto = pki.client("admin", "admin"), pki.client("auto", "autoscaler")
    async with tls_channel(agent, pki, auto) as ch:
        stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListDevices(pb.ListDevicesRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert err.value.details() == "CN=autoscaler may not call ListDevices"
    async with tls_channel(agent, pki, admin) as ch:
        stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
        # Past the policy: this agent runs without a device monitor.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListDevices(pb.ListDevicesRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.WatchDevices(pb.WatchDevicesRequest(), timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
