"""A shared PID namespace's next PID moved past every PID a pod's restore will ask it for.

The containers of a pod that shares one PID namespace (the CRI's POD mode,
a Pod's ``shareProcessNamespace``) join the pause process's namespace, and
their checkpointed PIDs are distinct in it. Their restores come one after
another, and each container runs as soon as CRIU has restored it. CRIU
gives every restored task its exact PID (clone3 with ``set_tid``), which
does not move the namespace's allocation cursor: left alone, what the first
restored container forks next, and what runc starts in the namespace, take
low PIDs one by one, and a later container's restore fails where one of
them holds a PID it needs ("Can't fork for N: File exists").

So before CRIU restores a container into a namespace it joins, `advance`
sets that namespace's ``ns_last_pid`` to the highest PID any container of
the checkpoint uses (the agent puts it in the plan), unless the namespace is
past it already: whatever is forked in the pod from then on gets a PID above
all of them. The file acts on the namespace of the process writing it, so a
helper joins the namespace (setns) and its child, born in it, writes it.

Standard library only: the restore wrapper imports it.
"""

from __future__ import annotations

import os
import sys

CLONE_NEWPID = 0x20000000
LAST_PID = "/proc/sys/kernel/ns_last_pid"
PID_MAX = "/proc/sys/kernel/pid_max"
_MAX_REASON = 4096
HELPER_TIMEOUT = 30.0


def joined(spec: dict[str, object]) -> str | None:
    """The PID namespace a container's OCI config joins (its path); None when it gets its own or the host's."""
    linux = spec.get("linux")
    namespaces = linux.get("namespaces") if isinstance(linux, dict) else None
    for ns in namespaces if isinstance(namespaces, list) else ():
        if isinstance(ns, dict) and ns.get("type") == "pid":
            path = ns.get("path")
            return path if isinstance(path, str) and path else None
    return None


def _setns(fd: int, kind: int) -> None:
    setns = getattr(os, "setns", None)  # Python 3.12 and later
    if setns is not None:
        setns(fd, kind)
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, kind) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _write_cursor(floor: int) -> None:
    """In the namespace: move its cursor up to `floor` (never down, never past pid_max)."""
    with open(PID_MAX, encoding="ascii") as fh:
        floor = min(floor, int(fh.read(32)) - 1)
    with open(LAST_PID, "r+", encoding="ascii") as fh:
        if int(fh.read(32)) < floor:
            fh.seek(0)
            fh.write(str(floor))


def main(argv: list[str] | None = None) -> int:
    """The helper, in an interpreter of its own (one thread, so it may fork): join the namespace, fork, write."""
    ns_path, floor = argv if argv is not None else sys.argv[1:3]
    try:
        fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
        _setns(fd, CLONE_NEWPID)
    except OSError as exc:
        os.write(2, f"cannot enter the PID namespace: {exc}\n".encode())
        return 1
    child = os.fork()
    if child == 0:  # born in the namespace
        code = 1
        try:
            _write_cursor(int(floor))
            code = 0
        except BaseException as exc:  # noqa: BLE001 - said on stderr, which the wrapper reports
            os.write(2, f"{LAST_PID}: {exc}\n".encode())
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    return 0 if os.waitstatus_to_exitcode(status) == 0 else 1


def advance(ns_path: str, floor: int, *, python: str = sys.executable) -> None:
    """Make the next PID the namespace at `ns_path` allocates greater than `floor`; OSError with why if not.

    The work is done by `main` in a new interpreter (``python -IS``, finding
    criu_bridge where this one did): forking a process that may hold other
    threads would leave the child their locks.
    """
    import subprocess

    home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"import sys; sys.path.append({home!r}); from criu_bridge.pidns import main; sys.exit(main())"
    try:
        cp = subprocess.run([python, "-IS", "-c", code, ns_path, str(floor)], capture_output=True, text=True,
                            timeout=HELPER_TIMEOUT, close_fds=True)
    except subprocess.TimeoutExpired as exc:
        raise OSError(f"its helper did not finish within {HELPER_TIMEOUT:.0f}s") from exc
    if cp.returncode != 0:
        raise OSError(cp.stderr.strip()[-_MAX_REASON:] or f"its helper exited {cp.returncode}")
