"""CRIU images written field by field as CRIU writes them, for the unit tests of what they grant.

The layout is a genuine one: a two-process container of the test bed, dumped
by CRIU 4.2 (`Checkpoint`), and the OCI config containerd gave it (`spec`).
Tests change a field and read the images back with criu_bridge.taskimages.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

from criu_bridge import criuimg, privileges, taskimages

DEFAULT_CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
                "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT",
                "CAP_KILL", "CAP_AUDIT_WRITE"]
DEFAULT_MASK = privileges.capability_mask(DEFAULT_CAPS)
ROOT_IDS = {"pid": 1, "network": 2, "ipc": 3, "uts": 4, "mount": 6, "user": 7, "cgroup": 8, "time": 5}
TASK_IDS = {"pid": 9, "network": 10, "ipc": 11, "uts": 12, "mount": 13, "user": 7, "cgroup": 8, "time": 5}
MS_RO, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_RELATIME = 1, 2, 4, 8, 1 << 21


def v(number: int, value: int) -> bytes:
    return criuimg.encode_varint(number << 3) + criuimg.encode_varint(value)


def b(number: int, payload: bytes | str) -> bytes:
    raw = payload.encode() if isinstance(payload, str) else payload
    return criuimg.encode_varint(number << 3 | 2) + criuimg.encode_varint(len(raw)) + raw


def image(magic: int, *entries: bytes) -> bytes:
    return struct.pack("<II", criuimg.IMG_COMMON_MAGIC, magic) + b"".join(criuimg.entry_bytes(e) for e in entries)


def caps_words(mask: int) -> list[int]:
    return [mask & 0xFFFFFFFF, mask >> 32]


def creds(uid: int = 0, gid: int = 0, groups: tuple[int, ...] = (0,), caps: int = DEFAULT_MASK,
          bounding: int | None = None, inheritable: int = 0, ambient: int = 0, secbits: int = 0,
          nnp: bool = False, lsm: str = "", apparmor_data: bool = False) -> bytes:
    out = b"".join(v(n, x) for n, x in ((1, uid), (2, gid), (3, uid), (4, gid), (5, uid), (6, gid), (7, uid), (8, gid)))
    for number, mask in ((9, inheritable), (10, caps), (11, caps), (12, caps if bounding is None else bounding),
                         (19, ambient)):
        out += b"".join(v(number, w) for w in caps_words(mask))
    out += v(13, secbits) + b"".join(v(14, g) for g in groups)
    if lsm:
        out += b(15, lsm)
    if apparmor_data:
        out += b(17, b"policy")
    if nnp:
        out += v(18, 1)
    return out


def ids(values: dict[str, int]) -> bytes:
    out = v(1, 2) + v(2, 2) + v(3, 2) + v(4, 2)
    return out + b"".join(v(taskimages.NAMESPACE_FIELDS[k], x) for k, x in values.items())


def core(pid: int, *, comm: str = "server", state: int = taskimages.TASK_ALIVE, thread: bytes | None = None,
         seccomp: int | None = None, old_seccomp: int | None = None, task_extra: bytes = b"",
         thread_extra: bytes = b"", main: bool = True) -> bytes:
    th = v(1, 0) + v(2, 0) + (b(10, thread) if thread is not None else b"") + thread_extra
    if seccomp is not None:
        th += v(11, seccomp)
    out = v(1, 1)
    if main:
        tc = v(1, state) + v(2, 0) + v(3, 0) + v(4, 0) + v(5, 0) + b(6, comm) + task_extra
        if old_seccomp is not None:
            tc += v(11, old_seccomp)
        out += b(3, tc)
    return image(criuimg.CORE_MAGIC, out + b(5, th))


def mount(mnt_id: int, parent: int, fstype: int, mountpoint: str, *, root: str = "/", source: str = "none",
          flags: int = MS_RELATIME, ext_key: str = "", root_dev: int = 0, fsname: str = "") -> bytes:
    out = (v(1, fstype) + v(2, mnt_id) + v(3, root_dev or mnt_id + 1000) + v(4, parent) + v(5, flags)
           + b(6, root) + b(7, mountpoint) + b(8, source) + b(9, "") + v(17, 0))
    if ext_key:
        out += b(18, ext_key)
    if fsname:
        out += b(14, fsname)
    return out


GENUINE_MOUNTS = [
    mount(100, 66, 17, "/", source="overlay"),
    mount(102, 100, 1, "/proc", source="proc", flags=MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RELATIME),
    mount(103, 100, 5, "/dev", source="tmpfs", flags=MS_NOSUID),
    mount(104, 103, 6, "/dev/pts", source="devpts", flags=MS_NOSUID | MS_NOEXEC),
    mount(105, 103, 14, "/dev/mqueue", source="mqueue", flags=MS_NOSUID | MS_NODEV | MS_NOEXEC),
    mount(106, 100, 2, "/sys", source="sysfs", flags=MS_RO | MS_NOSUID | MS_NODEV | MS_NOEXEC),
    mount(107, 106, 5, "/sys/fs/cgroup", source="tmpfs", flags=MS_NOSUID | MS_NODEV | MS_NOEXEC),
    mount(108, 107, 12, "/sys/fs/cgroup/memory", source="cgroup", flags=MS_RO | MS_NOSUID, root="/pod/c1",
          ext_key="/sys/fs/cgroup/memory"),
    mount(118, 100, 0, "/etc/hosts", source="/dev/vda", root="/var/lib/sandboxes/x/hosts", ext_key="/etc/hosts"),
    mount(120, 103, 5, "/dev/shm", source="shm", ext_key="/dev/shm"),
    mount(121, 100, 0, "/data", source="/dev/vda", root="/var/lib/kubelet/pods/u/volumes/data", ext_key="/data",
          flags=MS_RO | MS_RELATIME),
]


def spec(**changes: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "process": {"user": {"uid": 0, "gid": 0, "additionalGids": [0]},
                    "capabilities": {k: list(DEFAULT_CAPS) for k in ("bounding", "effective", "permitted")}},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["nosuid", "ro"]},
            {"destination": "/etc/hosts", "type": "bind", "source": "/var/lib/sandboxes/y/hosts",
             "options": ["rbind", "rw"]},
            {"destination": "/dev/shm", "type": "bind", "source": "/run/sandboxes/y/shm", "options": ["rbind", "rw"]},
            {"destination": "/data", "type": "bind", "source": "/var/lib/kubelet/pods/v/volumes/data",
             "options": ["rbind", "ro"]},
        ],
        "linux": {"namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network")]},
    }
    for key, value in changes.items():
        section, _, name = key.partition("__")
        target = s[section] if section in ("process", "linux") else s
        target[name or section] = value
    return s


class Checkpoint:
    """A dumped container's images, written into a directory, changeable before they are read."""

    def __init__(self, root: Path) -> None:
        self.dir = root
        self.files: dict[str, bytes] = {}
        self.tasks: list[tuple[int, list[int]]] = [(7, [7]), (23, [23])]
        for pid in (7, 23):
            self.files[f"core-{pid}.img"] = core(pid, comm="sh" if pid == 7 else "sleep", thread=creds())
            self.files[f"ids-{pid}.img"] = image(criuimg.IDS_MAGIC, ids(TASK_IDS))
        self.root_ids = dict(ROOT_IDS)
        self.mounts = list(GENUINE_MOUNTS)

    def read(self) -> taskimages.Images:
        self.write()
        return taskimages.read(str(self.dir))

    def write(self) -> None:
        """The images, as files in `dir` (and nothing else there)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(self.dir):
            os.unlink(self.dir / name)
        entries = [v(1, pid) + v(2, 0 if i == 0 else self.tasks[0][0]) + v(3, 7) + v(4, 7)
                   + b"".join(v(5, t) for t in threads) for i, (pid, threads) in enumerate(self.tasks)]
        files = dict(self.files)
        files["pstree.img"] = image(taskimages.PSTREE_MAGIC, *entries)
        inventory = v(1, 2) + v(2, 1) + b(3, ids(self.root_ids)) + v(4, 1)
        files["inventory.img"] = struct.pack("<I", taskimages.INVENTORY_MAGIC) + criuimg.entry_bytes(inventory)
        files.setdefault(f"mountpoints-{TASK_IDS['mount']}.img", image(taskimages.MNTS_MAGIC, *self.mounts))
        for name, data in files.items():
            (self.dir / name).write_bytes(data)

    def findings(self, config: dict[str, Any] | None = None, exists: Any = lambda _p: True) -> list[str]:
        return privileges.findings(self.read(), config or spec(), exists=exists)
