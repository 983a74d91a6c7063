"""The namespace policy and the restore admission on every path, over real sockets.

The real servicers, checkpointer and restorer: the local socket and the
mutual-TLS listener (`Listeners`), and the CRI endpoint in front of a fake
containerd. Only the CRI client below the agent and CRIU are fakes, and they
record every call: a refused call must reach neither, must arrive as
PERMISSION_DENIED, and must leave nothing behind (no sandbox, no freeze, no
journal entry, no plan, nothing in a caller's directory).
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
import msgspec
import pytest

from node_agent import errors, interop
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from node_agent._proto.nodeagent.v1 import nodeagent_pb2 as pb
from node_agent._proto.nodeagent.v1 import nodeagent_pb2_grpc as pb_grpc
from node_agent.admission import foreign_engine
from node_agent.api.agent import AgentServicer
from node_agent.api.cri_endpoint import RESTORE_FROM, CriEndpoint
from node_agent.api.listeners import Listeners
from node_agent.checkpointing import Checkpointer
from node_agent.rekeying import Rekeyer
from node_agent.config.loading import from_mapping
from node_agent.config.schema import Settings
from node_agent.cri.types import Pod
from node_agent.journal import Journal
from node_agent.metrics import Metrics
from node_agent.podformat import load_saved
from node_agent.restoring import Restorer
from node_agent.store import CheckpointRecord, Store
from node_agent.transfers import Transfers
from test_interop import fake_cpuinfo, make_checkpoint, podman_archive

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests/unit is not a package: make the repository's tests/ importable
    sys.path.insert(0, str(REPO))

from tests.pki import Leaf, Pki  # noqa: E402

DNS = Pod("ab" * 32, "dns", "kube-system", "u1", 0, "SANDBOX_READY", 0)
WEB = Pod("cd" * 32, "web", "prod", "u2", 0, "SANDBOX_READY", 0)
RULES = {"*": {"checkpoint": True}, "kube-system": {"checkpoint": False, "restore": False}}
AUTHORIZATION = [
    {"identities": ["CN=admin"], "methods": ["*"], "namespaces": ["*"]},
    {"identities": ["CN=mover"], "methods": ["Restore"], "namespaces": ["prod", "team"]},
]
DENIED_CHECKPOINT = ('checkpoint of pod kube-system/dns: refused by this node\'s policy: '
                     'namespaces["kube-system"].checkpoint is false')


class FakeCri:
    """The CRI client under the agent: pods are listed, every other call is recorded and fails."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def list_pods(self) -> list[Pod]:
        self.calls.append("list_pods")
        return [DNS, WEB]

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            raise errors.Unavailable(f"the fake CRI does not serve {name}")

        return call


class FakeCriu:
    """CRIU: any call is recorded (a refused checkpoint or restore makes none)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            raise AssertionError(f"CRIU was asked to {name}")

        return call


class FakeContainerd(grpc.GenericRpcHandler):  # type: ignore[misc]
    """The containerd behind the CRI endpoint: records each forwarded method."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        name = str(details.method).rsplit("/", 1)[-1]

        async def answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            self.methods.append(name)
            if name == "RunPodSandbox":
                return bytes(cri.RunPodSandboxResponse(pod_sandbox_id="ef" * 32).SerializeToString())
            return b""

        return grpc.unary_unary_rpc_method_handler(answer)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Node:
    """One node's agent: store, checkpointer, restorer, API listeners and CRI endpoint."""

    def __init__(self, root: Path, pki: Pki, **config: Any) -> None:
        self.root = root
        self.server_leaf = pki.server()
        self.port = free_port()
        self.settings = from_mapping({
            "store": str(root / "store"), "socket": str(root / "agent.sock"),
            "listen": f"127.0.0.1:{self.port}", "tls-cert": self.server_leaf.cert, "tls-key": self.server_leaf.key,
            "tls-client-ca": pki.ca, "authorization": AUTHORIZATION, "namespaces": RULES, **config,
        })
        self.store = Store(self.settings.store)
        self.native, _ = make_checkpoint(self.store)  # pod team/web
        archive = root / "podman.tar"
        archive.write_bytes(podman_archive())
        self.foreign = interop.import_archive(self.store, str(archive), namespace="prod", cpuinfo_dump=fake_cpuinfo)
        self.cri = FakeCri()
        self.criu = FakeCriu()
        metrics = Metrics()
        journal = Journal(self.settings.journal_dir)
        self.checkpointer = Checkpointer(self.settings, self.cri, self.store, journal, self.criu, metrics)  # type: ignore[arg-type]
        self.restorer = Restorer(self.settings, self.cri, self.store, journal, self.criu, metrics)  # type: ignore[arg-type]
        self.containerd = FakeContainerd()

    async def __aenter__(self) -> Node:
        transfers = Transfers(self.settings, self.store, seal_for=self.checkpointer.seal_key)
        self.servicer = AgentServicer(self.checkpointer, self.restorer, self.store, lambda dry_run=False: None,
                                      transfers=transfers,
                                      rekeyer=Rekeyer(self.settings, self.store, self.checkpointer.keys))
        self.server = grpc.aio.server()
        pb_grpc.add_NodeAgentServicer_to_server(self.servicer, self.server)  # type: ignore[no-untyped-call]
        self.listeners = Listeners(self.settings, self.servicer, None)  # type: ignore[arg-type]
        await self.listeners.bind(self.server)
        await self.server.start()
        await self.listeners.start()
        self.upstream = grpc.aio.server()
        self.upstream.add_generic_rpc_handlers((self.containerd,))
        self.upstream.add_insecure_port(f"unix://{self.root}/containerd.sock")
        await self.upstream.start()
        self.upstream_channel = grpc.aio.insecure_channel(f"unix://{self.root}/containerd.sock")
        self.endpoint = CriEndpoint(self.checkpointer, self.restorer, self.store, self.upstream_channel)
        self.cri_server = grpc.aio.server()
        self.cri_server.add_generic_rpc_handlers((self.endpoint.proxy,))
        self.cri_server.add_insecure_port(f"unix://{self.root}/cri.sock")
        await self.cri_server.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.cri_server.stop(0)
        await self.upstream_channel.close()
        await self.upstream.stop(0)
        await self.listeners.stop(self.server, grace=1)

    def local(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"unix://{self.settings.socket}")

    def tls(self, pki: Pki, client: Leaf) -> grpc.aio.Channel:
        key, cert = client.pem()
        return grpc.aio.secure_channel(f"localhost:{self.port}", grpc.ssl_channel_credentials(pki.ca_pem(), key, cert))

    def kubelet(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"unix://{self.root}/cri.sock")

    def assert_nothing_made(self) -> None:
        """Nothing reached containerd or CRIU beyond listing pods, and nothing was left on disk."""
        assert set(self.cri.calls) <= {"list_pods"}, self.cri.calls
        assert self.criu.calls == []
        assert [m for m in self.containerd.methods if m != "Version"] == []
        s = self.settings
        for d in (s.journal_dir, s.work_dir, s.plans_dir):
            assert not os.path.isdir(d) or os.listdir(d) == [], (d, os.listdir(d))
        state = os.path.join(s.store, "cri-restores")
        assert not os.path.isdir(state) or os.listdir(state) == []
        assert {r.id for r in self.store.list()} == {self.native.id, self.foreign.id}


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "ca")


@pytest.fixture
async def node(tmp_path: Path, pki: Pki) -> AsyncIterator[Node]:
    async with Node(tmp_path, pki) as n:
        yield n


async def _status(call: Any) -> tuple[grpc.StatusCode, str]:
    """The status a call ends with (a streaming call read to its end)."""
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _restored_as(namespace: str) -> str:
    return rf"^restore as pod {namespace}/web-restored-[0-9a-f]{{6}}: "


# ---- the local socket and the mutual-TLS listener ------------------------------------------


async def test_the_local_socket_refuses_a_namespace_the_policy_refuses(node: Node) -> None:
    async with node.local() as ch:
        stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
        code, details = await _status(stub.Checkpoint(pb.CheckpointRequest(pod="kube-system/dns"), timeout=30))
        assert (code, details) == (grpc.StatusCode.PERMISSION_DENIED, DENIED_CHECKPOINT)
        # By sandbox ID too: the pod is resolved first, then refused.
        code, details = await _status(stub.Checkpoint(pb.CheckpointRequest(pod=DNS.id[:12]), timeout=30))
        assert (code, details) == (grpc.StatusCode.PERMISSION_DENIED, DENIED_CHECKPOINT)
        node.assert_nothing_made()
        code, details = await _status(stub.Restore(
            pb.RestoreRequest(checkpoint_id=node.native.id, namespace="kube-system"), timeout=30))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert re.match(_restored_as("kube-system") + re.escape(
            "refused by this node's policy: namespaces[\"kube-system\"].restore is false") + "$", details), details
        node.assert_nothing_made()
        assert node.cri.calls == ["list_pods", "list_pods"]  # the two checkpoints' lookups; the restore made none


async def test_a_foreign_checkpoint_is_refused_by_default_and_names_the_key(node: Node) -> None:
    assert node.foreign.metadata["imported"]["format"] == "podman"
    async with node.local() as ch:
        stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
        code, details = await _status(stub.Restore(pb.RestoreRequest(checkpoint_id=node.foreign.id), timeout=30))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details.startswith("restore as pod prod/") and details.endswith(
        f"checkpoint {node.foreign.id} was imported from another engine's archive (podman), not made by "
        "node-agent; this node restores such checkpoints only with restore.allow-foreign: true"), details
    node.assert_nothing_made()


async def test_an_admitted_restore_goes_on_to_its_preflight(node: Node) -> None:
    """The control: an allowed namespace and the agent's own checkpoint pass admission."""
    async with node.local() as ch:
        stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
        code, details = await _status(stub.Restore(
            pb.RestoreRequest(checkpoint_id=node.native.id, namespace="prod"), timeout=30))
    assert code == grpc.StatusCode.UNAVAILABLE and "image_present" in details, (code, details)
    assert node.cri.calls == ["list_pods", "image_present"]


async def test_allow_foreign_admits_a_foreign_checkpoint(tmp_path: Path, pki: Pki) -> None:
    async with Node(tmp_path, pki, restore={"allow-foreign": True}) as n:
        async with n.local() as ch:
            stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
            code, details = await _status(stub.Restore(pb.RestoreRequest(checkpoint_id=n.foreign.id), timeout=30))
        assert code == grpc.StatusCode.UNAVAILABLE and "image_present" in details, (code, details)


async def test_an_unsigned_checkpoint_is_refused_where_signatures_are_required(tmp_path: Path, pki: Pki) -> None:
    import base64

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    raw = Ed25519PrivateKey.generate().public_key().public_bytes(serialization.Encoding.Raw,
                                                                serialization.PublicFormat.Raw)
    trusted = {"*": ["ed25519:" + base64.b64encode(raw).decode()]}
    async with Node(tmp_path, pki, restore={"require-signature": True, "trusted-keys": trusted}) as n:
        async with n.local() as ch:
            stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
            code, details = await _status(stub.Restore(
                pb.RestoreRequest(checkpoint_id=n.native.id, namespace="prod"), timeout=30))
        assert code == grpc.StatusCode.PERMISSION_DENIED and n.native.id in details, details
        n.assert_nothing_made()
        assert n.cri.calls == []


async def test_the_tls_listener_applies_the_policy_on_top_of_its_authorization(node: Node, pki: Pki) -> None:
    async with node.tls(pki, pki.client("admin", "admin")) as ch:
        stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
        code, details = await _status(stub.Checkpoint(pb.CheckpointRequest(pod="kube-system/dns"), timeout=30))
        assert (code, details) == (grpc.StatusCode.PERMISSION_DENIED, DENIED_CHECKPOINT)
        code, details = await _status(stub.Restore(
            pb.RestoreRequest(checkpoint_id=node.native.id, namespace="kube-system"), timeout=30))
        assert code == grpc.StatusCode.PERMISSION_DENIED and re.match(_restored_as("kube-system"), details), details
        assert 'namespaces["kube-system"].restore is false' in details
        code, details = await _status(stub.Restore(
            pb.RestoreRequest(checkpoint_id=node.foreign.id, namespace="prod"), timeout=30))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "restore.allow-foreign: true" in details, details
    node.assert_nothing_made()
    # The authorization rules still come first, unchanged.
    async with node.tls(pki, pki.client("mover", "mover")) as ch:
        stub = pb_grpc.NodeAgentStub(ch)  # type: ignore[no-untyped-call]
        code, details = await _status(stub.Restore(
            pb.RestoreRequest(checkpoint_id=node.native.id, namespace="kube-system"), timeout=30))
        assert (code, details) == (grpc.StatusCode.PERMISSION_DENIED,
                                   "CN=mover may not call Restore for namespace 'kube-system'")
        code, details = await _status(stub.Checkpoint(pb.CheckpointRequest(pod="prod/web"), timeout=30))
        assert (code, details) == (grpc.StatusCode.PERMISSION_DENIED, "CN=mover may not call Checkpoint")
    node.assert_nothing_made()


# ---- the CRI endpoint --------------------------------------------------------------------------


async def test_cri_checkpoint_pod_is_refused_before_output_path_is_touched(node: Node, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    async with node.kubelet() as ch:
        stub = cri_grpc.RuntimeServiceStub(ch)  # type: ignore[no-untyped-call]
        code, details = await _status(stub.CheckpointPod(cri.CheckpointPodRequest(
            pod_sandbox_id=DNS.id, output_path=str(out), container_ids=["c1"]), timeout=30))
    assert (code, details) == (grpc.StatusCode.PERMISSION_DENIED, DENIED_CHECKPOINT)
    assert os.listdir(out) == []
    assert node.cri.calls == ["list_pods"]  # not even its containers were listed
    node.assert_nothing_made()


def _layout(root: Path) -> tuple[Path, CheckpointRecord]:
    """A directory as CheckpointPod writes it: one checkpoint (pod team/web, container app)."""
    root.mkdir()
    record, _ = make_checkpoint(Store(root))
    return root, record


def _restore_pod(layout: Path, namespace: str) -> Any:
    image = cri.ImageSpec(image="localhost/busybox:1")
    return cri.RestorePodRequest(
        checkpoint_path=str(layout),
        config=cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="web2", namespace=namespace, uid="u9")),
        container_configs=[cri.ContainerConfig(metadata=cri.ContainerMetadata(name="app"), image=image)],
    )


async def test_cri_restore_pod_is_refused_for_its_target_namespace(node: Node, tmp_path: Path) -> None:
    layout, record = _layout(tmp_path / "layout")
    async with node.kubelet() as ch:
        stub = cri_grpc.RuntimeServiceStub(ch)  # type: ignore[no-untyped-call]
        code, details = await _status(stub.RestorePod(_restore_pod(layout, "kube-system"), timeout=30))
        assert (code, details) == (grpc.StatusCode.PERMISSION_DENIED,
                                   "restore as pod kube-system/web2: refused by this node's policy: "
                                   'namespaces["kube-system"].restore is false')
        node.assert_nothing_made()
        # The same checkpoint into an allowed namespace is admitted (and stops at the fake's images).
        code, details = await _status(stub.RestorePod(_restore_pod(layout, "prod"), timeout=30))
        assert code == grpc.StatusCode.UNAVAILABLE and "image_present" in details, (code, details)
    assert Store(layout).list()[0].id == record.id


def _annotated(namespace: str, ref: str) -> Any:
    return cri.RunPodSandboxRequest(config=cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name="dns", namespace=namespace, uid="u7"),
        annotations={RESTORE_FROM: ref}))


async def test_restore_through_a_pod_is_refused_and_no_sandbox_is_made(node: Node) -> None:
    async with node.kubelet() as ch:
        stub = cri_grpc.RuntimeServiceStub(ch)  # type: ignore[no-untyped-call]
        code, details = await _status(stub.RunPodSandbox(_annotated("kube-system", node.native.id), timeout=30))
        assert (code, details) == (grpc.StatusCode.PERMISSION_DENIED,
                                   f"restore of pod kube-system/dns from {node.native.id}: restore as pod "
                                   "kube-system/dns: refused by this node's policy: "
                                   'namespaces["kube-system"].restore is false')
        # A refused namespace pulls nothing either: the registry reference is never asked for.
        code, details = await _status(stub.RunPodSandbox(
            _annotated("kube-system", "127.0.0.1:1/nowhere/ckpt:v1"), timeout=30))
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        code, details = await _status(stub.RunPodSandbox(_annotated("prod", node.foreign.id), timeout=30))
        assert code == grpc.StatusCode.PERMISSION_DENIED and details.startswith(
            f"restore of pod prod/dns from {node.foreign.id}: restore as pod prod/dns: checkpoint "), details
        assert details.endswith("restore.allow-foreign: true"), details
        node.assert_nothing_made()
        # A pod without the annotation is the kubelet's own: forwarded, whatever its namespace.
        plain = cri.RunPodSandboxRequest(config=cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name="dns", namespace="kube-system", uid="u8")))
        resp = await stub.RunPodSandbox(plain, timeout=30)
    assert resp.pod_sandbox_id == "ef" * 32 and node.containerd.methods == ["RunPodSandbox"]


# ---- the admission itself ---------------------------------------------------------------------


def _restorer(s: Settings, store: Store) -> Restorer:
    return Restorer(s, FakeCri(), store, Journal(s.journal_dir), FakeCriu(), Metrics())  # type: ignore[arg-type]


async def test_admission_checks_policy_then_foreign_then_signature(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from node_agent import signing

    asked: list[tuple[Any, ...]] = []

    def require_trusted(store: Store, record: CheckpointRecord, settings: Settings, namespace: str) -> str:
        asked.append((store, record.id, namespace))
        if namespace == "untrusted":
            raise errors.PermissionDenied(f"checkpoint {record.id} carries no signature trusted for {namespace}")
        return "ci-2026"

    # The signature check itself is node_agent.signing's (tests/unit/test_signing.py): here, what it is asked.
    monkeypatch.setattr(signing, "require_trusted", require_trusted)

    base = from_mapping({"store": str(tmp_path / "store"), "namespaces": RULES,
                         "restore": {"require-signature": True}})
    store = Store(base.store)
    native, _ = make_checkpoint(store)
    archive = tmp_path / "podman.tar"
    archive.write_bytes(podman_archive())
    foreign = interop.import_archive(store, str(archive), cpuinfo_dump=fake_cpuinfo)
    r = _restorer(base, store)
    n_saved, f_saved = load_saved(store, native), load_saved(store, foreign)

    with pytest.raises(errors.PermissionDenied, match=r'namespaces\["kube-system"\]\.restore is false'):
        await r.admit(native, n_saved, "kube-system", "kube-system/x")
    with pytest.raises(errors.PermissionDenied, match="restore.allow-foreign: true"):
        await r.admit(foreign, f_saved, "prod", "prod/x")
    assert asked == []  # neither refusal got as far as the signature
    assert await r.admit(native, n_saved, "prod", "prod/x") == "ci-2026"
    other = Store(tmp_path / "layout")
    assert await r.admit(native, n_saved, "prod", "prod/x", other) == "ci-2026"
    assert asked == [(store, native.id, "prod"), (other, native.id, "prod")]
    with pytest.raises(errors.PermissionDenied, match="no signature trusted for untrusted"):
        await r.admit(native, n_saved, "untrusted", "untrusted/x")
    # allow-foreign lets a foreign checkpoint reach the signature check; without the requirement none is asked.
    r = _restorer(msgspec.structs.replace(base, restore=msgspec.structs.replace(base.restore, allow_foreign=True)),
                  store)
    assert await r.admit(foreign, f_saved, "prod", "prod/x") == "ci-2026"
    asked.clear()
    r = _restorer(msgspec.structs.replace(base, restore=msgspec.structs.replace(
        base.restore, allow_foreign=True, require_signature=False)), store)
    assert await r.admit(foreign, f_saved, "prod", "prod/x") == "" and asked == []


def test_a_foreign_checkpoint_stays_foreign_through_export_and_import(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    native, _ = make_checkpoint(store)
    assert foreign_engine(native, load_saved(store, native)) == ""
    archive = tmp_path / "podman.tar"
    archive.write_bytes(podman_archive())
    foreign = interop.import_archive(store, str(archive), cpuinfo_dump=fake_cpuinfo)
    assert foreign_engine(foreign, load_saved(store, foreign)) == "podman"
    # Exported as node-agent's own archive and imported again: the configs still say where it came from.
    out = tmp_path / "again.tar"
    name = foreign.metadata["containers"][0]["name"]
    interop.export_container(store, foreign.id, name, str(out))
    again = interop.import_archive(store, str(out), namespace="elsewhere")
    assert again.metadata["imported"]["format"] == "node-agent"
    assert foreign_engine(again, load_saved(store, again)) == "podman"
    # The agent's own archive of its own checkpoint is not foreign.
    out2 = tmp_path / "own.tar"
    interop.export_container(store, native.id, "app", str(out2))
    own = interop.import_archive(store, str(out2), namespace="elsewhere")
    assert foreign_engine(own, load_saved(store, own)) == ""
