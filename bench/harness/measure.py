"""Measuring primitives: bytes in the store, a process's memory and CPU, CRIU's run time, the page cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from collections.abc import Iterator
from typing import Any

from bench.harness.base import NOT_STORE


def files_under(root: str, skip: frozenset[str] | set[str] = frozenset()) -> Iterator[str]:
    """Paths of every file under `root`, but not under its top-level `skip` dirs."""
    for dirpath, dirs, files in os.walk(root):
        if dirpath == root:
            dirs[:] = [d for d in dirs if d not in skip]
        for f in files:
            yield os.path.join(dirpath, f)


def tree_bytes(root: str, skip: frozenset[str] | set[str] = frozenset()) -> int:
    """Bytes of every file under `root` (but not under its top-level `skip` dirs)."""
    total = 0
    for path in files_under(root, skip):
        try:
            total += os.lstat(path).st_size
        except FileNotFoundError:
            pass
    return total


def store_usage(store: str) -> int:
    """Bytes of every file of the checkpoint store (blobs, manifests, indexes)."""
    return tree_bytes(store, NOT_STORE)


def proc_status(pid: int, key: str) -> int | None:
    """A `kB` field of /proc/<pid>/status, in KiB."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def criu_log_ms(path: str) -> float | None:
    """The last relative time stamp, `(SS.ssssss)`, in a CRIU log: its run time."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 65536))
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("(") and ")" in line:
            try:
                return round(float(line[1:line.index(")")]) * 1000, 1)
            except ValueError:
                continue
    return None


def warm(root: str, skip: frozenset[str] | set[str] = frozenset()) -> int:
    """Reads every file under `root` (but not under its top-level `skip`
    dirs), so an operation that follows finds its data in the page cache."""
    buf = bytearray(8 << 20)
    total = 0
    for path in files_under(root, skip):
        try:
            with open(path, "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    total += n
        except OSError:
            pass
    return total


def evict(roots: list[str]) -> int:
    """Empties the page cache of every regular file under `roots` (written back first): an operation that
    follows reads them from the disk, as on a node whose memory went to other work. Returns the files."""
    os.sync()
    count = 0
    for root in roots:
        for path in files_under(root):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue  # a link, a socket, gone
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                count += 1
            except OSError:
                pass
            finally:
                os.close(fd)
    return count


def copy_tree(src: Path, dst: Path) -> None:
    """A private copy of a plan directory, as the agent makes one per restore.

    Untimed. It must be a copy, not hard links: the restore runs CRIU with
    --auto-dedup, which punches each restored page out of the image files.
    """
    shutil.copytree(src, dst, symlinks=True)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_through(path: str) -> int:
    """Reads a file once, so what follows finds it in the page cache."""
    buf = bytearray(8 << 20)
    total = 0
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            total += n
    return total


def _clock_ticks() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError):
        return 100


CLK_TCK = _clock_ticks()


def proc_times(pid: int) -> dict[str, float] | None:
    """A process's (all its threads') user and system CPU seconds and minor page faults, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return {"user_s": int(fields[11]) / CLK_TCK, "sys_s": int(fields[12]) / CLK_TCK, "minflt": float(fields[7])}
    except (OSError, ValueError, IndexError):
        return None


def agent_usage(a: dict[str, float] | None, b: dict[str, float] | None) -> dict[str, Any]:
    """What the agent spent between two `proc_times`: CPU seconds (all, user, system) and minor faults."""
    if a is None or b is None:
        return {"agent_cpu_s": None, "agent_user_s": None, "agent_sys_s": None, "agent_minflt": None}
    user, sys_ = b["user_s"] - a["user_s"], b["sys_s"] - a["sys_s"]
    return {"agent_cpu_s": round(user + sys_, 3), "agent_user_s": round(user, 3), "agent_sys_s": round(sys_, 3),
            "agent_minflt": int(b["minflt"] - a["minflt"])}


def machine_cpu_seconds() -> float | None:
    """CPU time spent on the whole machine (all cores, not idle or waiting), in seconds, from /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...
    return (sum(fields[:3]) + sum(fields[5:8])) / CLK_TCK


def delta(a: float | None, b: float | None) -> float | None:
    return round(b - a, 3) if a is not None and b is not None else None


def store_blobs(store: str) -> set[str]:
    """Paths of every file of the checkpoint store (not its scratch, plans, logs, ...)."""
    return set(files_under(store, NOT_STORE))
