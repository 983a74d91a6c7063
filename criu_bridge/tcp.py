"""The TCP connections a container's processes hold, read from /proc while they are frozen.

A server that is being talked to holds connections at almost any instant.
CRIU refuses to dump one ("Connected TCP socket, consider using
--tcp-established option") unless it is told either to dump the connections
(--tcp-established: restored open, which works only where their addresses
exist) or to restore them closed (--tcp-close). The agent asks for the
second when a frozen container holds any and the checkpoint did not ask for
the first. The states CRIU counts as connected are every state but LISTEN and
CLOSE (sk-inet.c); TIME_WAIT and SYN_RECV sockets belong to no process.
Standard library only.
"""

from __future__ import annotations

import ipaddress
import os

_STATES = {
    "01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
    "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING",
}
_NOT_CONNECTED = {"07", "0A"}


def cgroup_pids(path: str) -> list[int]:
    """Every process in the cgroup directory `path` and below (its cgroup.procs files)."""
    pids: list[int] = []
    for dirpath, _dirs, files in os.walk(path):
        if "cgroup.procs" not in files:
            continue
        try:
            with open(os.path.join(dirpath, "cgroup.procs"), encoding="ascii") as fh:
                pids += [int(x) for x in fh.read().split() if x.isdigit()]
        except OSError:
            continue
    return sorted(set(pids))


def _address(field: str) -> str:
    """`0100007F:1F90` (or 32 hex digits for IPv6) as `127.0.0.1:8080`, `[::1]:8080`."""
    host, _, port = field.partition(":")
    try:
        raw = bytes.fromhex(host)
        # /proc/net/tcp{,6} prints each 32-bit word in host (little-endian here) order.
        addr = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        ip = ipaddress.ip_address(addr)
        text = str(ip) if ip.version == 4 else f"[{ip}]"
        return f"{text}:{int(port, 16)}"
    except ValueError:
        return field


def held_connections(pids: list[int], proc: str = "/proc") -> list[str]:
    """The connected TCP sockets these processes hold, one line each:
    `pid 7: 10.231.1.5:8080 -> 10.231.1.1:40112 ESTABLISHED`."""
    owner: dict[int, int] = {}  # socket inode -> a pid holding it
    for pid in pids:
        fd_dir = os.path.join(proc, str(pid), "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if link.startswith("socket:[") and link.endswith("]") and link[8:-1].isdigit():
                owner.setdefault(int(link[8:-1]), pid)
    if not owner:
        return []
    found: list[str] = []
    namespaces: set[int] = set()
    for pid in pids:  # each network namespace once
        try:
            ns = os.stat(os.path.join(proc, str(pid), "ns", "net")).st_ino
        except OSError:
            continue
        if ns in namespaces:
            continue
        namespaces.add(ns)
        for table in ("tcp", "tcp6"):
            try:
                with open(os.path.join(proc, str(pid), "net", table), encoding="ascii", errors="replace") as fh:
                    lines = fh.read().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                f = line.split()
                if len(f) < 10 or not f[9].isdigit():
                    continue
                state, inode = f[3].upper(), int(f[9])
                if inode in owner and state not in _NOT_CONNECTED:
                    found.append(f"pid {owner[inode]}: {_address(f[1])} -> {_address(f[2])} {_STATES.get(state, state)}")
    return found
