"""Restored replicas: the containers the agent restored, from what, and whether their restore failed.

Rule: the restorer records each container when it writes the container's
restore plan, one file per container, ``<store>/replicas/<sandbox ID>/<container
ID>.json``. Whoever finds that a replica cannot be restored (the agent, or a
page source whose agent is gone) marks it failed beside its record,
``<container ID>.failed``, once: the first reason stays, and only the writer of
the mark tells the container's CRI log (`tell`), so each failure is said once.

The records outlive their containers: the kubelet removes a dead container and
then creates its name again in the same sandbox, and the record says that the
name's restore failed there (`failed_name`). They go with their sandbox
(`forget`, `prune`). Nothing here is secret: names, IDs and reasons.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Final

log = logging.getLogger(__name__)

RECORD: Final = ".json"
FAILED: Final = ".failed"
MAX_RECORD: Final = 64 << 10
MAX_LINE: Final = 8 << 10  # a CRI log line stays well under containerd's 16 KiB line split


@dataclass(frozen=True)
class Replica:
    """One restored container, as recorded when its restore plan was written."""

    container_id: str
    sandbox: str
    pod: str  # namespace/name
    container: str
    checkpoint: str
    lazy: bool
    # The container's CRI log file, and the sandbox's log directory it must lie in ("" when it has none).
    log_path: str = ""
    log_dir: str = ""
    restored: str = ""  # RFC 3339, UTC

    @property
    def namespace(self) -> str:
        return self.pod.partition("/")[0]

    @property
    def pod_name(self) -> str:
        return self.pod.partition("/")[2]

    def failure_text(self, reason: str) -> str:
        """What the user reads about this replica's failed restore (its CRI log, ContainerStatus, the refusals)."""
        return f"restore of pod {self.pod}, container {self.container} failed: {reason}; the container was stopped"


@dataclass(frozen=True)
class ReplicaState:
    """How a restored replica is doing now (`node-agent restores`)."""

    replica: Replica
    # created (not started), paging-in (a lazy one's memory still comes in),
    # done (all of it is in), running (restored in full), exited, failed.
    state: str
    reason: str = ""  # why it failed
    pages: int = 0  # a lazy replica's pages in so far, and in all (0: not known)
    total: int = 0
    runtime: str = ""  # its container's state as the runtime reports it ("" when not known)


def valid_id(name: str) -> bool:
    """Whether ``name`` may be a container or sandbox ID: a name of a file of its own, never a path."""
    return 0 < len(name) <= 128 and all(c.isalnum() or c in "-_." for c in name) and not name.startswith(".")


def _read(path: str, limit: int) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, limit).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _parse(text: str | None) -> Replica | None:
    try:
        doc = json.loads(text or "null")
        if not isinstance(doc, dict):
            return None
        rep = Replica(**{k: doc[k] for k in Replica.__dataclass_fields__ if k in doc})
    except (ValueError, TypeError):
        return None
    ok = all(isinstance(getattr(rep, k), str) for k in Replica.__dataclass_fields__ if k != "lazy")
    return rep if ok and isinstance(rep.lazy, bool) and valid_id(rep.container_id) and valid_id(rep.sandbox) else None


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Replicas:
    """The ``replicas/`` directory of a store (see the module's rule).

    The agent keeps the records in memory too (it is their only writer);
    failure marks, which a page source may write, are always read from disk.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._index: dict[str, Replica] | None = None

    def _dir(self, sandbox: str) -> str:
        if not valid_id(sandbox):
            raise ValueError(f"not a sandbox ID: {sandbox!r}")
        return os.path.join(self.root, sandbox)

    def _path(self, rep: Replica, suffix: str) -> str:
        if not valid_id(rep.container_id):
            raise ValueError(f"not a container ID: {rep.container_id!r}")
        return os.path.join(self._dir(rep.sandbox), rep.container_id + suffix)

    # ---- records ----

    def record(self, rep: Replica) -> None:
        """Record a restored container (its plan is being written)."""
        os.makedirs(self._dir(rep.sandbox), mode=0o700, exist_ok=True)
        path = self._path(rep, RECORD)
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(asdict(rep), fh)
        os.replace(path + ".tmp", path)
        with self._lock:
            if self._index is not None:
                self._index[rep.container_id] = rep

    def load(self, sandbox: str, container_id: str) -> Replica | None:
        """One record, read from disk."""
        if not (valid_id(sandbox) and valid_id(container_id)):
            return None
        return _parse(_read(os.path.join(self.root, sandbox, container_id + RECORD), MAX_RECORD))

    def of_sandbox(self, sandbox: str) -> list[Replica]:
        """The records of one sandbox, read from disk."""
        try:
            names = sorted(os.listdir(self._dir(sandbox)))
        except (OSError, ValueError):
            return []
        out = []
        for name in names:
            if name.endswith(RECORD):
                rep = self.load(sandbox, name[: -len(RECORD)])
                if rep is not None and rep.sandbox == sandbox:
                    out.append(rep)
        return out

    def sandboxes(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.root) if valid_id(n))
        except OSError:
            return []

    def _all(self) -> dict[str, Replica]:
        with self._lock:
            if self._index is None:
                self._index = {r.container_id: r for s in self.sandboxes() for r in self.of_sandbox(s)}
            return self._index

    def all(self) -> list[Replica]:
        return sorted(self._all().values(), key=lambda r: (r.pod, r.restored, r.container))

    def get(self, container_id: str) -> Replica | None:
        """The record of a container the agent restored; None for any other (no disk read)."""
        return self._all().get(container_id)

    def in_sandbox(self, sandbox: str) -> list[Replica]:
        """The records of one sandbox, from memory."""
        return [r for r in self._all().values() if r.sandbox == sandbox]

    def forget(self, sandbox: str) -> None:
        """The sandbox is gone: its records go."""
        import shutil

        try:
            shutil.rmtree(self._dir(sandbox), ignore_errors=True)
        except ValueError:
            return
        with self._lock:
            if self._index is not None:
                self._index = {k: r for k, r in self._index.items() if r.sandbox != sandbox}

    def prune(self, gone: Collection[str]) -> None:
        """Forget the sandboxes in ``gone``: the caller listed the sandboxes here, then the live ones."""
        for sandbox in gone:
            self.forget(sandbox)

    # ---- failures ----

    def failure(self, rep: Replica) -> str | None:
        """Why the replica's restore failed, or None (read from disk: a page source may have marked it)."""
        text = _read(self._path(rep, FAILED), MAX_LINE)
        return None if text is None else text.strip() or "the restore failed"

    def mark_failed(self, rep: Replica, reason: str) -> bool:
        """Mark the replica failed for ``reason``; False when it was already (its first reason stays)."""
        path = self._path(rep, FAILED)
        if os.path.exists(path):
            return False
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(_one_line(reason))
        try:
            os.link(tmp, path)  # the first writer wins, whole
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        return True

    def failed_name(self, sandbox: str, name: str) -> tuple[Replica, str] | None:
        """A restore of container ``name`` in ``sandbox`` that failed, and why (None when none did)."""
        for rep in self.in_sandbox(sandbox):
            if rep.container == name:
                reason = self.failure(rep)
                if reason is not None:
                    return rep, reason
        return None


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 3] + "..."


def cri_log_line(text: str, now_ns: int | None = None) -> bytes:
    """``text`` as one line of a CRI log file, as containerd writes them: ``<RFC3339Nano> stderr F <text>``."""
    ns = time.time_ns() if now_ns is None else now_ns
    secs, frac = divmod(ns, 1_000_000_000)
    digits = f"{frac:09d}".rstrip("0")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + (f".{digits}" if digits else "") + "Z"
    return f"{stamp} stderr F {_one_line(text)}\n".encode()


def tell(rep: Replica, text: str) -> bool:
    """Append ``text`` to the replica's CRI log (what ``kubectl logs`` shows); False when it has none here.

    The file must lie inside the sandbox's log directory (both come from
    configs the agent did not write) and be a regular file, opened without
    following a link; it is created when the container never started.
    """
    if not (rep.log_path and rep.log_dir and os.path.isabs(rep.log_path) and os.path.isabs(rep.log_dir)):
        return False
    parent = os.path.realpath(os.path.dirname(rep.log_path))
    root = os.path.realpath(rep.log_dir)
    if parent != root and not parent.startswith(root.rstrip("/") + "/"):
        log.warning("restore of pod %s, container %s: its log file %s lies outside the pod's log directory %s; "
                    "not writing to it", rep.pod, rep.container, rep.log_path, rep.log_dir)
        return False
    try:
        fd = os.open(os.path.join(parent, os.path.basename(rep.log_path)),
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    except OSError as exc:
        log.warning("restore of pod %s, container %s: cannot write to its log file %s: %s", rep.pod, rep.container,
                    rep.log_path, exc.strerror)
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        os.write(fd, cri_log_line(text))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def log_path_of(log_dir: str, log_path: str) -> str:
    """The CRI log file of a container, as containerd joins it: the sandbox's log directory and the container's path."""
    return os.path.join(log_dir, log_path) if log_dir and log_path else ""


def sibling_reason(failed: Replica, reason: str) -> str:
    """Why a restored container is stopped with ``failed``: a pod is never left half-restored."""
    return f"the restore of container {failed.container} of the same pod failed ({reason})"

