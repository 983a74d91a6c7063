"""File locks a restore is about to take, tested against the live holders on this host.

CRIU restores a process's file locks with blocking calls (`flock(2)`
without LOCK_NB, `F_SETLKW`): if a live process on this host holds a
conflicting lock on the same file (the still-running source pod, on a
volume both pods mount), the restore would wait for it forever. So before
`runc restore`, every lock of a restore plan whose file lies on a host
path is compared with the kernel's table of held locks (`/proc/locks`),
without taking any lock itself. Files in the container's own rootfs are
new copies and cannot conflict.

A plan's locks (``locks.json``, written by the agent from the CRIU
images) are a list of objects:
``{"path": container path, "host": host path, "kind": "flock"|"posix"|"ofd",
"write": bool, "start": int, "len": int (0: to the end)}``.

Standard library only (the restore wrapper uses it; a named tuple, as in `taskimages`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, NamedTuple

PROC_LOCKS = "/proc/locks"
KINDS = ("flock", "posix", "ofd")
_EOF = (1 << 63) - 1


class Held(NamedTuple):
    """One lock the kernel reports as held."""

    kind: str  # flock / posix / ofd
    write: bool
    pid: int
    dev: tuple[int, int]
    ino: int
    start: int
    end: int  # inclusive


def held_locks(text: str) -> list[Held]:
    """The held locks in /proc/locks' format (waiters, shown with "->", are skipped)."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) < 8 or f[1] == "->":
            continue
        kind = {"FLOCK": "flock", "POSIX": "posix", "OFDLCK": "ofd"}.get(f[1])
        if kind is None or f[3] not in ("READ", "WRITE"):
            continue
        try:
            major, minor, ino = f[5].split(":")
            pid = int(f[4])
            dev = (int(major, 16), int(minor, 16))
            start = int(f[6])
            end = _EOF if f[7] == "EOF" else int(f[7])
            out.append(Held(kind, f[3] == "WRITE", pid, dev, int(ino), start, end))
        except ValueError:
            continue
    return out


def _conflicts(want: dict[str, Any], held: Held) -> bool:
    if not (want["write"] or held.write):
        return False  # two read locks share
    if want["kind"] == "flock":
        return held.kind == "flock"  # flock and record locks are independent on Linux
    if held.kind == "flock":
        return False
    start = int(want["start"])
    end = _EOF if not want["len"] else start + int(want["len"]) - 1
    return start <= held.end and held.start <= end


def conflicts(entries: Iterable[dict[str, Any]], proc_locks: str = PROC_LOCKS) -> list[str]:
    """One line per planned lock that a live process on this host holds against it."""
    entries = [e for e in entries if e.get("host")]
    if not entries:
        return []
    try:
        with open(proc_locks, encoding="ascii", errors="replace") as fh:
            held = held_locks(fh.read(16 << 20))
    except OSError as exc:
        return [f"cannot read {proc_locks} to check the checkpoint's file locks: {exc.strerror}"]
    out = []
    for e in entries:
        try:
            st = os.stat(e["host"])
        except OSError:
            continue  # a missing file fails the restore later, by name
        dev = (os.major(st.st_dev), os.minor(st.st_dev))
        for h in held:
            if h.dev == dev and h.ino == st.st_ino and _conflicts(e, h):
                what = "an exclusive" if h.write else "a shared"
                out.append(f"{e['path']} (host {e['host']}) is locked by a live process on this node "
                           f"(pid {h.pid}, {what} {h.kind} lock) that the restored process held too")
                break
    return out


def check_entries(doc: Any) -> list[dict[str, Any]]:
    """A plan's locks.json, validated (ValueError if malformed)."""
    if not isinstance(doc, list) or len(doc) > 4096:
        raise ValueError("locks.json must be a list of at most 4096 locks")
    out = []
    for e in doc:
        if not isinstance(e, dict) or e.get("kind") not in KINDS or not isinstance(e.get("write"), bool):
            raise ValueError(f"malformed lock entry {e!r:.200}")
        for key in ("path", "host"):
            if not isinstance(e.get(key), str) or len(e[key]) > 4096:
                raise ValueError(f"malformed lock entry {e!r:.200}")
        for key in ("start", "len"):
            if not isinstance(e.get(key), int) or isinstance(e.get(key), bool) or e[key] < 0:
                raise ValueError(f"malformed lock entry {e!r:.200}")
        out.append(e)
    return out
