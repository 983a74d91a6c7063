"""An asyncio client for CRIU's RPC service, `criu swrk`.

Each request runs one `criu swrk <fd>` process. The agent and CRIU share a
SOCK_SEQPACKET socket pair: every datagram is one serialized `criu_req` or
`criu_resp`, without framing. While it works, CRIU may send `criu_resp` with
type NOTIFY (an action-script point such as "pre-dump" or "post-restore");
the client runs the caller's hook, answers `criu_req{type: NOTIFY,
notify_success}` and reads on until the final reply.

Rules of this module:

* It never blocks the event loop: the socket is non-blocking and driven with
  `loop.sock_recv` / `loop.sock_sendall`, file work runs in threads.
* Every request has a deadline. On expiry or cancellation the CRIU process
  group is killed and reaped under a shield before the error propagates.
  Killing CRIU half-way through a dump can leave the dumped tasks stopped;
  bound the freeze with `criu_opts.timeout` and give the request enough time.
* Descriptors named in a request (`images_dir_fd`, `work_dir_fd`, ...) belong
  to the caller and must stay open until `request` returns: CRIU opens them
  through /proc/<our pid>/fd/<n>. Descriptors that CRIU uses directly
  (`inherit_fd`, `ps.fd`) are passed to the child process.
* Failures become `RuntimeFailure` carrying CRIU's decisive log lines;
  protocol violations (a malformed or mismatched reply) are `BridgeError`.
* No other module imports the generated CRIU messages; callers that build
  requests use `criu_bridge.rpc.rpc_pb2`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import IO

from google.protobuf.message import DecodeError, EncodeError

from criu_bridge import logs
from criu_bridge._proto.criu import rpc_pb2
from criu_bridge.errors import BridgeError, InvalidInput, RuntimeFailure

__all__ = ["FEATURES", "CriuClient", "CriuVersion", "rpc_pb2"]

logger = logging.getLogger(__name__)

# Features a FEATURE_CHECK request can ask about (fields of criu_features).
FEATURES: tuple[str, ...] = ("mem_track", "lazy_pages", "pidfd_store")

# CRIU's log file name when a request sets none (relative to the work dir).
DEFAULT_LOG_FILE = "criu.log"

# Replies are a few hundred bytes; a datagram this large means truncation.
_MAX_DATAGRAM = 1 << 20
# After the final reply CRIU exits on its own; how long to wait before killing.
_EXIT_GRACE_S = 5.0
# Upper bound for killing and reaping CRIU during cleanup.
_REAP_DEADLINE_S = 10.0
# How much of CRIU's stdout/stderr to quote when it dies without answering.
_OUTPUT_TAIL = 2000


@dataclass(frozen=True)
class CriuVersion:
    major: int
    minor: int
    sublevel: int
    gitid: str
    text: str  # "4.2.1", or "4.2" for a release without a sublevel

    def at_least(self, major: int, minor: int, sublevel: int = 0) -> bool:
        return (self.major, self.minor, self.sublevel) >= (major, minor, sublevel)


NotifyHook = Callable[[str], Awaitable[None]]


class CriuClient:
    """Runs CRIU requests through `criu swrk`, one process per request."""

    def __init__(self, criu: str = "criu", *, timeout: float = 30.0) -> None:
        if timeout <= 0:
            raise InvalidInput(f"CRIU request timeout must be positive, not {timeout!r}")
        self.criu = criu
        self.timeout = timeout

    # -- simple requests ----------------------------------------------------

    async def version(self) -> CriuVersion:
        resp = await self.request(rpc_pb2.criu_req(type=rpc_pb2.VERSION))
        if not resp.HasField("version"):
            raise BridgeError(f"criu version: {self.criu} answered without a version")
        v = resp.version
        parts = [str(v.major_number), str(v.minor_number)]
        if v.HasField("sublevel"):
            parts.append(str(v.sublevel))
        if v.HasField("extra"):
            parts.append(str(v.extra))
        return CriuVersion(
            major=v.major_number,
            minor=v.minor_number,
            sublevel=v.sublevel,
            gitid=v.gitid,
            text=".".join(parts),
        )

    async def check(self, *, work_dir: str | None = None) -> None:
        """Run CRIU's own kernel and environment check (`criu check`).

        Raises RuntimeFailure with CRIU's error lines when the check fails.
        The debug log goes to `work_dir` (kept) or to a temporary directory.
        """
        async with _work_dir(work_dir) as (wd, keep):
            with _open_dir(wd) as fd:
                req = rpc_pb2.criu_req(
                    type=rpc_pb2.CHECK,
                    opts=rpc_pb2.criu_opts(images_dir_fd=fd, log_file="check.log", log_level=4),
                )
                await self._request_logged(req, keep=keep)

    async def features(self) -> dict[str, bool]:
        """Which optional features this CRIU and kernel support.

        mem_track: soft-dirty memory tracking (incremental pre-dumps);
        lazy_pages: userfaultfd post-copy restore; pidfd_store: stable
        pidfds for pre-dump iterations.
        """
        req = rpc_pb2.criu_req(
            type=rpc_pb2.FEATURE_CHECK,
            features=rpc_pb2.criu_features(**{name: True for name in FEATURES}),
        )
        resp = await self.request(req)
        return {name: bool(getattr(resp.features, name)) for name in FEATURES}

    async def cpuinfo_dump(self, images_dir: str, *, work_dir: str | None = None) -> None:
        """Write this machine's CPU description, cpuinfo.img, into `images_dir`."""
        await self._cpuinfo(rpc_pb2.CPUINFO_DUMP, images_dir, work_dir, "cpuinfo-dump.log")

    async def cpuinfo_check(self, images_dir: str, *, work_dir: str | None = None) -> None:
        """Check that this machine's CPU can run images described by cpuinfo.img.

        Raises RuntimeFailure whose decisive lines name the mismatch (or the
        missing image).
        """
        await self._cpuinfo(rpc_pb2.CPUINFO_CHECK, images_dir, work_dir, "cpuinfo-check.log")

    async def _cpuinfo(
        self,
        kind: rpc_pb2.criu_req_type,
        images_dir: str,
        work_dir: str | None,
        log_file: str,
    ) -> None:
        async with _work_dir(work_dir) as (wd, keep):
            with _open_dir(images_dir) as images_fd, _open_dir(wd) as work_fd:
                req = rpc_pb2.criu_req(
                    type=kind,
                    opts=rpc_pb2.criu_opts(
                        images_dir_fd=images_fd,
                        work_dir_fd=work_fd,
                        log_file=log_file,
                        log_level=4,
                    ),
                )
                await self._request_logged(req, keep=keep)

    async def _request_logged(self, req: rpc_pb2.criu_req, *, keep: bool) -> None:
        """`request`, for logs in a temporary directory that goes away after."""
        try:
            await self.request(req)
        except RuntimeFailure as exc:
            if keep:
                raise
            # The decisive lines are in the error; the file will be gone.
            raise RuntimeFailure(exc.phase, exc.message, decisive=exc.decisive) from exc

    # -- the primitive --------------------------------------------------------

    async def request(
        self,
        req: rpc_pb2.criu_req,
        *,
        on_notify: NotifyHook | None = None,
        timeout: float | None = None,
    ) -> rpc_pb2.criu_resp:
        """Send one request to a fresh `criu swrk` and return its final reply.

        `on_notify(script)` runs for every NOTIFY CRIU sends; if it raises,
        CRIU is told the action failed (so it rolls back), and once CRIU has
        answered the hook's exception propagates. Without a hook, every
        NOTIFY is acknowledged as successful.

        `timeout` (default: the client's) bounds the whole exchange. On
        expiry RuntimeFailure is raised (with TimeoutError as its cause);
        on expiry and on cancellation the CRIU process group is killed and
        reaped first. A reply with success=false raises RuntimeFailure with
        the decisive lines of CRIU's log (or its error message).
        """
        deadline = self.timeout if timeout is None else timeout
        phase = _phase(req)
        try:
            payload = req.SerializeToString()
        except EncodeError as exc:
            raise InvalidInput(f"{phase}: incomplete request: {exc}") from exc
        log_path = _log_path(req)

        # CRIU's stdout and stderr, quoted if it dies without answering.
        output = tempfile.TemporaryFile(prefix="criu-swrk-")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with output, ours:
            ours.setblocking(False)
            try:
                proc = await asyncio.create_subprocess_exec(
                    self.criu,
                    "swrk",
                    str(theirs.fileno()),
                    pass_fds=(theirs.fileno(), *_direct_fds(req)),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=output,
                    stderr=output,
                    process_group=0,
                )
            except OSError as exc:
                raise RuntimeFailure(phase, f"cannot run {self.criu}: {exc}") from exc
            finally:
                theirs.close()
            logger.debug("%s: criu swrk started, pid %d", phase, proc.pid)

            conversation = _Conversation(ours, proc, phase, on_notify)
            try:
                async with asyncio.timeout(deadline):
                    resp = await conversation.run(payload)
                    if resp is None:
                        await proc.wait()
                        raise RuntimeFailure(
                            phase,
                            f"criu swrk (pid {proc.pid}) exited with status "
                            f"{proc.returncode} before answering",
                            decisive=await _tail(output),
                            log_path=_existing(log_path),
                        )
            except TimeoutError as exc:
                await _shielded(_reap(proc, grace=0.0), f"criu-reap-{proc.pid}")
                raise RuntimeFailure(
                    phase,
                    f"criu swrk (pid {proc.pid}) gave no final answer within "
                    f"{deadline:g}s and was killed",
                    log_path=_existing(log_path),
                ) from exc
            except BaseException:
                await _shielded(_reap(proc, grace=0.0), f"criu-reap-{proc.pid}")
                raise

        # CRIU closes its end and exits after the final reply.
        await _shielded(_reap(proc, grace=_EXIT_GRACE_S), f"criu-reap-{proc.pid}")
        if conversation.notify_error is not None:
            raise conversation.notify_error
        if resp.type != req.type:
            raise BridgeError(
                f"{phase}: criu answered {_type_name(resp.type)} to {_type_name(req.type)}"
            )
        if not resp.success:
            raise RuntimeFailure(
                phase, decisive=await _decisive(resp, log_path), log_path=_existing(log_path)
            )
        return resp


class _Conversation:
    """One request on a swrk socket: send it, answer NOTIFYs, return the reply."""

    def __init__(
        self,
        sock: socket.socket,
        proc: asyncio.subprocess.Process,
        phase: str,
        on_notify: NotifyHook | None,
    ) -> None:
        self.sock = sock
        self.proc = proc
        self.phase = phase
        self.on_notify = on_notify
        # The hook's failure, raised once CRIU has rolled back and answered.
        self.notify_error: Exception | None = None

    async def run(self, payload: bytes) -> rpc_pb2.criu_resp | None:
        """The final reply, or None when CRIU closed the socket without one."""
        if not await self._send(payload):
            return None
        while True:
            data = await self._recv()
            if not data:
                return None
            resp = _parse(data, self.phase)
            if resp.type != rpc_pb2.NOTIFY:
                return resp
            ok = await self._notify(resp.notify.script)
            ack = rpc_pb2.criu_req(type=rpc_pb2.NOTIFY, notify_success=ok)
            if not await self._send(ack.SerializeToString()):
                return None

    async def _notify(self, script: str) -> bool:
        logger.debug("%s: notify %r", self.phase, script)
        if self.notify_error is not None:
            return False
        if self.on_notify is None:
            return True
        try:
            await self.on_notify(script)
        except Exception as exc:  # raised by request() after CRIU answers
            logger.warning("%s: notify hook for %r failed: %s", self.phase, script, exc)
            self.notify_error = exc
            return False
        return True

    async def _send(self, data: bytes) -> bool:
        """Send one datagram; False if CRIU has already closed its end."""
        try:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    async def _recv(self) -> bytes:
        """Receive one datagram; b"" once CRIU has closed its end."""
        try:
            return await asyncio.get_running_loop().sock_recv(self.sock, _MAX_DATAGRAM)
        except ConnectionResetError:
            # SOCK_SEQPACKET reports a peer that closed with our data unread so.
            return b""


# -- helpers ------------------------------------------------------------------


def _type_name(kind: int) -> str:
    try:
        return rpc_pb2.criu_req_type.Name(kind)
    except ValueError:
        return str(kind)


def _phase(req: rpc_pb2.criu_req) -> str:
    return "criu " + _type_name(req.type).lower().replace("_", "-")


def _parse(data: bytes, phase: str) -> rpc_pb2.criu_resp:
    if len(data) >= _MAX_DATAGRAM:
        raise BridgeError(f"{phase}: criu reply exceeds {_MAX_DATAGRAM} bytes")
    try:
        return rpc_pb2.criu_resp.FromString(data)
    except DecodeError as exc:
        raise BridgeError(f"{phase}: malformed criu reply: {exc}") from exc


def _direct_fds(req: rpc_pb2.criu_req) -> tuple[int, ...]:
    """Descriptors CRIU uses by number, so they must be inherited."""
    if not req.HasField("opts"):
        return ()
    opts = req.opts
    fds = [item.fd for item in opts.inherit_fd]
    if opts.HasField("ps") and opts.ps.HasField("fd"):
        fds.append(opts.ps.fd)
    return tuple(sorted(set(fds)))


def _log_path(req: rpc_pb2.criu_req) -> str | None:
    """Where CRIU writes its log for this request, if it can be known."""
    if not req.HasField("opts"):
        return None
    opts = req.opts
    if opts.log_to_stderr:
        return None
    name = opts.log_file or DEFAULT_LOG_FILE
    if opts.HasField("work_dir_fd"):
        base = _fd_path(opts.work_dir_fd)
    elif opts.HasField("images_dir"):
        base = opts.images_dir
    else:
        base = _fd_path(opts.images_dir_fd)
    return os.path.join(base, name) if base else None


def _existing(path: str | None) -> str | None:
    return path if path is not None and os.path.exists(path) else None


def _fd_path(fd: int) -> str | None:
    if fd < 0:
        return None
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


async def _decisive(resp: rpc_pb2.criu_resp, log_path: str | None) -> list[str]:
    lines: list[str] = []
    if log_path is not None:
        lines = await asyncio.to_thread(logs.read_decisive, log_path)
    if not lines and resp.cr_errmsg:
        lines = [line for line in resp.cr_errmsg.splitlines() if line.strip()]
    if not lines:
        errno = resp.cr_errno
        reason = f" (errno {errno}: {os.strerror(errno)})" if errno else ""
        lines = [f"criu reported failure{reason} and left no log"]
    return lines


async def _tail(output: IO[bytes]) -> list[str]:
    def read() -> list[str]:
        output.seek(0, os.SEEK_END)
        size = output.tell()
        output.seek(max(0, size - _OUTPUT_TAIL))
        text = output.read().decode(errors="replace")
        return [line for line in text.splitlines() if line.strip()][-6:]

    return await asyncio.to_thread(read)


async def _reap(proc: asyncio.subprocess.Process, *, grace: float) -> None:
    """Wait up to `grace` seconds for CRIU to exit, then kill its group; reap it."""
    if proc.returncode is None and grace > 0:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await proc.wait()
    if proc.returncode is None:
        # Not reaped yet, so the group ID cannot have been reused.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        logger.info("killed criu swrk (pid %d)", proc.pid)
    try:
        async with asyncio.timeout(_REAP_DEADLINE_S):
            await proc.wait()
    except TimeoutError:
        # Stuck in the kernel; the child watcher reaps it when it goes.
        logger.error("criu swrk (pid %d) did not exit after SIGKILL", proc.pid)


async def _shielded(cleanup: Coroutine[object, object, None], name: str) -> None:
    """Run cleanup to completion even if the caller is being cancelled."""
    task = asyncio.create_task(cleanup, name=name)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_REAP_DEADLINE_S + 1):
                await asyncio.shield(task)
        raise


@contextlib.contextmanager
def _open_dir(path: str) -> Iterator[int]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidInput(f"cannot open directory {path!r}: {exc.strerror}") from exc
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def _work_dir(path: str | None) -> AsyncIterator[tuple[str, bool]]:
    """Yield (directory, kept): `path` itself, or a temporary one removed after."""
    if path is not None:
        yield path, True
        return
    tmp = await asyncio.to_thread(tempfile.mkdtemp, prefix="criu-work-")
    try:
        yield tmp, False
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)

