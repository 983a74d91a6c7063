"""The background priority of lazy transfers: the page sources.

A task's nice value weighs only against the tasks of its own scheduling
group. Where the kernel groups tasks by session (autogroup:
``kernel.sched_autogroup_enabled=1``, the default of Debian's kernels),
every session is such a group, and each page source runs in a session of
its own, as does the next restore's work (containerd, its shim, runc,
CRIU). Its nice alone then changes nothing: a transfer still
takes as much CPU as that restore. So the session's autogroup gets the same
nice value. Where the task sits in a CPU cgroup of its own (systemd with CPU
accounting, a DaemonSet pod), autogroup does not apply and the task's nice
orders it within that cgroup.
"""

from __future__ import annotations

import os
from typing import Final

NICE: Final = 10


def lower(pid: int) -> None:
    """Give ``pid``, the leader of its own session, the background priority: its nice, then its autogroup's.

    Best effort: only ever lowers a priority, and a kernel without autogroup
    (or a process already gone) is left as it is.
    """
    try:
        if os.getpriority(os.PRIO_PROCESS, pid) < NICE:
            os.setpriority(os.PRIO_PROCESS, pid, NICE)
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/autogroup", "w", encoding="ascii") as fh:
            fh.write(str(NICE))
    except OSError:
        pass
