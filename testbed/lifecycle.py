"""A bed's containerd: which containerd, runc and ctr it runs, starting it, waiting until it serves.

containerd runs detached in a session of its own, so the command that
started it can exit; it is ready once its CRI plugin reports ok.

Rule: standard library only (see testbed/host.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import time

from testbed.config import config_version_for
from testbed.host import PATH_ENV, TestbedError, alive, grep_log, run, tail, write_file
from testbed.layout import BedLayout

def containerd_binary(requested: str | None) -> str:
    """The containerd to run: `requested` (--containerd), else the one on PATH."""
    if requested is None:
        binary = shutil.which("containerd", path=PATH_ENV)
        if binary is None:
            raise TestbedError("containerd not found (run scripts/install-host)")
        return binary
    binary = os.path.abspath(requested)
    if not os.path.isfile(binary) or not os.access(binary, os.X_OK):
        raise TestbedError(f"--containerd {requested}: not an executable file (run scripts/install-host)")
    return binary


def containerd_version(binary: str) -> str:
    """The version `containerd --version` reports (its third word)."""
    words = run([binary, "--version"], timeout=30).stdout.decode(errors="replace").split()
    if len(words) < 3:
        raise TestbedError(f"'{binary} --version' printed no version")
    return str(words[2])


def runc_binary(requested: str | None, containerd: str, containerd_version: str) -> tuple[str, bool]:
    """The runc of the bed's `runc` runtime, and whether the config names it
    (BinaryName). `requested` (--runc) wins. A 2.x bed takes the runc beside its
    containerd (install-host's prefix: runc 1.3), never the system's. A 1.x bed
    leaves it to the shim's PATH, which finds the system's runc."""
    if requested is not None:
        binary = os.path.abspath(requested)
        if not os.path.isfile(binary) or not os.access(binary, os.X_OK):
            raise TestbedError(f"--runc {requested}: not an executable file")
        return binary, True
    if config_version_for(containerd_version) >= 3:
        beside = os.path.join(os.path.dirname(containerd), "runc")
        if os.path.isfile(beside) and os.access(beside, os.X_OK):
            return beside, True
        raise TestbedError(f"containerd {containerd_version} ({containerd}) has no runc beside it: "
                           f"pass --runc PATH, or use install-host's launcher "
                           f"(/opt/node-agent/containerd-2/bin/containerd)")
    found = shutil.which("runc", path=PATH_ENV)
    if found is None:
        raise TestbedError("runc not found (run scripts/install-host)")
    return found, False


def runc_version(binary: str) -> str:
    """The version `runc --version` reports (the third word of its first line)."""
    words = run([binary, "--version"], timeout=30).stdout.decode(errors="replace").split()
    if len(words) < 3 or words[0] != "runc":
        raise TestbedError(f"'{binary} --version' printed no runc version")
    return str(words[2])


def ctr_binary(containerd: str) -> str:
    """The ctr beside the containerd binary (the 2.x prefix has one), else the
    one on PATH (the system's, which talks to 1.6 and 1.7 alike)."""
    beside = os.path.join(os.path.dirname(containerd), "ctr")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    binary = shutil.which("ctr", path=PATH_ENV)
    if binary is None:
        raise TestbedError("ctr not found (run scripts/install-host)")
    return binary


def start_containerd(bed: BedLayout, binary: str) -> int:
    """Starts the bed's containerd in a session of its own, detached from this
    command (which exits while containerd keeps running)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CONTAINERD_", "NOTIFY_SOCKET", "LISTEN_"))}
    env["PATH"] = PATH_ENV  # /usr/local/sbin first: runc finds the newer criu there
    argv = [binary, "--config", bed.config]
    logfd = os.open(bed.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    nullfd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            os.chdir(bed.base)
            for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            os.dup2(nullfd, 0)
            os.dup2(logfd, 1)
            os.dup2(logfd, 2)
            for fd in os.listdir("/proc/self/fd"):
                if int(fd) > 2:
                    try:
                        os.close(int(fd))
                    except OSError:
                        pass
            os.execve(binary, argv, env)
        except BaseException as exc:  # noqa: BLE001 - the child must never return
            try:
                os.write(2, f"testbed: cannot exec {binary}: {exc}\n".encode())
            finally:
                os._exit(127)
    os.close(logfd)
    os.close(nullfd)
    write_file(bed.pid_path, f"{pid}\n")
    return pid


def wait_ready(bed: BedLayout, pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if not alive(pid):
            raise TestbedError(f"containerd exited during startup; log {bed.log}: {tail(bed.log)}")
        if os.path.exists(bed.socket):
            proc = bed.ctr("plugins", "ls", namespace=None, timeout=10, check=False)
            if proc.returncode == 0:
                for line in proc.stdout.decode().splitlines():
                    cols = line.split()
                    if len(cols) >= 3 and cols[0] == "io.containerd.grpc.v1" and cols[1] == "cri":
                        if cols[-1] == "ok":
                            return
                        if cols[-1] == "error":
                            raise TestbedError(f"containerd's CRI plugin failed; log {bed.log}: "
                                               f"{grep_log(bed.log, 'failed to load plugin') or tail(bed.log)}")
                last = "CRI plugin not listed yet"
            else:
                last = proc.stderr.decode(errors="replace").strip()
        time.sleep(0.1)
    raise TestbedError(f"containerd not ready after {timeout:.0f}s ({last}); log {bed.log}: {tail(bed.log)}")
