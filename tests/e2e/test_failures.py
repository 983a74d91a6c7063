"""Failure paths: kill -9 mid-freeze, deadlines, refused input, failed restores."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import time

import pytest

from testbed.bed import (
    NODE_AGENT, Bed, container_config, container_detail, counter_pod, criu_processes, freezer_state, make_pod,
    pods_in, remove_pod, ticks, volume_holder_pod, wait_for,
)


def _ids(bed: Bed) -> set[str]:
    return {c["id"] for c in json.loads(bed.cli("checkpoints", "ls", "-o", "json").stdout)}


def _leftovers(bed: Bed) -> list[str]:
    return [p for p in glob.glob(os.path.join(bed.store, "work", "*")) + glob.glob(os.path.join(bed.store, "journal", "*"))]


@pytest.mark.also17
@pytest.mark.parametrize("moment", ["frozen", "dumping"])
def test_agent_killed_while_pod_frozen(agent: Bed, moment: str) -> None:
    """SIGKILL the agent right after the freeze, or while CRIU is dumping."""
    pod = counter_pod(agent, "e2e-kill", mib=768 if moment == "frozen" else 256)
    try:
        server = container_detail(agent, pod.containers["server"])
        log_path = server.log_path
        wait_for(lambda: len(ticks(log_path)) >= 3, what="ticks")
        before = _ids(agent)
        env = dict(os.environ, NODE_AGENT_SOCKET=agent.socket)
        cli = subprocess.Popen([NODE_AGENT, "checkpoint", pod.id], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            wait_for(lambda: freezer_state(server.pid) == "FROZEN", timeout=60, interval=0.002, what="the pod to freeze")
            if moment == "dumping":
                wait_for(criu_processes, timeout=10, interval=0.002, what="CRIU to start dumping")
            agent.kill_agent()
            t_kill = time.monotonic()
        finally:
            cli.communicate(timeout=60)
        # Without any restart, the pod runs again within 2 s.
        wait_for(lambda: freezer_state(server.pid) == "THAWED" and freezer_state(
            container_detail(agent, pod.containers["shell"]).pid) == "THAWED", timeout=2, interval=0.01,
            what="the watchdog to thaw the pod")
        thawed_after = time.monotonic() - t_kill
        assert thawed_after < 2.0
        # The watchdog's part ends there. If CRIU had already seized the
        # tasks, they stay stopped under ptrace until CRIU's next exchange
        # with the (killed) runc, at worst the end of the memory copy; it
        # then lets go of them. Killing CRIU sooner would kill the tasks.
        n = max(ticks(log_path))
        wait_for(lambda: max(ticks(log_path)) > n, timeout=60, interval=0.01, what="the pod to tick again")
        # It stays thawed once CRIU is done (CRIU re-freezes a cgroup it found frozen, and the
        # watchdog thaws it again): with no CRIU left, nothing can freeze it after this.
        wait_for(lambda: not criu_processes(), timeout=60, what="CRIU to finish")
        wait_for(lambda: freezer_state(server.pid) == "THAWED", timeout=2, interval=0.01,
                 what="the pod thawed once CRIU is gone")

        agent.start_agent()
        assert _ids(agent) == before, "a half-written checkpoint is listed"
        assert not criu_processes(), "a CRIU process was left behind"
        assert not _leftovers(agent), _leftovers(agent)
        n = max(ticks(log_path))
        wait_for(lambda: max(ticks(log_path)) > n, timeout=30, what="the pod to keep ticking")
    finally:
        remove_pod(agent, pod.id)


def test_deadline_exceeded_resumes_pod_and_keeps_nothing(agent: Bed) -> None:
    pod = counter_pod(agent, "e2e-deadline", mib=512)
    try:
        server = container_detail(agent, pod.containers["server"])
        wait_for(lambda: len(ticks(server.log_path)) >= 3, what="ticks")
        before = _ids(agent)
        for timeout in ("0.001", "0.4"):
            cp = agent.cli("checkpoint", pod.id, "--timeout", timeout, check=False)
            assert cp.returncode != 0
            assert "DEADLINE_EXCEEDED" in cp.stderr, cp.stderr
            # Thawed at once by the agent and kept thawed by the watchdog; while CRIU is still letting go
            # of the tasks it seized it may re-freeze the cgroup for a moment (docs/architecture.md), so
            # the bound is the watchdog's, as for a killed agent: thawed within 2 s, and for good once
            # CRIU is gone.
            wait_for(lambda: freezer_state(server.pid) == "THAWED", timeout=2, interval=0.01, what="the thaw")
            n = max(ticks(server.log_path))
            wait_for(lambda: max(ticks(server.log_path)) > n, timeout=30, what="the pod to keep ticking")
            wait_for(lambda: not _leftovers(agent), timeout=30, what=f"scratch files to go: {_leftovers(agent)}")
            wait_for(lambda: not criu_processes(), timeout=60, what="CRIU to finish")
            assert freezer_state(server.pid) == "THAWED"
            assert _ids(agent) == before
        wait_for(lambda: not criu_processes(), timeout=30, what="CRIU to exit")
        wait_for(lambda: freezer_state(server.pid) == "THAWED", timeout=2, interval=0.01,
                 what="the pod thawed once CRIU is gone")
    finally:
        remove_pod(agent, pod.id)


def test_refusals_change_nothing(agent: Bed) -> None:
    imgs = agent.info["images"]
    gpu = make_pod(agent, "e2e-refuse", [
        container_config("cuda", imgs["busybox"], ["sh", "-c", "while :; do sleep 1; done"],
                         devices=[{"container_path": "/dev/nvidia0", "host_path": "/dev/null", "permissions": "rw"}]),
    ])
    try:
        before = _ids(agent)
        cp = agent.cli("checkpoint", gpu.id, check=False)
        assert cp.returncode != 0 and "FAILED_PRECONDITION" in cp.stderr and "/dev/nvidia0" in cp.stderr, cp.stderr
        assert "not paused" in cp.stderr
        cp = agent.cli("checkpoint", gpu.id, "--option", "bogus=1", check=False)
        assert cp.returncode != 0 and "INVALID_ARGUMENT" in cp.stderr and "bogus" in cp.stderr, cp.stderr
        cp = agent.cli("checkpoint", "e2e-refuse/no-such-pod", check=False)
        assert cp.returncode != 0 and "NOT_FOUND" in cp.stderr, cp.stderr
        cp = agent.cli("checkpoint", gpu.id, "--container", "nope", check=False)
        assert cp.returncode != 0 and "NOT_FOUND" in cp.stderr, cp.stderr
        cp = agent.cli("restore", "sha256:" + "0" * 64, check=False)
        assert cp.returncode != 0 and "NOT_FOUND" in cp.stderr, cp.stderr
        cp = agent.cli("checkpoints", "inspect", "sha256:" + "0" * 64, check=False)
        assert cp.returncode != 0 and "NOT_FOUND" in cp.stderr, cp.stderr
        assert _ids(agent) == before
        assert not _leftovers(agent), _leftovers(agent)
        d = container_detail(agent, gpu.containers["cuda"])
        assert freezer_state(d.pid) == "THAWED"
    finally:
        remove_pod(agent, gpu.id)


def test_failed_restore_leaves_nothing_and_names_the_missing_file(agent: Bed) -> None:
    pod, vol = volume_holder_pod(agent, "e2e-vol")
    try:
        d = container_detail(agent, pod.containers["holder"])
        wait_for(lambda: len(ticks(d.log_path)) >= 2, what="ticks")
        ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
        os.unlink(os.path.join(vol, "held.txt"))
        cp = agent.cli("restore", ckpt, "--namespace", "e2e-vol-dst", "--start", check=False)
        assert cp.returncode != 0, cp.stdout
        assert "held.txt" in cp.stderr, cp.stderr
        assert "holder" in cp.stderr, cp.stderr
        assert pods_in(agent, "e2e-vol-dst") == [], "a failed restore left a sandbox behind"
        assert not os.listdir(os.path.join(agent.store, "plans"))
        agent.cli("checkpoints", "rm", ckpt)
    finally:
        remove_pod(agent, pod.id)


def test_doctor_passes_on_this_node(agent: Bed) -> None:
    cp = agent.cli("doctor", "--config", agent.config, check=False)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    lines = cp.stdout.strip().splitlines()
    assert lines and all(line.split()[0] in ("OK", "WARN") for line in lines), cp.stdout
