"""What `doctor`'s checks are made of: a check and its line, this process's capabilities, mount table and
programs' versions, and the processes running a program.

Reads /proc and runs `--version`; never changes anything.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from criu_bridge import mountinfo
from criu_bridge.mountinfo import Mount

MIN_CRIU = (4, 2)
CAP_SYS_ADMIN = 21
CAP_CHECKPOINT_RESTORE = 40
CAP_DAC_OVERRIDE = 1
CAP_NET_ADMIN = 12
CAP_SYS_PTRACE = 19


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str  # OK / WARN / FAIL
    detail: str
    fix: str = ""  # what to do about it (not for OK)

    def line(self) -> str:
        fix = f"; fix: {self.fix}" if self.fix and self.verdict != "OK" else ""
        return f"{self.verdict:<4} {self.name}: {self.detail}{fix}"


def effective_caps() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def version_line(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else None


def mounts(path: str = "/proc/self/mountinfo") -> list[Mount]:
    """This process's mount table; empty if it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return mountinfo.parse(fh.read())
    except OSError:
        return []


def mount_of(path: str, table: list[Mount]) -> Mount | None:
    """The mount `path` lies on (the longest mount point above it)."""
    path = os.path.realpath(path)
    best: Mount | None = None
    for m in table:
        p = m.point.rstrip("/") or "/"
        if (path == p or path.startswith(p.rstrip("/") + "/")) and (best is None or len(p) >= len(best.point)):
            best = m
    return best


def criu_cache_check(table: list[Mount]) -> Check:
    """CRIU keeps its kernel-feature probes in /run/criu.kdat only when /run is a tmpfs."""
    run = mount_of("/run", table)
    if run is not None and run.fstype == "tmpfs":
        return Check("criu cache", "OK", "/run is a tmpfs: CRIU keeps its kernel-feature cache (/run/criu.kdat)")
    return Check("criu cache", "WARN",
                 f"/run is {run.fstype if run else 'unknown'}, not a tmpfs: CRIU cannot keep its kernel-feature cache "
                 "(/run/criu.kdat) and probes the kernel again, iptables included, on every dump and restore "
                 "(tens of milliseconds each, inside StartContainer)",
                 "mount /run as a tmpfs (systemd does so by default)")


def in_container(table: list[Mount]) -> bool:
    """Whether this process runs in a container (its root is an image, not the host's)."""
    if os.path.exists("/run/.containerenv") or os.path.exists("/.dockerenv") or os.environ.get("KUBERNETES_SERVICE_HOST"):
        return True
    root = mount_of("/", table)
    return root is not None and root.fstype == "overlay"


def status_field(name: str) -> str:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(name + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def pids_of(name: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm", encoding="utf-8", errors="replace") as fh:
                if fh.read().strip() == name:
                    pids.append(int(entry))
        except OSError:
            continue
    return pids
