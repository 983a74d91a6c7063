"""One lazily restored container: its page source, and the guard over it.

Started by the restorer after the container's restore plan is written and
before StartContainer:

1. a listening Unix socket, ``work/lazy-pages.socket`` in the plan, where
   the restore (run by the wrapper at StartContainer) will connect and hand
   over the processes' userfaultfds; and ``work/memory.socket``, served by
   the session itself, where the wrapper asks first for the memory CRIU
   places itself (`staging`: held here, the plan holds none until then);
2. the page source (`node_agent.lazy.source`), a separate process that
   takes that socket and fills the processes' memory from the store: the
   agent's spare, started ahead with its imports done, or a new one
   (`node_agent.lazy.spare`);
3. for a full restore through the page source (`filled`), a second
   listening socket, ``work/resume.socket``, where the restore's pre-resume
   gate asks the source whether the processes may run.

The session then guards the transfer: it holds a duplicate of every
userfaultfd the source is handed, so a page source that dies can never make
the kernel fill the missing pages with zeros. On any failure it kills the
container's processes first (and, through `pod_failed`, the pod's other
restored containers), then lets the duplicates go, then reports the
failure with the pod, the container, the phase and the source's reason.
When every page is in, the source exits by itself and the plan's images are
removed. The source reports how many pages are in as it goes (`progress`).

Before the restored process connects, the source serves nothing and must
not outlive its purpose: it ends when the restore fails (`end`), when the
container is removed (the guard asks CRI), after `timeouts.lazy-start`
(the source enforces that by itself too), and when the agent stops (`end`;
the plan then says why, and a later StartContainer fails instead of
starting the image fresh). Once the restore is connected, the source holds
the userfaultfds: an agent that stops lets go of the session (`detach`)
and the transfer goes on.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from criu_bridge import resumegate
from node_agent.cancelling import cancel_and_wait
from node_agent.config.schema import Settings
from node_agent.lazy.fault_handler import SOCKET_NAME
from node_agent.lazy.kill import kill_container
from node_agent.lazy.source import DONE_FILE, FAILED_FILE, peer_is_root
from node_agent.lazy.spare import Spare, start_source
from node_agent.lazy.staging import Memory
from node_agent.store.ingest import Ingest
from node_agent.store.sealing import SealKey

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    ok: bool
    message: str = ""
    pages: int = 0
    total: int = 0
    seconds: float = 0.0


@dataclass(eq=False)  # one session is one set of helpers: identity, not value
class LazySession:
    settings: Settings
    pod: str  # namespace/name
    container: str
    container_id: str
    checkpoint_id: str
    plan_dir: str
    store_root: str
    # Where a lazily pulled checkpoint's missing pages come from (read when
    # the restore began), and the password for that registry.
    origin: dict[str, Any] | None = None
    passwords: dict[str, str] = field(default_factory=dict)
    # The store's hold on the checkpoint's blobs (`Store.hold`), handed to
    # the page source: it lasts exactly as long as the source does.
    hold: Ingest | None = None
    # ``store_root`` is the source's own (hard links to a caller's
    # checkpoint, in the plan dir): the source removes it when it ends.
    private_store: bool = False
    # Whether the container still exists (CRI); None: not known now.
    exists: Callable[[], Awaitable[bool | None]] | None = None
    # The key an encrypted checkpoint is sealed under: handed to the source
    # over its private control socket, never on its command line.
    seal_key: SealKey | None = None
    # The sandbox the container is in: its pod's other restored containers
    # are stopped with it when its memory cannot be restored.
    sandbox: str = ""
    # Called when the memory of the connected container cannot be restored:
    # stops the whole pod's restored containers, this one first, and returns
    # how many of this one's processes were killed.
    pod_failed: Callable[[LazySession, str], Awaitable[int]] | None = None
    # A full restore through the page source: the processes resume only once every page is in (the source
    # answers the restore's pre-resume gate, criu_bridge.resumegate, on its own socket in the plan).
    filled: bool = False
    # The memory CRIU places itself, held until the wrapper asks for it on ``work/memory.socket`` just
    # before CRIU runs: then written into the plan's images (`staging`), whose pages files are not there.
    memory: Memory | None = None
    # The agent's started, idle page source (`spare`), taken for this restore when there is one.
    spare: Spare | None = None
    # Called once the restore connected (the page source takes over the transfer): ends the fetches ahead
    # of it (`prefetch`).
    on_connected: Callable[[], None] | None = None
    # (pages in, pages in all) as the source last reported them.
    progress: tuple[int, int] | None = None
    started_at: float = field(default_factory=time.monotonic)
    outcome: Outcome | None = None
    _source: asyncio.subprocess.Process | None = None
    _memory_server: asyncio.Server | None = None
    _ctrl: socket.socket | None = None
    _held: list[int] = field(default_factory=list)  # duplicates of the processes' userfaultfds
    _task: asyncio.Task[None] | None = None
    _finished: asyncio.Event = field(default_factory=asyncio.Event)
    _removed: bool = False
    _connected: bool = False
    _ending: str = ""  # why the helpers are being ended before a connection
    _quiet: bool = False  # an ending the caller reports itself
    _stopped: str = ""  # why another container of the pod stopped this one
    _failed: str = ""  # the page source's account of a failed transfer, as soon as it gave it
    _restore_failed: bool = False  # ... which is that the restore itself ended (CRIU failed on its own)
    _failed_known: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def connected(self) -> bool:
        return self._connected

    async def failure(self, wait: float, *, early: bool = False) -> str:
        """Why the transfer failed ("" if it did not, or not within `wait` seconds).

        For a StartContainer that failed: when the restore had connected, the
        page source's own account (a chunk that failed verification, a
        registry gone) is the reason, not what CRIU logged as it was cut off.
        When the source failed only because the restore ended (CRIU failed on
        its own), CRIU's account is the reason, and this is "".
        """
        if self._connected and not self._finished.is_set():
            # `early`: the restore was stopped because the page source failed (its pre-resume gate found no
            # page source, or one that said why), so its first account is the reason; the ending may wait
            # long, for runc's state of a container the failed restore never left.
            events = [self._finished, *([self._failed_known] if early else [])]
            waiting = [asyncio.ensure_future(e.wait()) for e in events]
            try:
                await asyncio.wait(waiting, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiting:
                    w.cancel()
            if not self._finished.is_set():
                return f"{self.where}: {self._failed}" if early and self._failed and not self._restore_failed else ""
        outcome = self.outcome
        if outcome is None or outcome.ok or self._removed or self._restore_failed:
            return ""
        return outcome.message

    @property
    def where(self) -> str:
        return f"restore of pod {self.pod}, container {self.container}, phase lazy-pages"

    @property
    def work(self) -> str:
        return os.path.join(self.plan_dir, "work")

    @property
    def images(self) -> str:
        return os.path.join(self.plan_dir, "images")

    async def start(self) -> None:
        """Start the page source and serve the wrapper's request for the memory; return once the sockets
        the restore reaches listen."""
        os.makedirs(self.work, mode=0o700, exist_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        asked = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        memory: socket.socket | None = asked
        gate = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) if self.filled else None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            resumegate.at_path(listener.bind, os.path.join(self.work, SOCKET_NAME))
            listener.listen(1)
            resumegate.at_path(asked.bind, os.path.join(self.work, resumegate.MEMORY_SOCKET_NAME))
            asked.listen(1)
            asked.setblocking(False)
            self._memory_server = await asyncio.start_unix_server(self._serve_memory, sock=asked)
            memory = None  # the server's now
            errlog = os.open(os.path.join(self.work, "page-source.log"),
                             os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            source_args: list[str] = ["--private-store"] if self.private_store else []
            fds = [listener.fileno(), theirs.fileno()]
            if self.hold is not None:
                source_args += ["--hold-fd", str(self.hold.lease_fd), "--hold-dir", self.hold.dir]
                fds.append(self.hold.lease_fd)
            if gate is not None:
                resumegate.at_path(gate.bind, os.path.join(self.work, resumegate.SOCKET_NAME))
                gate.listen(1)
                source_args += ["--resume-fd", str(gate.fileno())]
                fds.append(gate.fileno())
            try:
                # The spare started ahead, or a new process (`spare`). A lazy
                # transfer yields to foreground work (the next restore, most
                # of all): the source lowers itself to the background
                # priority (`background`).
                argv = ["--store", self.store_root, "--checkpoint", self.checkpoint_id, "--container", self.container,
                        "--images", self.images,
                        "--listen-fd", str(listener.fileno()), "--control-fd", str(theirs.fileno()),
                        "--runc-root", self.settings.runc_root, "--container-id", self.container_id,
                        "--start-timeout", str(self.settings.timeouts.lazy_start), *source_args]
                if self.spare is not None:
                    self._source, ahead = await self.spare.launch(argv, fds, errlog)
                else:
                    self._source, ahead = await start_source(argv, fds, errlog), False
            finally:
                os.close(errlog)
            if self.hold is not None:
                self.hold.detach()  # the source holds it now
        except BaseException:
            self._stop_memory()
            self._remove_sockets()
            if self.hold is not None:
                self.hold.release()
            ours.close()
            raise
        finally:
            listener.close()
            if memory is not None:
                memory.close()
            if gate is not None:
                gate.close()
            theirs.close()
        self._ctrl = ours
        try:
            keys = [] if self.seal_key is None else [
                {"id": self.seal_key.key_id, "key": base64.b64encode(self.seal_key.secret).decode()}]
            ours.sendall((json.dumps({"origin": self.origin, "passwords": self.passwords, "keys": keys,
                                      "registry": self.settings.registry.as_mapping(),
                                      "lazy_fetch": self.settings.timeouts.lazy_fetch,
                                      "min_free": self.settings.min_free_bytes,
                                      "replicas": self.settings.replicas_dir, "sandbox": self.sandbox})
                          + "\n").encode())
        except OSError:
            pass  # the source is gone already: the guard reports it
        self._task = asyncio.create_task(self._guard(), name=f"lazy {self.container_id[:13]}")
        log.info("restore of pod %s, container %s: page source %d (%s), waiting for the restored "
                 "process (StartContainer, within %gs)", self.pod, self.container, self._source.pid,
                 "started ahead" if ahead else "started now", self.settings.timeouts.lazy_start,
                 extra={"pod": self.pod, "container": self.container, "phase": "lazy-pages"})

    async def _serve_memory(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The wrapper asks, just before CRIU runs: the memory CRIU places itself goes into the plan, then
        ``ok``; or ``failed <reason>``. Once: the socket goes with the first request from root."""
        try:
            ok, who = peer_is_root(writer.get_extra_info("socket"))
            if not ok:
                log.warning("%s: refused a request for the memory from %s: not root", self.where, who)
                return
            memory, self.memory = self.memory, None
            self._stop_memory()
            try:
                if memory is None:
                    raise RuntimeError("the memory was asked for already, or its restore ended")
                took = time.monotonic()
                written = await asyncio.to_thread(memory.write, self.images)
                log.debug("%s: wrote the %d bytes of memory CRIU places itself in %.3fs", self.where, written,
                          time.monotonic() - took)
                answer = "ok"
            except Exception as exc:  # noqa: BLE001 - every failure is the wrapper's answer
                answer = f"failed cannot write the memory CRIU places itself: {exc}"
                log.error("%s: %s", self.where, answer.removeprefix("failed "),
                          extra={"pod": self.pod, "container": self.container, "phase": "lazy-pages"})
            writer.write((" ".join(answer.split()) + "\n").encode())
            await writer.drain()
        except OSError:
            pass  # the wrapper went away: its start fails without an answer
        finally:
            writer.close()

    def _stop_memory(self) -> None:
        """No more requests for the memory: the socket goes (a second StartContainer finds none)."""
        if self._memory_server is not None:
            self._memory_server.close()
            self._memory_server = None
        _unlink(os.path.join(self.work, resumegate.MEMORY_SOCKET_NAME))

    def _remove_sockets(self) -> None:
        for name in (SOCKET_NAME, resumegate.SOCKET_NAME):  # the memory's goes with its server (`_stop_memory`)
            _unlink(os.path.join(self.work, name))

    async def wait(self) -> Outcome:
        await self._finished.wait()
        assert self.outcome is not None
        return self.outcome

    # -- the guard ------------------------------------------------------------------------------

    async def _guard(self) -> None:
        try:
            outcome = await self._watch()
        except asyncio.CancelledError:
            # The agent lets go (`detach`): the page source serves on by itself.
            self._close_conn()
            self._close_ctrl()
            raise
        except Exception as exc:  # noqa: BLE001 - a guard must always end in a decision
            outcome = Outcome(False, f"the guard failed: {exc!r}")
            if self._connected:
                await asyncio.to_thread(kill_container, self.settings.runc_root, self.container_id,
                                        plan_dir=self.plan_dir)
        self._close_conn()
        await self._finish(outcome)

    async def _watch(self) -> Outcome:
        assert self._ctrl is not None
        reader = _ControlReader(self._ctrl)
        first = asyncio.ensure_future(reader.next())
        deadline = time.monotonic() + self.settings.timeouts.lazy_start
        asked = time.monotonic()
        while not first.done():
            await asyncio.wait([first], timeout=1.0)
            if first.done():
                break
            if self._ending:
                break
            gone = not os.path.isdir(self.plan_dir)
            if not gone and self.exists is not None and time.monotonic() - asked >= 2.0:
                asked = time.monotonic()
                gone = await self.exists() is False
            if gone:
                self._removed = True
                return Outcome(False, "the container was removed before it started")
            if time.monotonic() > deadline:
                return Outcome(False, f"StartContainer did not come within {self.settings.timeouts.lazy_start:g}s "
                                      "(timeouts.lazy-start): the page source gave up (restore the checkpoint "
                                      "again)")
        if self._ending and not first.done():
            return Outcome(False, self._ending)
        event = first.result()
        if event is None:
            if self._ending:
                return Outcome(False, self._ending)
            return Outcome(False, f"the page source exited before the restore connected ({await self._source_exit()})")
        if event.get("event") == "error":
            return Outcome(False, str(event.get("message")))
        if event.get("event") != "connected":
            return Outcome(False, f"unexpected message from the page source: {event!r}")
        self._connected = True
        if self.on_connected is not None:
            self.on_connected()
        log.info("restore of pod %s, container %s: the restored process connected, its pages stream in",
                 self.pod, self.container, extra={"pod": self.pod, "container": self.container, "phase": "lazy-pages"})
        while True:
            event = await reader.next()
            self._held.extend(reader.fds)
            reader.fds.clear()
            if event is not None and event.get("event") == "progress":
                self.progress = (int(event.get("pages", 0)), int(event.get("total", 0)))
                continue
            if event is None or event.get("event") != "uffd":
                break
        if event is not None and event.get("event") == "done":
            self._close_conn()
            try:
                self._ctrl.sendall(b"released\n")
            except OSError:
                pass
            if self._stopped:  # its processes were killed with the pod: over, but not restored
                return Outcome(False, f"{self._stopped}; the container was stopped")
            pages = int(event.get("pages", 0))
            return Outcome(True, pages=pages, total=int(event.get("total", pages)),
                           seconds=float(event.get("seconds", 0.0)))
        reason = (
            str(event.get("message")) if event is not None and event.get("event") == "error"
            else f"the page source exited mid-transfer ({await self._source_exit()})"
        )
        self._failed = reason
        self._restore_failed = event is not None and event.get("restore_failed") is True
        self._failed_known.set()
        if self.pod_failed is not None and not self._stopped:
            killed = await self.pod_failed(self, reason)
        else:
            killed = await asyncio.to_thread(kill_container, self.settings.runc_root, self.container_id,
                                             plan_dir=self.plan_dir)
        try:
            self._ctrl.sendall(b"killed\n")
        except OSError:
            pass
        return Outcome(False, f"{reason}; the container was killed ({killed} processes) rather than run on "
                              "with missing memory")

    async def _source_exit(self) -> str:
        if self._source is None:
            return "not started"
        try:
            async with asyncio.timeout(5):
                rc = await self._source.wait()
        except TimeoutError:
            return "still running"
        return f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"

    def _close_conn(self) -> None:
        while self._held:
            os.close(self._held.pop())

    def _close_ctrl(self) -> None:
        """Close the control socket, waking a thread blocked reading it (it reads the end of the stream)."""
        if self._ctrl is not None:
            try:
                self._ctrl.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    async def _finish(self, outcome: Outcome) -> None:
        if outcome.ok:  # every page is in now; the source's exit is its own business
            self._record_done(outcome)
        if self._source is not None and self._source.returncode is None:
            if not self._connected and not outcome.ok:
                self._source.kill()  # it never got a connection: nothing to finish
            try:
                async with asyncio.timeout(10):
                    await self._source.wait()
            except TimeoutError:
                self._source.kill()
                await self._source.wait()
        if self._ctrl is not None:
            self._close_ctrl()
            self._ctrl.close()
        self._stop_memory()
        self.memory = None  # not asked for: let go
        self._remove_sockets()
        self.outcome = outcome
        if outcome.ok:
            shutil.rmtree(self.images, ignore_errors=True)
        elif self._removed:
            log.info("restore of pod %s, container %s: removed before it started; its page source stopped",
                     self.pod, self.container, extra={"pod": self.pod, "container": self.container})
        elif self._quiet:
            outcome.message = f"{self.where}: {outcome.message}"
            log.info("%s; its page source stopped", outcome.message,
                     extra={"pod": self.pod, "container": self.container, "phase": "lazy-pages"})
            _write(os.path.join(self.plan_dir, FAILED_FILE), outcome.message)
        else:
            reason = outcome.message
            outcome.message = f"{self.where}: {reason}"
            log.error("%s", outcome.message,
                      extra={"pod": self.pod, "container": self.container, "phase": "lazy-pages"})
            _write(os.path.join(self.plan_dir, FAILED_FILE), reason)
        self._finished.set()

    def _record_done(self, outcome: Outcome) -> None:
        took = time.monotonic() - self.started_at
        if outcome.pages >= outcome.total:
            what = f"all {outcome.pages} lazy pages in"
        else:  # pages that were unmapped, or whose processes ended, are not needed
            what = f"lazy transfer over, {outcome.pages} of {outcome.total} pages were still needed"
        log.info("restore of pod %s, container %s: %s, %.2fs after the page source started",
                 self.pod, self.container, what, took,
                 extra={"pod": self.pod, "container": self.container, "phase": "lazy-pages"})
        _write(os.path.join(self.plan_dir, DONE_FILE),
               json.dumps({"pages": outcome.pages, "total": outcome.total,
                           "transfer_seconds": outcome.seconds, "seconds": round(took, 3)}))

    async def end(self, reason: str) -> None:
        """End the helpers of a container that has not connected (the restore failed, the agent stops).

        `reason` goes into the plan (`lazy.failed`), so a later StartContainer
        fails with it instead of running without memory. A session already
        connected is left alone: its transfer goes on.
        """
        if self._task is None or self._task.done() or self._connected:
            return
        self._ending, self._quiet = reason, True
        if self._source is not None and self._source.returncode is None:
            self._source.kill()
        await self._finished.wait()

    def stopped_with(self, reason: str) -> None:
        """Another restored container of the pod failed: this one's processes are being killed, and it is failed too."""
        self._stopped = self._stopped or reason

    async def cancel(self) -> None:
        """Stop waiting for a restore that will not come (the restore failed)."""
        await self.end("the restore failed before the container was started")

    async def detach(self) -> None:
        """Let go of a connected transfer (the agent stops): the page source goes on alone."""
        if self._task is not None and not self._task.done():
            try:
                await cancel_and_wait(self._task)
            finally:
                # The source learns that the agent is gone (also when the guard never got to run).
                self._close_conn()
                self._close_ctrl()
                if self._ctrl is not None:
                    self._ctrl.close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _write(path: str, text: str) -> None:
    if not os.path.isdir(os.path.dirname(path)):
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError:
        pass


class _ControlReader:
    """JSON lines (and passed fds) from the page source's control socket, read in a thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.fds: list[int] = []

    def _read_line(self) -> dict[str, Any] | None:
        while b"\n" not in self.buf:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, 65536, 4)
            except OSError:
                return None  # the source is gone (reset), or the agent closed its end: the end of the stream
            self.fds.extend(fds)
            if not data:
                return None
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            event = json.loads(line)
        except ValueError:
            return {"event": "error", "message": f"garbled message from the page source: {line[:200]!r}"}
        return event if isinstance(event, dict) else {"event": "error", "message": "malformed message"}

    async def next(self) -> dict[str, Any] | None:
        return await asyncio.to_thread(self._read_line)
