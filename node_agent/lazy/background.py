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
IDLE_NICE: Final = 19


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


def idle(pid: int) -> None:
    """The lowest priority for ``pid``, the leader of its own session (a spare page source waiting for a
    restore): the idle scheduling class, nice 19, and its autogroup's nice 19. Best effort."""
    _set(pid, os.SCHED_IDLE, IDLE_NICE, IDLE_NICE)


def foreground(pid: int) -> bool:
    """Take ``pid`` (see `idle`) back to the priority of a process this one starts: this one's scheduling class
    and nice, in an autogroup of nice 0 as a new session's is. Whether it has that priority now (raising it
    takes CAP_SYS_NICE)."""
    return _set(pid, os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0), 0)


def _set(pid: int, policy: int, nice: int, group_nice: int) -> bool:
    """Set what can be set; whether the scheduling class and the nice value took."""
    try:
        os.sched_setscheduler(pid, policy, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, pid, nice)
        ok = True
    except OSError:
        ok = False
    try:
        with open(f"/proc/{pid}/autogroup", "w", encoding="ascii") as fh:
            fh.write(str(group_nice))
    except OSError:
        pass  # no autogroup here: the task's own priority is what counts
    return ok
