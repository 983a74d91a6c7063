"""Concurrency, cancellation and shutdown on the real node."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

from testbed.bed import (
    NODE_AGENT, Bed, container_detail, counter_pod, criu_processes, freezer_state, pods_in, remove_pod, ticks,
    wait_for,
)


def _ids(bed: Bed) -> set[str]:
    return {c["id"] for c in json.loads(bed.cli("checkpoints", "ls", "-o", "json").stdout)}


def _scratch(bed: Bed) -> list[str]:
    return glob.glob(os.path.join(bed.store, "work", "*")) + glob.glob(os.path.join(bed.store, "journal", "*"))


def test_twenty_concurrent_checkpoints_across_five_pods(agent: Bed) -> None:
    pods = [counter_pod(agent, "e2e-load", mib=8) for _ in range(5)]
    try:
        for p in pods:
            d = container_detail(agent, p.containers["server"])
            wait_for(lambda d=d: len(ticks(d.log_path)) >= 2, what="ticks")
        before = _ids(agent)
        with ThreadPoolExecutor(max_workers=20) as pool:
            results = list(pool.map(lambda i: agent.cli("checkpoint", pods[i % 5].id, check=False, timeout=600),
                                    range(20)))
        failed = [r.stderr for r in results if r.returncode != 0]
        assert not failed, failed
        ids = {r.stdout.strip().splitlines()[-1] for r in results}
        assert len(ids) == 20 and ids.isdisjoint(before)
        assert ids <= _ids(agent)
        for p in pods:
            for cid in p.containers.values():
                assert freezer_state(container_detail(agent, cid).pid) == "THAWED"
        for cid in ids:
            assert agent.cli("checkpoints", "verify", cid).returncode == 0
            agent.cli("checkpoints", "rm", cid)
        assert not _scratch(agent)
    finally:
        for p in pods:
            remove_pod(agent, p.id)


def test_a_cancelled_checkpoint_leaves_the_pod_running_and_nothing_behind(agent: Bed) -> None:
    pod = counter_pod(agent, "e2e-cancel", mib=512)
    try:
        server = container_detail(agent, pod.containers["server"])
        wait_for(lambda: len(ticks(server.log_path)) >= 3, what="ticks")
        before = _ids(agent)
        env = dict(os.environ, NODE_AGENT_SOCKET=agent.socket)
        cli = subprocess.Popen([NODE_AGENT, "checkpoint", pod.id], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
        wait_for(lambda: freezer_state(server.pid) == "FROZEN", timeout=60, interval=0.002, what="the freeze")
        cli.send_signal(signal.SIGKILL)  # the client goes away: the call is cancelled
        cli.communicate(timeout=30)
        wait_for(lambda: freezer_state(server.pid) == "THAWED", timeout=5, interval=0.01, what="the thaw")
        wait_for(lambda: not _scratch(agent), timeout=60, what="scratch files to go")
        # Only CRIU, on its way out, could freeze the pod again: once it is gone, thawed is for good.
        wait_for(lambda: not criu_processes(), timeout=60, what="CRIU to finish")
        wait_for(lambda: freezer_state(server.pid) == "THAWED", timeout=2, interval=0.01,
                 what="the pod thawed once CRIU is gone")
        n = max(ticks(server.log_path))
        wait_for(lambda: max(ticks(server.log_path)) > n, what="the pod to keep ticking")
        assert _ids(agent) == before
    finally:
        remove_pod(agent, pod.id)


def test_sigterm_during_a_checkpoint_ends_cleanly_with_the_pod_running(agent: Bed) -> None:
    pod = counter_pod(agent, "e2e-term", mib=512)
    try:
        server = container_detail(agent, pod.containers["server"])
        wait_for(lambda: len(ticks(server.log_path)) >= 3, what="ticks")
        env = dict(os.environ, NODE_AGENT_SOCKET=agent.socket)
        cli = subprocess.Popen([NODE_AGENT, "checkpoint", pod.id], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        wait_for(lambda: freezer_state(server.pid) == "FROZEN", timeout=60, interval=0.002, what="the freeze")
        assert agent.agent is not None
        agent.agent.send_signal(signal.SIGTERM)
        rc = agent.agent.wait(90)
        out, err = cli.communicate(timeout=30)
        assert rc == 0, agent.tail_log()
        assert freezer_state(server.pid) == "THAWED"
        # The running checkpoint either finished within the grace period or was cancelled cleanly.
        agent.start_agent()
        if cli.returncode == 0:
            ckpt = out.strip().splitlines()[-1]
            assert agent.cli("checkpoints", "verify", ckpt).returncode == 0
            agent.cli("checkpoints", "rm", ckpt)
        assert not _scratch(agent)
        n = max(ticks(server.log_path))
        wait_for(lambda: max(ticks(server.log_path)) > n, what="the pod to keep ticking")
    finally:
        remove_pod(agent, pod.id)


def test_a_second_restore_into_the_same_pod_is_aborted(agent: Bed) -> None:
    pod = counter_pod(agent, "e2e-abort", mib=256)
    try:
        wait_for(lambda: len(ticks(container_detail(agent, pod.containers["server"]).log_path)) >= 2, what="ticks")
        ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
        with ThreadPoolExecutor(max_workers=2) as pool:
            runs = list(pool.map(lambda _: agent.cli("restore", ckpt, "--namespace", "e2e-abort-dst", "--name", "twin",
                                                     check=False), range(2)))
        codes = sorted(r.returncode for r in runs)
        assert codes[0] == 0 and codes[1] != 0, [r.stderr for r in runs]
        loser = next(r for r in runs if r.returncode != 0)
        assert "ABORTED" in loser.stderr or "ALREADY_EXISTS" in loser.stderr, loser.stderr
        assert len(pods_in(agent, "e2e-abort-dst")) == 1
        for p in pods_in(agent, "e2e-abort-dst"):
            remove_pod(agent, p.id)
        agent.cli("checkpoints", "rm", ckpt)
    finally:
        remove_pod(agent, pod.id)
