"""Killing a lazily restored container whose pages can no longer come, and the rest of its pod with it.

A process whose page source failed must never run on: once the last holder
of its userfaultfd lets go, the kernel would fill the missing pages with
zeros. So whoever notices the failure kills every process of the container
(found through runc's state: its cgroups) while the userfaultfds are still
held open, and only then lets them go.

A pod restored from one checkpoint never runs half-restored: the pod's other
restored containers are stopped too (`stop_pod`), each marked failed in the
agent's records first (`node_agent.replicas`), so that a kubelet seeing one
exit finds it failed before it could create it again, and each told in its
CRI log why.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

from criu_bridge.wrapper import FAILED
from node_agent.replicas import Replica, Replicas, sibling_reason, tell

log = logging.getLogger(__name__)


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


def marked_failed(plan_dir: str) -> bool:
    """Whether the restore wrapper marked the restore of the plan in ``plan_dir`` failed: runc has exited
    then, and left no state for the container (or removed what it made)."""
    return bool(plan_dir) and os.path.exists(os.path.join(plan_dir, FAILED))


def kill_container(runc_root: str, container_id: str, timeout: float = 10.0, *, wait_for_state: bool = True,
                   plan_dir: str = "") -> int:
    """SIGKILL every process of the container until none is left; the number signalled.

    Waits (up to ``timeout``) for runc's state to appear when the restore
    that creates it is still running, but not once the wrapper has marked
    that restore failed in ``plan_dir`` (the container's restore plan): no
    state comes then. Without ``wait_for_state``, a container that has no
    state (never started) is left as it is.
    """
    deadline = time.monotonic() + timeout
    killed: set[int] = set()
    seen_state = False
    while time.monotonic() < deadline:
        groups = container_cgroups(runc_root, container_id)
        seen_state = seen_state or bool(groups)
        if not seen_state and (not wait_for_state or marked_failed(plan_dir)):
            return len(killed)
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


def stop_pod(replicas: Replicas, runc_root: str, failed: Replica, reason: str, *,
             wait_for_state: bool = True, plans_dir: str = "") -> dict[str, int]:
    """Stop every restored container of ``failed``'s pod, ``failed`` itself first; processes killed, by container ID.

    In order: each is marked failed (``failed`` for ``reason``, the others
    naming it), then every process of each is killed (the others' only
    where they have runc state; ``failed``'s waiting for it unless
    ``wait_for_state`` is false, a start that failed made none, or, under
    ``plans_dir`` (the restore plans), its restore is marked failed), then
    each newly marked one's CRI log gets its line. A container marked before (by
    another agent or page source) is killed again but not told twice.
    """
    pod = [failed, *(r for r in replicas.of_sandbox(failed.sandbox) if r.container_id != failed.container_id)]
    told = []
    for rep in pod:
        why = reason if rep is failed else sibling_reason(failed, reason)
        if replicas.mark_failed(rep, why):
            told.append((rep, why))
    killed = {rep.container_id: kill_container(runc_root, rep.container_id,
                                               wait_for_state=wait_for_state and rep is failed,
                                               plan_dir=os.path.join(plans_dir, rep.container_id) if plans_dir else "")
              for rep in pod}
    for rep, why in told:
        tell(rep, "node-agent: " + rep.failure_text(why))
    if len(pod) > 1:
        log.error("restore of pod %s failed: its restored containers %s were stopped (%s)", failed.pod,
                  ", ".join(r.container for r in pod), reason,
                  extra={"pod": failed.pod, "container": failed.container, "phase": "lazy-pages"})
    return killed
