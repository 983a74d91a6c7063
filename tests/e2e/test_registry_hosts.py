"""A node reaches registries the way its containerd does: hosts.toml's mirrors, and the node's logins.

Two real docker-registry instances on loopback play a plain-HTTP mirror and a private registry with
basic auth. The second node (its own containerd, store and agent) is configured as a node is: its
agent reads the registry hosts directory its containerd reads, and a kubelet-format config.json.
Without that configuration each pull here fails (the reference's registry is down, or the registry
wants a login); with it, the checkpoint comes through and the restored process carries on counting.
"""

from __future__ import annotations

import base64
import json
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote
from typing import Any

import grpc
import pytest

from node_agent.api.pod_restores import RESTORE_FROM
from testbed.bed import Bed, container_detail, counter_pod, reconfigured, remove_pod, ticks, wait_for
from testbed.layout import BedLayout, write_hosts_toml
from testbed.registry import Registry
from tests.e2e.test_cross_node import _cli_with_password
from tests.e2e.test_tenancy import _sandbox


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A plain-HTTP registry on loopback, anonymous: the mirror a node's hosts.toml names."""
    with Registry(tmp_path_factory.mktemp("mirror")) as reg:
        yield reg


@pytest.fixture
def down_registry() -> Iterator[str]:
    """``127.0.0.1:PORT`` where nothing answers (the port is bound, not listening): a registry that is down."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


def _checkpoint_of_counter(agent: Bed, namespace: str) -> tuple[Any, str, int]:
    """A counter pod, its checkpoint, and a tick the counter had passed before the checkpoint was taken."""
    src = counter_pod(agent, namespace, mib=16, flip=False)
    shell = container_detail(agent, src.containers["shell"])
    wait_for(lambda: len(ticks(shell.log_path)) >= 5, what="source ticks")
    before = max(ticks(shell.log_path))
    return src, agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1], before


def _restored_counts_on(bed: Bed, ckpt: str, namespace: str, passed: int) -> None:
    """Restore ``ckpt`` on ``bed``: its counter goes on past ``passed`` (the same process), then removed."""
    res = json.loads(bed.cli("restore", ckpt, "--namespace", namespace, "--start", "-o", "json").stdout)
    try:
        names = {c["name"]: c["container_id"] for c in res["containers"]}
        d = container_detail(bed, names["shell"])
        wait_for(lambda: len(ticks(d.log_path)) >= 3, what=f"restored ticks on {bed.name}")
        assert ticks(d.log_path)[0] > passed, ticks(d.log_path)[:3]
    finally:
        remove_pod(bed, res["pod_sandbox_id"])


def test_a_node_pulls_through_the_plain_http_mirror_its_hosts_toml_names(
    agent: Bed, node2: Bed, mirror: Registry, down_registry: str
) -> None:
    src, ckpt, at = _checkpoint_of_counter(agent, "e2e-mirror")
    try:
        path = f"ckpts/mirrored:{secrets.token_hex(3)}"
        agent.cli("push", ckpt, mirror.ref(path), "--plain-http")
        ref = f"{down_registry}/{path}"

        # The registry the reference names is down; nothing tells node 2 of the mirror yet.
        failed = node2.cli("pull", ref, check=False)
        assert failed.returncode != 0 and "UNAVAILABLE" in failed.stderr, failed.stderr

        hosts = write_hosts_toml(BedLayout(node2.name).hosts_dir, down_registry, (
            f'server = "http://{down_registry}"\n\n'
            f'[host."http://{mirror.host}"]\n  capabilities = ["pull", "resolve"]\n'))
        try:
            pulled = node2.cli("pull", ref).stdout.strip().splitlines()[-1]
            assert pulled == ckpt
            # The mirror served it, told which registry it stands in for (containerd's ?ns=).
            assert f"ns={quote(down_registry, safe='')}" in mirror.log_tail(400), mirror.log_tail(40)
            _restored_counts_on(node2, ckpt, "e2e-mirror-2", at)
        finally:
            hosts.unlink()
            node2.cli("checkpoints", "rm", ckpt, check=False)
    finally:
        remove_pod(agent, src.id)


def _logins(bed: Bed, registry: Registry, user: str, password: str) -> Path:
    path = Path(bed.config).parent / "config.json"
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {registry.host: {"auth": auth}}}))
    return path


def test_the_nodes_logins_reach_a_private_registry_on_every_path_its_config_allows(
    agent: Bed, node2: Bed, registry: Any
) -> None:
    src, ckpt, at = _checkpoint_of_counter(agent, "e2e-logins")
    logins: Path | None = None
    hosts: Path | None = None
    try:
        ref = registry.ref(f"ckpts/private:{secrets.token_hex(3)}")
        _cli_with_password(agent, "push", ckpt, ref, "--plain-http", "--username", "ops", password="s3cret")

        # Node 2's hosts.toml says the registry speaks plain HTTP; it has no login for it yet: the registry says no.
        hosts = write_hosts_toml(BedLayout(node2.name).hosts_dir, registry.host, f'server = "http://{registry.host}"\n')
        refused = node2.cli("pull", ref, check=False)
        assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr, refused.stderr

        # The kubelet's config.json gives the node its login: the CLI pulls with it.
        logins = _logins(node2, registry, "ops", "s3cret")
        assert node2.cli("pull", ref).stdout.strip().splitlines()[-1] == ckpt
        _restored_counts_on(node2, ckpt, "e2e-logins-2", at)
        node2.cli("checkpoints", "rm", ckpt)

        # The Pod path: a Pod author names the reference, so the node's login goes only where
        # restore.pod-credentials lets that namespace use it.
        allowed = (f"restore:\n  pod-registries: [{registry.host}/ckpts]\n"
                   f"  pod-sources:\n    e2e-logins-pod: [e2e-logins]\n    e2e-logins-other: [e2e-logins]\n"
                   f"  pod-credentials:\n    e2e-logins-pod: [{registry.host}/ckpts]\n")
        with reconfigured(node2, allowed):
            e = _sandbox(node2, "e2e-logins-other", {RESTORE_FROM: ref})
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (e.code(), e.details())
            assert "s3cret" not in e.details()
            assert ckpt not in _listed(node2)
            pod = _run_restored_sandbox(node2, "e2e-logins-pod", ref)
            try:
                assert ckpt in _listed(node2)
            finally:
                remove_pod(node2, pod)
    finally:
        for path in (logins, hosts):
            if path is not None:
                path.unlink()
        node2.cli("checkpoints", "rm", ckpt, check=False)
        remove_pod(agent, src.id)


def _listed(bed: Bed) -> set[str]:
    return {c["id"] for c in json.loads(bed.cli("checkpoints", "ls", "-o", "json").stdout)}


def _run_restored_sandbox(bed: Bed, namespace: str, ref: str) -> str:
    """RunPodSandbox of a Pod annotated to restore ``ref``, through the agent's CRI endpoint: its sandbox ID."""
    from tests.e2e.test_cri_endpoint import pod_via_agent

    return pod_via_agent(bed, namespace, [], annotations={RESTORE_FROM: ref}).id
