"""The page source: fills one lazily restored container's memory from the store, through its userfaultfds.

The agent starts one per lazily restored container, as its own process, so
that pages keep flowing if the agent itself goes away mid-transfer. It
takes the listening Unix socket ``work/lazy-pages.socket`` of the
container's restore plan (inherited), waits for the restore's CRIU
(``runc restore --lazy-pages``, at StartContainer) to connect and hand it
the restored processes' userfaultfds, and fills their memory from the
checkpoint's chunks (`handler`, `chunks`): each chunk is verified against
its digest before a byte of it reaches a process.

Only a process running as root (the restore's CRIU) may connect: any other
peer is refused.

A full restore through this process (``--resume-fd``: a filled plan) is
the same transfer, with the restored processes held by CRIU until it is
over: once every page is in, the source answers the restore's pre-resume
gate (`criu_bridge.resumegate`) ``ok`` on that socket; when serving fails,
``failed <reason>`` (or nothing: the gate then finds the socket closed),
and the gate kills the processes before they run.

Control channel (inherited Unix stream socket), JSON lines to the agent:

* ``{"event": "connected"}``: the restore connected; the processes exist.
* ``{"event": "uffd", "task": N}`` with that process's userfaultfd attached
  (SCM_RIGHTS), sent before any of its faults is served: the agent keeps a
  duplicate, so a source that crashes or is killed never lets the kernel
  fill the missing pages with zeros.
* ``{"event": "progress", "pages": N, "total": M}``: every second of the
  transfer, how many pages are in.
* ``{"event": "done", ...}``: every page is in. The source answers the
  last faults (zero pages) until the agent answers ``released`` (it closed
  its duplicates) or goes away.
* ``{"event": "error", "message": ...}``: serving is impossible (a bad or
  missing chunk, a chunk the registry did not give within
  ``timeouts.lazy-fetch``, a failed copy). The userfaultfds stay open until
  the agent answers ``killed`` (it has stopped the pod's restored
  containers) or goes away, and then this process stops them itself
  (`kill.stop_pod`).

Whoever is there when the transfer ends writes its outcome: the agent, or,
when the agent is gone, this process: ``lazy.done`` in the plan, and the
lazily pulled checkpoint's origin record goes once every blob of it is in
(`Origins.settle`).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import os
import shutil
import socket
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from node_agent import podformat
from node_agent.config.loading import parse_registry
from node_agent.config.schema import DEFAULT_MIN_FREE_BYTES
from node_agent.errors import AgentError
from node_agent.lazy import background, pagemap
from node_agent.lazy.chunks import PAGE_SIZE, ChunkCache, SourceError
from node_agent.lazy.fault_handler import SOCKET_NAME, Handler
from node_agent.lazy.kill import kill_container, stop_pod
from node_agent.registry.fetching import RemoteBlobs
from node_agent.replicas import Replicas
from node_agent.store import Store
from node_agent.store.sealing import SealKey, StaticKeyring

log = logging.getLogger("node_agent.lazy.source")

RELEASE_WAIT = 10.0
# How long a filled restore's page source waits, every page in, for CRIU's pre-resume gate to ask.
GATE_WAIT = 60.0
PROGRESS_EVERY = 1.0
# The outcome in the plan: written by the agent's session, or by this process when the agent is gone.
DONE_FILE = "lazy.done"
FAILED_FILE = "lazy.failed"


class Source:
    """The checkpoint's memory images of one container: each task's pagemap and its pages file's chunks."""

    def __init__(
        self, store: Store, checkpoint_id: str, container: str, images: str, origin: dict[str, object] | None = None,
        lanes: int = 1,
    ) -> None:
        """``lanes``: how many chunks may be fetched from ``origin`` at once (``registry.connections``): the
        reads ahead of the stream keep that many in flight."""
        record = store.held(checkpoint_id)  # the agent handed this process a hold on it
        self.checkpoint_id = record.id
        self.images = images
        self.maps = pagemap.load_dir(images)
        ahead = lanes if origin is not None else 1
        self.pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2, ahead), thread_name_prefix="page-source")
        self.files: dict[int, ChunkCache] = {}
        self.total = 0
        for task, pm in self.maps.items():
            path = podformat.image_path(container, pm.pages_file)
            entry = record.entry(path)
            if entry.size != pm.pages_size:
                raise SourceError(f"{path} holds {entry.size} bytes, its pagemap accounts for {pm.pages_size}")
            self.files[task] = ChunkCache(store.chunks, record.id, entry, self.pool,
                                          store.origins.fetch_for(record.id, origin), read_ahead=ahead)
            self.total += pm.lazy_pages

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def peer_is_root(conn: socket.socket) -> tuple[bool, str]:
    """Whether the peer of a Unix connection runs as root (as the restore's CRIU does), and who it is."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid == 0, f"pid {pid}, uid {uid}"


def accept_restore(listener: socket.socket, timeout: float) -> socket.socket:
    """The restore's connection: the first from a process running as root; others are refused.

    The socket lies in the plan's work directory (mode 0700, root's), so
    only root reaches it at all; the check keeps it that way.
    """
    deadline = time.monotonic() + timeout
    while True:
        listener.settimeout(max(0.0, deadline - time.monotonic()))
        try:
            conn, _addr = listener.accept()
        except TimeoutError:
            # Worded as the agent's session words the same deadline (whichever of the two sees it first).
            raise SourceError(f"StartContainer did not come within {timeout:g}s (timeouts.lazy-start): no restore "
                              "connected, and the page source gave up (restore the checkpoint again)") from None
        conn.settimeout(None)
        ok, who = peer_is_root(conn)
        if ok:
            return conn
        log.warning("refused a connection to the lazy-pages socket from %s: not root", who)
        conn.close()


def _answer_gate(gate: socket.socket | None, line: str, wait: float) -> None:
    """Tell a filled restore's pre-resume gate (`criu_bridge.resumegate`) whether its processes may run.

    ``ok`` once every page is in; anything else, and a gate that finds the
    socket closed, kills the processes before they run. The gate connects
    when CRIU reaches ``pre-resume``, just after it says the restore
    finished: success waits up to ``wait`` for it, failure does not wait.
    """
    if gate is None:
        return
    try:
        with accept_restore(gate, wait) as conn:
            conn.sendall((" ".join(line.split()) + "\n").encode())
    except (SourceError, OSError) as exc:
        if line == "ok":
            log.warning("the restore's pre-resume gate did not ask within %gs: %s", wait, exc)
    finally:
        gate.close()


def _tell(ctrl: socket.socket, event: dict[str, object], fds: list[int] | None = None) -> None:
    data = (json.dumps(event) + "\n").encode()
    try:
        if fds:
            socket.send_fds(ctrl, [data], fds)
        else:
            ctrl.sendall(data)
    except OSError:
        pass  # the agent is gone; serving goes on without it


def _read_json_line(ctrl: socket.socket, timeout: float) -> dict[str, object]:
    ctrl.settimeout(timeout)
    buf = b""
    try:
        while not buf.endswith(b"\n") and len(buf) < 1 << 16:
            got = ctrl.recv(1)
            if not got:
                break
            buf += got
    except OSError:
        pass
    finally:
        ctrl.settimeout(None)
    try:
        doc = json.loads(buf or b"{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _wait_for(ctrl: socket.socket, word: bytes, timeout: float | None) -> bool:
    ctrl.settimeout(timeout)
    try:
        buf = b""
        while not buf.endswith(b"\n"):
            got = ctrl.recv(64)
            if not got:
                return False
            buf += got
        return buf.strip() == word
    except OSError:
        return False
    finally:
        ctrl.settimeout(None)


class _Agent:
    """What the agent said after ``done``: ``released``, or nothing because it is gone."""

    def __init__(self, ctrl: socket.socket) -> None:
        self.ctrl = ctrl
        self.gone = False

    def released(self) -> bool:
        """Whether the agent has let go of its duplicates (it said so, or it is gone); does not wait."""
        try:
            data = self.ctrl.recv(64, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            self.gone = True
            return True
        self.gone = not data
        return self.gone or b"released" in data


def _report_progress(ctrl: socket.socket, telling: threading.Lock, handler: Handler, over: threading.Event) -> None:
    while not over.wait(PROGRESS_EVERY):
        with telling:
            _tell(ctrl, {"event": "progress", "pages": handler.copied // PAGE_SIZE, "total": handler.total_pages})


def _done_alone(store: Store, checkpoint_id: str, images: str, outcome: dict[str, object]) -> None:
    """The transfer is over and the agent is gone: ``lazy.done``, the images go, the origin record once all is in."""
    plan_dir = os.path.dirname(os.path.abspath(images))
    try:
        with open(os.path.join(plan_dir, DONE_FILE), "w", encoding="utf-8") as fh:
            json.dump(outcome, fh)
    except OSError as exc:
        log.warning("cannot write %s: %s", DONE_FILE, exc.strerror)
    shutil.rmtree(images, ignore_errors=True)
    if store.origins.get(checkpoint_id) is None:
        return
    try:
        if store.origins.settle(checkpoint_id):
            log.info("checkpoint %s: every blob is in the store now", checkpoint_id)
    except AgentError as exc:  # removed meanwhile: gc prunes its record
        log.info("checkpoint %s: origin record kept: %s", checkpoint_id, exc)


def _stop_alone(args: argparse.Namespace, config: dict[str, object], message: str) -> None:
    """The memory cannot be restored and the agent is gone: stop the pod's restored containers here."""
    root, sandbox = config.get("replicas"), config.get("sandbox")
    replicas = Replicas(root) if isinstance(root, str) and root else None
    replica = replicas.load(sandbox, args.container_id) if replicas and isinstance(sandbox, str) else None
    plan_dir = os.path.dirname(os.path.abspath(args.images))
    if replicas is None or replica is None:
        kill_container(args.runc_root, args.container_id, plan_dir=plan_dir)
    else:
        stop_pod(replicas, args.runc_root, replica, message, plans_dir=os.path.dirname(plan_dir))
    try:
        with open(os.path.join(plan_dir, FAILED_FILE), "w", encoding="utf-8") as fh:
            fh.write(message)
    except OSError:
        pass


def _keys(given: object) -> list[SealKey]:
    """The encrypted checkpoint's key, as the agent sent it on the control socket."""
    out = []
    for item in given if isinstance(given, list) else []:
        if isinstance(item, dict) and isinstance(item.get("id"), str) and isinstance(item.get("key"), str):
            out.append(SealKey(item["id"], base64.b64decode(item["key"])))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="node-agent-page-source")
    p.add_argument("--store", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--container", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--listen-fd", type=int, required=True)
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--runc-root", required=True)
    p.add_argument("--container-id", required=True)
    p.add_argument("--start-timeout", type=float, default=600.0)
    # The store's hold on the checkpoint's blobs (its lease, inherited),
    # kept until this process is done: see Store.hold.
    p.add_argument("--hold-fd", type=int, default=-1)
    p.add_argument("--hold-dir", default="")
    # A filled restore (--full through this process): the listening socket its pre-resume gate asks.
    p.add_argument("--resume-fd", type=int, default=-1)
    # --store is this process's own (hard links in the restore plan): remove it at the end.
    p.add_argument("--private-store", action="store_true")
    args = p.parse_args(argv)
    if args.resume_fd < 0:  # a filled restore's transfer is the restore itself: it keeps the caller's priority
        background.lower(os.getpid())  # the transfer yields to foreground work
    logging.basicConfig(level=logging.INFO, format="%(asctime)s page-source %(levelname)s %(message)s")
    ctrl = socket.socket(fileno=args.control_fd)
    listener = socket.socket(fileno=args.listen_fd)
    gate = socket.socket(fileno=args.resume_fd) if args.resume_fd >= 0 else None
    socket_path = os.path.join(os.path.dirname(os.path.abspath(args.images)), "work", SOCKET_NAME)
    began = time.monotonic()
    conn: socket.socket | None = None
    source: Source | None = None
    handler: Handler | None = None
    config: dict[str, object] = {}
    telling = threading.Lock()  # the restore's reader, the progress reports and the main thread all tell the agent
    try:
        # First line from the agent: what this process may not take from its
        # command line (a lazily pulled checkpoint's origin, as the agent read
        # it when the restore began, and the password for its registry).
        config = _read_json_line(ctrl, 30)
        store = Store(args.store, keys=StaticKeyring(_keys(config.get("keys"))))
        given = config.get("passwords")
        passwords = {str(k): str(v) for k, v in given.items()} if isinstance(given, dict) else {}
        registry = config.get("registry")
        retry_for = config.get("lazy_fetch")
        min_free = config.get("min_free")
        settings = parse_registry(registry) if isinstance(registry, dict) else None
        fetcher = store.origins.fetcher = RemoteBlobs(
            store, passwords=passwords, settings=settings,
            retry_for=float(retry_for) if isinstance(retry_for, (int, float)) and not isinstance(retry_for, bool)
            else 60.0,
            min_free=min_free if isinstance(min_free, int) and not isinstance(min_free, bool) and min_free >= 0
            else DEFAULT_MIN_FREE_BYTES)
        origin = config.get("origin")
        if not (isinstance(origin, dict) and isinstance(origin.get("reference"), str)):
            origin = None
        source = Source(store, args.checkpoint, args.container, args.images, origin,
                        lanes=settings.connections if settings is not None else 1)

        def hand_over(fd: int, task: int) -> None:
            with telling:
                _tell(ctrl, {"event": "uffd", "task": task}, [fd])

        handler = Handler(source.maps, source.files, args.images, hand_over)
        handler.prepare()
        log.info("ready: %d pages of %d tasks to fill, %.3fs after this process started", source.total,
                 len(source.files), _since_started())
        try:
            conn = accept_restore(listener, args.start_timeout)
        finally:
            listener.close()
            with contextlib.suppress(OSError):  # one restore per plan: a second StartContainer finds no socket
                os.unlink(socket_path)
        log.info("the restore connected")
        _tell(ctrl, {"event": "connected"})
        start = time.monotonic()
        over = threading.Event()
        threading.Thread(target=_report_progress, args=(ctrl, telling, handler, over), name="progress",
                         daemon=True).start()
        try:
            handler.run(conn)
        finally:
            over.set()
        took = time.monotonic() - start
        _answer_gate(gate, "ok", GATE_WAIT)  # every page is in: the processes may run
        fetcher.drain()  # every chunk fetched is in the store before the agent hears it is done
        pages = handler.copied // PAGE_SIZE
        log.info("filled %d of %d lazy pages (%d faults) in %.2fs", pages, handler.total_pages, handler.faults, took)
        outcome: dict[str, object] = {"pages": pages, "total": handler.total_pages, "transfer_seconds": round(took, 3),
                                      "seconds": round(time.monotonic() - began, 3)}
        with telling:
            _tell(ctrl, {"event": "done", "pages": pages, "total": handler.total_pages, "faults": handler.faults,
                         "seconds": round(took, 3)})
        deadline = time.monotonic() + RELEASE_WAIT
        agent = _Agent(ctrl)
        handler.serve_until(lambda: agent.released() or time.monotonic() > deadline, ctrl.fileno())
        if agent.gone:
            _done_alone(store, source.checkpoint_id, args.images, outcome)
        return 0
    except (SourceError, AgentError, pagemap.PagemapError, OSError) as exc:
        copied = handler.copied // PAGE_SIZE if handler is not None else 0
        message = f"{exc} (after {copied} pages)"
        log.error("%s", message)
        _answer_gate(gate, f"failed {message}", 0.0)  # a filled restore's processes never run
        with telling:
            _tell(ctrl, {"event": "error", "message": message,
                         "restore_failed": handler is not None and handler.restore_failed})
        # Keep the userfaultfds open until the container is dead, so that no
        # page fault is ever answered with a zero page: the agent kills it
        # (and the pod's other restored containers), or, when the agent is
        # gone, this process does.
        if handler is not None and handler.tasks and not _wait_for(ctrl, b"killed", None):
            _stop_alone(args, config, message)
        return 1
    finally:
        if gate is not None:
            gate.close()
        if handler is not None:
            handler.close()
        if conn is not None:
            conn.close()
        if source is not None:
            source.close()
        _end_hold(args.store, args.hold_dir, args.hold_fd)
        if args.private_store and os.path.isfile(os.path.join(args.store, "oci-layout")):
            shutil.rmtree(args.store, ignore_errors=True)


def _since_started() -> float:
    """Seconds since this process started (its start time in /proc, in clock ticks since boot)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return -1.0


def _end_hold(store_root: str, hold_dir: str, fd: int) -> None:
    """Remove the hold's directory (only one under the store's ``ingest/``), then drop its lease."""
    ingest = os.path.join(os.path.abspath(store_root), "ingest")
    if hold_dir and os.path.dirname(os.path.abspath(hold_dir)) == ingest and not os.path.islink(hold_dir):
        shutil.rmtree(hold_dir, ignore_errors=True)
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
