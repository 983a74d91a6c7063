"""The mount table: /proc/<pid>/mountinfo parsed, the overlay upperdir of a process's root, mounts left below a directory.

A mountinfo line is "ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] -
FSTYPE SOURCE SUPER_OPTIONS", space separated, with the kernel's octal
escapes (\\040 for a space, \\011, \\012, \\134) in the names. `parse`
keeps the lines of that shape and skips every other one; mount point,
filesystem type and source come unescaped, the super options as written,
since an escaped comma must not split an option (`option` unescapes one
value). The last mount at a point is the one on top.

Standard library only.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass

from criu_bridge.errors import BridgeError

MNT_DETACH = 2


@dataclass(frozen=True)
class Mount:
    """One line of a mount table."""

    point: str
    fstype: str
    source: str
    options: str = ""  # the super options, escaped as in the table


def unescape(field: str) -> str:
    """Undo the kernel's octal escapes (\\040 for space, \\054 for comma...)."""
    if "\\" not in field:
        return field
    out: list[str] = []
    i = 0
    n = len(field)
    while i < n:
        c = field[i]
        if c == "\\" and i + 3 < n and all(ch in "01234567" for ch in field[i + 1 : i + 4]):
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(c)
            i += 1
    return "".join(out)


def parse(text: str) -> list[Mount]:
    """The mounts of a mountinfo text, in its order."""
    out: list[Mount] = []
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) < 9:
            continue
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 3:
            continue
        options = fields[sep + 3] if len(fields) > sep + 3 else ""
        out.append(Mount(unescape(fields[4]), unescape(fields[sep + 1]), unescape(fields[sep + 2]), options))
    return out


def option(mount: Mount, key: str) -> str | None:
    """The first non-empty unescaped value of super option `key` ("upperdir=..."), or None."""
    for item in mount.options.split(","):
        name, eq, value = item.partition("=")
        if name == key and eq and value:
            return unescape(value)
    return None


def parse_root_upperdir(mountinfo: str) -> str:
    """The upperdir of the mount at "/" in a mountinfo text; BridgeError if not overlayfs."""
    roots = [m for m in parse(mountinfo) if m.point == "/"]
    if not roots:
        raise BridgeError("no mount at / in the mount table")
    root = roots[-1]
    if root.fstype != "overlay":
        raise BridgeError(f"the root filesystem is {root.fstype}, not overlayfs")
    upper = option(root, "upperdir")
    if upper:
        return upper
    raise BridgeError("the overlayfs root has no upperdir")


def upperdir_of(pid: int) -> str:
    """The overlay upperdir of the root mount of process `pid`."""
    try:
        with open(f"/proc/{int(pid)}/mountinfo", "rb") as f:
            data = f.read()
    except OSError as e:
        detail = e.strerror or str(e)
        if isinstance(e.filename, str):
            detail += f" ({e.filename!r})"
        raise BridgeError(f"cannot read the mount table of pid {pid}: {detail}") from e
    return parse_root_upperdir(data.decode("utf-8", "surrogateescape"))


def mounts_below(directory: str, text: str) -> list[str]:
    """The mount points at or below `directory` in the mountinfo `text`, deepest (and latest) first."""
    top = directory.rstrip("/")
    points = [m.point for m in parse(text) if m.point == top or m.point.startswith(top + "/")]
    return sorted(dict.fromkeys(reversed(points)), key=lambda p: p.count("/"), reverse=True)


def detach_below(directory: str) -> list[str]:
    """Detach (umount2 MNT_DETACH) every mount at or below `directory` in this mount namespace.

    A CRIU cut off mid-restore leaves its cgroup yard (`.criu.cgyard.*`, a
    tmpfs with a cgroup hierarchy on each controller) mounted in its work
    directory, and nothing below a mount point can be removed. Returns what
    could not be detached, each with the reason.
    """
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
            points = mounts_below(os.path.realpath(directory), fh.read())
    except OSError as exc:
        return [f"cannot read the mount table: {exc.strerror}"]
    if not points:
        return []
    libc = ctypes.CDLL(None, use_errno=True)
    failed = []
    for point in points:
        if libc.umount2(os.fsencode(point), MNT_DETACH) != 0:
            err = ctypes.get_errno()
            if err != errno.EINVAL:  #: no longer a mount point (an upper one took it along)
                failed.append(f"{point}: {os.strerror(err)}")
    return failed
