"""Unix sockets of the agent: who is on the other end, and who owns the socket file.

- `peer_credentials` is the kernel's record of a connected peer
  (SO_PEERCRED, and SO_PEERGROUPS or /proc for its groups).
- `claim_socket` makes way for every Unix socket the agent listens on: a
  socket file another process still serves is never taken over (the start
  is refused), a stale one is replaced. `check_socket_free` asks the same
  without touching anything; `private_dir` is the root-only directory of
  the servers' own sockets, `group_id` the socket group's gid.
"""

from __future__ import annotations

import contextlib
import grp
import os
import socket
import stat
import struct
import tempfile
from dataclasses import dataclass

from node_agent import errors

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_MAX_GROUPS = 1024


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...]


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The kernel's record of who connected: SO_PEERCRED, plus supplementary groups."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    groups: tuple[int, ...] = ()
    try:
        data = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * _MAX_GROUPS)
        groups = struct.unpack(f"{len(data) // 4}I", data[: len(data) // 4 * 4])
    except OSError:
        groups = _proc_groups(pid)
    return PeerCredentials(pid, uid, gid, tuple(groups))


def _proc_groups(pid: int) -> tuple[int, ...]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Groups:"):
                    return tuple(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def group_id(group: str) -> int | None:
    """The gid of `group` (a name or a number); None when empty."""
    if not group:
        return None
    if group.isascii() and group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError as exc:
        raise errors.InvalidArgument(f"socket-group {group!r}: no such group") from exc


def private_dir(store: str) -> str:
    """A root-only directory for the server's own sockets (short enough for a socket path)."""
    path = os.path.join(store, "run")
    if len(path) > 80:
        return tempfile.mkdtemp(prefix="node-agent-")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def check_socket_free(path: str, what: str) -> bool:
    """Is there a socket file at `path` that no process serves (stale)? FAILED_PRECONDITION when one serves it.

    False when nothing is there. A connection that is accepted (or waits in
    a full backlog) means a live server: refused, naming its PID where the
    kernel tells it. Only a refused connection (nobody listens) makes a
    socket stale. Anything else at `path` that is not a socket counts as
    stale too (it was always replaced).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        return True
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except BlockingIOError:
            pid = 0
        except OSError as exc:
            raise errors.FailedPrecondition(
                f"{what} {path}: cannot tell whether another process serves it ({exc.strerror}); not replacing it"
            ) from exc
        else:
            pid = peer_credentials(probe).pid
    by = f" (pid {pid})" if pid > 0 else ""
    raise errors.FailedPrecondition(
        f"{what} {path} is served by another process{by}; refusing to take it over (is another node-agent running?)"
    )


def claim_socket(path: str, what: str) -> None:
    """Make way for a new listening socket at `path`: a stale one is removed, a served one refuses the start.

    Every listener of the agent binds through this (the local socket, the
    store's private backend sockets, `cri-listen`), right before it binds.
    """
    if check_socket_free(path, what):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
