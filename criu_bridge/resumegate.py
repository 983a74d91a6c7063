"""The pre-resume gate of a filled restore: the processes run only once every page of their memory is in.

A full restore (``--full``) whose memory can come through the page source
(docs/lazy-restore.md, "Full restores through the page source") restores
the processes like a lazy one, but CRIU does not let them run until the
page source has put every page in. The wrapper names this gate as CRIU's
action script for that restore (``work/resume-gate``, through
``CRIU_CONFIG_FILE``); CRIU runs it at each action point, and at
``pre-resume`` (every process restored, each stopped under ptrace just
before its last ``rt_sigreturn``, nothing of the program run yet) the gate
asks the page source over ``work/resume.socket`` and waits:

* ``ok``: every page is in, each chunk verified first: exit 0, and CRIU
  lets the processes go;
* anything else (``failed <reason>``, the connection refused or closed: the
  page source failed or is gone): the gate writes the reason to
  ``work/resume.failed``, kills every process of the container's cgroup
  (still stopped by CRIU, so none ever runs), and exits 1. CRIU only logs
  that and may fail to let go of them or say the restore finished; either
  way the wrapper, which finds ``work/resume.failed``, fails the restore
  (deleting the container where runc left one) and reports the reason.

The same line protocol (``ok``, or ``failed <reason>``) answers the
wrapper of every restore through the page source, lazy or filled, before it
runs CRIU: on ``work/memory.socket`` it asks the agent to write the memory
CRIU places itself into the plan (`node_agent.lazy.staging`), which holds
none of it until then.

Standard library only: CRIU runs it as a plain program.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable

SOCKET_NAME = "resume.socket"
MEMORY_SOCKET_NAME = "memory.socket"
FAILED_NAME = "resume.failed"
SCRIPT_NAME = "resume-gate"
ACTION = "pre-resume"
_MAX_LINE = 1 << 16


def script(python: str, work: str) -> str:
    """The action script the wrapper writes for CRIU: the gate at ``pre-resume``, nothing at the other points.

    The gate starts inside the filled restore's transfer, which keeps every core busy, so it starts as the
    wrapper's launcher does: without the site module (``-S``, no ``.pth`` file processed), finding
    criu_bridge where the wrapper's own interpreter found this module."""
    import shlex

    home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"import sys; sys.path.append({home!r}); from criu_bridge.resumegate import main; sys.exit(main())"
    return ("#!/bin/sh\n"
            "# The pre-resume gate of a filled restore (criu_bridge.resumegate), written by the restore's wrapper.\n"
            f'[ "$CRTOOLS_SCRIPT_ACTION" = {ACTION} ] || exit 0\n'
            f"exec {shlex.quote(python)} -IS -c {shlex.quote(code)} {shlex.quote(work)}\n")


def ask(path: str, ended: str = "the page source ended before every page was in",
        peer: str = "the page source") -> str:
    """The verdict on ``path``: "ok", or why not (`ended` when `peer` closed it without a word)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    buf = b""
    try:
        at_path(sock.connect, path)
        while not buf.endswith(b"\n") and len(buf) < _MAX_LINE:
            got = sock.recv(4096)
            if not got:
                break
            buf += got
    except OSError as exc:
        return f"{peer} cannot be reached ({exc.strerror or exc}); it failed or is gone"
    finally:
        sock.close()
    line = buf.decode("utf-8", errors="replace").strip()
    if line == "ok":
        return line
    return line.removeprefix("failed ").strip() or ended


def at_path(act: Callable[[str], None], path: str) -> None:
    """``act`` (a Unix socket's ``bind`` or ``connect``) at ``path``, which may be longer than a socket
    address holds: then through the directory's ``/proc/self/fd`` entry, opened for the call."""
    if len(os.fsencode(path)) < 100:
        act(path)
        return
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        act(f"/proc/self/fd/{fd}/{os.path.basename(path)}")
    finally:
        os.close(fd)


def kill_restored(pid: int, timeout: float = 10.0) -> int:
    """SIGKILL the restored root `pid`, its descendants and every process of its cgroup, until none is left.

    The cgroup is the container's, where the restore put its processes; a
    cgroup the gate itself is in (a restore that put nothing in one of its
    own) is never swept: only the tree under `pid` is. Returns how many
    processes were signalled.
    """
    from criu_bridge.errors import BridgeError
    from criu_bridge.freezer import freezer_of

    if pid <= 0:
        return 0
    procs = ""
    try:
        theirs = freezer_of(pid).path
        if theirs != freezer_of(os.getpid()).path:
            procs = os.path.join(theirs, "cgroup.procs")
    except BridgeError:
        pass
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        pids = _tree(pid)
        try:
            with open(procs, encoding="ascii") as fh:
                pids |= {int(x) for x in fh.read().split()}
        except (OSError, ValueError):
            pass
        fresh = pids - killed  # the stopped processes cannot fork; one killed may linger as it exits
        if not fresh or time.monotonic() > deadline:
            return len(killed)
        for p in fresh:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
            killed.add(p)
        time.sleep(0.01)


def _tree(pid: int) -> set[int]:
    """`pid` and its descendants that are alive now (/proc/PID/task/TID/children)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        if p in out or not os.path.exists(f"/proc/{p}"):
            continue
        out.add(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children", encoding="ascii") as fh:
                    todo += [int(x) for x in fh.read().split()]
            except (OSError, ValueError):
                pass
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if os.environ.get("CRTOOLS_SCRIPT_ACTION") != ACTION:
        return 0
    if len(args) != 1 or not os.path.isabs(args[0]):
        print("usage: resumegate WORK_DIR", file=sys.stderr)
        return 2
    work = args[0]
    verdict = ask(os.path.join(work, SOCKET_NAME))
    if verdict == "ok":
        return 0
    try:
        with open(os.path.join(work, FAILED_NAME), "w", encoding="utf-8") as fh:
            fh.write(verdict)
    except OSError:
        pass
    try:
        root = int(os.environ.get("CRTOOLS_INIT_PID", "0"))
    except ValueError:
        root = 0
    kill_restored(root)
    print(f"resume gate: {verdict}; the restored processes were killed before they ran", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
