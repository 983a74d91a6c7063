"""Kept leases: the ingest lease of an import that stopped half-way, kept until a time.

Rule: an importer told to keep what it brought (a pull, ``registry.partial-pull-ttl``)
reserves a ``kept`` file in its ingest directory when it starts, while there is
room; when it stops without publishing, it writes into that file, in place, the
time until which its ``refs`` stay pinned and what it was importing, then lets
its flock go and leaves the directory. Garbage collection, manual, periodic
or at start-up, counts such a lease as live until that time, so running the
import again finds the blobs and fetches only the rest; afterwards the
directory is removed and the blobs nothing else reaches go. Kept across agent
restarts, since it is a file under the store. An importer that dies (SIGKILL)
never writes the file: its lease is dead at once, as before, and the store's
start-up repair removes it. A file that cannot be read, or is torn, keeps
nothing. This module reads and writes that one file; ``blobs.lease_is_live``
and ``gc`` apply it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
from collections.abc import Mapping
from typing import Any, Final

KEPT_NAME: Final = "kept"
RECORD_BYTES: Final = 1024
"""The kept file's fixed size: written once in full at the start, then overwritten in place."""
NOTE_CHARS: Final = 300
"""The longest value of a note kept (a reference, a reason)."""
_OPEN_FLAGS: Final = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _padded(doc: Mapping[str, Any]) -> bytes:
    data = json.dumps(dict(doc), sort_keys=True, separators=(",", ":")).encode()
    if len(data) >= RECORD_BYTES:
        raise ValueError(f"kept record of {len(data)} bytes is over {RECORD_BYTES - 1}")
    return data + b" " * (RECORD_BYTES - 1 - len(data)) + b"\n"


def _put(path: str, flags: int, doc: Mapping[str, Any]) -> None:
    """Write the padded record at offset 0 of ``path`` and fsync it."""
    data = _padded(doc)
    fd = os.open(path, os.O_WRONLY | flags | _OPEN_FLAGS, 0o600)
    try:
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(f"short write to {path}")
        os.fsync(fd)
    finally:
        os.close(fd)


def reserve(ingest_dir: str) -> None:
    """Create the kept file, saying nothing is kept yet (while the import runs, its flock keeps it)."""
    _put(os.path.join(ingest_dir, KEPT_NAME), os.O_CREAT | os.O_EXCL, {"until": 0})


def write(ingest_dir: str, until: float, note: Mapping[str, str]) -> str:
    """Say, in the reserved file, that the lease is kept until ``until`` (epoch seconds); its path.

    ``note`` (``manifest``: the digest imported, which ``gc.Collector.forget_kept``
    matches; ``reference``, ``reason``: for people) is kept with it, long
    values cut so that the record fits its reserved size. Overwrites in
    place: no new space is needed on a full disk.
    """
    doc: dict[str, Any] = {"until": float(until), "until_utc": iso(until), "pid": os.getpid()}
    doc.update((key, str(value)[:NOTE_CHARS]) for key, value in note.items())
    while len(json.dumps(doc, separators=(",", ":"))) >= RECORD_BYTES - 1:
        longest = max(note, key=lambda k: len(doc[k]))
        doc[longest] = doc[longest][: len(doc[longest]) // 2]
    path = os.path.join(ingest_dir, KEPT_NAME)
    _put(path, 0, doc)
    return path


def read(ingest_dir: str) -> dict[str, Any] | None:
    """The kept record of an ingest directory; None when it has none, or one that does not read whole."""
    with contextlib.suppress(OSError, ValueError):
        fd = os.open(os.path.join(ingest_dir, KEPT_NAME), os.O_RDONLY | _OPEN_FLAGS)
        try:
            data = os.read(fd, RECORD_BYTES + 1)
        finally:
            os.close(fd)
        doc = json.loads(data) if len(data) <= RECORD_BYTES else None
        until = doc.get("until") if isinstance(doc, dict) else None
        if isinstance(until, (int, float)) and not isinstance(until, bool):
            return dict(doc) if isinstance(doc, dict) else None
    return None


def until(ingest_dir: str) -> float:
    """Until when an ingest directory's refs are kept past its lease (0: not kept)."""
    doc = read(ingest_dir)
    return float(doc["until"]) if doc is not None else 0.0


def iso(epoch: float) -> str:
    """An epoch time as RFC 3339 UTC, to the second."""
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
