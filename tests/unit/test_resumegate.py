"""The pre-resume gate of a filled restore: what the wrapper hands CRIU, what the gate asks, what it kills."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from criu_bridge import resumegate, wrapper
from node_agent.lazy.source import _answer_gate
from tests.unit.test_wrapper import CID, _argv, _lazy_plan, _run, env  # noqa: F401 - env is a fixture


def _filled_plan(env: dict[str, Path]) -> Path:  # noqa: F811
    d = _lazy_plan(env)
    plan = json.loads((d / "plan.json").read_text())
    (d / "plan.json").write_text(json.dumps({**plan, "filled": True}))
    (d / "work").mkdir()
    (d / "work" / "lazy-pages.socket").write_text("")
    return d


def test_a_filled_plan_restores_lazily_with_the_gate_as_criu_action_script(env: dict[str, Path]) -> None:  # noqa: F811
    d = _filled_plan(env)
    r = _run(env, "--root", "/r", "create", "--bundle", str(env["bundle"]), CID)
    assert r.returncode == 0, r.stderr
    assert "--lazy-pages" in _argv(env)
    gate = d / "work" / resumegate.SCRIPT_NAME
    # The plan restores connections open (tcp-established): the gate is all CRIU's file says.
    assert Path(str(env["record"]) + ".criu.conf").read_text() == f"action-script {gate}\n"
    assert os.stat(gate).st_mode & 0o777 == 0o700
    assert (d / "images" / "inventory.img").exists(), "the images stay the page source's"


def test_a_filled_restore_the_gate_stopped_says_why_not_what_criu_logged(env: dict[str, Path]) -> None:  # noqa: F811
    d = _filled_plan(env)
    (d / "work" / resumegate.FAILED_NAME).write_text("chunk sha256:0f of pages-1.img: digest mismatch")
    log = env["tmp"] / "log.json"
    r = _run(env, "--root", "/r", "--log", str(log), "--log-format", "json", "create", "--bundle",
             str(env["bundle"]), CID, extra_env={"FAKE_RUNC_FAIL": "1"})
    assert r.returncode != 0
    msg = json.loads(log.read_text().splitlines()[-1])["msg"]
    for needle in ("ns/p", "container app", "phase lazy-pages", "digest mismatch", "killed before they ran"):
        assert needle in msg, msg


def test_a_restore_the_gate_stopped_failed_even_where_criu_says_it_finished(env: dict[str, Path]) -> None:  # noqa: F811
    """CRIU only logs a failed pre-resume script: it may let go of the killed processes in time and exit 0.
    The restore still did not happen: the wrapper fails it, and the container goes as after a failed one."""
    d = _filled_plan(env)
    (d / "work" / resumegate.FAILED_NAME).write_text("the page source cannot be reached (Connection refused)")
    log = env["tmp"] / "log.json"
    r = _run(env, "--root", "/r", "--log", str(log), "--log-format", "json", "create", "--bundle",
             str(env["bundle"]), CID)
    assert r.returncode == 1
    msg = json.loads(log.read_text().splitlines()[-1])["msg"]
    assert "phase lazy-pages" in msg and "cannot be reached" in msg and wrapper.GATE_KILLED in msg, msg
    assert _argv(env)[-3:] == ["delete", "--force", CID]  # runc's last call: the restored container removed
    assert (d / wrapper.FAILED).exists() and not (d / wrapper.RESTORED).exists()


@pytest.fixture
def work(tmp_path: Path) -> Iterator[tuple[Path, socket.socket]]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / resumegate.SOCKET_NAME))
    listener.listen(1)
    try:
        yield tmp_path, listener
    finally:
        listener.close()


def _gate(work: Path, action: str) -> subprocess.CompletedProcess[str]:
    """The script the wrapper writes, run as CRIU runs it (no restored root: CRTOOLS_INIT_PID unset)."""
    script = work / resumegate.SCRIPT_NAME
    script.write_text(resumegate.script(sys.executable, str(work)))
    script.chmod(0o700)
    env = {k: v for k, v in os.environ.items() if k != "CRTOOLS_INIT_PID"}
    return subprocess.run([str(script)], env=dict(env, CRTOOLS_SCRIPT_ACTION=action), capture_output=True,
                          text=True, timeout=60)


def test_the_gate_waits_for_the_page_source_only_at_pre_resume(work: tuple[Path, socket.socket]) -> None:
    path, listener = work
    assert _gate(path, "post-restore").returncode == 0  # no one answers: it did not ask
    answered = threading.Thread(target=_answer_gate, args=(listener, "ok", 30.0))
    answered.start()
    r = _gate(path, "pre-resume")
    answered.join()
    assert r.returncode == 0, r.stderr
    assert not (path / resumegate.FAILED_NAME).exists()


def test_the_gate_starts_without_the_site_module(tmp_path: Path) -> None:
    """It starts inside a filled restore's transfer: no .pth file processed, criu_bridge found where the
    wrapper's interpreter found it."""
    text = resumegate.script(sys.executable, str(tmp_path))
    exec_line = text.splitlines()[-1]
    assert exec_line.startswith(f"exec {sys.executable} -IS -c ")
    code = shlex.split(exec_line)[4]
    probe = code.replace("sys.exit(main())", "print('site' in sys.modules, main.__module__)")
    out = subprocess.run([sys.executable, "-IS", "-c", probe], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split() == ["False", "criu_bridge.resumegate"]


def test_the_gate_refuses_to_let_go_when_the_page_source_fails_or_is_gone(work: tuple[Path, socket.socket]) -> None:
    path, listener = work
    answered = threading.Thread(target=_answer_gate, args=(listener, "failed chunk 7:\ndigest mismatch", 30.0))
    answered.start()
    r = _gate(path, "pre-resume")
    answered.join()
    assert r.returncode == 1 and "killed" in r.stderr, r.stderr
    assert (path / resumegate.FAILED_NAME).read_text() == "chunk 7: digest mismatch"

    # The page source failed before the gate asked: it closed the socket; the gate finds no one.
    (path / resumegate.FAILED_NAME).unlink()
    r = _gate(path, "pre-resume")
    assert r.returncode == 1
    assert "cannot be reached" in (path / resumegate.FAILED_NAME).read_text()


def test_a_failure_with_no_gate_asking_yet_does_not_wait_and_closes_the_socket(
        work: tuple[Path, socket.socket]) -> None:
    path, listener = work
    _answer_gate(listener, "failed gone", 0.0)
    assert listener.fileno() == -1
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, pytest.raises(ConnectionRefusedError):
        s.connect(str(path / resumegate.SOCKET_NAME))


def test_the_kill_takes_the_restored_tree_and_never_the_gates_own_cgroup() -> None:
    """A root in the gate's own cgroup (here: this test's) has its tree killed, and nothing else of that cgroup."""
    tree = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(kids := resumegate._tree(tree.pid) - {tree.pid}) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the shell starts its two children
        assert len(kids) == 2, kids
        assert resumegate.kill_restored(tree.pid) == 3
        assert tree.wait(timeout=30) == -9
        for kid in kids:  # reparented and reaped by init, or a zombie of ours: never running
            try:
                with open(f"/proc/{kid}/stat", encoding="ascii") as fh:
                    assert fh.read().split(")")[-1].split()[0] in ("Z", "X")
            except FileNotFoundError:
                pass
    finally:
        if tree.poll() is None:
            tree.kill()
            tree.wait()
    assert resumegate.kill_restored(0) == 0


@pytest.mark.parametrize(("asked", "setting", "predump", "supported", "filled"), [
    (False, "auto", False, True, True),  # --full: through the page source
    (None, "auto", False, True, False),  # the default is lazy, not filled
    (True, "auto", False, True, False),
    (False, "never", False, True, False),  # the node keeps userfaultfd out of restores
    (False, "auto", True, True, False),  # a pre-dump chain is staged whole
    (False, "auto", False, False, False),  # no userfaultfd here
])
def test_which_full_restores_go_through_the_page_source(tmp_path: Path, asked: bool | None, setting: str,
                                                       predump: bool, supported: bool, filled: bool) -> None:
    from types import SimpleNamespace

    from node_agent.config.loading import from_mapping
    from node_agent.lazy.restores import LazyRestores
    from node_agent.replicas import Replicas

    lazy = LazyRestores(from_mapping({"lazy-restore": setting}), Replicas(str(tmp_path)))
    lazy._support = (supported, "" if supported else "UFFD is not supported")
    files = [SimpleNamespace(path="containers/app/checkpoint/pages-1.img")]
    if predump:
        files.append(SimpleNamespace(path="containers/app/predump/1/pages-1.img"))
    record: Any = SimpleNamespace(id="sha256:" + "0" * 64, files=files)
    assert asyncio.run(lazy.filled(asked, record)) is filled


def test_a_socket_deeper_than_an_address_holds_is_bound_and_reached_at_its_path(tmp_path: Path) -> None:
    """A restore plan's directory may be deeper than a Unix socket address (108 bytes) holds: the page
    source's sockets are bound there and the gate reaches them there, both through `at_path`."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = str(deep / resumegate.SOCKET_NAME)
    assert len(os.fsencode(path)) > 108
    before = set(os.listdir("/proc/self/fd"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        resumegate.at_path(server.bind, path)
        server.listen(1)
        assert os.path.exists(path)
        resumegate.at_path(client.connect, path)
        conn, _ = server.accept()
        with conn:
            client.sendall(b"ok")
            assert conn.recv(2) == b"ok"
    assert set(os.listdir("/proc/self/fd")) <= before  # the directory's descriptor is closed again
