"""A durable record of operations in flight, for crash recovery.

Before the agent freezes a pod or creates a sandbox it writes an entry here
(fsynced), updates it as it goes, and removes it when the operation has put
everything back. Whatever is left at start-up is an operation the agent did
not finish: `recovery` thaws, kills and removes what such an entry names.

Each entry names its writer: the PID and the start time (/proc/<pid>/stat)
of the agent process that last wrote it. An entry whose writer still runs
belongs to that process, whoever reads the journal: no other process undoes
it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from criu_bridge.watchdog import alive, proc_starttime

log = logging.getLogger(__name__)


@dataclass
class Entry:
    """One operation. `data` is JSON-shaped and grows as the operation goes."""

    kind: str  # "checkpoint" or "restore"
    op_id: str = field(default_factory=lambda: time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(4))
    data: dict[str, Any] = field(default_factory=dict)
    # Who wrote it last, as read back by `Journal.pending` (0 / None: not known).
    pid: int = 0
    start: int | None = None

    def writer_alive(self) -> bool:
        """Does the process that wrote this entry still run (same PID, same start time)?

        An entry without a start time (written by an agent before this
        record existed) has no live writer.
        """
        return self.pid > 0 and self.start is not None and alive(self.pid, self.start)

    def written_by_me(self) -> bool:
        return self.pid == os.getpid() and self.start is not None and self.start == proc_starttime(os.getpid())


class Journal:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        os.makedirs(directory, mode=0o700, exist_ok=True)

    def _path(self, op_id: str) -> str:
        if not op_id or "/" in op_id or op_id.startswith("."):
            raise ValueError(f"bad journal id {op_id!r}")
        return os.path.join(self.directory, op_id + ".json")

    def write(self, entry: Entry) -> None:
        """Atomically replace the entry on disk, durably."""
        with self._lock:
            self._write(entry)

    def _write(self, entry: Entry) -> None:
        path = self._path(entry.op_id)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        pid = os.getpid()
        entry.pid, entry.start = pid, proc_starttime(pid)
        doc = {"kind": entry.kind, "op_id": entry.op_id, "pid": pid, "start": entry.start, "data": entry.data}
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(doc, sort_keys=True).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def remove(self, entry: Entry) -> None:
        with self._lock:
            try:
                os.unlink(self._path(entry.op_id))
            except FileNotFoundError:
                pass

    def holds(self, entry: Entry) -> bool:
        """Is `entry` still on disk?"""
        return os.path.exists(self._path(entry.op_id))

    def pending(self) -> list[Entry]:
        """Entries on disk, oldest first, each with its writer. Unreadable ones are logged and dropped."""
        with self._lock:  # a write in flight in another thread keeps its temporary file
            return self._pending()

    def _pending(self) -> list[Entry]:
        out = []
        for name in sorted(os.listdir(self.directory)):
            path = os.path.join(self.directory, name)
            if name.endswith(".tmp"):
                os.unlink(path)
                continue
            if not name.endswith(".json"):
                continue
            try:
                with open(path, encoding="utf-8") as fh:
                    doc = json.load(fh)
                start = doc.get("start")
                out.append(Entry(kind=str(doc["kind"]), op_id=str(doc["op_id"]), data=dict(doc["data"]),
                                 pid=int(doc.get("pid") or 0), start=int(start) if start is not None else None))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("dropping unreadable journal entry %s: %s", path, exc)
                os.unlink(path)
        return out
