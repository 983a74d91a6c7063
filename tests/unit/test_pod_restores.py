"""Restore through a Pod: its annotations are whoever may create Pods', held to the node's rules.

The kubelet's RunPodSandbox reaches the agent's real CRI endpoint over a real socket (the node of
test_policy_paths: a real store, a fake containerd behind it). A checkpoint of another namespace is
not found, exactly as a missing one; `restore.pod-sources` lets one in; registry references only from
`restore.pod-registries`; host access by annotation only in `restore.pod-host-access-namespaces`; a
sealed checkpoint of the Pod's own namespace only from that namespace's key domain.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from node_agent.config.loading import from_mapping
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from node_agent.api.pod_restores import ALLOW_HOST_ACCESS, RESTORE_FROM, STATE_DIR, PodRestores
from node_agent.keys import Keys
from node_agent.podformat import load_saved
from node_agent.registry.reference import listed
from node_agent.store import Store
from test_interop import make_checkpoint
from test_policy_paths import Node, Pki, _status  # noqa: F401 - the node harness and its fixtures


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "ca")


def _run(namespace: str, ref: str, **more: str) -> Any:
    return cri.RunPodSandboxRequest(config=cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name="web2", namespace=namespace, uid="u9"),
        annotations={RESTORE_FROM: ref, **more}))


async def _ask(node: Node, request: Any) -> tuple[grpc.StatusCode, str]:
    async with node.kubelet() as ch:
        stub = cri_grpc.RuntimeServiceStub(ch)  # type: ignore[no-untyped-call]
        return await _status(stub.RunPodSandbox(request, timeout=30))


@pytest.fixture
async def node(tmp_path: Path, pki: Pki) -> AsyncIterator[Node]:
    async with Node(tmp_path, pki) as n:
        yield n


async def test_a_checkpoint_of_another_namespace_is_answered_as_a_missing_one(node: Node) -> None:
    ckpt = node.native.id  # pod team/web
    missing = "sha256:" + "ab" * 32
    code, details = await _ask(node, _run("prod", ckpt))
    code2, details2 = await _ask(node, _run("prod", missing))
    assert (code, code2) == (grpc.StatusCode.FAILED_PRECONDITION,) * 2
    assert details == f"restore of pod prod/web2 from {ckpt}: checkpoint {ckpt} is not in this node's store"
    assert details2 == details.replace(ckpt, missing)
    node.assert_nothing_made()
    # Each refusal is a failed Pod restore in the metrics the alerts read.
    assert f'node_agent_failures_total{{operation="pod-restore",reason="FAILED_PRECONDITION"}} 2.0' in (
        node.restorer.metrics.render())


async def test_pod_sources_lets_a_named_namespace_in(tmp_path: Path, pki: Pki) -> None:
    async with Node(tmp_path, pki, restore={"pod-sources": {"prod": ["team"]}}) as node:
        code, details = await _ask(node, _run("prod", node.native.id))
    # Admitted: it got as far as its preflight's CPU check (the fake node has no CRIU; the kubelet, not
    # RunPodSandbox, sees to the images).
    assert "CRIU was asked to cpuinfo_check" in details, (code, details)


async def test_registry_references_only_from_the_listed_registries(node: Node) -> None:
    code, details = await _ask(node, _run("prod", "127.0.0.1:1/team/ckpt:v1"))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details.endswith("127.0.0.1:1/team/ckpt:v1 is not in a registry or repository this node lets Pods "
                            "restore from (restore.pod-registries: none)"), details
    node.assert_nothing_made()


async def test_host_access_by_annotation_only_where_the_node_says(node: Node) -> None:
    code, details = await _ask(node, _run("team", node.native.id, **{ALLOW_HOST_ACCESS: "true"}))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details.endswith("the Pod's annotation allows host access, which this node honours only in namespaces "
                            "listed in restore.pod-host-access-namespaces (none)"), details
    node.assert_nothing_made()
    # "false" asks for nothing: the restore goes on to its preflight.
    code, details = await _ask(node, _run("team", node.native.id, **{ALLOW_HOST_ACCESS: "false"}))
    assert "CRIU was asked to cpuinfo_check" in details, (code, details)


def _sealed_node(tmp_path: Path, domains: dict[str, list[str]]) -> tuple[PodRestores, Store, Keys]:
    ring = tmp_path / "keyring.json"
    ring.write_text(json.dumps({"domains": {
        name: [{"id": f"{name}-1", "key": base64.b64encode(bytes([i + 1]) * 32).decode()}]
        for i, name in enumerate(["tenant-a", "tenant-b"])}}))
    s = from_mapping({"store": str(tmp_path / "store"),
                             "encryption": {"key-sources": [{"file": str(ring)}], "domains": domains}})
    keys = Keys(s.encryption)
    store = Store(s.store, keys=keys)
    pods = PodRestores.__new__(PodRestores)
    pods.settings, pods.checkpointer = s, SimpleNamespace(keys=keys)  # type: ignore[assignment]
    return pods, store, keys


def test_a_sealed_checkpoint_must_come_from_the_namespaces_own_key_domain(tmp_path: Path) -> None:
    pods, store, keys = _sealed_node(tmp_path, {"tenant-a": ["team"], "tenant-b": ["other"]})
    own = keys.seal_key("team")
    other = keys.seal_key("other")
    assert own is not None and other is not None and own.domain != other.domain
    make = store.writer

    def sealed(key: Any) -> Any:
        store.writer = lambda **kw: make(**{**kw, "seal": key})  # type: ignore[method-assign]
        try:
            rec, _ = make_checkpoint(store)  # pod team/web
        finally:
            store.writer = make  # type: ignore[method-assign]
        return rec

    good, forged = sealed(own), sealed(other)
    assert pods._outside(good, load_saved(store, good), "team") == ""
    assert pods._outside(forged, load_saved(store, forged), "team") == \
        "is sealed under key tenant-b-1, not in namespace team's key domain"
    assert pods._outside(good, load_saved(store, good), "prod") == "is of namespace team"


def test_a_registry_reference_is_listed_by_registry_or_repository() -> None:
    allowed = ["registry.example:5000", "ghcr.example/team-a/ckpt"]
    assert listed("registry.example:5000/anything/x:v1", allowed)
    assert listed("REGISTRY.example:5000/x@sha256:" + "a" * 64, allowed)
    assert listed("ghcr.example/team-a/ckpt:v1", allowed) and listed("ghcr.example/team-a/ckpt/sub:v1", allowed)
    assert not listed("ghcr.example/team-a/ckpt2:v1", allowed)
    assert not listed("ghcr.example/team-b/ckpt:v1", allowed)
    assert not listed("registry.example:5001/x:v1", allowed) and not listed("registry.example/x:v1", allowed)
    assert not listed("registry.example:5000/x:v1", [])


def test_restore_state_keeps_no_staged_files_across_a_restart(tmp_path: Path) -> None:
    """An agent that starts finds each Pod restore's state, and nothing else: verified files a CreateContainer
    cut short left, or that an agent from before lazy Pod restores kept between calls, are removed (they are
    plaintext, and CreateContainer reads them again); such an old state had restored /dev/shm already."""
    root = tmp_path / "store" / STATE_DIR
    old, new = root / "sb-old", root / "sb-new"
    for d in (old / "staging" / "containers", new / "staging-0123ab"):
        d.mkdir(parents=True)
    (old / "state.json").write_text(json.dumps({"sandbox_id": "sb-old", "checkpoint": "sha256:" + "a" * 64,
                                                "pod": "ns/p", "options": [], "pending": ["c"], "staged_at": 5.0}))
    (new / "state.json").write_text(json.dumps({"sandbox_id": "sb-new", "checkpoint": "sha256:" + "b" * 64,
                                                "pod": "ns/q", "options": [], "pending": ["c"], "lazy": True,
                                                "devshm": True}))
    (root / "new-half").mkdir()  # a sandbox that never finished being made
    settings = SimpleNamespace(store=str(tmp_path / "store"))
    proxy = SimpleNamespace(unary_forwarder=lambda method: None)
    restores = PodRestores(SimpleNamespace(settings=settings), SimpleNamespace(), SimpleNamespace(),  # type: ignore[arg-type]
                           proxy)  # type: ignore[arg-type]
    assert sorted(p.name for p in root.iterdir()) == ["sb-new", "sb-old"]
    assert [p.name for p in old.iterdir()] == ["state.json"] and [p.name for p in new.iterdir()] == ["state.json"]
    got = restores.restores
    assert (got["sb-old"].lazy, got["sb-old"].devshm, got["sb-old"].pending) == (False, False, ["c"])
    assert (got["sb-new"].lazy, got["sb-new"].devshm) == (True, True)


# ---- restore by PodCheckpoint name ------------------------------------------------------------


def _named_checkpoint(store: Store, uid: str, provenance: str = "local") -> str:
    """A checkpoint of pod team/web as a PodCheckpoint with this UID had it taken (``provenance``: where the
    store says it came from)."""
    rec, files = make_checkpoint(store, names=("app",))
    meta = dict(rec.metadata) | {"requested_by": {"kind": "PodCheckpoint", "namespace": "team", "name": "warm",
                                                  "uid": uid}}
    with store.writer() as w:
        w.add_dir("containers/app/checkpoint", mode=0o700)
        for path, data in sorted(files.items()):
            w.add_bytes(path, data, mode=0o644 if path.endswith(".img") else 0o600)
        return w.commit(meta | {"node": f"n1-{provenance}"}, provenance=provenance).id  # one ID per provenance


async def test_a_pod_restores_a_podcheckpoint_by_name_only_as_its_status_and_this_store_agree(
        tmp_path: Path, pki: Pki) -> None:
    from tests.kube_fake import FakeKube

    with FakeKube() as api:
        kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
        async with Node(tmp_path, pki, devices={"kubeconfig": str(kubeconfig), "node-name": "n1"}) as node:
            made = api.put("podcheckpoints", {"apiVersion": "node-agent.io/v1alpha1", "kind": "PodCheckpoint",
                                              "metadata": {"name": "warm", "namespace": "team"},
                                              "spec": {"source": {"podName": "web"}}})
            ckpt = _named_checkpoint(node.store, made["metadata"]["uid"])

            def status(**given: Any) -> None:
                obj = api.get("podcheckpoints", "team", "warm")
                assert obj is not None
                code, answer = api.server.apply("PUT", api.kind("podcheckpoints"), "team", "warm", "status",
                                                obj | {"status": given}, "application/json")
                assert code == 200, answer

            code, details = await _ask(node, _run("team", "podcheckpoint/warm"))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "has not succeeded (phase none yet)" in details
            assert node.criu.calls == [] and [m for m in node.containerd.methods if m != "Version"] == []
            status(phase="Succeeded", node="n1", checkpointID=ckpt)
            # Admitted: it got as far as its preflight (the fake node has no CRIU).
            code, details = await _ask(node, _run("team", " podcheckpoint/warm\n"))
            assert "CRIU was asked to cpuinfo_check" in details, (code, details)
            # A status that names another checkpoint of this store (any agent could have written it) is not
            # followed: only a checkpoint whose metadata names the object counts.
            asked = len(node.criu.calls)
            status(phase="Succeeded", node="n1", checkpointID=node.native.id)
            code, details = await _ask(node, _run("team", "podcheckpoint/warm"))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert details.endswith("podcheckpoint team/warm was taken on node n1 and not pushed: only that node "
                                    "restores it (push it: spec.push)"), details
            # A pushed copy of another checkpoint than the one taken.
            status(phase="Succeeded", node="n2", checkpointID=ckpt,
                   pushedReference="registry.example/team/x@sha256:" + "e" * 64)
            code, details = await _ask(node, _run("team", "podcheckpoint/warm"))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "is not its checkpoint pinned by digest" in details
            # Another namespace's PodCheckpoint of the same name is not this one.
            code, details = await _ask(node, _run("prod", "podcheckpoint/warm"))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "podcheckpoint prod/warm does not exist" in details
            # A pulled checkpoint whose metadata claims the object (a UID is no secret), named by a status
            # someone wrote: not this node's checkpoint of that object.
            pulled = _named_checkpoint(node.store, made["metadata"]["uid"], provenance="pulled")
            status(phase="Succeeded", node="n1", checkpointID=pulled)
            code, details = await _ask(node, _run("team", "podcheckpoint/warm"))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "taken on node n1 and not pushed" in details
            assert len(node.criu.calls) == asked  # none of these got as far as the preflight
            assert [m for m in node.containerd.methods if m != "Version"] == []  # no sandbox was made
