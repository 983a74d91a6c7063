"""A PodCheckpoint on a real node: the bed's agent, its containerd, runc and CRIU, a loopback registry, and
the fake API server (tests/kube_fake.py) in place of the cluster's.

The agent finds the Pod on its node, checkpoints it for real (the pod keeps
running), pushes the checkpoint to the registry the node's hosts.toml reaches
over plain HTTP, and writes the status the CRD allows; deleting the object
removes the checkpoint from the node's store. A PodCheckpoint whose push
reference is outside `podcheckpoints.push-registries` fails, saying why,
and what it took stays until the object goes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any, Iterator

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node_agent import errors, signing

from node_agent.api.pod_restores import RESTORE_FROM
from testbed.bed import SHELL_COUNTER, Bed, answers, ask, container_config, container_detail, make_pod, pod_config
from testbed.bed import pod_detail
from testbed.bed import reconfigured, remove_pod, ticks, wait_for
from testbed.kubelet import Kubelet, StartedPod
from testbed.layout import BedLayout, write_hosts_toml
from testbed.registry import Registry
from tests.kube_fake import FakeKube

NS = "pcp-team"
NODE = "bed-node"
SIGNING_KEY = Ed25519PrivateKey.generate()  # the source node's (signing.key-file)
MEMHOG = ["/usr/local/bin/memhog", "--mib", "64", "--seed", "31", "--port", "8080", "--interval-ms", "100",
          "--flip", "0"]


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with Registry(tmp_path_factory.mktemp("pcp-registry")) as reg:
        yield reg


@pytest.fixture(scope="module")
def cluster(bed: Bed, origin: Registry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Bed, FakeKube]]:
    """The bed's agent watching PodCheckpoints on the fake API server, as node NODE, pushing to `origin`."""
    tmp = tmp_path_factory.mktemp("pcp")
    hosts = write_hosts_toml(BedLayout(bed.name).hosts_dir, origin.host, f'server = "http://{origin.host}"\n')
    key_file = tmp / "signing.pem"
    key_file.write_bytes(SIGNING_KEY.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    key_file.chmod(0o600)
    with FakeKube() as api:
        api.put("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        extra = json.dumps({
            "devices": {"enabled": False, "kubeconfig": str(api.kubeconfig(tmp / "kubeconfig")), "node-name": NODE},
            "podcheckpoints": {"enabled": True, "push-registries": [f"{origin.host}/team"]},
            "signing": {"key-file": str(key_file)},
        })
        try:
            with reconfigured(bed, extra):
                yield bed, api
        finally:
            hosts.unlink()
        assert api.state.problems == [], "every write the agent sent must pass the CRD's schema"


def _pod(bed: Bed, api: FakeKube, name: str, containers: list[dict[str, Any]] | None = None) -> Any:
    """A pod on the bed (a shell counter unless ``containers`` say otherwise), and its Pod on the API server."""
    pod = make_pod(bed, NS, containers or [container_config(
        "shell", bed.info["images"]["busybox"], ["sh", "-c", SHELL_COUNTER.format(name="shell")])], name=name)
    api.put("pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod.name, "namespace": NS},
                     "spec": {"nodeName": NODE}})
    return pod


@contextlib.contextmanager
def _model_server(bed: Bed, api: FakeKube, name: str, node2: Bed, origin: Registry) -> Iterator[tuple[str, list[str]]]:
    """A memhog "model server" pod `name` on the bed, answering, with node2 reaching `origin` over plain HTTP.
    Yields the server's checksum and a list for the sandboxes made on node2; afterwards they go, with node2's
    copies of this namespace's checkpoints, its hosts.toml, and the server."""
    src = _pod(bed, api, name, [container_config("mem", bed.info["images"]["memhog"], MEMHOG)])
    hosts = write_hosts_toml(BedLayout(node2.name).hosts_dir, origin.host, f'server = "http://{origin.host}"\n')
    made: list[str] = []
    try:
        ip = pod_detail(bed, src.id).ip
        wait_for(lambda: answers(ip), what="the model server to answer")
        yield ask(ip).split("sum=")[1], made
    finally:
        for sandbox in made:
            remove_pod(node2, sandbox)
        for record in json.loads(node2.cli("checkpoints", "ls", "-o", "json").stdout or "[]"):
            if record["pod_namespace"] == NS:
                node2.cli("checkpoints", "rm", record["id"], check=False)
        hosts.unlink(missing_ok=True)
        remove_pod(bed, src.id)


def _ask(api: FakeKube, name: str, pod: str, **spec: Any) -> None:
    api.put("podcheckpoints", {"apiVersion": "node-agent.io/v1alpha1", "kind": "PodCheckpoint",
                               "metadata": {"name": name, "namespace": NS},
                               "spec": {"source": {"podName": pod}, **spec}})


def _by_name(bed: Bed, pod: str, podcheckpoint: str, containers: list[str]) -> StartedPod:
    """A Pod restoring PodCheckpoint `podcheckpoint` by its name, started with the kubelet's calls."""
    pcfg = pod_config(bed, NS, pod)
    pcfg["annotations"] = {RESTORE_FROM: f"podcheckpoint/{podcheckpoint}"}
    cmd = ["sh", "-c", SHELL_COUNTER.format(name="shell")]
    return asyncio.run(Kubelet(bed.cri_endpoint).start_pod(
        pcfg, [container_config(c, bed.info["images"]["busybox"], cmd) for c in containers]))


def _finished(api: FakeKube, name: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        obj = api.get("podcheckpoints", NS, name)
        status = (obj or {}).get("status") or {}
        return obj if status.get("phase") in ("Succeeded", "Failed") else None

    return dict(wait_for(done, timeout=180, what=f"podcheckpoint {name} to finish"))


def _stored(bed: Bed) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in json.loads(bed.cli("checkpoints", "ls", "-o", "json").stdout or "[]")}


def test_a_podcheckpoint_is_taken_on_its_node_pushed_and_deleted_with_its_checkpoint(
        cluster: tuple[Bed, FakeKube], origin: Registry) -> None:
    bed, api = cluster
    pod = _pod(bed, api, "web")
    try:
        _ask(api, "warm", pod.name, push={"reference": origin.ref("team/web:warm")})
        obj = _finished(api, "warm")
        status = obj["status"]
        assert status["phase"] == "Succeeded", status
        assert status["node"] == NODE and status["conditions"][0]["status"] == "True"
        stored = _stored(bed)
        assert status["checkpointID"] in stored
        ours = stored[status["checkpointID"]]
        assert (ours["pod_namespace"], ours["pod_name"]) == (NS, pod.name)
        assert status["frozenMilliseconds"] == int(ours["frozen_ms"])
        # Pushed, and pinned by the digest the registry serves it under: the checkpoint's own ID.
        assert status["pushedReference"] == f"{origin.host}/team/web@{status['checkpointID']}"
        assert origin.manifest_blobs("team/web", status["checkpointID"])
        assert origin.manifest_blobs("team/web", "warm")
        # The pod was resumed: it goes on counting.
        log = os.path.join(pod.log_dir, "shell", "0.log")
        seen = max(ticks(log))
        wait_for(lambda: max(ticks(log)) > seen + 2, what="the pod counting on after its checkpoint")
        # Restored by name on this node, with the kubelet's calls: the same process, counting on from where it
        # was checkpointed; a Pod with a container the checkpoint does not have is refused at its
        # CreateContainer.
        restored = _by_name(bed, "web-again", "warm", ["shell"])
        try:
            assert restored.error is None, restored.error
            again = container_detail(bed, restored.containers["shell"]).log_path
            wait_for(lambda: len(ticks(again)) >= 2, what="the restored shell to tick")
            assert ticks(again)[0] > 1, "a fresh start, not the checkpointed process"
        finally:
            remove_pod(bed, restored.sandbox_id)
        extra = _by_name(bed, "web-extra", "warm", ["shell", "sidecar"])
        try:
            assert extra.error is not None and "container sidecar is not in the checkpoint" in str(extra.error)
        finally:
            remove_pod(bed, extra.sandbox_id)

        api.delete("podcheckpoints", NS, "warm")
        wait_for(lambda: api.get("podcheckpoints", NS, "warm") is None, timeout=60, what="the object gone")
        assert status["checkpointID"] not in _stored(bed)
    finally:
        remove_pod(bed, pod.id)


def test_a_push_outside_the_nodes_registries_fails_and_keeps_the_checkpoint_until_the_object_goes(
        cluster: tuple[Bed, FakeKube], origin: Registry) -> None:
    bed, api = cluster
    pod = _pod(bed, api, "other")
    try:
        _ask(api, "elsewhere", pod.name, push={"reference": origin.ref("elsewhere/web:x")})
        status = _finished(api, "elsewhere")["status"]
        assert status["phase"] == "Failed"
        assert "is not in a registry or repository this node pushes PodCheckpoints to" in status["message"]
        assert status["checkpointID"] in _stored(bed)
        api.delete("podcheckpoints", NS, "elsewhere")
        wait_for(lambda: api.get("podcheckpoints", NS, "elsewhere") is None, timeout=60, what="the object gone")
        assert status["checkpointID"] not in _stored(bed)
    finally:
        remove_pod(bed, pod.id)


def test_the_readmes_from_kubectl_steps(cluster: tuple[Bed, FakeKube], origin: Registry, node2: Bed) -> None:
    """README, "From kubectl", step by step. The test plays what a cluster would: kubectl (objects on the
    API server), the Deployment controller (a Pod per replica from the template), the scheduler (node2)
    and node2's kubelet (its CRI calls, in its order)."""
    bed, api = cluster
    image = bed.info["images"]["memhog"]
    with _model_server(bed, api, "model-7c9f5", node2, origin) as (checksum, made):
        # 1. kubectl apply -f the PodCheckpoint, with a push.
        _ask(api, "model-warm", "model-7c9f5", push={"reference": origin.ref("team/model:warm")})
        # 2. kubectl get podcheckpoint model-warm -o wide: Succeeded, and where it was pushed.
        status = _finished(api, "model-warm")["status"]
        assert status["phase"] == "Succeeded", status
        pushed = status["pushedReference"]
        assert pushed == f"{origin.host}/team/model@{status['checkpointID']}"
        # 3. A Deployment of two replicas whose template restores from it, on a node that lets Pods restore
        #    from that registry and the source's namespace.
        dst = "pcp-serving"
        template = {"annotations": {RESTORE_FROM: pushed}}
        rules = f"restore:\n  pod-registries: [{origin.host}/team]\n  pod-sources:\n    {dst}: [{NS}]\n"
        with reconfigured(node2, rules):
            for replica in range(2):
                name = f"model-{secrets.token_hex(3)}"
                api.put("pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {
                    "name": name, "namespace": dst, **template}, "spec": {"nodeName": node2.name}})
                pcfg = pod_config(node2, dst, name)
                pcfg["annotations"] = dict(template["annotations"])
                pod = asyncio.run(Kubelet(node2.cri_endpoint).start_pod(pcfg, [container_config("mem", image, MEMHOG)]))
                made.append(pod.sandbox_id)
                assert pod.error is None, pod.error
                # Each replica answers, on node2, with the source's own memory.
                new_ip = pod_detail(node2, pod.sandbox_id).ip
                wait_for(lambda: answers(new_ip), what=f"replica {replica} to answer")
                assert ask(new_ip).split("sum=")[1] == checksum
        # 4. Deleting the PodCheckpoint removes the checkpoint from the source node's store; the replicas stay.
        api.delete("podcheckpoints", NS, "model-warm")
        wait_for(lambda: api.get("podcheckpoints", NS, "model-warm") is None, timeout=60, what="the object gone")
        assert status["checkpointID"] not in _stored(bed)
        assert all(pod_detail(node2, sandbox).ip for sandbox in made)


def test_a_podcheckpoint_is_restored_by_name_on_another_node_only_with_a_trusted_signature(
        cluster: tuple[Bed, FakeKube], origin: Registry, node2: Bed, tmp_path: Path) -> None:
    bed, api = cluster
    image = bed.info["images"]["memhog"]
    with _model_server(bed, api, "signed-src", node2, origin) as (checksum, made):
        _ask(api, "signed", "signed-src", push={"reference": origin.ref("team/signed:v1")})
        status = _finished(api, "signed")["status"]
        assert status["phase"] == "Succeeded", status

        def by_name() -> StartedPod:
            pcfg = pod_config(node2, NS, f"r-{secrets.token_hex(3)}")
            pcfg["annotations"] = {RESTORE_FROM: "podcheckpoint/signed"}
            started = asyncio.run(Kubelet(node2.cri_endpoint).start_pod(pcfg, [container_config("mem", image, MEMHOG)]))
            made.append(started.sandbox_id)
            return started

        node2_config = {"devices": {"enabled": False, "kubeconfig": str(api.kubeconfig(tmp_path / "kubeconfig")),
                                    "node-name": "node-2"},
                        "restore": {"pod-registries": [f"{origin.host}/team"]}}
        # Elsewhere than its own node, the object's pushed copy; without a key the node trusts, refused.
        with reconfigured(node2, json.dumps(node2_config)):
            with pytest.raises(errors.PermissionDenied, match="may not be restored into namespace"):
                by_name()
        trusted = "ed25519:" + base64.b64encode(signing.raw_public(SIGNING_KEY.public_key())).decode()
        node2_config["restore"]["trusted-keys"] = {"*": [trusted]}  # type: ignore[index]
        with reconfigured(node2, json.dumps(node2_config)):
            started = by_name()
            assert started.error is None, started.error
            new_ip = pod_detail(node2, started.sandbox_id).ip
            wait_for(lambda: answers(new_ip), what="the replica restored by name to answer")
            assert ask(new_ip).split("sum=")[1] == checksum
