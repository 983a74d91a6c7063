"""Lazy-restore helpers a previous agent process left running, found and ended at start-up.

A helper belongs to this agent when its work directory lies under this
agent's plans directory (test beds run several agents on one machine):
``node_agent.lazy.source ... --images <plans>/<container id>/images`` (and
``criu lazy-pages ... --work-dir <plans>/<container id>/work``, which agents
before the page source's own fault handler started beside it). Such a
helper may go on only while it serves a transfer in flight: the
container runs the process the wrapper restored from the plan. Every other
one (its container gone, exited, or never started) is a stray: it is killed,
and the plan says why, so that a later StartContainer fails instead of
running without memory.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

from criu_bridge.watchdog import alive, proc_argv, proc_starttime

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Helper:
    pid: int
    start: int
    kind: str  # lazy-pages / page-source
    container_id: str


def _value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv[:-1]):
        if a == flag:
            return argv[i + 1]
    return None


def helpers(plans_dir: str) -> list[Helper]:
    """This agent's lazy-restore helpers now running, by the plan (container ID) they serve."""
    plans = os.path.realpath(plans_dir).rstrip("/") + "/"
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        argv = proc_argv(pid)
        if "lazy-pages" in argv:
            kind, path = "lazy-pages", _value(argv, "--work-dir")
        elif "node_agent.lazy.source" in argv:
            kind, path = "page-source", _value(argv, "--images")
        else:
            continue
        if not path or not os.path.isabs(path):
            continue
        path = os.path.normpath(path)
        if not path.startswith(plans):
            continue
        cid = path[len(plans):].split("/", 1)[0]
        start = proc_starttime(pid)
        if cid and start is not None:
            out.append(Helper(pid, start, kind, cid))
    return out


def end(found: list[Helper], reasons: dict[str, str], plans_dir: str) -> list[Helper]:
    """SIGKILL every helper whose container has a reason to end; returns those ended."""
    ended = []
    for h in found:
        reason = reasons.get(h.container_id)
        if reason is None:
            continue
        if alive(h.pid, h.start):
            try:
                os.kill(h.pid, signal.SIGKILL)
            except OSError:
                continue
            ended.append(h)
            log.warning("ended stray lazy-restore helper %d (%s) of container %s: %s", h.pid, h.kind,
                        h.container_id[:13], reason, extra={"phase": "recovery"})
        plan = os.path.join(plans_dir, h.container_id)
        if os.path.isdir(plan) and not os.path.exists(os.path.join(plan, "lazy.done")):
            try:
                with open(os.path.join(plan, "lazy.failed"), "w", encoding="utf-8") as fh:
                    fh.write(f"restore of container {h.container_id[:13]}, phase lazy-pages: {reason}")
            except OSError:
                pass
    return ended
