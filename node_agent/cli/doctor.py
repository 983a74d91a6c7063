"""`node-agent doctor`: can this node checkpoint and restore pods?

One line per check: OK, WARN or FAIL, with what to do about anything that
isn't OK. Exits 0 when nothing FAILs. Works without a running daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable

from node_agent.config import Settings

MIN_CRIU = (4, 2)
CAP_SYS_ADMIN = 21
CAP_CHECKPOINT_RESTORE = 40


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str  # OK / WARN / FAIL
    detail: str


def _caps() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def _version(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else None


async def _criu_checks(s: Settings) -> list[Check]:
    from criu_bridge.errors import BridgeError
    from criu_bridge.rpc import CriuClient

    path = s.criu if os.path.isabs(s.criu) else shutil.which(s.criu)
    if not path:
        return [Check("criu", "FAIL", f"{s.criu} not found on PATH; install CRIU >= 4.2 (scripts/install-host)")]
    client = CriuClient(path, timeout=30)
    out = []
    try:
        v = await client.version()
    except BridgeError as exc:
        return [Check("criu", "FAIL", f"{path} does not answer: {exc}")]
    if (v.major, v.minor) < MIN_CRIU:
        out.append(Check("criu", "FAIL", f"{path} is {v.text}; 4.2 or newer is needed (4.1 cannot dump TCP sockets on current kernels)"))
    else:
        out.append(Check("criu", "OK", f"{path} {v.text}"))
    try:
        await client.check()
        out.append(Check("criu check", "OK", "the kernel supports what CRIU needs"))
    except BridgeError as exc:
        out.append(Check("criu check", "FAIL", f"{exc}"))
    try:
        feats = await client.features()
    except BridgeError as exc:
        out.append(Check("criu features", "WARN", f"cannot query: {exc}"))
        return out
    out.append(
        Check("mem_dirty_track", "OK", "iterative pre-dump available")
        if feats.get("mem_track")
        else Check("mem_dirty_track", "WARN", "no soft-dirty memory tracking (CONFIG_MEM_SOFT_DIRTY off): checkpoints freeze the pod for a full dump")
    )
    out.append(
        Check("lazy-pages", "OK", "userfaultfd lazy restore available")
        if feats.get("lazy_pages")
        else Check("lazy-pages", "WARN", "no userfaultfd lazy restore: restores read all memory before starting")
    )
    return out


def _cri_check(s: Settings) -> Check:
    async def probe() -> tuple[str, str]:
        from node_agent.cri import CriClient

        c = CriClient(s.cri_endpoint, timeout=5)
        try:
            return await c.version()
        finally:
            await c.close()

    try:
        name, ver = asyncio.run(probe())
        return Check("cri", "OK", f"{s.cri_endpoint}: {name} {ver}")
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return Check("cri", "WARN", f"{s.cri_endpoint} not reachable ({str(exc).splitlines()[0][:160]}); start containerd or pass --cri-endpoint")


def run_checks(s: Settings) -> list[Check]:
    checks: list[Check] = []
    caps = _caps()
    if os.geteuid() != 0:
        checks.append(Check("privileges", "FAIL", "not root: checkpoint and restore need root"))
    elif not caps & (1 << CAP_SYS_ADMIN):
        checks.append(Check("privileges", "FAIL", "CAP_SYS_ADMIN missing: run privileged"))
    else:
        extra = "" if caps & (1 << CAP_CHECKPOINT_RESTORE) else " (CAP_CHECKPOINT_RESTORE missing; CAP_SYS_ADMIN covers it)"
        checks.append(Check("privileges", "OK", "root with CAP_SYS_ADMIN" + extra))

    runc = s.runc if os.path.isabs(s.runc) else shutil.which(s.runc)
    if runc:
        checks.append(Check("runc", "OK", f"{runc}: {_version([runc, '--version']) or '?'}"))
    else:
        checks.append(Check("runc", "FAIL", f"{s.runc} not found on PATH; install runc"))

    checks.extend(asyncio.run(_criu_checks(s)))

    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        checks.append(Check("cgroups", "OK", "v2 (unified)"))
    elif os.path.isdir("/sys/fs/cgroup/freezer"):
        checks.append(Check("cgroups", "OK", "v1 with the freezer controller"))
    else:
        checks.append(Check("cgroups", "FAIL", "no cgroup freezer found: pods cannot be paused"))

    if shutil.which("iptables-restore") or shutil.which("nft"):
        checks.append(Check("network lock", "OK", "iptables-restore/nft present for CRIU's network lock"))
    else:
        checks.append(Check("network lock", "FAIL", "neither iptables-restore nor nft found: CRIU cannot lock the network; install iptables"))

    checks.append(_cri_check(s))

    if os.path.isdir(s.store):
        mode = os.stat(s.store).st_mode & 0o777
        st = os.statvfs(s.store)
        free = st.f_bavail * st.f_frsize
        if mode & 0o077:
            checks.append(Check("store", "WARN", f"{s.store} is mode {mode:o}; `serve` tightens it to 700"))
        else:
            checks.append(Check("store", "OK", f"{s.store}: {free >> 30} GiB free"))
    else:
        checks.append(Check("store", "WARN", f"{s.store} does not exist yet; `serve` creates it (mode 700)"))

    if os.path.exists(s.socket):
        checks.append(Check("daemon", "OK", f"socket {s.socket} present"))
    else:
        checks.append(Check("daemon", "WARN", f"no daemon socket at {s.socket}; run `node-agent serve`"))

    if ctypes.util.find_library("nvidia-ml"):
        checks.append(Check("nvml", "OK", "libnvidia-ml found"))
    else:
        checks.append(Check("nvml", "WARN", "libnvidia-ml not found: NVIDIA GPUs, if any, are reported as unmonitored"))
    return checks


def add_parser(sub: Any, parent: argparse.ArgumentParser, settings_from: Callable[[argparse.Namespace], Settings]) -> None:
    p = sub.add_parser("doctor", parents=[parent], help="check this node for checkpoint/restore")

    def run(args: argparse.Namespace) -> int:
        checks = run_checks(settings_from(args))
        for c in checks:
            sys.stdout.write(f"{c.verdict:<4} {c.name}: {c.detail}\n")
        return 1 if any(c.verdict == "FAIL" for c in checks) else 0

    p.set_defaults(func=run)
