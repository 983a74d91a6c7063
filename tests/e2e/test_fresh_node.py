"""A replica on a fresh node: it has never pulled the image, holds no checkpoint, and reaches the registry only
through the hosts its containerd is configured with.

The fresh node is a test bed of its own with no image but the sandbox's. A real registry on loopback holds
both the workload's image and its checkpoint; the node's hosts.toml names it (plain HTTP), for its
containerd and its agent alike. The kubelet's calls come in the kubelet's order: RunPodSandbox (the agent
pulls the checkpoint), then ImageStatus and PullImage (containerd pulls the image), CreateContainer (the
agent checks the image is the checkpoint's own) and StartContainer (the process comes back). A restore
from the CLI, which no kubelet precedes, pulls a missing image itself.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.api.pod_restores import RESTORE_FROM
from testbed.bed import (
    SHELL_COUNTER, Bed, container_config, container_detail, make_pod, pod_config, reconfigured, remove_pod, ticks,
    wait_for,
)
from testbed.kubelet import Kubelet
from testbed.layout import BedLayout, write_hosts_toml
from testbed.registry import Registry


def _ctr(bed: Bed, *args: str) -> str:
    cp = subprocess.run([bed.info["ctr_binary"], "-a", bed.info["containerd_socket"], "-n", "k8s.io", *args],
                        capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, f"ctr {' '.join(args)} exited {cp.returncode}:\n{cp.stderr}\n{cp.stdout}"
    return cp.stdout


def _point_at(bed: Bed, registry: Registry) -> None:
    """The node's hosts.toml for the registry: plain HTTP, for its containerd and its agent."""
    write_hosts_toml(BedLayout(bed.name).hosts_dir, registry.host, f'server = "http://{registry.host}"\n')


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with Registry(tmp_path_factory.mktemp("fresh-origin")) as reg:
        yield reg


def test_a_fresh_node_restores_a_pod_in_the_kubelets_order_and_the_cli_pulls_the_image_itself(
    agent: Bed, fresh: Bed, origin: Registry
) -> None:
    _point_at(fresh, origin)
    image = origin.ref(f"workloads/busybox:{secrets.token_hex(3)}")
    _ctr(agent, "images", "tag", agent.info["images"]["busybox"], image)
    _ctr(agent, "images", "push", "--plain-http", image, image)
    assert not json.loads(fresh.cli("checkpoints", "ls", "-o", "json").stdout)
    assert image not in _ctr(fresh, "images", "ls", "-q")
    src = make_pod(agent, "e2e-fresh", [
        container_config("shell", image, ["sh", "-c", SHELL_COUNTER.format(name="shell")])])
    restored: list[str] = []
    try:
        log = container_detail(agent, src.containers["shell"]).log_path
        wait_for(lambda: len(ticks(log)) >= 5, what="source ticks")
        at = max(ticks(log))  # passed before the checkpoint: the restored counter goes on past it
        ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        ref = origin.ref(f"ckpts/fresh:{secrets.token_hex(3)}")
        agent.cli("push", ckpt, ref, "--plain-http")

        rules = (f"restore:\n  pod-registries: [{origin.host}/ckpts]\n"
                 "  pod-sources:\n    e2e-fresh-kubelet: [e2e-fresh]\n")
        with reconfigured(fresh, rules):
            pcfg = pod_config(fresh, "e2e-fresh-kubelet", f"p-{secrets.token_hex(3)}")
            pcfg["annotations"] = {RESTORE_FROM: ref}
            shell = container_config("shell", image, ["sh", "-c", "exit 3"])  # the checkpoint's process runs
            pod = asyncio.run(Kubelet(fresh.cri_endpoint).start_pod(pcfg, [shell]))
            restored.append(pod.sandbox_id)
            assert pod.error is None, pod.error
            assert pod.calls == ["RunPodSandbox", "ImageStatus", "PullImage", "CreateContainer", "StartContainer"]
            assert pod.pulled == [image]
            d = container_detail(fresh, pod.containers["shell"])
            assert d.container.state == "CONTAINER_RUNNING"
            wait_for(lambda: len(ticks(d.log_path)) >= 3, what="restored ticks on the fresh node")
            assert ticks(d.log_path)[0] > at, ticks(d.log_path)[:3]

        # The CLI restores on a node without the image: the agent pulls it through CRI PullImage.
        remove_pod(fresh, restored.pop())
        _ctr(fresh, "images", "rm", image)
        res = json.loads(fresh.cli("restore", ckpt, "--namespace", "e2e-fresh-cli", "--start", "-o", "json").stdout)
        restored.append(res["pod_sandbox_id"])
        d = container_detail(fresh, res["containers"][0]["container_id"])
        wait_for(lambda: len(ticks(d.log_path)) >= 3, what="ticks of the CLI's restore")
        assert ticks(d.log_path)[0] > at, ticks(d.log_path)[:3]
        assert image in _ctr(fresh, "images", "ls", "-q")
    finally:
        (Path(BedLayout(fresh.name).hosts_dir) / origin.host / "hosts.toml").unlink()
        for pod_id in restored:
            remove_pod(fresh, pod_id)
        remove_pod(agent, src.id)
        subprocess.run([agent.info["ctr_binary"], "-a", agent.info["containerd_socket"], "-n", "k8s.io",
                        "images", "rm", image], capture_output=True, timeout=60)
