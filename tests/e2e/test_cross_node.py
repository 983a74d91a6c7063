"""Checkpoint on one node, push to a registry, pull and restore on another."""

from __future__ import annotations

import json
import os
from typing import Any

from testbed.bed import Bed, answers, ask, container_detail, counter_pod, pod_detail, remove_pod, ticks, wait_for


def _cli_with_password(bed: Bed, *args: str, password: str, check: bool = True) -> Any:
    import subprocess

    from testbed.bed import NODE_AGENT

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


def _blob_bytes(bed: Bed) -> int:
    root = os.path.join(bed.store, "blobs", "sha256")
    return sum(e.stat().st_size for e in os.scandir(root) if e.is_file())


def test_a_lazy_restore_on_a_node_with_an_empty_store_fetches_its_pages_on_demand(
    agent: Bed, node2: Bed, registry: Any
) -> None:
    from testbed.bed import container_config, make_pod

    imgs = agent.info["images"]
    src = make_pod(agent, "e2e-xlazy", [container_config("mem", imgs["memhog"], [
        "/usr/local/bin/memhog", "--mib", "64", "--seed", "7", "--port", "8080", "--interval-ms", "100",
        "--flip", "0",
    ])])
    try:
        ip = pod_detail(agent, src.id).ip
        wait_for(lambda: answers(ip), what="memhog to answer")
        before = ask(ip).split("sum=")[1]
        ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        ref = registry.ref("checkpoints/xlazy:v1")
        _cli_with_password(agent, "push", ckpt, ref, "--plain-http", "--username", "ops", password="s3cret")

        # A lazy pull brings everything but the memory images' chunks.
        used = _blob_bytes(node2)
        pulled = _cli_with_password(node2, "pull", ref, "--lazy", "--plain-http", "--username", "ops",
                                    password="s3cret")
        assert pulled.stdout.strip().splitlines()[-1] == ckpt
        assert _blob_bytes(node2) - used < 16 << 20
        origin = os.path.join(node2.store, "origins", ckpt.split(":")[1] + ".json")
        with open(origin, encoding="utf-8") as fh:
            recorded = json.load(fh)
        assert recorded["reference"].endswith("@" + ckpt) and "s3cret" not in json.dumps(recorded)
        # What is still in the registry is not "bad".
        assert node2.cli("checkpoints", "verify", ckpt).returncode == 0

        res = json.loads(node2.cli("restore", ckpt, "--namespace", "e2e-xlazy-2", "--lazy", "--start",
                                   "-o", "json").stdout)
        try:
            cid = res["containers"][0]["container_id"]
            plan = os.path.join(node2.store, "plans", cid)
            with open(os.path.join(plan, "plan.json"), encoding="utf-8") as fh:
                assert json.load(fh)["lazy"] is True
            new_ip = pod_detail(node2, res["pod_sandbox_id"]).ip
            assert ask(new_ip).split("sum=")[1] == before
            wait_for(lambda: os.path.exists(os.path.join(plan, "lazy.done")), timeout=120, what="every page in")
            # The pages came through the store: the checkpoint is whole on node 2 now.
            assert _blob_bytes(node2) - used > 60 << 20
            wait_for(lambda: not os.path.exists(origin), timeout=30, what="the origin to be settled")
            assert "every blob is in the store now" in node2.tail_log(200)
            assert node2.cli("checkpoints", "verify", ckpt).returncode == 0
        finally:
            remove_pod(node2, res["pod_sandbox_id"])
        node2.cli("checkpoints", "rm", ckpt)
        agent.cli("checkpoints", "rm", ckpt)
    finally:
        remove_pod(agent, src.id)
