"""The cgroup freezer, v1 and v2: find a process's freezer, freeze, thaw.

Used by the agent to pause a pod's containers and by the watchdog to thaw
them. Writes the same files runc's own pause/resume writes, so runc's view of
a container (running or paused) stays right. The same cgroup tells how much
memory the container uses (``memory_usage``), which a checkpoint writes out.
Standard library only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from criu_bridge.errors import BridgeError

CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class Freezer:
    """One container's freezer: the control file and the cgroup version."""

    path: str  # the cgroup directory
    version: int  # 1 or 2

    @property
    def control(self) -> str:
        return os.path.join(self.path, "freezer.state" if self.version == 1 else "cgroup.freeze")

    def to_arg(self) -> str:
        return f"v{self.version}:{self.path}"

    @classmethod
    def from_arg(cls, arg: str) -> "Freezer":
        version, _, path = arg.partition(":")
        if version not in ("v1", "v2") or not os.path.isabs(path):
            raise BridgeError(f"bad freezer argument {arg!r}")
        return cls(path=path, version=int(version[1]))


def parse_proc_cgroup(text: str) -> tuple[str | None, str | None]:
    """(v1 freezer path, v2 unified path) from /proc/<pid>/cgroup text."""
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "freezer" in controllers.split(","):
            v1 = path
    return v1, v2


def freezer_of(pid: int, *, cgroup_root: str = CGROUP_ROOT) -> Freezer:
    """The freezer that holds process `pid` (v1 freezer controller, else v2)."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise BridgeError(f"cannot read the cgroups of pid {pid}: {exc.strerror}") from exc
    v1, v2 = parse_proc_cgroup(text)
    if v1 is not None and os.path.isdir(os.path.join(cgroup_root, "freezer")):
        return Freezer(os.path.join(cgroup_root, "freezer", v1.lstrip("/")), 1)
    if v2 is not None and os.path.exists(os.path.join(cgroup_root, "cgroup.controllers")):
        return Freezer(os.path.join(cgroup_root, v2.lstrip("/")), 2)
    raise BridgeError(f"no cgroup freezer found for pid {pid}")


def memory_usage(fz: Freezer, *, cgroup_root: str = CGROUP_ROOT) -> int | None:
    """Bytes of memory charged to the freezer's cgroup; None when it cannot be read.

    cgroup v2: ``memory.current`` in the same directory. cgroup v1: the
    memory hierarchy's ``memory.usage_in_bytes`` at the freezer's path
    (runc places a container at the same path in every hierarchy).
    """
    if fz.version == 2:
        path = os.path.join(fz.path, "memory.current")
    else:
        rel = os.path.relpath(fz.path, os.path.join(cgroup_root, "freezer"))
        if rel.startswith(".."):
            return None
        path = os.path.join(cgroup_root, "memory", rel, "memory.usage_in_bytes")
    try:
        with open(path, encoding="ascii") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def state(fz: Freezer) -> str:
    """"FROZEN", "FREEZING" or "THAWED"."""
    with open(fz.control, encoding="ascii") as fh:
        raw = fh.read().strip()
    if fz.version == 2:
        if raw == "0":
            return "THAWED"
        # cgroup.freeze says what was asked; cgroup.events says if it is done.
        try:
            with open(os.path.join(fz.path, "cgroup.events"), encoding="ascii") as fh:
                events = dict(line.split() for line in fh if line.strip())
            return "FROZEN" if events.get("frozen") == "1" else "FREEZING"
        except OSError:
            return "FROZEN"
    return raw


def _write(fz: Freezer, value: str) -> None:
    with open(fz.control, "w", encoding="ascii") as fh:
        fh.write(value)


def thaw(fz: Freezer) -> None:
    _write(fz, "THAWED" if fz.version == 1 else "0")


def freeze(fz: Freezer, *, timeout: float = 10.0) -> None:
    """Freeze and wait until every task is frozen; thaw again on failure."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    try:
        while True:
            _write(fz, "FROZEN" if fz.version == 1 else "1")
            if state(fz) == "FROZEN":
                return
            if time.monotonic() > deadline:
                raise BridgeError(f"the cgroup {fz.path} did not freeze within {timeout:g}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
    except BaseException:
        try:
            thaw(fz)
        except OSError:
            pass
        raise
