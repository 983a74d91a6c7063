"""sd_notify: the daemon tells a NOTIFY_SOCKET when it serves and when it stops."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node_agent import sdnotify

NODE_AGENT = str(Path(sys.executable).parent / "node-agent")


def _listener(addr: str | bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(addr)
    s.settimeout(60)
    return s


def test_address_forms() -> None:
    assert sdnotify.address("/run/systemd/notify") == "/run/systemd/notify"
    assert sdnotify.address("@abstract/x") == b"\0abstract/x"
    assert sdnotify.address("relative") is None
    assert sdnotify.address("@") is None


def test_notify_without_socket_is_a_no_op() -> None:
    assert sdnotify.notify("READY=1", env={}) is False


def test_notify_to_a_path_and_an_abstract_name(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with _listener(path) as s:
        assert sdnotify.notify("READY=1", "STATUS=up", env={sdnotify.ENV: path})
        assert s.recv(4096) == b"READY=1\nSTATUS=up"
    name = f"node-agent-test-{secrets.token_hex(6)}"
    with _listener(b"\0" + name.encode()) as s:
        assert sdnotify.notify("STOPPING=1", env={sdnotify.ENV: "@" + name})
        assert s.recv(4096) == b"STOPPING=1"


def test_a_missing_socket_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert sdnotify.notify("READY=1", env={sdnotify.ENV: str(tmp_path / "gone")}) is False
    assert "sd_notify" in caplog.text


def _messages(s: socket.socket, until: str, timeout: float) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            data = s.recv(4096).decode()
        except TimeoutError:
            break
        got.append(data)
        if until in data.split("\n"):
            return got
    raise AssertionError(f"no {until} within {timeout}s; got {got}")


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_daemon_sends_ready_then_stopping(tmp_path: Path, abstract: bool) -> None:
    bind_addr: str | bytes
    if abstract:
        name = f"node-agent-test-{secrets.token_hex(6)}"
        env_value, bind_addr = "@" + name, b"\0" + name.encode()
    else:
        env_value = bind_addr = str(tmp_path / "notify")
    sock = tmp_path / "agent.sock"
    cmd = [NODE_AGENT, "serve", "--socket", str(sock), "--store", str(tmp_path / "store"),
           "--cri-endpoint", f"unix://{tmp_path}/no-containerd.sock", "--log-level", "debug"]
    with _listener(bind_addr) as s:
        log = open(tmp_path / "agent.log", "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=dict(os.environ, NOTIFY_SOCKET=env_value),
                                start_new_session=True)
        log.close()
        try:
            ready = _messages(s, "READY=1", 60)
            # serve writes the restore wrapper with its own Python (no wrapper-python set).
            assert (tmp_path / "store/bin/node-agent-runc").read_text().startswith(f"#!{Path(sys.executable).parent}/python")
            # READY=1 only once the local socket accepts connections.
            with socket.socket(socket.AF_UNIX) as c:
                c.connect(str(sock))
            assert not any("STOPPING=1" in m for m in ready)
            proc.send_signal(signal.SIGTERM)
            _messages(s, "STOPPING=1", 60)
            assert proc.wait(60) == 0, (tmp_path / "agent.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_serve_leaves_the_wrapper_to_install_handler_when_wrapper_python_is_set(tmp_path: Path) -> None:
    """The DaemonSet's agent must not replace the host's wrapper with one that runs the image's Python."""
    store = tmp_path / "store"
    wrapper = store / "bin" / "node-agent-runc"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text("#!/opt/node-agent/runtime/bin/python3 -I\n# written by install-handler\n")
    config = tmp_path / "agent.yaml"
    config.write_text(f"store: {store}\nsocket: {tmp_path}/agent.sock\ncri-endpoint: unix://{tmp_path}/none.sock\n"
                      "wrapper-python: /opt/node-agent/runtime/bin/python3\n")
    notify = str(tmp_path / "notify")
    with _listener(notify) as s:
        proc = subprocess.Popen([NODE_AGENT, "serve", "--config", str(config)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=dict(os.environ, NOTIFY_SOCKET=notify), start_new_session=True)
        try:
            _messages(s, "READY=1", 60)
            assert wrapper.read_text().endswith("# written by install-handler\n")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
