"""Faults injected at a named phase, for the end-to-end fault suite: never after a sleep.

- `Gate`: a runtime binary that stops at one call (`create` of a restored container, runc's
  `checkpoint`, ...) until the test releases it. It stands in for the restore handler's wrapper (the
  bed's `BinaryName`) or the agent's runc; the test waits until the call has reached it, injects the
  fault, then lets it go on.
- `containerd_down` / `containerd_up`: containerd SIGKILLed, as a crash ends it, and started again
  (`scripts/testbed restart --kill --down`, then `restart`).
- `Blip`: a TCP proxy in front of the registry whose connections the test cuts and lets through again.
- `killed_outright`: a Python child (the agent's own code in a process of its own) SIGKILLed, as a crash
  ends it, once the test has seen what it waits for.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from testbed.bed import REPO, Bed, testbed, wait_for

_GATE = r'''
# A fault-injection gate: stops at `{command}` {which} until released.
import json as _j, os as _o, sys as _s, time as _t
def _gate(gate={gate!r}, args=_s.argv[1:]):
    if {command!r} not in args or not _o.path.exists(_o.path.join(gate, "armed")):
        return
    if {marked_only!r}:
        bundle = args[args.index("--bundle") + 1] if "--bundle" in args else _o.getcwd()
        try:
            with open(_o.path.join(bundle, "config.json"), "rb") as fh:
                if b"node-agent.io/restore-plan" not in fh.read():
                    return
        except OSError:
            return
    _o.unlink(_o.path.join(gate, "armed"))  # one call only
    with open(_o.path.join(gate, "reached.tmp"), "w") as fh:
        _j.dump({{"pid": _o.getpid(), "argv": args}}, fh)
    _o.rename(_o.path.join(gate, "reached.tmp"), _o.path.join(gate, "reached"))
    while not _o.path.exists(_o.path.join(gate, "release")):
        _t.sleep(0.02)
_gate()
'''


class Gate:
    """Stops the next `command` call of the binary at `path` (restored containers only with `marked_only`).

    In place (the binary at `path` moves aside while the gate stands there), or, with `real`, a new
    binary at `path` in front of `real`.
    """

    def __init__(self, path: str, directory: Path, command: str, *, marked_only: bool = False,
                 real: str = "") -> None:
        self.path = path
        self.dir = directory
        self.command = command
        self.marked_only = marked_only
        self.in_place = not real
        self.real = real or path + ".gated"

    def __enter__(self) -> Gate:
        self.dir.mkdir(parents=True, exist_ok=True)
        gate = _GATE.format(gate=str(self.dir), command=self.command, marked_only=self.marked_only,
                            which="of a restored container" if self.marked_only else "")
        if self.in_place:
            # The agent's own launcher with the gate first: still what the agent takes for its wrapper.
            original = Path(self.path).read_text()
            shebang, _, rest = original.partition("\n")
            text = f"{shebang}\n{gate}{rest}"
            os.replace(self.path, self.real)
        else:
            text = f"#!{sys.executable} -I\n{gate}import os\nos.execv({self.real!r}, [{self.real!r}, *_s.argv[1:]])\n"
        tmp = self.path + ".tmp"
        Path(tmp).write_text(text)
        os.chmod(tmp, 0o755)
        os.replace(tmp, self.path)
        return self

    def arm(self) -> None:
        for name in ("reached", "release"):
            with contextlib.suppress(FileNotFoundError):
                (self.dir / name).unlink()
        (self.dir / "armed").touch()

    def reached(self, timeout: float = 120) -> dict[str, object]:
        """Waits until a call has stopped at the gate; its pid and arguments."""
        wait_for(lambda: (self.dir / "reached").exists(), timeout=timeout, what=f"`{self.command}` at the gate")
        return dict(json.loads((self.dir / "reached").read_text()))

    def release(self) -> None:
        (self.dir / "release").touch()

    def __exit__(self, *exc: object) -> None:
        self.release()
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "armed").unlink()
        if self.in_place and os.path.exists(self.real):
            os.replace(self.real, self.path)


@contextlib.contextmanager
def setting(bed: Bed, values: dict[str, str]) -> Iterator[Bed]:
    """The bed's agent restarted with these top-level keys set (YAML scalars); afterwards as it was."""
    config = Path(bed.config)
    original = config.read_text()
    lines = [ln for ln in original.splitlines() if ln.split(":", 1)[0] not in values]
    bed.stop_agent()
    config.write_text("\n".join([*lines, *(f"{k}: {v}" for k, v in values.items())]) + "\n")
    try:
        bed.start_agent()
        yield bed
    finally:
        bed.stop_agent()
        config.write_text(original)
        bed.start_agent()


def wrapper_gate(bed: Bed, directory: Path) -> Gate:
    """A gate at `create` of a restored container: the restore handler's wrapper, during StartContainer."""
    return Gate(os.path.join(bed.store, "bin", "node-agent-runc"), directory, "create", marked_only=True)


def containerd_down(bed: Bed) -> None:
    """containerd SIGKILLed, as a crash ends it; its shims and pods stay. It stays down until `containerd_up`."""
    testbed("restart", bed.name, "--kill", "--down")


def containerd_up(bed: Bed) -> None:
    info = json.loads(testbed("restart", bed.name))
    bed.info["containerd_pid"] = info["containerd_pid"]


class Blip:
    """A TCP proxy on loopback in front of `target` (host, port): `cut()` drops every connection and refuses
    new ones (as a registry that died), `restore()` lets them through again. `requests` counts connections."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = threading.Event()
        self.up.set()
        self.connections = 0
        self.sent_up = self.sent_down = 0  # bytes through, client -> registry and back
        self._cut_up: int | None = None
        self._cut_down: int | None = None
        self._rate = 0.0  # bytes per second from the registry, 0: as fast as it goes
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="blip", daemon=True)
        self._thread.start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self._closing:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.connections += 1
                self._open.update((client, upstream))
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()

    def cut_after(self, *, up: int | None = None, down: int | None = None) -> None:
        """Cut (as `cut`) once this many more bytes went to the registry (`up`) or came from it (`down`):
        the registry dies in the middle of a push or a pull, at a point the test chose."""
        with self._lock:
            self._cut_up = None if up is None else self.sent_up + up
            self._cut_down = None if down is None else self.sent_down + down

    def pace(self, bytes_per_second: float) -> None:
        """Let bytes come from the registry at most this fast (0: as fast as they go): a transfer of a
        known size then takes a known least time, so that a fault can land in its middle."""
        self._rate = bytes_per_second

    def _count(self, upward: bool, n: int) -> bool:
        """Counts `n` bytes; True when that crosses a cut point."""
        with self._lock:
            if upward:
                self.sent_up += n
                due = self._cut_up is not None and self.sent_up >= self._cut_up
            else:
                self.sent_down += n
                due = self._cut_down is not None and self.sent_down >= self._cut_down
            if due:
                self._cut_up = self._cut_down = None
        return due

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while self.up.is_set():
                ready, _, _ = select.select([a, b], [], [], 0.1)
                for s in ready:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    if self._count(s is a, len(data)):
                        self.cut()
                        return
                    (b if s is a else a).sendall(data)
                    if s is b and self._rate:
                        time.sleep(len(data) / self._rate)
        except OSError:
            return
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()
            with self._lock:
                self._open.difference_update((a, b))

    def cut(self) -> None:
        self.up.clear()
        with self._lock:
            for s in list(self._open):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def restore(self) -> None:
        self.up.set()

    def close(self) -> None:
        self._closing = True
        self.cut()
        self.listener.close()


@contextlib.contextmanager
def blip(target_host: str) -> Iterator[Blip]:
    host, _, port = target_host.rpartition(":")
    b = Blip((host, int(port)))
    try:
        yield b
    finally:
        b.close()


@contextlib.contextmanager
def killed_outright(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``python -c script args`` from the repository, its standard input and output pipes to the test, which
    reads what it waits for from it; then SIGKILLed and reaped, however the test's part ends."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
