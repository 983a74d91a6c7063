"""runc, driven for checkpoints: `runc checkpoint` of a frozen container.

The pod-wide cut freezes containers through the cgroup freezer (see
`criu_bridge.freezer`) and then asks runc to dump each one with CRIU, leaving
it running (runc puts it back in the state it found it: frozen). runc does the
OCI-specific work: external bind mounts, namespaces, the stdio pipes
(`descriptors.json`). Failures carry CRIU's decisive log lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass
from typing import Awaitable, Callable

from criu_bridge import logs
from criu_bridge.errors import RuntimeFailure

# Checkpoint options people may set, and the runc flag each one maps to.
CHECKPOINT_OPTIONS: dict[str, str] = {
    "tcp-established": "--tcp-established",
    "file-locks": "--file-locks",
    "ext-unix-sk": "--ext-unix-sk",
    "shell-job": "--shell-job",
}


# Options the agent itself records with a checkpoint, never asked for:
# `tcp-close` when a container held TCP connections and `tcp-established` was
# not asked for (criu_bridge.tcp); CRIU restores those connections closed, and
# needs the option again to restore at all.
RECORDED_OPTIONS = ("tcp-close",)


@dataclass(frozen=True)
class CheckpointFlags:
    tcp_established: bool = False
    file_locks: bool = False
    ext_unix_sk: bool = False
    shell_job: bool = False
    tcp_close: bool = False

    def runc_args(self) -> list[str]:
        out = []
        for name, flag in CHECKPOINT_OPTIONS.items():
            if getattr(self, name.replace("-", "_")):
                out.append(flag)
        return out

    def criu_config(self) -> str:
        """The CRIU configuration file of a dump with these flags (see CRIU_CONFIG_FILE): in-flight connections
        skipped, and without `tcp-established` connections closed where held and no network lock."""
        lines = [SKIP_IN_FLIGHT, *(["tcp-close"] if self.tcp_close else [])]
        if not self.tcp_established:
            lines.append(NETWORK_LOCK_SKIP)
        return "".join(f"{line}\n" for line in lines)

    def as_options(self) -> dict[str, str]:
        return {n: "true" for n in (*CHECKPOINT_OPTIONS, *RECORDED_OPTIONS) if getattr(self, n.replace("-", "_"))}


# CRIU reads this configuration file (option names without "--", one a line)
# before the RPC request runc sends it; runc has no flag for every option.
CRIU_CONFIG_ENV = "CRIU_CONFIG_FILE"
CRIU_CONFIG_FILE = "criu.conf"
# Connections that the kernel has accepted but the server has not yet taken
# from its listen queue are left out of every dump: the source, which always
# runs on, takes them, and the restored listening socket starts empty. Without
# it a server that is being connected to cannot be checkpointed at all ("In-flight
# connection (l)"). runc >= 1.3 sends the option in its RPC request (from its
# --tcp-skip-in-flight flag, false unless given), which overrides the file;
# older runcs send nothing, and the file sets it.
SKIP_IN_FLIGHT = "skip-in-flight"
# A dump that does not keep connections open takes no network lock: CRIU's
# lock only keeps packets from changing the TCP state it dumps with
# `tcp-established`, and restores made from it (they use the dump's method,
# recorded in the images) restore none open either. The lock ran
# iptables-restore and ip6tables-restore twice to take it and five processes
# to release it: inside the frozen window at the dump (the source pod, which
# runs on, saw its packets dropped meanwhile), and on the restore's path
# before StartContainer returns (some 60 ms here).
NETWORK_LOCK_SKIP = "network-lock skip"
RUNC_SKIP_IN_FLIGHT = "--tcp-skip-in-flight"


class Runc:
    def __init__(self, binary: str, root: str) -> None:
        self.binary = binary
        self.root = root
        self._checkpoint_flags: str | None = None  # `runc checkpoint --help`, read once

    async def _knows(self, flag: str) -> bool:
        """Whether `runc checkpoint` takes `flag` (from its --help, asked once)."""
        if self._checkpoint_flags is None:
            try:
                proc = await asyncio.create_subprocess_exec(
                    self.binary, "checkpoint", "--help", stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                )
                out, _ = await proc.communicate()
                self._checkpoint_flags = out.decode(errors="replace")
            except OSError:
                self._checkpoint_flags = ""
        return flag in self._checkpoint_flags.split()

    def _base(self, log_path: str | None = None) -> list[str]:
        args = [self.binary, "--root", self.root]
        if log_path:
            args += ["--log", log_path, "--log-format", "json"]
        return args

    async def checkpoint(
        self,
        container_id: str,
        *,
        image_dir: str,
        work_dir: str,
        flags: CheckpointFlags,
        pre_dump: bool = False,
        parent: str | None = None,
        on_start: Callable[[int], Awaitable[None]] | None = None,
        procs: list[asyncio.subprocess.Process] | None = None,
    ) -> None:
        """Dump a (frozen) container, leaving it as it was.

        `on_start(pid)` runs once runc has started, so a watchdog can follow
        it, and the process is appended to `procs`. Cancelling this coroutine
        does not kill runc: CRIU holds the container's tasks, and killing it
        mid-dump can hurt them. The caller decides (see `reap`).
        """
        os.makedirs(image_dir, exist_ok=True)
        os.makedirs(work_dir, exist_ok=True)
        runc_log = os.path.join(work_dir, "runc.log")
        config = os.path.join(work_dir, CRIU_CONFIG_FILE)
        with open(config, "w", encoding="ascii") as fh:
            fh.write(flags.criu_config())
        argv = self._base(runc_log) + [
            "checkpoint", "--pre-dump" if pre_dump else "--leave-running",
            "--image-path", image_dir, "--work-path", work_dir,
            *(["--parent-path", parent] if parent else []),
            *flags.runc_args(),
            *([RUNC_SKIP_IN_FLIGHT] if await self._knows(RUNC_SKIP_IN_FLIGHT) else []),
            container_id,
        ]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True, env={**os.environ, CRIU_CONFIG_ENV: config},
        )
        if procs is not None:
            procs.append(proc)
        if on_start is not None:
            await on_start(proc.pid)
        out = await proc.communicate()
        if proc.returncode != 0:
            dump_log = os.path.join(work_dir, "pre-dump.log" if pre_dump else "dump.log")
            if not os.path.exists(dump_log):
                dump_log = os.path.join(work_dir, "dump.log")
            decisive = logs.read_decisive(dump_log)
            if not decisive:
                with contextlib.suppress(OSError):
                    with open(runc_log, encoding="utf-8", errors="replace") as fh:
                        decisive = logs.runc_log_errors(fh.read())[-4:]
            if not decisive:
                decisive = [(out[0] or b"").decode(errors="replace").strip()[-2000:]]
            raise RuntimeFailure(phase="pre-dump" if pre_dump else "dump", decisive=decisive, log_path=dump_log)


async def reap(proc: asyncio.subprocess.Process, *, grace: float) -> None:
    """Wait up to `grace` seconds for `proc`, then kill its session and reap it."""
    if proc.returncode is None:
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(grace):
                await asyncio.shield(proc.wait())
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
