"""A two-container pod, checkpointed while running and restored elsewhere."""

from __future__ import annotations

import json
import os
import re

import pytest

from testbed.bed import (
    Bed, ask, container_detail, counter_pod, freezer_state, pod_detail, pods_in, remove_pod, ticks, wait_for,
)


def _log(pod_log_dir: str, name: str) -> str:
    return os.path.join(pod_log_dir, name, "0.log")


@pytest.mark.also17
def test_pod_checkpoint_and_restore_into_another_namespace(agent: Bed) -> None:
    src = counter_pod(agent, "e2e-src")
    try:
        shell_log, server_log = _log(src.log_dir, "shell"), _log(src.log_dir, "server")
        wait_for(lambda: len(ticks(shell_log)) >= 5 and len(ticks(server_log)) >= 5, what="source ticks")
        src_ip = pod_detail(agent, src.id).ip
        assert ask(src_ip).startswith("counter=")

        cp = agent.cli("checkpoint", "e2e-src/" + src.name, "-o", "json")
        info = json.loads(cp.stdout)
        ckpt = info["id"]
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", ckpt)
        at_checkpoint = max(ticks(shell_log))
        assert info["pod_namespace"] == "e2e-src" and info["pod_name"] == src.name
        assert sorted(c["name"] for c in info["containers"]) == ["server", "shell"]
        assert info["frozen_ms"] > 0

        # The source pod goes on, thawed.
        for cid in src.containers.values():
            assert freezer_state(container_detail(agent, cid).pid) == "THAWED"
        wait_for(lambda: max(ticks(shell_log)) > at_checkpoint + 3, what="source keeps ticking")

        # It is listed, and inspect shows it.
        ls = json.loads(agent.cli("checkpoints", "ls", "-o", "json").stdout)
        assert ckpt in [c["id"] for c in ls]
        for c in ls:
            for key in ("id", "pod_namespace", "pod_name", "containers", "created", "size", "frozen_ms"):
                assert key in c
        ins = json.loads(agent.cli("checkpoints", "inspect", ckpt[:19], "-o", "json").stdout)
        assert ins["id"] == ckpt

        # Restore into another namespace and start it.
        out = agent.cli("restore", ckpt, "--namespace", "e2e-dst", "--start", "-o", "json").stdout
        res = json.loads(out)
        new_pod = res["pod_sandbox_id"]
        try:
            assert res["namespace"] == "e2e-dst"
            assert res["name"].startswith(src.name + "-restored-")
            names = {c["name"]: c["container_id"] for c in res["containers"]}
            assert sorted(names) == ["server", "shell"]
            for name, cid in names.items():
                d = container_detail(agent, cid)
                assert d.container.state == "CONTAINER_RUNNING", (name, d.container.state)
            shell_new = container_detail(agent, names["shell"])
            server_new = container_detail(agent, names["server"])

            # Counters go on from their state: the first restored tick follows the checkpoint.
            wait_for(lambda: len(ticks(shell_new.log_path)) >= 3, what="restored shell ticks")
            first = ticks(shell_new.log_path)[0]
            assert first > 5, f"restored shell restarted its counter: first tick {first}"
            wait_for(lambda: len(ticks(server_new.log_path)) >= 3, what="restored server ticks")
            assert ticks(server_new.log_path)[0] > 5

            # The file held open in the writable layer continues.
            root = f"/proc/{shell_new.pid}/root"
            assert os.readlink(f"/proc/{shell_new.pid}/fd/3") == "/data/count.log"
            counts = ticks(f"{root}/data/count.log")
            assert counts[0] == 1 and counts == list(range(1, len(counts) + 1)), "count.log lost its history"
            # The file held open in /dev/shm continues.
            assert os.readlink(f"/proc/{shell_new.pid}/fd/4") == "/dev/shm/shell.count"
            shm_counts = ticks(f"{root}/dev/shm/shell.count")
            assert shm_counts[0] == 1 and shm_counts[-1] >= first

            # The listening socket accepts connections in the new pod.
            new_ip = pod_detail(agent, new_pod).ip
            assert new_ip and new_ip != src_ip
            reply = ask(new_ip)
            m = re.match(r"counter=(\d+) mib=16 sum=[0-9a-f]{16}$", reply)
            assert m, reply
            assert int(m.group(1)) > 5

            # The source pod is still running and not frozen.
            for cid in src.containers.values():
                d = container_detail(agent, cid)
                assert d.container.state == "CONTAINER_RUNNING"
                assert freezer_state(d.pid) == "THAWED"
            before = max(ticks(shell_log))
            wait_for(lambda: max(ticks(shell_log)) > before, what="source still ticking")
            assert ask(src_ip).startswith("counter=")
        finally:
            remove_pod(agent, new_pod)
        assert agent.cli("checkpoints", "rm", ckpt).stdout.strip() == ckpt
    finally:
        remove_pod(agent, src.id)


def test_restore_default_name_keeps_namespace_and_created_state(agent: Bed) -> None:
    src = counter_pod(agent, "e2e-keep")
    try:
        wait_for(lambda: len(ticks(_log(src.log_dir, "shell"))) >= 3, what="ticks")
        ckpt = agent.cli("checkpoint", src.id[:12], "--container", "shell").stdout.strip().splitlines()[-1]
        out = agent.cli("restore", ckpt).stdout.strip().splitlines()
        new_pod = out[0]
        try:
            assert len(out) == 2 and out[1].startswith("shell ")
            cid = out[1].split()[1]
            d = container_detail(agent, cid)
            assert d.container.state == "CONTAINER_CREATED"
            pods = pods_in(agent, "e2e-keep")
            restored = [p for p in pods if p.id == new_pod]
            assert restored and re.fullmatch(re.escape(src.name) + r"-restored-[0-9a-f]{6}", restored[0].name)
            # Start it by plain CRI: the restored process resumes, not the image's command.
            agent.cri(lambda cri: cri.start_container(cid))
            d = container_detail(agent, cid)
            wait_for(lambda: len(ticks(d.log_path)) >= 2, what="restored ticks")
            assert ticks(d.log_path)[0] > 3
        finally:
            remove_pod(agent, new_pod)
        agent.cli("checkpoints", "rm", ckpt)
    finally:
        remove_pod(agent, src.id)
