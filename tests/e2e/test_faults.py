"""Faults a node meets every week, each injected at the phase it names, each checked from outside.

One test per row of the table in docs/operations.md ("Failures and what you see"), on containerd 2.1.
A fault lands at a phase the test observes (a gate that holds a runtime call, the bytes a registry has
served), never after a sleep. Afterwards, from outside: the pods that should run do and are not frozen,
no stray process, sandbox or plan is left, the store verifies and collects cleanly, and the user's error
says what happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node_agent.api.pod_restores import RESTORE_FROM
from node_agent.oci import digest_hex
from testbed.bed import (
    NODE_AGENT, Bed, answers, ask, container_config, container_detail, criu_processes, freezer_state, make_pod,
    pod_config, pod_detail, pods_in, reconfigured, remove_pod, wait_for,
)
from testbed.faults import Gate, blip, containerd_down, containerd_up, setting
from testbed.kubelet import Kubelet
from testbed.layout import BedLayout, write_hosts_toml
from testbed.registry import Registry
from tests.e2e.test_cross_node import _cli_with_password
from tests.e2e.test_fanout import push_memhog
from tests.e2e.test_lazy import _memhog_pod, _sum


def _pending_undos(agent: Bed) -> list[str]:
    """The journal entries whose removal of what they made is still pending."""
    journal = Path(agent.store, "journal")
    return [p.name for p in journal.glob("*.json") if json.loads(p.read_text()).get("data", {}).get("undo")]


def _mounts_in_store(agent: Bed) -> list[str]:
    """Mounts left under the store (a CRIU cut off mid-restore leaves its cgroup yard in the plan's work/)."""
    store = os.path.realpath(agent.store) + "/"
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        return [point for point in (line.split()[4] for line in fh) if point.startswith(store)]


def _clean(agent: Bed, *namespaces: str) -> None:
    """Nothing of a fault stays: no pod in `namespaces`, no pending undo, no mount in the store, no CRIU; the
    store verifies and collects."""
    for ns in namespaces:
        assert pods_in(agent, ns) == [], ns
    assert _pending_undos(agent) == [] and _mounts_in_store(agent) == []
    assert not criu_processes()
    for c in json.loads(agent.cli("checkpoints", "ls", "-o", "json").stdout):
        assert agent.cli("checkpoints", "verify", c["id"], check=False).returncode == 0, c["id"]
    agent.cli("gc")


def _seed(namespace: str) -> int:
    """A memhog seed of the test's own: its memory shares no chunk with another test's checkpoint, which the
    store may still hold (a kept partial pull, a transfer going on alone), so what the test removes, corrupts
    or cuts off is its own. memhog's memory from one seed is the same stream at every size."""
    return zlib.crc32(namespace.encode()) | 1


def _source(agent: Bed, namespace: str, mib: int) -> tuple[Any, str, str]:
    pod = _memhog_pod(agent, namespace, mib, seed=_seed(namespace))
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
        with Gate(gate_path, tmp_path / "gate", "checkpoint", real=real) as gate, \
                setting(agent, {"runc": gate_path}):
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


# ---- the agent and containerd going away at a phase of a restore ---------------------------------------


def _unique_memhog(agent: Bed, namespace: str, marker: int) -> tuple[Any, str, str]:
    """A memhog whose command line no other test's has (its tick interval): its copies can be counted."""
    from testbed.bed import container_config, make_pod

    pod = make_pod(agent, namespace, [container_config("mem", agent.info["images"]["memhog"], [
        "/usr/local/bin/memhog", "--mib", "16", "--port", "8080", "--interval-ms", str(marker), "--flip", "0",
        "--seed", str(_seed(namespace))])])
    ip = pod_detail(agent, pod.id).ip
    wait_for(lambda: answers(ip), what="memhog to answer")
    return pod, ip, _sum(ask(ip))


def _copies(marker: int) -> list[int]:
    """PIDs of every process running the memhog with this marker."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"memhog") and str(marker).encode() in argv:
            out.append(int(pid))
    return out


def _restoring(agent: Bed, ckpt: str, namespace: str, *more: str) -> subprocess.Popen[str]:
    return subprocess.Popen([NODE_AGENT, "restore", ckpt, "--namespace", namespace, "--start", "-o", "json", *more],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, NODE_AGENT_SOCKET=agent.socket))


def _plans_of(agent: Bed) -> set[str]:
    plans = os.path.join(agent.store, "plans")
    return set(os.listdir(plans)) if os.path.isdir(plans) else set()


def test_a_second_agent_on_the_same_store_is_refused_and_the_first_goes_on(agent: Bed, tmp_path: Path) -> None:
    from testbed.faults import wrapper_gate

    pod, _ip, before = _unique_memhog(agent, "e2e-fault-two", 91)
    ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
    assert agent.agent is not None
    try:
        with wrapper_gate(agent, tmp_path / "gate") as gate:
            gate.arm()
            run = _restoring(agent, ckpt, "e2e-fault-two-r")
            gate.reached()  # a restore in flight, held in its StartContainer
            second = subprocess.run([NODE_AGENT, "serve", "--config", agent.config], capture_output=True, text=True,
                                    timeout=120)
            assert second.returncode != 0, second.stderr
            assert second.stderr.strip().splitlines()[-1] == (
                f"node-agent: FAILED_PRECONDITION: store {agent.store} is in use by another node-agent "
                f"(pid {agent.agent.pid}); one agent per store"), second.stderr
            # Another store, the same sockets: refused too, and the first agent's sockets stay its own.
            other = tmp_path / "other.yaml"
            other.write_text("\n".join(ln for ln in Path(agent.config).read_text().splitlines()
                                       if not ln.startswith("store:")) + f"\nstore: {tmp_path / 'other-store'}\n")
            third = subprocess.run([NODE_AGENT, "serve", "--config", str(other)], capture_output=True, text=True,
                                   timeout=120)
            assert third.returncode != 0 and "is served by another process" in third.stderr, third.stderr
            assert agent.agent.poll() is None, "the first agent was killed"
            assert json.loads(agent.cli("checkpoints", "ls", "-o", "json").stdout) is not None
            gate.release()
            out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        res = json.loads(out)
        try:
            assert _sum(ask(pod_detail(agent, res["pod_sandbox_id"]).ip, timeout=60)) == before
        finally:
            remove_pod(agent, res["pod_sandbox_id"])
        _clean(agent, "e2e-fault-two-r")
    finally:
        agent.cli("checkpoints", "rm", ckpt, check=False)
        remove_pod(agent, pod.id)


def test_containerd_killed_during_a_restore_leaves_no_sandbox_and_no_duplicate(agent: Bed, tmp_path: Path) -> None:
    from testbed.faults import wrapper_gate

    pod, _ip, _before = _unique_memhog(agent, "e2e-fault-ctrd", 93)
    ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
    plans = _plans_of(agent)
    try:
        with wrapper_gate(agent, tmp_path / "gate") as gate:
            gate.arm()
            run = _restoring(agent, ckpt, "e2e-fault-ctrd-r", "--full")
            reached = gate.reached()
            containerd_down(agent)
            try:
                gate.release()  # the shim goes on without containerd: runc restores a copy of the process
                wait_for(lambda: not os.path.exists(f"/proc/{reached['pid']}"), timeout=120, what="runc restore")
                out, err = run.communicate(timeout=300)
                assert run.returncode != 0 and "UNAVAILABLE" in err, err
            finally:
                containerd_up(agent)
        # Once containerd answers again, the agent's undo removes what the restore made.
        wait_for(lambda: pods_in(agent, "e2e-fault-ctrd-r") == [], timeout=120, what="the undo to finish")
        wait_for(lambda: len(_copies(93)) == 1, timeout=60, what="the restored copy to go")
        assert _plans_of(agent) <= plans
        _running_thawed(agent, pod)
        _clean(agent, "e2e-fault-ctrd-r")
    finally:
        agent.cli("checkpoints", "rm", ckpt, check=False)
        remove_pod(agent, pod.id)


def test_the_agent_killed_during_a_restore_is_undone_at_its_next_start(agent: Bed, registry: Any,
                                                                       tmp_path: Path) -> None:
    """During RunPodSandbox and during StartContainer: recovery removes the half-made pod (and any copy of
    the process); during a lazy transfer: the page source serves on alone, the replica stays whole."""
    from testbed.faults import wrapper_gate
    from tests.e2e.test_lazy import _lazy_processes

    pod, _ip, before = _unique_memhog(agent, "e2e-fault-kill", 97)
    ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
    plans = _plans_of(agent)
    launcher = os.path.join(agent.store, "bin", "node-agent-runc")
    try:
        for phase, gate in (("RunPodSandbox", Gate(launcher, tmp_path / "sandbox", "create")),
                            ("StartContainer", wrapper_gate(agent, tmp_path / "start"))):
            with gate:
                gate.arm()
                run = _restoring(agent, ckpt, "e2e-fault-kill-r", "--full")
                gate.reached()
                agent.kill_agent()
                gate.release()
                _out, err = run.communicate(timeout=300)
                assert run.returncode != 0, (phase, err)
            agent.start_agent()
            wait_for(lambda: pods_in(agent, "e2e-fault-kill-r") == [], timeout=120, what=f"recovery after {phase}")
            wait_for(lambda: len(_copies(97)) == 1, timeout=60, what=f"no copy of the process after {phase}")
            assert _plans_of(agent) <= plans, phase

        # During a lazy transfer: its pages wait in a registry that does not answer; the agent dies; the
        # registry comes back and the page source finishes alone.
        with _lazy_from_registry(agent, registry, ckpt) as (b, _ref):
            b.pace(1 << 20)  # 16 MiB of memory from the registry: the transfer lasts about 16 s
            res = json.loads(agent.cli("restore", ckpt, "--namespace", "e2e-fault-kill-r", "--lazy", "--start",
                                       "-o", "json").stdout)
            cid = res["containers"][0]["container_id"]
            assert _lazy_processes(cid), "no page source for the lazy replica"
            agent.kill_agent()
            b.pace(0)
            try:
                assert _sum(ask(pod_detail(agent, res["pod_sandbox_id"]).ip, timeout=60)) == before
                wait_for(lambda: not _lazy_processes(cid), timeout=60, what="the transfer to end")
                assert os.path.exists(os.path.join(agent.store, "plans", cid, "lazy.done"))
                agent.start_agent()
                assert container_detail(agent, cid).container.state == "CONTAINER_RUNNING"
                assert _sum(ask(pod_detail(agent, res["pod_sandbox_id"]).ip)) == before
            finally:
                if agent.agent is None or agent.agent.poll() is not None:
                    agent.start_agent()
                remove_pod(agent, res["pod_sandbox_id"])
        _running_thawed(agent, pod)
        _clean(agent, "e2e-fault-kill-r")
    finally:
        agent.cli("checkpoints", "rm", ckpt, check=False)
        remove_pod(agent, pod.id)


# ---- a full disk ----------------------------------------------------------------------------------------


def _tmpfs(path: Path, mib: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "tmpfs", str(path)], check=True)


def _ticking(agent: Bed, pod: Any) -> None:
    """The pod runs on, thawed, its ticker going (not frozen now, not stopped)."""
    from testbed.bed import ticks

    _running_thawed(agent, pod)
    for cid in pod.containers.values():
        log = container_detail(agent, cid).log_path
        n = len(ticks(log))
        wait_for(lambda log=log, n=n: len(ticks(log)) > n, what="the ticker to go on")


def test_a_full_store_gets_a_clear_answer_and_keeps_nothing(agent: Bed, registry: Any, tmp_path: Path) -> None:
    pod, _ip, _ = _source(agent, "e2e-fault-full", 64)
    ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
    ref = registry.ref(f"faults/full:{secrets.token_hex(3)}")
    _cli_with_password(agent, "push", ckpt, ref, "--plain-http", "--username", "ops", password="s3cret")
    try:
        # A store smaller than the pod: refused before the pod is paused, and a pull refused before a byte.
        small = tmp_path / "small"
        _tmpfs(small, 48)
        try:
            with setting(agent, {"store": str(small / "store")}):
                cp = agent.cli("checkpoint", pod.id, check=False)
                assert cp.returncode != 0 and "RESOURCE_EXHAUSTED" in cp.stderr, cp.stderr
                assert f"not enough free space in store {small / 'store'}" in cp.stderr, cp.stderr
                assert "the pod was not paused and nothing was written" in cp.stderr, cp.stderr
                _ticking(agent, pod)
                cp = _cli_with_password(agent, "pull", ref, "--plain-http", "--username", "ops",
                                        password="s3cret", check=False)
                assert cp.returncode != 0 and "RESOURCE_EXHAUSTED" in cp.stderr, cp.stderr
                assert f"pull of {ref}" in cp.stderr and "min-free-bytes" in cp.stderr, cp.stderr
                assert json.loads(agent.cli("checkpoints", "ls", "-o", "json").stdout) == []
                assert os.listdir(small / "store" / "ingest") == []
        finally:
            subprocess.run(["umount", str(small)], check=False)

        # Room for the pod's memory, not for its dump and its chunks both: the disk fills during the
        # checkpoint. The pod runs on, nothing is kept, the answer says so and why.
        mid = tmp_path / "mid"
        _tmpfs(mid, 112)
        try:
            with setting(agent, {"store": str(mid / "store"), "min-free-bytes": "0"}):
                cp = agent.cli("checkpoint", pod.id, check=False)
                assert cp.returncode != 0 and "RESOURCE_EXHAUSTED" in cp.stderr, cp.stderr
                assert f"store {mid / 'store'} ran out of space during" in cp.stderr, cp.stderr
                assert "the pod runs on and nothing was kept" in cp.stderr, cp.stderr
                _ticking(agent, pod)
                assert json.loads(agent.cli("checkpoints", "ls", "-o", "json").stdout) == []
                for d in ("work", "ingest", "journal"):
                    assert os.listdir(mid / "store" / d) == [], d
                agent.cli("gc")
        finally:
            subprocess.run(["umount", str(mid)], check=False)
        _clean(agent)
    finally:
        agent.cli("checkpoints", "rm", ckpt, check=False)
        remove_pod(agent, pod.id)



# ---- lazy replicas: a registry blip, a registry gone, a corrupt chunk ---------------------------------


@contextlib.contextmanager
def _lazy_from_registry(agent: Bed, registry: Any, ckpt: str) -> Iterator[tuple[Any, str]]:
    """`ckpt` pushed through a cuttable proxy, removed from the store, and pulled back lazily: its memory
    stays in the registry until a replica faults it in, through the proxy."""
    with blip(registry.host) as b:
        ref = f"{b.host}/faults/lazy:{secrets.token_hex(3)}"
        auth = ("--plain-http", "--username", "ops")
        _cli_with_password(agent, "push", ckpt, ref, *auth, password="s3cret")
        agent.cli("checkpoints", "rm", ckpt)
        agent.cli("gc")
        pulled = _cli_with_password(agent, "pull", ref, *auth, "--lazy", password="s3cret").stdout.split()[-1]
        assert pulled == ckpt
        yield b, ref


def _stopped(agent: Bed, cid: str, says: str) -> Any:
    """The container's detail once the runtime no longer reports it running and its CRI log `says` so (None
    before: for wait_for)."""
    d = container_detail(agent, cid)
    return d if d.container.state != "CONTAINER_RUNNING" and _cri_log_says(d.log_path, says) else None


def _restores(agent: Bed) -> list[dict[str, Any]]:
    return list(json.loads(agent.cli("restores", "-o", "json").stdout))


def _status_via_agent(agent: Bed, cid: str) -> Any:
    from node_agent._proto.k8s.cri.runtime.v1 import api_pb2 as cri
    from tests.e2e.test_cri_endpoint import RT, raw_call

    raw = raw_call(agent.cri_endpoint, RT + "ContainerStatus", cri.ContainerStatusRequest(container_id=cid)
                   .SerializeToString())
    return cri.ContainerStatusResponse.FromString(raw).status


def _cri_log_says(path: str, text: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return any(" stderr F node-agent: " in line and text in line for line in fh)
    except OSError:
        return False


def test_a_lazy_replica_survives_a_registry_blip_and_fails_visibly_when_it_stays_away(
        agent: Bed, registry: Any) -> None:
    from tests.e2e.test_lazy import _lazy_processes

    pod, _ip, before = _source(agent, "e2e-fault-blip", 64)
    ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
    try:
        with setting(agent, {"timeouts": "{lazy-fetch: 8}"}), _lazy_from_registry(agent, registry, ckpt) as (b, ref):
            # A blip: the registry goes away while the replica's memory comes in (paced: 64 MiB take about
            # 16 s), and comes back before the deadline.
            b.pace(4 << 20)
            res = json.loads(agent.cli("restore", ckpt, "--namespace", "e2e-fault-blip-r", "--lazy", "--start",
                                       "-o", "json").stdout)
            cid = res["containers"][0]["container_id"]
            assert _lazy_processes(cid), "the transfer was over before the registry went away"
            b.cut()
            source_log = Path(agent.store) / "plans" / cid / "work" / "page-source.log"
            wait_for(lambda: source_log.exists() and "trying again" in source_log.read_text(errors="replace"),
                     timeout=30, what="a failed fetch, retried")
            b.pace(0)
            b.restore()
            try:
                assert _sum(ask(pod_detail(agent, res["pod_sandbox_id"]).ip, timeout=60)) == before
                wait_for(lambda: not _lazy_processes(cid), timeout=60, what="the transfer to end")
                assert container_detail(agent, cid).container.state == "CONTAINER_RUNNING"
                assert [r["state"] for r in _restores(agent) if r["container_id"] == cid] in (["done"], ["running"])
            finally:
                remove_pod(agent, res["pod_sandbox_id"])

            # Gone for good (past timeouts.lazy-fetch): the replica is stopped, never run on missing memory,
            # and the reason is where the user looks. (The first replica brought every page into the store:
            # pulled lazily again, the memory is in the registry only.)
            agent.cli("checkpoints", "rm", ckpt)
            agent.cli("gc")
            _cli_with_password(agent, "pull", ref, "--plain-http", "--username", "ops", "--lazy", password="s3cret")
            b.pace(4 << 20)
            res = json.loads(agent.cli("restore", ckpt, "--namespace", "e2e-fault-blip-r", "--lazy", "--start",
                                       "-o", "json").stdout)
            cid = res["containers"][0]["container_id"]
            assert _lazy_processes(cid), "the transfer was over before the registry went away"
            b.cut()
            b.pace(0)
            try:
                wait_for(lambda: [r["state"] for r in _restores(agent) if r["container_id"] == cid] == ["failed"],
                         timeout=90, what="the replica to fail")
                (record,) = [r for r in _restores(agent) if r["container_id"] == cid]
                assert "timeouts.lazy-fetch" in record["reason"], record
                # Marked failed first, then killed and told in its log: the runtime reports the exit once it has
                # reaped the processes.
                d = wait_for(lambda: _stopped(agent, cid, "timeouts.lazy-fetch"), timeout=30,
                             what="the runtime to see it stopped, its log to say why")
                status = _status_via_agent(agent, cid)
                assert status.reason == "RestoreFailed" and "timeouts.lazy-fetch" in status.message, status
            finally:
                b.restore()
                remove_pod(agent, res["pod_sandbox_id"])
        _running_thawed(agent, pod)
        _clean(agent, "e2e-fault-blip-r")
    finally:
        agent.cli("checkpoints", "rm", ckpt, check=False)
        remove_pod(agent, pod.id)


def test_a_corrupt_memory_chunk_stops_the_whole_restored_pod_and_says_why(agent: Bed) -> None:
    """The default (lazy) restore reports success; the bad chunk is found as the memory comes in, and both
    restored containers stop: no wrong byte ever runs, and the user is told where they look. Under a
    kubelet, a restored container that failed is not created again from its image."""
    from node_agent.api.pod_restores import RESTORE_FROM
    from testbed.bed import counter_pod
    from tests.e2e.test_cri_endpoint import pod_via_agent, shell, via_agent

    src = counter_pod(agent, "e2e-fault-bit", mib=32, flip=False, seed=_seed("e2e-fault-bit"))
    ckpt = agent.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
    blobs = os.path.join(agent.store, "blobs", "sha256")
    with open(os.path.join(blobs, ckpt.split(":")[1]), encoding="utf-8") as fh:
        victim = max(json.load(fh)["layers"], key=lambda layer: layer["size"])["digest"]  # a chunk of memory
    res: dict[str, Any] = {}
    try:
        # Before the flip, a Pod restore under a user the checkpoint's processes are not (root's images,
        # a config that runs as 1000): refused at its start, so it failed; the kubelet's re-create of that
        # container is refused too, never a cold start of its image in a pod restored from a checkpoint.
        as_1000 = shell(agent)
        as_1000["linux"] = {"security_context": {"run_as_user": {"value": 1000}}}
        from node_agent import errors

        with contextlib.suppress(errors.AgentError):
            pod_via_agent(agent, "e2e-fault-bit", [as_1000], annotations={RESTORE_FROM: ckpt})
        (new_pod,) = [p for p in pods_in(agent, "e2e-fault-bit") if p.id != src.id]

        async def again(client: Any) -> str:
            config = (await client.pod_status(new_pod.id)).config
            retry = dict(shell(agent), metadata={"name": "shell", "attempt": 1})
            try:
                await client.create_container(new_pod.id, retry, dict(config))
            except errors.FailedPrecondition as exc:
                return str(exc)
            return ""

        refusal = via_agent(agent, again)
        assert "phase privileges" in refusal and "is not created again from its image" in refusal, refusal

        async def gone(client: Any) -> None:  # as the kubelet does: through the agent, which takes the plans along
            await client.stop_pod(new_pod.id)
            await client.remove_pod(new_pod.id)

        via_agent(agent, gone)
        assert not os.listdir(os.path.join(agent.store, "plans"))

        with open(os.path.join(blobs, victim.split(":")[1]), "r+b") as fh:
            fh.seek(4096)
            b = fh.read(1)
            fh.seek(4096)
            fh.write(bytes([b[0] ^ 0x01]))
        cp = agent.cli("restore", ckpt, "--namespace", "e2e-fault-bit-r", "--start", "-o", "json", check=False)
        if cp.returncode != 0:
            # The bad chunk came in while CRIU was still restoring (the page source streams from the moment
            # it holds the memory): the restore fails, naming the chunk, and nothing of it stays. A shim that
            # CRIU's end took along may refuse the first StopPodSandbox; then the caller hears that the removal
            # is pending, and the agent's retries finish it.
            assert "DATA_LOSS" in cp.stderr and "digest mismatch" in cp.stderr and victim in cp.stderr, cp.stderr
            if "removing what it created is pending" in cp.stderr:
                wait_for(lambda: not pods_in(agent, "e2e-fault-bit-r") and not _pending_undos(agent),
                         timeout=60, what="the agent's retries to remove the failed restore")
            assert pods_in(agent, "e2e-fault-bit-r") == []
        else:
            # Otherwise the restore returned first; the bad chunk stops the pod once it comes in.
            res = json.loads(cp.stdout)
            cids = {c["name"]: c["container_id"] for c in res["containers"]}
            wait_for(lambda: {r["container_id"]: r["state"] for r in _restores(agent)
                              if r["container_id"] in cids.values()} == {c: "failed" for c in cids.values()},
                     timeout=90, what="both restored containers to fail")
            for name, cid in cids.items():
                d = wait_for(lambda: _stopped(agent, cid, "failed"), timeout=30,
                             what=f"the runtime to see {name} stopped, its log to say why")
                status = _status_via_agent(agent, cid)
                assert status.reason == "RestoreFailed" and status.message, (name, status)
            (server,) = [r for r in _restores(agent) if r["container_id"] == cids["server"]]
            assert "digest mismatch" in server["reason"] and victim in server["reason"], server
    finally:
        if res:
            remove_pod(agent, res["pod_sandbox_id"])
        for p in pods_in(agent, "e2e-fault-bit"):
            if p.id != src.id:
                remove_pod(agent, p.id)
        remove_pod(agent, src.id)
        agent.cli("checkpoints", "rm", ckpt, check=False)
        agent.cli("gc")
    _clean(agent, "e2e-fault-bit", "e2e-fault-bit-r")


@pytest.mark.also17
def test_a_full_restore_refuses_a_corrupt_memory_chunk_before_any_process_runs(agent: Bed) -> None:
    """`--full` brings the memory in through the page source while CRIU holds the restored processes before
    their first instruction: a chunk that fails verification is refused with DATA_LOSS, naming it, the
    processes are killed where they stand and nothing of the restore stays. The same checkpoint, whole
    again, restores in full as the same memory. On containerd 2.1 and 1.7."""
    pod, _ip, before = _unique_memhog(agent, "e2e-fault-full", 89)
    ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
    blobs = os.path.join(agent.store, "blobs", "sha256")
    with open(os.path.join(blobs, ckpt.split(":")[1]), encoding="utf-8") as fh:
        victim = max(json.load(fh)["layers"], key=lambda layer: layer["size"])["digest"]  # a chunk of memory
    plans = _plans_of(agent)
    blob = os.path.join(blobs, victim.split(":")[1])
    try:
        with open(blob, "r+b") as fh:
            original = fh.read(1)
            fh.seek(0)
            fh.write(bytes([original[0] ^ 0x01]))
        cp = agent.cli("restore", ckpt, "--namespace", "e2e-fault-full-r", "--start", "--full", check=False)
        assert cp.returncode != 0, cp.stdout
        assert "DATA_LOSS" in cp.stderr and "digest mismatch" in cp.stderr and victim in cp.stderr, cp.stderr
        wait_for(lambda: not pods_in(agent, "e2e-fault-full-r") and not _pending_undos(agent), timeout=60,
                 what="the failed restore's pod to go")
        assert _copies(89) == [container_detail(agent, pod.containers["mem"]).pid], "a restored copy was left"
        assert _plans_of(agent) <= plans

        with open(blob, "r+b") as fh:
            fh.write(original)
        res = json.loads(agent.cli("restore", ckpt, "--namespace", "e2e-fault-full-r", "--start", "--full",
                                   "-o", "json").stdout)
        try:
            got = wait_for(lambda: answers(pod_detail(agent, res["pod_sandbox_id"]).ip), timeout=60,
                           what="the full restore to answer")
            assert got and _sum(ask(pod_detail(agent, res["pod_sandbox_id"]).ip)) == before
        finally:
            remove_pod(agent, res["pod_sandbox_id"])
    finally:
        remove_pod(agent, pod.id)
        agent.cli("checkpoints", "rm", ckpt, check=False)
    _clean(agent, "e2e-fault-full-r")


def test_a_full_restore_of_a_lazily_pulled_checkpoint_brings_its_memory_from_the_registry_first(
        agent: Bed, registry: Any) -> None:
    """`pull --lazy` leaves the memory in the registry; `restore --full` then fetches it through the page
    source, every chunk verified, while CRIU holds the process: the call returns running with the memory
    in, the process answers with the source's memory, and the checkpoint is whole in the store after."""
    pod, _ip, before = _source(agent, "e2e-fault-pulled", 32)
    ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
    try:
        with _lazy_from_registry(agent, registry, ckpt):
            origin = Path(agent.store) / "origins" / f"{ckpt.split(':')[1]}.json"
            assert origin.is_file(), "its memory is still in the registry"
            res = json.loads(agent.cli("restore", ckpt, "--namespace", "e2e-fault-pulled-r", "--start", "--full",
                                       "-o", "json").stdout)
            cid = res["containers"][0]["container_id"]
            try:
                with open(os.path.join(agent.store, "plans", cid, "plan.json"), encoding="utf-8") as fh:
                    plan = json.load(fh)
                assert (plan["lazy"], plan["filled"]) == (True, True), plan
                assert [(r["lazy"], r["state"]) for r in _restores(agent) if r["container_id"] == cid] == [
                    (False, "running")]
                assert _sum(ask(pod_detail(agent, res["pod_sandbox_id"]).ip, timeout=30)) == before
                wait_for(lambda: not origin.exists(), timeout=60, what="every blob of the checkpoint in the store")
                assert agent.cli("checkpoints", "verify", ckpt).returncode == 0
            finally:
                remove_pod(agent, res["pod_sandbox_id"])
    finally:
        agent.cli("checkpoints", "rm", ckpt, check=False)
        remove_pod(agent, pod.id)
    _clean(agent, "e2e-fault-pulled-r")


# ---- the store fills while a lazily pulled checkpoint restores --------------------------------------


@contextlib.contextmanager
def _small_store(bed: Bed, extra: str, mib: int) -> Iterator[None]:
    """The bed's agent restarted with `extra` in its config and its store on a tmpfs of `mib` MiB of its own,
    mounted over the store's directory (what was there comes back once it is unmounted)."""
    with contextlib.ExitStack() as stack:
        bed.stop_agent()
        _tmpfs(Path(bed.store), mib)
        stack.callback(subprocess.run, ["umount", bed.store], check=True)
        bed.start_agent()  # at the old config; `reconfigured` restarts it with `extra`, and stops it after
        stack.callback(bed.stop_agent)
        stack.enter_context(reconfigured(bed, extra))
        yield


def test_a_pod_restored_while_its_store_fills_gets_its_memory_verified_and_the_store_keeps_none_of_it(
        agent: Bed, node2: Bed, tmp_path: Path) -> None:
    """A Pod restores a checkpoint from a registry on a node whose store (its own 256 MiB filesystem,
    `min-free-bytes` 16 MiB, no fetching ahead) another writer fills to 8 MiB free between RunPodSandbox and
    CreateContainer, where the kubelet pulls the image: the replica is the same process with the same memory,
    every page comes in, verified, and the store keeps nothing that came after RunPodSandbox."""
    ns, dst = "e2e-fault-fill", "e2e-fault-fill-r"
    memhog = ["/usr/local/bin/memhog", "--mib", "64", "--seed", str(_seed(ns)), "--port", "8080",
              "--interval-ms", "100", "--flip", "0"]
    image = agent.info["images"]["memhog"]
    src = make_pod(agent, ns, [container_config("mem", image, memhog)])
    with Registry(tmp_path / "origin") as origin:
        hosts = write_hosts_toml(BedLayout(node2.name).hosts_dir, origin.host, f'server = "http://{origin.host}"\n')
        try:
            pushed = push_memhog(agent, src.id, origin, "faults/fill")
            rules = (f"restore:\n  pod-registries: [{origin.host}/faults]\n  pod-sources:\n    {dst}: [{ns}]\n"
                     f"min-free-bytes: {16 << 20}\nregistry:\n  prefetch: false\n")
            blob = Path(node2.store) / "blobs" / "sha256"
            origins = Path(node2.store) / "origins" / (digest_hex(pushed.ckpt) + ".json")
            with _small_store(node2, rules, 256):
                seen: dict[str, Any] = {}

                def fill(sandbox: str) -> None:
                    seen["kept"] = {d for d in pushed.digests if (blob / digest_hex(d)).exists()}
                    st = os.statvfs(node2.store)
                    fd = os.open(os.path.join(node2.store, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
                    try:
                        os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize - (8 << 20))
                    finally:
                        os.close(fd)

                pcfg = pod_config(node2, dst, f"p-{secrets.token_hex(3)}")
                pcfg["annotations"] = {RESTORE_FROM: pushed.ref}
                pod = asyncio.run(Kubelet(node2.cri_endpoint).start_pod(
                    pcfg, [container_config("mem", node2.info["images"]["memhog"], memhog)], sandboxed=fill))
                try:
                    assert pod.error is None, pod.error
                    new_ip = pod_detail(node2, pod.sandbox_id).ip
                    wait_for(lambda: answers(new_ip), what="the replica to answer")
                    assert ask(new_ip).split("sum=")[1] == pushed.checksum, "not the checkpointed memory"
                    plan = Path(node2.store) / "plans" / pod.containers["mem"]
                    wait_for(lambda: (plan / "lazy.done").exists(), timeout=120, what="every page in")
                    done = json.loads((plan / "lazy.done").read_text())
                    assert done["pages"] == done["total"] > 0, done
                    # Nothing came into the store after the fill; the memory is still only in the registry.
                    assert {d for d in pushed.digests if (blob / digest_hex(d)).exists()} == seen["kept"]
                    assert len(seen["kept"]) < len(pushed.digests) // 2, (len(seen["kept"]), len(pushed.digests))
                    assert origins.exists(), "the checkpoint no longer counts as lazily pulled"
                    log = Path(node2.agent_log).read_text(errors="replace")
                    assert "are verified and handed to their readers, not kept" in log
                    assert ask(new_ip).split("sum=")[1] == pushed.checksum  # it runs on
                finally:
                    remove_pod(node2, pod.sandbox_id)
                    node2.cli("checkpoints", "rm", pushed.ckpt, check=False)
                assert pods_in(node2, dst) == [] and _mounts_in_store(node2) == [] and not criu_processes()
        finally:
            hosts.unlink(missing_ok=True)
            remove_pod(agent, src.id)
