"""What a results file records about the machine, the test bed and the code that ran."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from node_agent.cli.checks import mount_of, mounts

REPO = Path(__file__).resolve().parents[2]


def _cmd_first_line(argv: list[str]) -> str:
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return "not found"
    if cp.returncode != 0:
        return "unknown"
    text = (cp.stdout or cp.stderr).strip()
    return text.splitlines()[0] if text else "unknown"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def _fstype(path: str) -> str:
    """The filesystem type of the mount ``path`` lies on."""
    found = mount_of(path, mounts())
    return found.fstype if found is not None else "unknown"


def machine_info(repo: Path) -> dict[str, Any]:
    cpuinfo = _read("/proc/cpuinfo")
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    mem = re.search(r"^MemTotal:\s*(\d+)", _read("/proc/meminfo"), re.M)
    osrel = re.search(r'^PRETTY_NAME="?([^"\n]+)', _read("/etc/os-release"), re.M)
    criu_line = _cmd_first_line(["criu", "--version"])
    ctrd = _cmd_first_line(["containerd", "--version"]).split(" ")
    zstd = _cmd_first_line(["zstd", "--version"])
    commit = _cmd_first_line(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"])
    try:
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=20).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        dirty = False
    return {
        "cores": os.cpu_count(),
        "cpu": model.group(1).strip() if model else platform.machine(),
        "memory_gib": round(int(mem.group(1)) / 1048576, 1) if mem else None,
        "kernel": platform.release(),
        "os": (osrel.group(1) if osrel else "unknown") + (f" ({_read('/etc/debian_version').strip()})"
                                                          if os.path.exists("/etc/debian_version") else ""),
        "cgroup": "v2" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "v1",
        "containerd": (ctrd[2] if len(ctrd) > 2 else "unknown"),
        "runc": _cmd_first_line(["runc", "--version"]).removeprefix("runc version "),
        "criu": criu_line.removeprefix("Version: "),
        "criu_path": shutil.which("criu") or "",
        "run_fs": _fstype("/run"),
        "zstd": (re.findall(r"v\d+\.\d+\.\d+", zstd) or [zstd])[0],
        "python": platform.python_version(),
        "node_agent_commit": commit + (" with local changes" if dirty and commit != "unknown" else ""),
    }


def bed_info(info: dict[str, Any]) -> dict[str, Any]:
    """The test bed's containerd and runc, which `machine_info` cannot know (a bed may run a
    containerd other than the one on PATH)."""
    return {
        "containerd": str(info.get("containerd_version") or "unknown"),
        "containerd_binary": str(info.get("containerd_binary") or ""),
        "runc": str(info.get("runc_version") or "unknown"),
        "runc_binary": str(info.get("runc_binary") or ""),
    }


def tree_digest(root: Path) -> str:
    """A digest of every Python file of the product (node_agent/, criu_bridge/) as the agent loaded it:
    the working tree changes under a long benchmark, and the commit alone does not say which code ran."""
    h = hashlib.sha256()
    for pkg in ("node_agent", "criu_bridge"):
        for path in sorted((root / pkg).rglob("*.py")):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            h.update(str(path.relative_to(root)).encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:12]


_REPORTING = "/sys/module/page_reporting/parameters/reported_kib"


def memory_given_back() -> float | None:
    """GiB of the guest's freed memory its host has taken back since boot (the kernel's free page reporting,
    on a virtual machine with a balloon device that asks for it); None where the kernel does not report.

    Memory the host took back is backed again only when the guest next touches it, and that touch costs
    the guest a fault in the host per page: on the test machines writing 1 GiB into new page cache took
    1.4 to 2.9 CPU seconds the first time and 0.2 to 0.4 when the same pages were used again at once. A
    run records how much was taken back while it ran, so that its figures can be read with that in mind.
    """
    text = _read(_REPORTING).strip()
    return round(int(text) / (1 << 20), 1) if text.isdigit() else None


def inode_reuse_window(path: str) -> float:
    """Seconds after files are deleted on the filesystem of ``path`` during which creating new files there
    costs more than on a fresh node: 0 unless it is ext4 without a journal.

    There, to keep a crash from leaving a new file with a just-freed inode's stale record on disk, the inode
    allocator skips each free inode whose record says it was deleted within the kernel's writeback age
    (``vm.dirty_expire_centisecs``, 5 s more while that record is not written back), reading that record
    from the buffer cache first, one free inode after the other. A store's worth of blobs deleted and then
    made again in the same place pays for it on every new file: on the test machines, whose root filesystem
    is such an ext4, 1024 files made right after 1024 were deleted in their directory took 0.39 CPU seconds
    to create, and 0.02 once the window had passed. A fresh node, which holds no checkpoint, never pays it,
    so the benchmarks wait it out between emptying a node's store and measuring a path that fills it again.
    """
    try:
        dev = os.stat(path).st_dev
        name = os.path.basename(os.readlink(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
    except OSError:
        return 0.0
    if not os.path.isdir(f"/proc/fs/ext4/{name}") or os.path.isdir(f"/proc/fs/jbd2/{name}-8"):
        return 0.0
    age = _read("/proc/sys/vm/dirty_expire_centisecs").strip()
    return (int(age) / 100 if age.isdigit() else 30.0) + 5.0 + 1.0  # 1 s to spare
