"""More of the contract: CRIU refusals people can act on, preflight checks, the handler."""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess

import pytest

from testbed.bed import (
    Bed, container_config, container_detail, freezer_state, make_pod, pod_detail, pods_in, remove_pod, ticks, wait_for,
)

HOLD_TCP = (
    "sleep 100000 | nc -l -p 9000 >/dev/null & sleep 0.3; sleep 100000 | nc 127.0.0.1 9000 >/dev/null & "
    "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done"
)


def _nc_pids(host_pid: int) -> list[int]:
    """The host PIDs of the `nc` processes in the PID namespace of `host_pid` (the pod's)."""
    ino = os.stat(f"/proc/{host_pid}/ns/pid").st_ino
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{entry}/ns/pid").st_ino != ino:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if fh.read().split(b"\0")[0] == b"nc":
                    out.append(int(entry))
        except OSError:
            continue
    return sorted(out)


def test_held_tcp_connections_are_restored_closed_by_default_and_open_with_tcp_established(agent: Bed) -> None:
    imgs = agent.info["images"]
    pod = make_pod(agent, "e2e-tcp", [container_config("conn", imgs["busybox"], ["sh", "-c", HOLD_TCP])])
    try:
        d = container_detail(agent, pod.containers["conn"])
        wait_for(lambda: len(ticks(d.log_path)) >= 3, what="ticks")
        held = _nc_pids(d.pid)
        assert len(held) == 2, held  # the listener's accepted end and the client's end, on the pod's loopback
        # By default the connection is left to the source and the restore gets it closed (CRIU's
        # --tcp-close, recorded with the checkpoint, since CRIU restores such images only with it).
        ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
        info = json.loads(agent.cli("checkpoints", "inspect", ckpt, "-o", "json").stdout)
        assert info["options"] == {"file-locks": "true", "tcp-close": "true"}
        assert freezer_state(d.pid) == "THAWED" and _nc_pids(d.pid) == held
        out = agent.cli("restore", ckpt, "--namespace", "e2e-tcp-dst", "--start").stdout.split()
        try:
            nd = container_detail(agent, out[2])
            assert nd.container.state == "CONTAINER_RUNNING"
            wait_for(lambda: len(ticks(nd.log_path)) >= 2, what="restored ticks")
            assert ticks(nd.log_path)[0] > 3
            # Each nc finds its end closed and exits; the shell ticks on.
            wait_for(lambda: not _nc_pids(nd.pid), timeout=30, what="the restored nc processes to see it closed")
            n = max(ticks(nd.log_path))
            wait_for(lambda: max(ticks(nd.log_path)) > n, what="the restored shell to tick on")
        finally:
            remove_pod(agent, out[0])
        agent.cli("checkpoints", "rm", ckpt)
        assert _nc_pids(d.pid) == held  # the source's connection is untouched

        ckpt = agent.cli("checkpoint", pod.id, "--option", "tcp-established=true").stdout.strip().splitlines()[-1]
        info = json.loads(agent.cli("checkpoints", "inspect", ckpt, "-o", "json").stdout)
        assert info["options"] == {"tcp-established": "true", "file-locks": "true"}
        # The connection is on the pod's loopback, which the new pod has too: it comes back open.
        out = agent.cli("restore", ckpt, "--namespace", "e2e-tcp-dst", "--start").stdout.split()
        try:
            nd = container_detail(agent, out[2])
            assert nd.container.state == "CONTAINER_RUNNING"
            wait_for(lambda: len(ticks(nd.log_path)) >= 2, what="restored ticks")
            assert ticks(nd.log_path)[0] > 3
            assert len(_nc_pids(nd.pid)) == 2
        finally:
            remove_pod(agent, out[0])
        agent.cli("checkpoints", "rm", ckpt)
    finally:
        remove_pod(agent, pod.id)


# Listens on 9000 and never accepts: a connection to it waits in the listen queue for good.
NEVER_ACCEPTS = (
    "import socket, time\n"
    "s = socket.socket(); s.bind(('0.0.0.0', 9000)); s.listen(8)\n"
    "n = 0\n"
    "while True:\n"
    "    n += 1; print('tick', n, flush=True); time.sleep(0.2)\n"
)


@pytest.mark.also17  # runc 1.3 takes --tcp-skip-in-flight; runc 1.1 gets it through CRIU's configuration file
def test_connections_waiting_to_be_accepted_stay_with_the_source(agent: Bed) -> None:
    pod = make_pod(agent, "e2e-inflight", [container_config("srv", agent.info["images"]["debian"],
                                                            ["python3", "-c", NEVER_ACCEPTS])])
    waiting = []
    try:
        d = container_detail(agent, pod.containers["srv"])
        wait_for(lambda: len(ticks(d.log_path)) >= 3, what="ticks")
        ip = pod_detail(agent, pod.id).ip
        waiting = [socket.create_connection((ip, 9000), timeout=5) for _ in range(2)]  # queued, never accepted
        ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]  # CRIU alone refuses it
        info = json.loads(agent.cli("checkpoints", "inspect", ckpt, "-o", "json").stdout)
        assert info["options"] == {"file-locks": "true"}
        out = agent.cli("restore", ckpt, "--namespace", "e2e-inflight-dst", "--start").stdout.split()
        try:
            nd = container_detail(agent, out[2])
            wait_for(lambda: len(ticks(nd.log_path)) >= 2, what="restored ticks")
            assert ticks(nd.log_path)[0] > 3
            with socket.create_connection((pod_detail(agent, out[0]).ip, 9000), timeout=5):
                pass  # the restored socket listens, its queue empty
        finally:
            remove_pod(agent, out[0])
        agent.cli("checkpoints", "rm", ckpt)
        for s in waiting:  # the source still holds them: open, with nothing to read
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in waiting:
            s.close()
        remove_pod(agent, pod.id)


def test_a_container_that_is_not_running_is_refused(agent: Bed) -> None:
    imgs = agent.info["images"]
    pod = make_pod(agent, "e2e-exited", [
        container_config("quitter", imgs["busybox"], ["sh", "-c", "exit 0"]),
        container_config("runner", imgs["busybox"], ["sh", "-c", "while :; do sleep 1; done"]),
    ])
    try:
        wait_for(lambda: container_detail(agent, pod.containers["quitter"]).container.state == "CONTAINER_EXITED",
                 what="the quitter to exit")
        cp = agent.cli("checkpoint", pod.id, "--container", "quitter", check=False)
        assert cp.returncode != 0 and "FAILED_PRECONDITION" in cp.stderr and "quitter" in cp.stderr, cp.stderr
        assert "not running" in cp.stderr
        # Without a selection, only the running containers are taken.
        ckpt = agent.cli("checkpoint", pod.id, "-o", "json").stdout
        info = json.loads(ckpt)
        assert [c["name"] for c in info["containers"]] == ["runner"]
        agent.cli("checkpoints", "rm", info["id"])
    finally:
        remove_pod(agent, pod.id)


def _ctr(bed: Bed, *args: str) -> None:
    subprocess.run(["ctr", "--address", bed.info["containerd_socket"], "-n", "k8s.io", *args],
                   check=True, capture_output=True)


def test_restore_checks_the_image_before_creating_anything(agent: Bed) -> None:
    imgs = agent.info["images"]
    temp = "localhost/node-agent-test/transient:1"
    _ctr(agent, "images", "tag", "--force", imgs["busybox"], temp)
    pod = make_pod(agent, "e2e-img", [container_config("c", temp, ["sh", "-c", "while :; do sleep 1; done"])])
    try:
        ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
    finally:
        remove_pod(agent, pod.id)
    _ctr(agent, "images", "rm", temp)
    cp = agent.cli("restore", ckpt, "--namespace", "e2e-img-dst", check=False)
    assert cp.returncode != 0 and "FAILED_PRECONDITION" in cp.stderr and temp in cp.stderr, cp.stderr
    assert pods_in(agent, "e2e-img-dst") == []
    agent.cli("checkpoints", "rm", ckpt)


def test_a_corrupt_checkpoint_is_not_restored(agent: Bed) -> None:
    imgs = agent.info["images"]
    pod = make_pod(agent, "e2e-corrupt", [container_config("c", imgs["busybox"], ["sh", "-c", "while :; do sleep 1; done"])])
    try:
        ckpt = agent.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
    finally:
        remove_pod(agent, pod.id)
    blobs = os.path.join(agent.store, "blobs", "sha256")
    with open(os.path.join(blobs, ckpt.split(":")[1]), encoding="utf-8") as fh:
        manifest = json.load(fh)
    victim = max(manifest["layers"], key=lambda layer: layer["size"])["digest"]
    blob = os.path.join(blobs, victim.split(":")[1])
    with open(blob, "r+b") as fh:
        fh.seek(0)
        b = fh.read(1)
        fh.seek(0)
        fh.write(bytes([b[0] ^ 0xFF]))
    cp = agent.cli("restore", ckpt, "--namespace", "e2e-corrupt-dst", check=False)
    assert cp.returncode != 0 and "DATA_LOSS" in cp.stderr and "verification" in cp.stderr, cp.stderr
    assert pods_in(agent, "e2e-corrupt-dst") == []
    agent.cli("checkpoints", "rm", ckpt)


def test_pods_not_being_restored_run_normally_under_the_handler(agent: Bed) -> None:
    imgs = agent.info["images"]
    pod = make_pod(agent, "e2e-handler", [
        container_config("plain", imgs["busybox"], ["sh", "-c", "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.1; done"]),
    ], handler="criu")
    try:
        d = container_detail(agent, pod.containers["plain"])
        assert d.container.state == "CONTAINER_RUNNING"
        wait_for(lambda: len(ticks(d.log_path)) >= 3, what="ticks")
        assert ticks(d.log_path)[0] == 1
        assert not glob.glob(os.path.join(agent.store, "plans", "*"))
    finally:
        remove_pod(agent, pod.id)


def test_pre_dump_is_used_where_the_kernel_tracks_memory_and_falls_back_cleanly_elsewhere(agent: Bed) -> None:
    import asyncio

    from criu_bridge.rpc import CriuClient

    tracks = asyncio.run(CriuClient("criu").features()).get("mem_track", False)
    imgs = agent.info["images"]
    pod = make_pod(agent, "e2e-predump", [container_config("c", imgs["busybox"], ["sh", "-c", "while :; do sleep 1; done"])])
    try:
        info = json.loads(agent.cli("checkpoint", pod.id, "-o", "json").stdout)
        assert info["pre_dump"] is tracks
        forced = agent.cli("checkpoint", pod.id, "--option", "pre-dump=true", "-o", "json", check=False)
        if tracks:
            assert forced.returncode == 0 and json.loads(forced.stdout)["pre_dump"] is True
            agent.cli("checkpoints", "rm", json.loads(forced.stdout)["id"])
        else:
            assert forced.returncode != 0 and "FAILED_PRECONDITION" in forced.stderr, forced.stderr
            assert "dirty memory" in forced.stderr
        # Either way the checkpoint restores.
        out = agent.cli("restore", info["id"], "--namespace", "e2e-predump-dst", "--start").stdout.split()
        try:
            assert container_detail(agent, out[2]).container.state == "CONTAINER_RUNNING"
        finally:
            remove_pod(agent, out[0])
        agent.cli("checkpoints", "rm", info["id"])
    finally:
        remove_pod(agent, pod.id)


def test_the_cli_shows_streamed_progress_on_a_terminal(agent: Bed) -> None:
    import pty
    import select

    from testbed.bed import NODE_AGENT

    pod = make_pod(agent, "e2e-progress", [container_config("c", agent.info["images"]["busybox"],
                                                             ["sh", "-c", "while :; do sleep 1; done"])])
    try:
        master, slave = pty.openpty()
        env = dict(os.environ, NODE_AGENT_SOCKET=agent.socket)
        proc = subprocess.Popen([NODE_AGENT, "checkpoint", pod.id], env=env, stdout=subprocess.PIPE,
                                stderr=slave, text=True)
        os.close(slave)
        seen = b""
        while True:
            ready, _, _ = select.select([master], [], [], 60)
            if not ready:
                break
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        out, _ = proc.communicate(timeout=60)
        os.close(master)
        assert proc.returncode == 0
        text = seen.decode(errors="replace")
        for phase in ("resolve", "freeze", "dump", "ingest"):
            assert phase in text, text
        assert "frozen for" in text
        ckpt = out.strip().splitlines()[-1]
        assert ckpt.startswith("sha256:")
        agent.cli("checkpoints", "rm", ckpt)
    finally:
        remove_pod(agent, pod.id)
