"""A Pod with shareProcessNamespace (its containers in one PID namespace), restored while its first container forks.

The kubelet starts a pod's containers one after another, and a restored container runs as soon as its
StartContainer returns. Here the first container, once running, fills the namespace's free PIDs up to the
highest one the second container will take back (as a busy first container would, one fork at a time).
The second container still comes back as the same process, because the namespace's next PID was moved past
every PID of the checkpoint before the first container was restored (criu_bridge.pidns).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess

import pytest

from criu_bridge import taskimages
from node_agent import podformat
from node_agent.store import Store
from node_agent.cri import CriClient
from testbed.bed import (
    SHELL_COUNTER, Bed, PodHandle, answers, ask, container_detail, counter_containers, pod_config, pod_detail,
    remove_pod, shared_pids, ticks, wait_for,
)
from testbed.kubelet import Kubelet
from tests.e2e.test_cri_endpoint import RESTORE_FROM


# Forks a few hundred short-lived processes first, one after another.
BURST = "i=0; while [ $i -lt 300 ]; do /bin/true; i=$((i+1)); done; "


def _ns_pid(host_pid: int) -> int:
    """A process's PID by its own account: the innermost of its NSpid line."""
    with open(f"/proc/{host_pid}/status", encoding="ascii") as fh:
        line = next(ln for ln in fh if ln.startswith("NSpid:"))
    return int(line.split()[-1])


def _source_pod(agent: Bed, namespace: str) -> PodHandle:
    """The counting shell, then the server, in one PID namespace; the shell forks a few hundred times before
    it counts, and the server starts after that, so the server's PIDs lie well above the few that restoring
    the shell again uses by itself."""
    shell, server = counter_containers(agent, flip=False)
    shell["command"] = ["sh", "-c", BURST + SHELL_COUNTER.format(name="shell")]
    pcfg = pod_config(agent, namespace, f"p-{secrets.token_hex(3)}")
    shared_pids(pcfg, [shell, server])
    for c in (shell, server):
        os.makedirs(os.path.join(pcfg["log_directory"], c["metadata"]["name"]), exist_ok=True)

    async def go(cri: CriClient) -> PodHandle:
        pod_id = await cri.run_pod(pcfg, "")
        h = PodHandle(agent, pod_id, namespace, pcfg["metadata"]["name"], pcfg["metadata"]["uid"],
                      pcfg["log_directory"])
        h.containers["shell"] = await cri.create_container(pod_id, shell, pcfg)
        await cri.start_container(h.containers["shell"])
        log = os.path.join(pcfg["log_directory"], "shell", "0.log")
        await asyncio.to_thread(wait_for, lambda: ticks(log), 60, "the shell to count")
        h.containers["server"] = await cri.create_container(pod_id, server, pcfg)
        await cri.start_container(h.containers["server"])
        return h

    return agent.cri(go)


@pytest.mark.also17
def test_a_shared_pid_namespace_pod_restores_whole_while_its_first_container_forks(agent: Bed) -> None:
    ns = "e2e-sharedpid"
    src = _source_pod(agent, ns)
    new_id = ""
    try:
        ip = pod_detail(agent, src.id).ip
        wait_for(lambda: answers(ip), what="the server to answer")
        server_pid = _ns_pid(container_detail(agent, src.containers["server"]).pid)
        before = int(ask(ip).split("counter=")[1].split()[0])
        ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]

        # The PIDs the second container takes back, from the checkpoint's own images.
        store = Store(agent.store)
        with store.open(ckpt, podformat.image_path("server", "pstree.img")) as fh:
            server_top = taskimages.highest_pid(fh.read(fh.size))
        assert server_top >= server_pid > 100, (server_top, server_pid)

        filled: list[str] = []

        def fill_pids(name: str, cid: str) -> None:
            """Once the first container runs: hold every free PID of the pod's namespace up to server_top."""
            if name != "shell":
                return
            script = (f"n=0; while [ $n -lt 4000 ]; do sleep 3600 </dev/null >/dev/null 2>&1 & "
                      f"[ $! -ge {server_top} ] && break; n=$((n+1)); done; echo $! $n")
            cp = subprocess.run([agent.info["runc_binary"], "--root", agent.runc_root, "exec", cid, "sh", "-c", script],
                                capture_output=True, text=True, timeout=120, check=True)
            filled.append(cp.stdout.strip())

        pcfg = pod_config(agent, ns, f"r-{secrets.token_hex(3)}")
        pcfg["annotations"] = {RESTORE_FROM: ckpt}
        containers = counter_containers(agent, flip=False)
        containers[0]["command"] = ["sh", "-c", BURST + SHELL_COUNTER.format(name="shell")]
        shared_pids(pcfg, containers)
        pod = asyncio.run(Kubelet(agent.cri_endpoint).start_pod(pcfg, containers, started_one=fill_pids))
        new_id = pod.sandbox_id
        assert pod.error is None, f"{pod.calls}: {pod.error}"
        # The first fork after the first container's restore got a PID above the checkpoint's.
        [(last, count)] = [tuple(int(x) for x in f.split()) for f in filled]
        assert last > server_top and count == 0, filled

        # Both are the processes that were checkpointed, by their own account, and go on.
        new_ip = pod_detail(agent, new_id).ip
        wait_for(lambda: answers(new_ip), what="the restored server to answer")
        assert _ns_pid(container_detail(agent, pod.containers["server"]).pid) == server_pid
        assert int(ask(new_ip).split("counter=")[1].split()[0]) >= before
        log = container_detail(agent, pod.containers["shell"]).log_path
        wait_for(lambda: len(ticks(log)) >= 2, what="restored ticks")
        assert ticks(log)[0] > 1, "the shell's counter went on from where it was"
    finally:
        remove_pod(agent, src.id)
        if new_id:
            remove_pod(agent, new_id)
