"""The page source started ahead of its restore: a spare, its start-up paid off the restore's path.

A page source is a Python process of its own (`source`). Starting one, the
interpreter and the store, registry and fault-handler modules it imports,
takes 0.1 to 0.2 CPU seconds, and a restore waits for it: the restored
processes hand over their memory only to a source that is ready, and on a
busy node the restore's own steps (the sandbox, runc, CRIU) need that CPU.

So the agent's lazy restores keep one page source started and idle (the
spare): ``python -m node_agent.lazy.spare --job-fd N``, its imports done,
at the lowest priority (`background.idle`: it takes only CPU nobody else
wants), blocked on a socket of its own. A restore's session `launch`es its
page source: the spare is raised to the priority a new source would have,
and is sent the same command line and descriptors (``SCM_RIGHTS``; the
``--*-fd`` values name the agent's numbers and are mapped to the ones
received) and the file for its standard error; from then on it is that
restore's page source, as if started for it. A new spare is then started.

Nothing depends on the spare: when there is none (not started yet, or it
died), the source is started as a new process with the same arguments. A
spare never taken ends with the agent: killed when the agent stops
(`Spare.close`), and by itself when its socket closes because the agent is
gone, whatever ended it.

A spare that becomes a page source takes that source's command line
(`retitle`), so ``ps`` shows which plan it serves and a later agent finds
it as a stray the way it finds any source (`strays`). The kernel shows a
process's command line from the memory its arguments were passed in, so
the spare is started with room there (``--room``) and writes the source's
arguments over its own, each ended by a NUL as the kernel gave them. (A
process-title library joins them into one string instead.) A job whose
command line would not fit starts a new process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import os
import socket
import sys

from node_agent.lazy import background
from node_agent.lazy import source as page_source

log = logging.getLogger(__name__)

SOURCE_MODULE = "node_agent.lazy.source"
SPARE_MODULE = "node_agent.lazy.spare"
MAX_JOB = 1 << 16
MAX_FDS = 8
ROOM = 8192  # bytes of command line a spare is started with, for its source's (`retitle`)


class Spare:
    """At most one started, idle page source, for the next restore (`launch`)."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._job: socket.socket | None = None
        self._starting: asyncio.Task[None] | None = None
        self._kept = False  # whether a spare is kept at all (`prepare`)
        self._closed = False
        self._reaping: set[asyncio.Task[None]] = set()

    @property
    def pid(self) -> int | None:
        """The waiting spare's process ID (None while there is none)."""
        return self._proc.pid if self._proc is not None else None

    async def launch(self, argv: list[str], fds: list[int], stderr: int) -> tuple[asyncio.subprocess.Process, bool]:
        """One restore's page source, given ``argv`` (its options) and the descriptors it names, and whether it
        was started ahead: the spare, or a new process when there is none. Then a new spare starts (once
        `prepare` was called)."""
        proc = self._take(argv, fds, stderr)
        if self._kept:
            self.prepare()
        if proc is not None:
            return proc, True
        return await start_source(argv, fds, stderr), False

    def prepare(self) -> None:
        """Keep a spare from now on: start one in the background, unless there is one (or one starting)."""
        self._kept = True
        if self._closed or self._proc is not None or (self._starting is not None and not self._starting.done()):
            return
        self._starting = asyncio.get_running_loop().create_task(self._start(), name="page source spare")

    async def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", SPARE_MODULE, "--job-fd", str(theirs.fileno()), "--room=" + "." * ROOM,
                pass_fds=[theirs.fileno()],
                start_new_session=True, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
        except OSError as exc:
            ours.close()
            log.warning("cannot start a spare page source (%s); each restore starts its own", exc)
            return
        finally:
            theirs.close()
        background.idle(proc.pid)
        if self._closed:
            ours.close()
            await _reap(proc)
            return
        self._proc, self._job = proc, ours

    def _take(self, argv: list[str], fds: list[int], stderr: int) -> asyncio.subprocess.Process | None:
        proc, job = self._proc, self._job
        if proc is None or job is None or len(command_line(argv)) + 16 * MAX_FDS > ROOM:
            return None  # none, or the command line would not fit: the spare waits for the next restore
        self._proc = self._job = None
        try:
            if proc.returncode is not None:
                raise ProcessLookupError(f"it exited ({proc.returncode})")
            if not background.foreground(proc.pid):
                self._kept = False  # it would stay at the idle priority: no spares on this node
                raise PermissionError("its priority cannot be raised from idle here; no spare is kept from now on")
            socket.send_fds(job, [(json.dumps({"argv": argv, "fds": fds}) + "\n").encode()], [*fds, stderr])
        except OSError as exc:
            log.info("the spare page source cannot serve (%s); starting one for this restore", exc)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            task = asyncio.get_running_loop().create_task(_reap(proc))
            self._reaping.add(task)
            task.add_done_callback(self._reaping.discard)
            return None
        finally:
            job.close()
        return proc

    async def close(self) -> None:
        """End the spare (the agent stops). It serves nothing and holds nothing: it is killed, not waited for
        (one still importing at the idle priority would take long to read the end of its socket)."""
        self._closed = True
        if self._starting is not None:
            await asyncio.gather(self._starting, return_exceptions=True)
        proc, job = self._proc, self._job
        self._proc = self._job = None
        if job is not None:
            job.close()
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        await asyncio.gather(*self._reaping, return_exceptions=True)


async def start_source(argv: list[str], fds: list[int], stderr: int) -> asyncio.subprocess.Process:
    """A page source started as a new process, in a session of its own."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", SOURCE_MODULE, *argv, pass_fds=fds, start_new_session=True,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=stderr,
    )


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Wait for a spare to exit (it does when its socket closes, or killed), killing it after a while."""
    try:
        async with asyncio.timeout(5):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def command_line(argv: list[str]) -> bytes:
    """What a source's command line holds after its interpreter (``-m`` and the module included)."""
    return b"".join(a.encode() + b"\0" for a in ["-m", SOURCE_MODULE, *argv])


def retitle(argv: list[str]) -> bool:
    """Show ``argv`` as this process's command line, after its interpreter: whether it fit."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        fields = stat[stat.rfind(b")") + 2:].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of proc(5)
        with open("/proc/self/cmdline", "rb") as fh:
            interpreter = fh.read(end - start).split(b"\0", 1)[0]
    except (OSError, IndexError, ValueError):
        return False
    title = interpreter + b"\0" + command_line(argv)
    if len(title) > end - start:
        return False
    ctypes.memmove(start, title.ljust(end - start, b"\0"), end - start)
    return True


def receive(job: socket.socket) -> tuple[list[str], int] | None:
    """The job a spare is sent: its page source's options, with every ``--*-fd`` value mapped to the descriptor
    received, and the descriptor for its standard error; None when the agent closed the socket instead.

    Raises ValueError for anything else, OSError when the socket fails (the descriptors received are closed
    then).
    """
    buf = b""
    got: list[int] = []
    try:
        while not buf.endswith(b"\n"):
            data, fds, _flags, _addr = socket.recv_fds(job, MAX_JOB, MAX_FDS)
            got += fds
            if not data:
                break
            buf += data
            if len(buf) > MAX_JOB:
                raise ValueError("the job is too long")
        if not buf and not got:
            return None
        doc = json.loads(buf)
        argv, theirs = (doc.get("argv"), doc.get("fds")) if isinstance(doc, dict) else (None, None)
        if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)
                and isinstance(theirs, list) and all(type(n) is int for n in theirs)
                and len(got) == len(theirs) + 1):
            raise ValueError(f"a malformed job ({len(got)} descriptors)")
        mapping = dict(zip(theirs, got))
        out = list(argv)
        for i, a in enumerate(out[:-1]):
            if a.startswith("--") and a.endswith("-fd"):
                number = int(out[i + 1])
                if number >= 0:
                    if number not in mapping:
                        raise ValueError(f"{a} {number} names no descriptor sent")
                    out[i + 1] = str(mapping[number])
        return out, got[-1]
    except (ValueError, OSError):
        for fd in got:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="node-agent-page-source-spare")
    p.add_argument("--job-fd", type=int, required=True)
    p.add_argument("--room", default="")  # room for the source's command line (`retitle`)
    args = p.parse_args(argv)
    job = socket.socket(fileno=args.job_fd)
    try:
        got = receive(job)
    except (ValueError, OSError) as exc:
        print(f"page source spare: {exc}", file=sys.stderr)
        return 2
    finally:
        job.close()
    if got is None:
        return 0  # the agent let go of its spare
    source_argv, stderr = got
    os.dup2(stderr, 2)
    os.close(stderr)
    if not retitle(source_argv):
        print("page source spare: its command line could not show the source's", file=sys.stderr)
    return page_source.main(source_argv)


if __name__ == "__main__":
    sys.exit(main())
