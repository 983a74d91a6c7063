"""Store operations through the daemon: verify, gc racing a checkpoint, dedup."""

from __future__ import annotations

import json
import os
import subprocess

from testbed.bed import NODE_AGENT, Bed, container_detail, counter_pod, remove_pod, ticks, wait_for


def _blob_bytes(bed: Bed) -> int:
    root = os.path.join(bed.store, "blobs", "sha256")
    return sum(os.path.getsize(os.path.join(root, n)) for n in os.listdir(root))


def test_gc_racing_a_checkpoint_loses_nothing(agent: Bed) -> None:
    pod = counter_pod(agent, "e2e-gc", mib=128)
    try:
        d = container_detail(agent, pod.containers["server"])
        wait_for(lambda: len(ticks(d.log_path)) >= 3, what="ticks")
        first = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
        env = dict(os.environ, NODE_AGENT_SOCKET=agent.socket)
        # A second checkpoint (deduplicating against the first) while the first is removed and gc runs.
        cli = subprocess.Popen([NODE_AGENT, "checkpoint", pod.id], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        agent.cli("checkpoints", "rm", first)
        rounds = 0
        while cli.poll() is None or rounds < 2:
            agent.cli("gc")
            rounds += 1
        out, err = cli.communicate(timeout=120)
        assert cli.returncode == 0, err
        second = out.strip().splitlines()[-1]
        assert agent.cli("checkpoints", "verify", second).returncode == 0
        new = agent.cli("restore", second, "--namespace", "e2e-gc-dst", "--start").stdout.split()
        try:
            nd = container_detail(agent, new[2])
            wait_for(lambda: len(ticks(nd.log_path)) >= 2, what="restored ticks")
        finally:
            remove_pod(agent, new[0])
        agent.cli("checkpoints", "rm", second)
        agent.cli("gc")
    finally:
        remove_pod(agent, pod.id)


def test_verify_names_a_corrupt_blob_and_a_repeat_checkpoint_adds_little(agent: Bed) -> None:
    pod = counter_pod(agent, "e2e-verify", mib=256, flip=False)
    try:
        d = container_detail(agent, pod.containers["server"])
        wait_for(lambda: len(ticks(d.log_path)) >= 3, what="ticks")
        first = json.loads(agent.cli("checkpoint", pod.id, "-o", "json").stdout)
        before = _blob_bytes(agent)
        second = json.loads(agent.cli("checkpoint", pod.id, "-o", "json").stdout)
        added = _blob_bytes(agent) - before
        assert second["id"] != first["id"]
        assert added <= 0.05 * 256 * 2**20, f"a repeated checkpoint added {added} bytes"

        ok = agent.cli("checkpoints", "verify", second["id"])
        assert "OK" in ok.stdout
        with open(os.path.join(agent.store, "index.json"), encoding="utf-8") as fh:
            assert any(m["digest"] == second["id"] for m in json.load(fh)["manifests"])
        # Corrupt the largest blob of the second checkpoint.
        blobs = os.path.join(agent.store, "blobs", "sha256")
        with open(os.path.join(blobs, second["id"].split(":")[1]), encoding="utf-8") as fh:
            manifest = json.load(fh)
        victim = max(manifest["layers"], key=lambda lay: lay["size"])["digest"]
        path = os.path.join(blobs, victim.split(":")[1])
        with open(path, "r+b") as fh:
            fh.seek(100)
            b = fh.read(1)
            fh.seek(100)
            fh.write(bytes([b[0] ^ 0x55]))
        bad = agent.cli("checkpoints", "verify", second["id"], check=False)
        assert bad.returncode != 0
        assert victim in bad.stdout, bad.stdout
        assert "containers/server/checkpoint/pages-" in bad.stdout, bad.stdout
        for cid in (first["id"], second["id"]):
            agent.cli("checkpoints", "rm", cid)
        agent.cli("gc")
    finally:
        remove_pod(agent, pod.id)
