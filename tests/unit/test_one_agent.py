"""One agent per store, and no live socket taken over (`agentlock`, `api.unix_sockets.claim_socket`).

Every "other agent" here is a real second process: one that holds the
store's agent lock, or one that serves a Unix socket.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from criu_bridge.watchdog import proc_starttime
from node_agent import agentlock, errors
from node_agent.api.listeners import Listeners
from node_agent.api.local_socket import LocalSocketGate
from node_agent.api.unix_sockets import claim_socket
from node_agent.config.loading import from_mapping
from node_agent.daemon import serve

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

HOLD_LOCK = ("import sys\nfrom node_agent import agentlock\nagentlock.take(sys.argv[1])\n"
             "print('held', flush=True)\nsys.stdin.read()\n")
SERVE_SOCKET = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\ns.listen()\n"
                "print('listening', flush=True)\nsys.stdin.read()\n")


@contextmanager
def other_process(code: str, arg: str, ready: bytes) -> Iterator[subprocess.Popen[bytes]]:
    """A second process running `code` with `arg`, once it has printed `ready`; it ends when the block does."""
    proc = subprocess.Popen([sys.executable, "-c", code, arg], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=ENV, cwd=str(REPO))
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline() == ready + b"\n"
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(30)
        proc.stdout.close()


def _inode(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as c:
        try:
            c.connect(str(path))
        except OSError:
            return False
        return True


# ---- the agent lock ------------------------------------------------------------------


def test_a_second_serve_on_the_same_store_is_refused_before_it_touches_anything(tmp_path: Path) -> None:
    store, sock = tmp_path / "store", tmp_path / "agent.sock"
    with other_process(HOLD_LOCK, str(store), b"held") as first:
        r = subprocess.run([sys.executable, "-m", "node_agent.cli.main", "serve", "--store", str(store),
                            "--socket", str(sock)], capture_output=True, env=ENV, cwd=str(REPO), timeout=120)
    assert r.returncode == 1
    assert r.stderr.decode() == (f"node-agent: FAILED_PRECONDITION: store {store} is in use by another node-agent "
                                 f"(pid {first.pid}); one agent per store\n")
    # No recovery, no socket, no wrapper: nothing but the lock file.
    assert sorted(str(p.relative_to(store)) for p in store.rglob("*")) == ["run", "run/agent.lock"]
    assert not sock.exists()


async def test_serve_refused_by_the_lock_names_the_holder(tmp_path: Path) -> None:
    s = from_mapping({"store": str(tmp_path / "store"), "socket": str(tmp_path / "agent.sock")})
    with other_process(HOLD_LOCK, s.store, b"held") as first:
        with pytest.raises(errors.FailedPrecondition) as e:
            await serve(s)
    assert str(e.value) == f"store {s.store} is in use by another node-agent (pid {first.pid}); one agent per store"
    assert not os.path.exists(s.journal_dir) and not os.path.exists(s.wrapper_path)


def test_the_lock_names_its_holder_and_is_not_inherited_by_a_child(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    lock = agentlock.take(store)
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=False)
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline() == b"up\n"  # started: its descriptors are settled
        pid = os.getpid()
        assert Path(agentlock.lock_path(store)).read_text() == f"{pid} {proc_starttime(pid)}\n"
        with pytest.raises(errors.FailedPrecondition, match=rf"\(pid {pid}\); one agent per store"):
            agentlock.take(store)
        held = {os.readlink(f"/proc/{child.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{child.pid}/fd")}
        assert agentlock.lock_path(store) not in held
        lock.release()
        with other_process(HOLD_LOCK, store, b"held"):
            assert child.poll() is None  # the child lives on, and another agent got the lock all the same
    finally:
        lock.release()
        child.stdin.close()
        child.wait(30)
        child.stdout.close()


# ---- sockets ---------------------------------------------------------------------------


def test_a_socket_another_process_serves_is_never_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    with other_process(SERVE_SOCKET, str(path), b"listening") as server:
        before = _inode(path)
        with pytest.raises(errors.FailedPrecondition) as e:
            claim_socket(str(path), "local socket")
        assert str(e.value) == (f"local socket {path} is served by another process (pid {server.pid}); refusing to "
                                "take it over (is another node-agent running?)")
        assert _inode(path) == before and _answers(path)


def test_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))  # bound, never served, closed: the file stays behind
    assert path.is_socket()
    claim_socket(str(path), "local socket")
    assert not path.exists()
    claim_socket(str(path), "local socket")  # nothing there: nothing to do


async def test_the_local_socket_gate_refuses_a_served_path_and_leaves_it_alone(tmp_path: Path) -> None:
    path, run = tmp_path / "agent.sock", tmp_path / "run"
    run.mkdir()
    gate = LocalSocketGate(str(path), str(run / "api.sock"), str(run), None)
    with other_process(SERVE_SOCKET, str(path), b"listening") as server:
        before = _inode(path)
        with pytest.raises(errors.FailedPrecondition, match=rf"^local socket {path} is served by another process "
                                                            rf"\(pid {server.pid}\)"):
            await gate.start()
        await gate.close()  # the failed start's cleanup: never the other process's socket
        assert _inode(path) == before and _answers(path)
    # Once that server is gone, its socket file is stale: the gate takes the path.
    assert path.is_socket() and not _answers(path)
    gate = LocalSocketGate(str(path), str(run / "api.sock"), str(run), None)
    await gate.start()
    try:
        assert _answers(path)
    finally:
        await gate.close()
    assert not path.exists()


async def test_a_served_backend_socket_refuses_the_listeners(tmp_path: Path) -> None:
    s = from_mapping({"store": str(tmp_path / "store"), "socket": str(tmp_path / "agent.sock")})
    listeners = Listeners(s, None, None)  # type: ignore[arg-type]
    with other_process(SERVE_SOCKET, listeners.backend, b"listening") as server:
        server_ = grpc.aio.server()
        with pytest.raises(errors.FailedPrecondition, match=rf"^the API's backend socket {listeners.backend} is "
                                                            rf"served by another process \(pid {server.pid}\)"):
            await listeners.bind(server_)
        assert _answers(Path(listeners.backend))
        await server_.stop(None)


@pytest.mark.parametrize("which", ["socket", "cri-listen"])
async def test_an_agent_of_another_store_on_the_same_socket_is_refused_at_start(tmp_path: Path, which: str) -> None:
    taken = tmp_path / "taken.sock"
    config = {"store": str(tmp_path / "store-b"), "socket": str(tmp_path / "agent.sock")}
    config[which] = str(taken) if which == "socket" else f"unix://{taken}"
    s = from_mapping(config)
    what = "local socket" if which == "socket" else "cri-listen socket"
    with other_process(SERVE_SOCKET, str(taken), b"listening") as server:
        before = _inode(taken)
        with pytest.raises(errors.FailedPrecondition) as e:
            await serve(s)
        assert str(e.value).startswith(f"{what} {taken} is served by another process (pid {server.pid})")
        assert _inode(taken) == before and _answers(taken)
    # Refused before recovery, the wrapper or any listener; the lock is let go.
    assert sorted(str(p.relative_to(s.store)) for p in Path(s.store).rglob("*")) == ["run", "run/agent.lock"]
    agentlock.take(s.store).release()
