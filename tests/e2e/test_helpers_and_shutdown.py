"""Helpers never outlive their purpose, and `serve` ends within its budget in every state.

The agent here runs with `timeouts: {cleanup: 5, lazy-start: 10}`; each SIGTERM is sent when the state
it targets shows in the agent's log, never after a sleep.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from testbed.bed import (
    NODE_AGENT, Bed, PodHandle, answers, ask, container_config, container_detail, counter_pod, freezer_state,
    make_pod, pod_detail, pods_in, remove_pod, start_refusal, ticks, volume_holder_pod, wait_for,
)
from tests.e2e.test_verified_restores import our_helpers as lazy_helpers

CLEANUP = 5
LAZY_START = 10


class AgentLog:
    """The agent's log from a point on."""

    def __init__(self, bed: Bed) -> None:
        self.path = bed.agent_log
        self.offset = os.path.getsize(self.path) if os.path.exists(self.path) else 0

    def text(self) -> str:
        with open(self.path, encoding="utf-8", errors="replace") as fh:
            fh.seek(self.offset)
            return fh.read()

    def wait(self, needle: str, timeout: float = 120) -> None:
        wait_for(lambda: needle in self.text(), timeout=timeout, what=f"{needle!r} in the agent's log", interval=0.02)


@pytest.fixture
def short(agent: Bed) -> Iterator[Bed]:
    """The bed's agent restarted with short cleanup and lazy-start timeouts."""
    config = Path(agent.config)
    original = config.read_text()
    agent.stop_agent()
    config.write_text(original + f"timeouts:\n  cleanup: {CLEANUP}\n  lazy-start: {LAZY_START}\n")
    agent.start_agent()
    try:
        yield agent
    finally:
        agent.stop_agent()
        config.write_text(original)
        agent.start_agent()


def _sigterm_and_time(bed: Bed) -> float:
    assert bed.agent is not None and bed.agent.poll() is None
    t0 = time.monotonic()
    bed.agent.send_signal(signal.SIGTERM)
    try:
        rc = bed.agent.wait(60)
    except subprocess.TimeoutExpired:
        bed.agent.kill()
        bed.agent.wait()
        raise AssertionError(f"serve still ran 60 s after SIGTERM:\n{bed.tail_log()}") from None
    took = time.monotonic() - t0
    assert rc == 0, f"serve exited {rc}:\n{bed.tail_log()}"
    assert took <= CLEANUP + 5, f"serve took {took:.1f}s to exit (limit {CLEANUP + 5}s):\n{bed.tail_log()}"
    return took


def _spares(bed: Bed) -> list[psutil.Process]:
    """The agent's spare page sources: its children waiting to become one (node_agent.lazy.spare)."""
    assert bed.agent is not None
    return [p for p in psutil.Process(bed.agent.pid).children() if "node_agent.lazy.spare" in p.cmdline()]


def _ended(proc: psutil.Process) -> bool:
    """Whether that process has ended (a zombie not reaped yet has ended too)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _memhog(bed: Bed, namespace: str, mib: int) -> PodHandle:
    return make_pod(bed, namespace, [container_config("mem", bed.info["images"]["memhog"], [
        "/usr/local/bin/memhog", "--mib", str(mib), "--port", "8080", "--interval-ms", "100", "--flip", "0",
    ])])


def _sum(reply: str) -> str:
    return dict(f.split("=", 1) for f in reply.split())["sum"]


# ---- helpers ------------------------------------------------------------------------------


def test_after_a_failed_restore_no_helper_is_left(short: Bed) -> None:
    pod, vol = volume_holder_pod(short, "e2e-help")
    try:
        wait_for(lambda: len(ticks(os.path.join(vol, "held.txt"))) >= 2, what="ticks")
        ckpt = short.cli("checkpoint", pod.id).stdout.strip().splitlines()[-1]
        os.unlink(os.path.join(vol, "held.txt"))  # the restore fails at StartContainer, after its helpers started
        log = AgentLog(short)
        cp = short.cli("restore", ckpt, "--namespace", "e2e-help-dst", "--start", "--lazy", check=False)
        failed_at = time.monotonic()
        assert cp.returncode != 0 and "held.txt" in cp.stderr, cp.stderr
        assert "waiting for the restored process" in log.text(), "the restore never started its helpers"
        wait_for(lambda: not lazy_helpers(short), timeout=5, what="no lazy-restore helper after the failure")
        assert time.monotonic() - failed_at <= 5
        assert pods_in(short, "e2e-help-dst") == []
        short.cli("checkpoints", "rm", ckpt)
    finally:
        remove_pod(short, pod.id)


def test_a_restore_never_started_leaves_no_helper_after_lazy_start(short: Bed) -> None:
    src = counter_pod(short, "e2e-help2", flip=False)
    new_pod = ""
    try:
        ckpt = short.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        out = short.cli("restore", ckpt, "--namespace", "e2e-help2-dst", "--lazy").stdout.split()
        new_pod = out[0]
        assert lazy_helpers(short), "a lazy restore starts its helpers before StartContainer"
        time.sleep(LAZY_START + 5)
        assert not lazy_helpers(short), lazy_helpers(short)
        # A late StartContainer fails, saying why: it never starts the image's command.
        cid = out[2]

        err = start_refusal(short, cid)
        # The page source and the agent's session each keep this deadline; whichever sees it first, the
        # reason reads the same.
        assert f"StartContainer did not come within {LAZY_START:g}s (timeouts.lazy-start)" in err, err
        assert not ticks(container_detail(short, cid).log_path)
        short.cli("checkpoints", "rm", ckpt)
    finally:
        if new_pod:
            remove_pod(short, new_pod)
        remove_pod(short, src.id)


def test_removing_a_created_container_ends_its_helpers(short: Bed) -> None:
    src = counter_pod(short, "e2e-help3", flip=False)
    try:
        ckpt = short.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        new_pod = short.cli("restore", ckpt, "--namespace", "e2e-help3-dst", "--lazy").stdout.split()[0]
        assert lazy_helpers(short)
        remove_pod(short, new_pod)
        wait_for(lambda: not lazy_helpers(short), timeout=8, what="helpers gone with their container")
        short.cli("checkpoints", "rm", ckpt)
    finally:
        remove_pod(short, src.id)


def test_start_up_recovery_ends_this_agents_stray_helpers_and_no_others(short: Bed, tmp_path: Path) -> None:
    src = counter_pod(short, "e2e-help4", flip=False)
    new_pod = ""
    # A helper of another agent on the same machine (its plans lie elsewhere).
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "lazy-pages", "--work-dir",
                              str(tmp_path / "other-agent" / "plans" / ("c" * 64) / "work")])
    try:
        ckpt = short.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        out = short.cli("restore", ckpt, "--namespace", "e2e-help4-dst", "--lazy").stdout.split()
        new_pod = out[0]
        assert lazy_helpers(short)
        # Every container's page source shows as one (a spare taken shows its source's command line once its
        # imports are done), so that the spares left are the ones waiting.
        wait_for(lambda: len(lazy_helpers(short)) == len(src.containers), what="every container's page source")
        spares = wait_for(lambda: _spares(short), timeout=30, what="the agent's next spare page source")
        short.kill_agent()  # no shutdown: its helpers stay behind
        assert lazy_helpers(short)
        # A spare serves nothing: it ends when its agent is gone (its socket closes).
        wait_for(lambda: all(_ended(p) for p in spares), timeout=10, what="the killed agent's spare to end")
        short.start_agent()
        wait_for(lambda: not lazy_helpers(short), timeout=10, what="stray helpers ended at start-up")
        assert other.poll() is None, "recovery ended another agent's helper"
        short.cli("checkpoints", "rm", ckpt)
    finally:
        other.kill()
        other.wait()
        if new_pod:
            remove_pod(short, new_pod)
        remove_pod(short, src.id)


# ---- bounded shutdown ---------------------------------------------------------------------


def test_idle_serve_exits_at_once(short: Bed) -> None:
    AgentLog(short)  # the agent is up and serving (the fixture waited for its sockets)
    # It keeps one page source started ahead of the next restore; the spare ends with it.
    spares = wait_for(lambda: _spares(short), timeout=30, what="the agent's spare page source")
    assert len(spares) == 1, spares
    assert _sigterm_and_time(short) < 3
    assert all(_ended(p) for p in spares), "the spare outlived the agent"


def test_serve_exits_in_time_mid_dump_and_leaves_the_pod_thawed(short: Bed) -> None:
    pod = _memhog(short, "e2e-down1", 768)
    try:
        ip = pod_detail(short, pod.id).ip
        wait_for(lambda: answers(ip), what="memhog")
        log = AgentLog(short)
        cli = subprocess.Popen([NODE_AGENT, "checkpoint", pod.id], env=dict(os.environ, NODE_AGENT_SOCKET=short.socket),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        log.wait("container(s) frozen, dumping")
        _sigterm_and_time(short)
        cli.communicate(timeout=30)
        d = container_detail(short, pod.containers["mem"])
        assert freezer_state(d.pid) == "THAWED"
        wait_for(lambda: answers(ip), timeout=60, what="the pod answers again")
    finally:
        remove_pod(short, pod.id)


def test_serve_exits_in_time_while_a_restore_waits_for_its_process(short: Bed) -> None:
    src = counter_pod(short, "e2e-down2", flip=False)
    new_pod = ""
    try:
        ckpt = short.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        log = AgentLog(short)
        out = short.cli("restore", ckpt, "--namespace", "e2e-down2-dst", "--lazy").stdout.split()
        new_pod = out[0]
        log.wait("waiting for the restored process")
        _sigterm_and_time(short)
        # The helpers of containers not started yet end with the agent; a later start says why.
        wait_for(lambda: not lazy_helpers(short), timeout=5, what="helpers ended with the agent")
        with open(os.path.join(short.store, "plans", out[2], "lazy.failed"), encoding="utf-8") as fh:
            assert "agent stopped before the container was started" in fh.read()
        short.start_agent()
        short.cli("checkpoints", "rm", ckpt)
    finally:
        if short.agent is None or short.agent.poll() is not None:
            short.start_agent()
        if new_pod:
            remove_pod(short, new_pod)
        remove_pod(short, src.id)


def test_serve_exits_in_time_mid_transfer_and_the_replica_pages_in_alone(short: Bed) -> None:
    src = _memhog(short, "e2e-down3", 768)
    new_pod = ""
    try:
        ip = pod_detail(short, src.id).ip
        wait_for(lambda: answers(ip), what="memhog")
        before = _sum(ask(ip))
        ckpt = short.cli("checkpoint", src.id).stdout.strip().splitlines()[-1]
        log = AgentLog(short)
        cli = subprocess.Popen([NODE_AGENT, "restore", ckpt, "--namespace", "e2e-down3-dst", "--lazy", "--start"],
                               env=dict(os.environ, NODE_AGENT_SOCKET=short.socket),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        log.wait("the restored process connected")
        _sigterm_and_time(short)
        stdout, _ = cli.communicate(timeout=30)
        new = [p for p in pods_in(short, "e2e-down3-dst") if p.ready]
        assert len(new) == 1, (stdout, new)
        new_pod = new[0].id
        new_ip = pod_detail(short, new_pod).ip
        assert _sum(ask(new_ip, timeout=60)) == before
        wait_for(lambda: not lazy_helpers(short), timeout=60, what="the transfer to end by itself")
        assert _sum(ask(new_ip)) == before
        short.start_agent()
        short.cli("checkpoints", "rm", ckpt)
    finally:
        if short.agent is None or short.agent.poll() is not None:
            short.start_agent()
        if new_pod:
            remove_pod(short, new_pod)
        remove_pod(short, src.id)


class Tarpit:
    """A "registry" on loopback that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self.held.append(conn)
            except OSError:
                continue

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for c in self.held:
            c.close()
        self.sock.close()


def test_serve_exits_in_time_mid_pull(short: Bed) -> None:
    pit = Tarpit()
    try:
        log = AgentLog(short)
        ref = f"127.0.0.1:{pit.port}/e2e/stuck:1"
        cli = subprocess.Popen([NODE_AGENT, "pull", ref, "--plain-http"],
                               env=dict(os.environ, NODE_AGENT_SOCKET=short.socket),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        log.wait(f"pulling {ref}")
        wait_for(lambda: pit.held, timeout=10, what="the pull to connect")
        _sigterm_and_time(short)
        cli.communicate(timeout=30)
        assert cli.returncode != 0
    finally:
        pit.close()
