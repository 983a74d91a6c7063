"""Checkpoint on one node, push to a registry, pull and restore on another."""

from __future__ import annotations

import json
import os
from typing import Any

from tests.e2e.bed import Bed, ask, container_detail, counter_pod, pod_detail, remove_pod, ticks, wait_for


def _cli_with_password(bed: Bed, *args: str, password: str, check: bool = True) -> Any:
    import subprocess

    from tests.e2e.bed import NODE_AGENT

    env = dict(os.environ, NODE_AGENT_SOCKET=bed.socket)
    cp = subprocess.run([NODE_AGENT, *args, "--password-stdin"], input=password + "\n", capture_output=True,
                        text=True, env=env, timeout=300)
    if check and cp.returncode != 0:
        raise AssertionError(f"node-agent {' '.join(args)} exited {cp.returncode}:\n{cp.stderr}")
    return cp


def test_restore_on_a_second_node_from_a_registry(agent: Bed, node2: Bed, registry: Any) -> None:
    src = counter_pod(agent, "e2e-xnode", mib=32)
    try:
        server = container_detail(agent, src.containers["server"])
        wait_for(lambda: len(ticks(server.log_path)) >= 5, what="ticks")
        ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        ref = registry.ref("checkpoints/xnode:v1")

        # Wrong password: a clear refusal.
        bad = _cli_with_password(agent, "push", ckpt, ref, "--plain-http", "--username", "ops", password="nope",
                                 check=False)
        assert bad.returncode != 0 and "UNAUTHENTICATED" in bad.stderr, bad.stderr
        out = _cli_with_password(agent, "push", ckpt, ref, "--plain-http", "--username", "ops",
                                 "-o", "json", password="s3cret").stdout
        pushed = json.loads(out)
        assert pushed["checkpoint_id"] == ckpt and int(pushed.get("blobs_transferred", 0)) > 0
        again = json.loads(_cli_with_password(agent, "push", ckpt, ref, "--plain-http", "--username", "ops",
                                              "-o", "json", password="s3cret").stdout)
        assert int(again.get("blobs_transferred", 0)) == 0, again

        # Node 2 has an empty store: it pulls everything.
        assert json.loads(node2.cli("checkpoints", "ls", "-o", "json").stdout) == []
        pulled = _cli_with_password(node2, "pull", ref, "--plain-http", "--username", "ops", password="s3cret")
        assert pulled.stdout.strip().splitlines()[-1] == ckpt
        assert node2.cli("checkpoints", "verify", ckpt).returncode == 0

        res = json.loads(node2.cli("restore", ckpt, "--namespace", "e2e-node2", "--start", "-o", "json").stdout)
        try:
            names = {c["name"]: c["container_id"] for c in res["containers"]}
            d = container_detail(node2, names["server"])
            assert d.container.state == "CONTAINER_RUNNING"
            wait_for(lambda: len(ticks(d.log_path)) >= 3, what="restored ticks on node 2")
            assert ticks(d.log_path)[0] > 5
            ip = pod_detail(node2, res["pod_sandbox_id"]).ip
            assert ip.startswith(node2.info["subnet"].rsplit(".", 1)[0] + "."), (ip, node2.info["subnet"])
            assert ask(ip).startswith("counter=")
        finally:
            remove_pod(node2, res["pod_sandbox_id"])
    finally:
        remove_pod(agent, src.id)
