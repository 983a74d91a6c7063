"""Killing a lazily restored container whose pages can no longer come.

A process whose page source failed must never run on: once the last holder
of its userfaultfd lets go, the kernel would fill the missing pages with
zeros. So whoever notices the failure kills every process of the container
(found through runc's state: its cgroups) while the userfaultfds are still
held open, and only then lets them go.
"""

from __future__ import annotations

import json
import os
import signal
import time


def container_cgroups(runc_root: str, container_id: str) -> list[str]:
    """The cgroup directories runc recorded for the container (empty if it has no state yet)."""
    path = os.path.join(runc_root, container_id, "state.json")
    try:
        with open(path, encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError):
        return []
    paths = state.get("cgroup_paths") if isinstance(state, dict) else None
    if not isinstance(paths, dict):
        return []
    out = []
    for key in ("freezer", "pids", "memory", "cpu", ""):
        p = paths.get(key)
        if isinstance(p, str) and os.path.isabs(p) and os.path.isdir(p) and p not in out:
            out.append(p)
    return out


def _procs(cgroup: str) -> list[int]:
    try:
        with open(os.path.join(cgroup, "cgroup.procs"), encoding="ascii") as fh:
            return [int(x) for x in fh.read().split()]
    except (OSError, ValueError):
        return []


def kill_container(runc_root: str, container_id: str, timeout: float = 10.0) -> int:
    """SIGKILL every process of the container until none is left; the number signalled.

    Waits (up to ``timeout``) for runc's state to appear when the restore
    that creates it is still running.
    """
    deadline = time.monotonic() + timeout
    killed: set[int] = set()
    seen_state = False
    while time.monotonic() < deadline:
        groups = container_cgroups(runc_root, container_id)
        seen_state = seen_state or bool(groups)
        pids = sorted({p for g in groups for p in _procs(g)})
        if seen_state and not pids:
            return len(killed)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    return len(killed)
