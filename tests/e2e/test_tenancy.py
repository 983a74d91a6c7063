"""Tenant boundaries on the Pod path: a Pod author reaches only its own namespace's checkpoints.

A "pod author" may create Pods in one namespace and nothing more; the checkpoint IDs of other
namespaces are not secret. Through the kubelet's RunPodSandbox on the agent's CRI endpoint:
- a checkpoint of another namespace, by ID, is answered as one that does not exist;
- a registry reference is refused unless the node lists its registry (`restore.pod-registries`), and
  what it pulls is admitted before it is published: another namespace's checkpoint, or an unsigned one
  where signatures are required, is refused and leaves nothing in the store;
- a pull beyond `registry.max-pull-bytes`, or beyond what `min-free-bytes` leaves free, is refused
  before a byte is written;
- `allow-host-access` in a Pod's own annotations is refused unless the node names its namespace, and
  even then the restored process gets no capability its new container's config does not grant.
The registry is a real one (Debian's docker-registry) over HTTPS with a test CA, which the node trusts
for the Pod path as a node trusts its registries' CAs (its trust store).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri
from node_agent._proto.k8s.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from testbed.bed import (
    Bed, container_config, container_detail, counter_pod, criu_processes, make_pod, pod_config, pods_in,
    reconfigured, remove_pod, ticks, wait_for,
)
from node_agent.api.pod_restores import ALLOW_HOST_ACCESS, RESTORE_FROM
from tests.e2e.test_cri_endpoint import pod_via_agent

COUNTER = "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done"


@pytest.fixture(scope="module")
def https_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real OCI registry on loopback over HTTPS, anonymous, with a certificate from a test CA."""
    from testbed.registry import Registry

    with Registry(tmp_path_factory.mktemp("https-registry"), tls=True) as reg:
        yield reg


def _sandbox(agent: Bed, namespace: str, annotations: dict[str, str]) -> grpc.RpcError:
    """RunPodSandbox of an annotated Pod, as the kubelet asks through the agent's endpoint: its refusal."""
    name = f"p-{secrets.token_hex(3)}"
    request = cri.RunPodSandboxRequest(config=cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, namespace=namespace, uid=str(uuid.uuid4())),
        log_directory=pod_config(agent, namespace, name)["log_directory"], annotations=annotations))
    there = {p.id for p in pods_in(agent, namespace)}
    with grpc.insecure_channel(agent.cri_endpoint) as ch:
        with pytest.raises(grpc.RpcError) as info:
            cri_grpc.RuntimeServiceStub(ch).RunPodSandbox(request, timeout=120)  # type: ignore[no-untyped-call]
    assert {p.id for p in pods_in(agent, namespace)} == there, "a refused Pod got a sandbox"
    return info.value


def _store_state(agent: Bed) -> tuple[frozenset[str], frozenset[str], list[str]]:
    """What the store holds: its blobs, the checkpoints it lists, and what is being ingested."""
    blobs = frozenset(os.listdir(os.path.join(agent.store, "blobs", "sha256")))
    listed = frozenset(c["id"] for c in json.loads(agent.cli("checkpoints", "ls", "-o", "json").stdout))
    ingest = os.path.join(agent.store, "ingest")
    return blobs, listed, sorted(os.listdir(ingest)) if os.path.isdir(ingest) else []


def _pushed_and_dropped(agent: Bed, ckpt: str, ref: str, registry: Any) -> None:
    """`ckpt` pushed to `ref`, then removed from the store with its blobs: a pull brings it all back."""
    agent.cli("push", ckpt, ref, "--ca-file", registry.ca_file)
    agent.cli("checkpoints", "rm", ckpt)
    agent.cli("gc")


@pytest.mark.also17
def test_a_pod_reaches_only_its_own_namespaces_checkpoints(agent: Bed, https_registry: Any, tmp_path: Path) -> None:
    tenant_b = counter_pod(agent, "e2e-ten-b", flip=False)
    tenant_a = counter_pod(agent, "e2e-ten-a", flip=False)
    try:
        ckpt_b = agent.cli("checkpoint", tenant_b.id).stdout.strip().splitlines()[-1]
        ckpt_a = agent.cli("checkpoint", tenant_a.id).stdout.strip().splitlines()[-1]

        # By ID: tenant-b's checkpoint is, for a Pod in tenant-a, a checkpoint that does not exist.
        missing = "sha256:" + secrets.token_hex(32)
        for ref in (ckpt_b, missing):
            e = _sandbox(agent, "e2e-ten-a", {RESTORE_FROM: ref})
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert e.details().endswith(f"checkpoint {ref} is not in this node's store"), e.details()

        # By registry reference: refused unless the node lists the registry, before any request.
        ref_b = https_registry.ref(f"tenants/b:{secrets.token_hex(3)}")
        _pushed_and_dropped(agent, ckpt_b, ref_b, https_registry)
        before = _store_state(agent)
        e = _sandbox(agent, "e2e-ten-a", {RESTORE_FROM: ref_b})
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED
        assert e.details().endswith(f"{ref_b} is not in a registry or repository this node lets Pods restore from "
                                    "(restore.pod-registries: none)"), e.details()
        assert _store_state(agent) == before

        listed = f"restore:\n  pod-registries: [{https_registry.host}/tenants]\n"
        with reconfigured(agent, listed, trust=https_registry.ca_file):
            # Listed: pulled, and admitted before it is published. tenant-b's is refused, and nothing stays.
            e = _sandbox(agent, "e2e-ten-a", {RESTORE_FROM: ref_b})
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "is of namespace e2e-ten-b; a Pod restores only checkpoints of its own namespace" in e.details(), \
                e.details()
            assert _store_state(agent) == before

            # Pulls are bounded: by max-pull-bytes, and by what min-free-bytes leaves free.
        with reconfigured(agent, listed + "registry:\n  max-pull-bytes: 4096\n", trust=https_registry.ca_file):
            e = _sandbox(agent, "e2e-ten-b", {RESTORE_FROM: ref_b})
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max-pull-bytes" in e.details(), e.details()
            assert _store_state(agent) == before
        with reconfigured(agent, listed + f"min-free-bytes: {1 << 50}\n", trust=https_registry.ca_file):
            e = _sandbox(agent, "e2e-ten-b", {RESTORE_FROM: ref_b})
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "min-free-bytes" in e.details(), e.details()
            assert _store_state(agent) == before

        # Signatures required: tenant-a's own, unsigned checkpoint is refused on pull and leaves nothing.
        key = Ed25519PrivateKey.generate().public_key()
        trusted = "ed25519:" + base64.b64encode(
            key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)).decode()
        ref_a = https_registry.ref(f"tenants/a:{secrets.token_hex(3)}")
        _pushed_and_dropped(agent, ckpt_a, ref_a, https_registry)
        before = _store_state(agent)
        signed = listed + f"  require-signature: true\n  trusted-keys:\n    '*': ['{trusted}']\n"
        with reconfigured(agent, signed, trust=https_registry.ca_file):
            e = _sandbox(agent, "e2e-ten-a", {RESTORE_FROM: ref_a})
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "no signature" in e.details(), e.details()
            assert _store_state(agent) == before
        assert not criu_processes()
    finally:
        remove_pod(agent, tenant_a.id)
        remove_pod(agent, tenant_b.id)


@pytest.mark.also17
def test_a_pod_cannot_grant_itself_host_access(agent: Bed) -> None:
    busybox = agent.info["images"]["busybox"]
    admin = container_config("admin", busybox, ["sh", "-c", COUNTER])
    admin["linux"] = {"security_context": {"capabilities": {"add_capabilities": ["SYS_ADMIN"]}}}
    src = make_pod(agent, "e2e-hax", [admin])
    restored = None
    try:
        d = container_detail(agent, src.containers["admin"])
        wait_for(lambda: len(ticks(d.log_path)) >= 3, what="source ticks")
        ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]

        # The Pod's own annotation does not allow host access where the node does not say so.
        e = _sandbox(agent, "e2e-hax", {RESTORE_FROM: ckpt, ALLOW_HOST_ACCESS: "true"})
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED
        assert e.details().endswith("the Pod's annotation allows host access, which this node honours only in "
                                    "namespaces listed in restore.pod-host-access-namespaces (none)"), e.details()
        e = _sandbox(agent, "e2e-hax", {RESTORE_FROM: ckpt})
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "adds capabilities CAP_SYS_ADMIN" in e.details()

        with reconfigured(agent, "restore:\n  pod-host-access-namespaces: [e2e-hax]\n"):
            # Allowed by the node, the restore goes on, but the container's new config (the Pod's, here
            # without SYS_ADMIN) decides what the process holds: its images are refused at start.
            plain = container_config("admin", busybox, ["sh", "-c", COUNTER])
            with pytest.raises(Exception) as info:
                pod_via_agent(agent, "e2e-hax", [plain], annotations={RESTORE_FROM: ckpt, ALLOW_HOST_ACCESS: "true"})
            assert "phase privileges" in str(info.value) and "CAP_SYS_ADMIN" in str(info.value), info.value
            for pod in pods_in(agent, "e2e-hax"):
                if pod.id != src.id:
                    remove_pod(agent, pod.id)
            # A config that grants it: the same process goes on, with exactly what its config grants.
            restored = pod_via_agent(agent, "e2e-hax", [admin],
                                     annotations={RESTORE_FROM: ckpt, ALLOW_HOST_ACCESS: "true"})
            r = container_detail(agent, restored.containers["admin"])
            assert r.container.state == "CONTAINER_RUNNING"
            wait_for(lambda: len(ticks(r.log_path)) >= 3, what="restored ticks")
            assert ticks(r.log_path)[0] > 3
            with open(f"/proc/{r.pid}/status") as fh:
                cap_eff = int(next(line for line in fh if line.startswith("CapEff:")).split()[1], 16)
            assert cap_eff & (1 << 21), "CAP_SYS_ADMIN, which the new config grants"
    finally:
        if restored is not None:
            remove_pod(agent, restored.id)
        remove_pod(agent, src.id)
