"""The thaw watchdog: a detached process that guarantees a pod is thawed.

Before the agent freezes anything it starts this watchdog in its own session
with the list of freezers, and keeps the write end of a pipe to its stdin.
Protocol, one line at a time on stdin:

  ``pid <pid> <starttime>``  a helper (runc checkpoint) to outlive: CRIU
                             re-freezes a cgroup it found frozen when it ends,
                             so the watchdog keeps thawing until every helper
                             and its descendants have exited;
  ``done``                   the agent thawed everything itself: stand down.

End of file without ``done`` (the agent died, or gave up), or the freeze
limit passing, makes the watchdog thaw every freezer, then keep them thawed
while any recorded helper lives (bounded), then exit. It prints ``ready``
once armed. Standard library only; never imports node_agent.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import signal
import subprocess
import sys
import time

from criu_bridge import freezer
from criu_bridge.errors import BridgeError
from criu_bridge.freezer import Freezer

POLL = 0.02


def proc_starttime(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ")".
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def proc_ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
        return int(data[data.rfind(b")") + 2 :].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def proc_argv(pid: int) -> list[str]:
    """The command line of `pid` (empty when it is gone, or a kernel thread)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read(1 << 16).split(b"\0") if a]
    except OSError:
        return []


# The programs a checkpoint or restore runs as helpers (`runc.amd64`, `criu-4.1` included).
HELPER_PROGRAMS = ("runc", "criu")


def _program(path: str) -> str:
    name = os.path.basename(path.removesuffix(" (deleted)"))
    return re.split(r"[.-]", name, maxsplit=1)[0]


def is_helper_program(pid: int) -> bool:
    """Is `pid` runc or CRIU, by its executable (or, where that cannot be read, its command line)?

    What a process is, not what it holds open: the agent itself, a page
    source or a shell in the scratch directory is never one.
    """
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = ""
    if exe:
        return _program(exe) in HELPER_PROGRAMS
    argv = proc_argv(pid)
    return bool(argv) and _program(argv[0]) in HELPER_PROGRAMS


def alive(pid: int, start: int) -> bool:
    return proc_starttime(pid) == start


def descendants(tracked: dict[int, int]) -> None:
    """Add every live child of a tracked process to `tracked` (in place)."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return
    changed = True
    while changed:
        changed = False
        for pid in pids:
            if pid in tracked:
                continue
            ppid = proc_ppid(pid)
            if ppid in tracked and alive(ppid, tracked[ppid]):
                start = proc_starttime(pid)
                if start is not None:
                    tracked[pid] = start
                    changed = True


def holders(work_dir: str) -> dict[int, int]:
    """runc and CRIU processes with a file, directory or cwd open under `work_dir`.

    Only those (`is_helper_program`): any other process that holds the
    directory (the agent reading what CRIU wrote, a shell) is never counted.
    """
    found: dict[int, int] = {}
    if not work_dir:
        return found
    prefix = work_dir.rstrip("/") + "/"
    me = os.getpid()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        if pid == me:
            continue
        links = []
        try:
            links.append(os.readlink(f"/proc/{pid}/cwd"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
        if any(link == work_dir or link.startswith(prefix) for link in links) and is_helper_program(pid):
            start = proc_starttime(pid)
            if start is not None:
                found[pid] = start
    return found


def thaw_all(freezers: list[Freezer], log: "Log") -> None:
    for fz in freezers:
        try:
            if freezer.state(fz) != "THAWED":
                freezer.thaw(fz)
                log(f"thawed {fz.path}")
        except OSError as exc:
            # A container that is gone has nothing left to thaw.
            log(f"cannot thaw {fz.path}: {exc.strerror}")


class Log:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        # Unbuffered and best-effort: a full disk under the log must never stop a thaw.
        try:
            os.write(2, f"[watchdog {os.getpid()} +{time.monotonic() - self.t0:.3f}s] {msg}\n".encode())
        except OSError:
            pass


def guard(freezers: list[Freezer], max_freeze: float, helper_grace: float, log: Log, work_dir: str = "") -> int:
    tracked: dict[int, int] = {}
    stdin = sys.stdin.buffer
    fd = stdin.fileno()
    os.set_blocking(fd, False)
    buf = b""
    deadline = time.monotonic() + max_freeze
    reason = "the freeze limit passed"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if not ready:
            descendants(tracked)
            continue
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            continue
        if not chunk:
            reason = "the agent went away"
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            words = line.decode("ascii", "replace").split()
            if words == ["done"]:
                log("stood down")
                return 0
            if len(words) == 3 and words[0] == "pid":
                tracked[int(words[1])] = int(words[2])
                descendants(tracked)
    log(f"{reason}: thawing {len(freezers)} container(s)")
    thaw_all(freezers, log)
    # Stop the checkpoint: kill the runc helpers. CRIU then fails at its next
    # exchange with runc, between tasks, and lets go of them cleanly (killing
    # CRIU itself while its parasite is inside a task would kill the task).
    descendants(tracked)
    runcs = dict(tracked)
    for pid, start in runcs.items():
        if alive(pid, start) and _comm(pid) == "runc":
            log(f"stopping checkpoint helper runc {pid}")
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    # Keep the pod thawed while CRIU could still re-freeze it on its way out.
    end = time.monotonic() + helper_grace
    while time.monotonic() < end:
        descendants(tracked)
        tracked.update(holders(work_dir))
        live = [p for p, s in tracked.items() if alive(p, s)]
        thaw_all(freezers, log)
        if not live:
            break
        time.sleep(POLL)
    else:
        live = [p for p, s in tracked.items() if alive(p, s)]
        for pid in live:
            log(f"helper {pid} still running after {helper_grace:g}s: killing it")
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(POLL)
        thaw_all(freezers, log)
    log("all thawed")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="node-agent-watchdog")
    ap.add_argument("--max-freeze", type=float, required=True)
    ap.add_argument("--helper-grace", type=float, default=60.0)
    ap.add_argument("--work-dir", default="", help="the checkpoint's scratch dir: runc or CRIU holding it open is a helper")
    ap.add_argument("freezers", nargs="+", help="v1:/sys/fs/cgroup/freezer/... or v2:/sys/fs/cgroup/...")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    log = Log()
    freezers = [Freezer.from_arg(a) for a in args.freezers]
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    try:
        return guard(freezers, args.max_freeze, args.helper_grace, log, args.work_dir)
    except Exception as exc:  # never leave without thawing
        log(f"error {exc!r}: thawing")
        thaw_all(freezers, log)
        return 1


if __name__ == "__main__":
    sys.exit(main())


class Armed:
    """The agent's handle on a running watchdog (blocking calls; cheap)."""

    def __init__(self, proc: "subprocess.Popen[bytes]") -> None:
        self.proc = proc
        self.pid = proc.pid

    def follow(self, pid: int) -> None:
        start = proc_starttime(pid)
        if start is not None:
            self._send(f"pid {pid} {start}\n")

    def stand_down(self) -> None:
        """Everything is thawed: tell the watchdog to exit quietly."""
        self._send("done\n")
        self._close()

    def release(self) -> None:
        """Close the pipe without `done`: the watchdog thaws and outlives helpers."""
        self._close()

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def _close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


def arm(
    freezers: list[Freezer],
    *,
    max_freeze: float,
    log_path: str,
    python: str = sys.executable,
    helper_grace: float = 60.0,
    work_dir: str = "",
    ready_timeout: float = 10.0,
) -> Armed:
    """Start a watchdog for `freezers` and wait until it is armed."""
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(
            [python, "-I", "-m", "criu_bridge.watchdog", "--max-freeze", f"{max_freeze:.3f}",
             "--helper-grace", f"{helper_grace:.3f}", "--work-dir", work_dir, *[f.to_arg() for f in freezers]],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf,
            start_new_session=True, close_fds=True,
        )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], ready_timeout)
    line = proc.stdout.readline() if ready else b""
    proc.stdout.close()
    if line.strip() != b"ready":
        proc.kill()
        proc.wait()
        raise BridgeError(f"the thaw watchdog did not start (see {log_path})")
    return Armed(proc)
