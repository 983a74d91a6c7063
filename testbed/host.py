"""The host, as the test bed's provisioning sees it: commands, processes, mounts, files.

Running a command with the bed's PATH and without containerd's client
variables, atomic file writes, processes read from /proc, the mount table
(criu_bridge/mountinfo.py's parser) and unmounting below a directory, and
the progress log (`-v`).

Rule: standard library only, as every provisioning module of the test bed
(the command line runs with the system python3 of a fresh Debian).
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
import time

from criu_bridge import mountinfo

PATH_ENV = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CTR_TIMEOUT_S = 30.0
VERBOSE = False


class TestbedError(Exception):
    """A failure reported to the user as one line."""


def log(msg: str) -> None:
    if VERBOSE:
        print(f"testbed: {msg}", file=sys.stderr, flush=True)


def under(path: str | None, parent: str) -> bool:
    if not path:
        return False
    path = os.path.normpath(path)
    return path == parent or path.startswith(parent + "/")


def run(argv: list[str], *, timeout: float = CTR_TIMEOUT_S, check: bool = True,
        input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, PATH=PATH_ENV)
    for key in ("CONTAINERD_ADDRESS", "CONTAINERD_NAMESPACE", "CONTAINERD_SNAPSHOTTER"):
        env.pop(key, None)
    try:
        proc = subprocess.run(argv, input=input, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout, env=env, check=False)
    except FileNotFoundError as exc:
        raise TestbedError(f"{argv[0]} not found (run scripts/install-host)") from exc
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"'{' '.join(argv)}' timed out after {timeout:.0f}s") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).decode(errors="replace").strip().splitlines()
        raise TestbedError(f"'{' '.join(argv)}' failed: {detail[-1] if detail else proc.returncode}")
    return proc


def write_file(path: str, data: str | bytes, mode: int = 0o644) -> None:
    """Writes a file atomically."""
    if isinstance(data, str):
        data = data.encode()
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def write_plain(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def read_argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] not in ("Z", "X", "")


def arg_value(argv: list[str], *names: str) -> str | None:
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1:]
    return None


def program_name(argv: list[str]) -> str:
    """The base name of the program a command line runs, looking past a dynamic
    loader run by hand (`ld-linux-x86-64.so.2 --library-path DIR PROGRAM ...`)."""
    prog = os.path.basename(argv[0])
    if not prog.startswith(("ld-linux", "ld64.so")):
        return prog
    i = 1
    while i < len(argv) and argv[i].startswith("--"):
        i += 1 if "=" in argv[i] or argv[i] in ("--list", "--verify") else 2
    return os.path.basename(argv[i]) if i < len(argv) else prog


def cwd_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def mountpoints() -> list[tuple[str, str]]:
    """(mount point, fs type) in mount order."""
    with open("/proc/self/mountinfo") as f:
        return [(m.point, m.fstype) for m in mountinfo.parse(f.read())]


def unmount_under(dirs: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for _ in range(5):
        points = [p for p, _ in mountpoints() if any(under(p, d) for d in dirs)]
        if not points:
            return
        # Latest mounts first, then deepest first.
        for point in sorted(reversed(points), key=lambda p: -p.count("/")):
            if libc.umount2(point.encode(), 0) != 0:
                err = ctypes.get_errno()
                if err in (errno.EINVAL, errno.ENOENT):
                    continue
                if libc.umount2(point.encode(), mountinfo.MNT_DETACH) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT):
                    log(f"cannot unmount {point}: {os.strerror(ctypes.get_errno())}")
    left = [p for p, _ in mountpoints() if any(under(p, d) for d in dirs)]
    if left:
        raise TestbedError(f"cannot unmount {left[0]} ({len(left)} mounts left)")


def link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def grep_log(path: str, text: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.rstrip() for line in f if text in line)
    except OSError:
        return ""


def tail(path: str, lines: int = 3) -> str:
    """The last error lines of a containerd log (or its last lines)."""
    try:
        with open(path, errors="replace") as f:
            last = [line.rstrip() for line in f.readlines()[-200:] if line.strip()]
    except OSError:
        return "(no log)"
    errors = [line for line in last
              if not line.startswith("time=") or "level=error" in line or "level=fatal" in line]
    return " | ".join((errors or last)[-lines:]) or "(empty log)"
