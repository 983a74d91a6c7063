"""One agent per store: the daemon's exclusive lock on `<store>/run/agent.lock`.

`serve` takes it before it touches anything (recovery, sockets, the restore
wrapper) and holds it for its whole life; a second `serve` on the same store
is refused, naming the process that holds it. The file holds the holder's
PID and process start time (field 22 of /proc/<pid>/stat) as
`<pid> <start>\\n`; the lock itself is an flock(2) on it, which the kernel
drops when the holder exits, however it exits.

This lock is the agent's alone. The store's own lock (`store.locking`), which
writers, gc and lazy page sources share, is another file. The descriptor is
close-on-exec, so no helper the agent starts (a page source that outlives
the agent, runc, CRIU) ever holds it.
"""

from __future__ import annotations

import errno
import fcntl
import os

from criu_bridge.watchdog import proc_starttime
from node_agent import errors

LOCK_FILE = "agent.lock"


def lock_path(store: str) -> str:
    return os.path.join(store, "run", LOCK_FILE)


class AgentLock:
    """The held lock; `release` lets go (the process's exit does too)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def holder(path: str) -> int | None:
    """The PID the lock file names (None when it names none)."""
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            words = fh.read(64).split()
        return int(words[0]) if words else None
    except (OSError, ValueError):
        return None


def take(store: str) -> AgentLock:
    """Lock `store` for this process, or raise FAILED_PRECONDITION naming the process that holds it."""
    path = lock_path(store)
    try:
        os.makedirs(store, mode=0o700, exist_ok=True)  # the store is root's alone (`daemon.prepare_dirs`)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise errors.FailedPrecondition(f"store {store}: cannot open the agent lock {path}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise errors.FailedPrecondition(f"store {store}: cannot lock {path}: {exc.strerror}") from exc
        pid = holder(path)
        raise errors.FailedPrecondition(
            f"store {store} is in use by another node-agent (pid {pid if pid else 'unknown'}); one agent per store"
        ) from None
    pid = os.getpid()
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{pid} {proc_starttime(pid) or 0}\n".encode(), 0)
    return AgentLock(path, fd)
