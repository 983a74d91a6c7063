"""Faults a node meets every week, each injected at the phase it names, each checked from outside.

One test per row of the table in docs/operations.md ("Failures and what you see"), on containerd 2.1.
A fault lands at a phase the test observes (a gate that holds a runtime call, the bytes a registry has
served), never after a sleep. Afterwards, from outside: the pods that should run do and are not frozen,
no stray process, sandbox or plan is left, the store verifies and collects cleanly, and the user's error
says what happened.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
from pathlib import Path
from typing import Any

from tests.e2e.bed import (
    NODE_AGENT, Bed, answers, ask, container_detail, criu_processes, freezer_state, pod_detail, pods_in,
    remove_pod, wait_for,
)
from tests.e2e.faults import Gate, blip, containerd_down, containerd_up, setting
from tests.e2e.test_cross_node import _cli_with_password
from tests.e2e.test_lazy import _memhog_pod, _sum


def _clean(agent: Bed, *namespaces: str) -> None:
    """Nothing of a fault stays: no pod in `namespaces`, no plan, no CRIU; the store verifies and collects."""
    for ns in namespaces:
        assert pods_in(agent, ns) == [], ns
    assert not criu_processes()
    for c in json.loads(agent.cli("checkpoints", "ls", "-o", "json").stdout):
        assert agent.cli("checkpoints", "verify", c["id"], check=False).returncode == 0, c["id"]
    agent.cli("gc")


def _source(agent: Bed, namespace: str, mib: int) -> tuple[Any, str, str]:
    pod = _memhog_pod(agent, namespace, mib)
    ip = pod_detail(agent, pod.id).ip
    wait_for(lambda: answers(ip), what="memhog to answer")
    return pod, ip, _sum(ask(ip))


def _running_thawed(agent: Bed, pod: Any) -> None:
    for cid in pod.containers.values():
        d = container_detail(agent, cid)
        assert d.container.state == "CONTAINER_RUNNING" and freezer_state(d.pid) == "THAWED", cid


def test_a_registry_that_dies_mid_push_or_mid_pull_is_named_and_running_again_resumes(
        agent: Bed, registry: Any) -> None:
    pod, _ip, _before = _source(agent, "e2e-fault-reg", 48)
    ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
    try:
        with blip(registry.host) as b:
            ref = f"{b.host}/faults/reg:{secrets.token_hex(3)}"
            auth = ("--plain-http", "--username", "ops")
            # The registry dies once 16 MiB went up: the push fails, naming it.
            b.cut_after(up=16 << 20)
            cp = _cli_with_password(agent, "push", ckpt, ref, *auth, password="s3cret", check=False)
            assert cp.returncode != 0 and "UNAVAILABLE" in cp.stderr and b.host in cp.stderr, cp.stderr
            b.restore()
            again = json.loads(_cli_with_password(agent, "push", ckpt, ref, *auth, "-o", "json",
                                                  password="s3cret").stdout)
            assert int(again.get("blobs_skipped", 0)) > 0, f"the push started over: {again}"

            # The same for a pull into a store without the checkpoint: it resumes with what it kept.
            agent.cli("checkpoints", "rm", ckpt)
            agent.cli("gc")
            b.cut_after(down=16 << 20)
            cp = _cli_with_password(agent, "pull", ref, *auth, password="s3cret", check=False)
            assert cp.returncode != 0 and "UNAVAILABLE" in cp.stderr and b.host in cp.stderr, cp.stderr
            assert ckpt not in agent.cli("checkpoints", "ls").stdout, "a failed pull published a checkpoint"
            b.restore()
            pulled = json.loads(_cli_with_password(agent, "pull", ref, *auth, "-o", "json",
                                                   password="s3cret").stdout)
            assert pulled["checkpoint_id"] == ckpt and int(pulled.get("blobs_skipped", 0)) > 0, pulled
        _running_thawed(agent, pod)
        _clean(agent, "e2e-fault-reg-r")
    finally:
        agent.cli("checkpoints", "rm", ckpt, check=False)
        remove_pod(agent, pod.id)


def test_concurrent_checkpoints_with_rm_and_gc_lose_nothing(agent: Bed) -> None:
    pods = [_source(agent, "e2e-fault-many", 16) for _ in range(3)]
    made: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()

    def checkpoint(pod_id: str) -> None:
        cp = agent.cli("checkpoint", pod_id, check=False, timeout=300)
        with lock:
            if cp.returncode == 0:
                made.append(cp.stdout.strip().splitlines()[-1])
            elif "ABORTED" not in cp.stderr and "busy" not in cp.stderr:
                errors.append(cp.stderr)

    def churn(rounds: int) -> None:
        for _ in range(rounds):
            with lock:
                victim = made[0] if len(made) > 3 else ""
                if victim:
                    made.remove(victim)
            if victim:
                agent.cli("checkpoints", "rm", victim)
            agent.cli("gc")

    try:
        for _ in range(3):  # rounds of 6 checkpoints at once (2 per pod), with rm and gc alongside
            threads = [threading.Thread(target=checkpoint, args=(p.id,)) for p, _, _ in pods for _ in range(2)]
            threads.append(threading.Thread(target=churn, args=(4,)))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert not errors, errors
        listed = {c["id"]: c for c in json.loads(agent.cli("checkpoints", "ls", "-o", "json").stdout)}
        assert set(made) <= set(listed), "a checkpoint reported made is gone"
        for pod, _ip, _ in pods:
            _running_thawed(agent, pod)
        _clean(agent)
        # The newest of each pod restores as the same process with the same memory.
        for pod, ip, before in pods:
            newest = max((c for c in listed.values() if c["pod_name"] == pod.name and c["id"] in made),
                         key=lambda c: c["created"])
            res = json.loads(agent.cli("restore", newest["id"], "--namespace", "e2e-fault-many-r", "--start",
                                       "-o", "json").stdout)
            try:
                assert _sum(ask(pod_detail(agent, res["pod_sandbox_id"]).ip, timeout=60)) == before
            finally:
                remove_pod(agent, res["pod_sandbox_id"])
    finally:
        for ckpt in made:
            agent.cli("checkpoints", "rm", ckpt, check=False)
        for pod, _, _ in pods:
            remove_pod(agent, pod.id)


def test_containerd_killed_during_a_dump_leaves_a_good_checkpoint(agent: Bed, tmp_path: Path) -> None:
    pod, ip, before = _source(agent, "e2e-fault-dump", 32)
    gate_path = str(tmp_path / "runc")
    real = [ln.split(":", 1)[1].strip() for ln in Path(agent.config).read_text().splitlines()
            if ln.startswith("runc:")][0]
    ckpt = ""
    try:
        with Gate(gate_path, tmp_path / "gate", "checkpoint", real=real) as gate, setting(agent, "runc", gate_path):
            gate.arm()
            run = subprocess.Popen([NODE_AGENT, "checkpoint", pod.id], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=dict(os.environ, NODE_AGENT_SOCKET=agent.socket))
            dump = gate.reached()
            containerd_down(agent)
            try:
                gate.release()
                # runc's dump goes on without containerd; it ends before containerd is back.
                wait_for(lambda: not os.path.exists(f"/proc/{dump['pid']}"), timeout=120, what="the dump")
            finally:
                containerd_up(agent)
            out, err = run.communicate(timeout=300)
            assert run.returncode == 0, err
            ckpt = out.strip().splitlines()[-1]
        assert agent.cli("checkpoints", "verify", ckpt).returncode == 0
        _running_thawed(agent, pod)
        res = json.loads(agent.cli("restore", ckpt, "--namespace", "e2e-fault-dump-r", "--start", "-o", "json").stdout)
        try:
            assert _sum(ask(pod_detail(agent, res["pod_sandbox_id"]).ip, timeout=60)) == before
        finally:
            remove_pod(agent, res["pod_sandbox_id"])
        _clean(agent, "e2e-fault-dump-r")
    finally:
        if ckpt:
            agent.cli("checkpoints", "rm", ckpt, check=False)
        remove_pod(agent, pod.id)
