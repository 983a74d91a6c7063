"""A checkpoint's CRIU images held to the privileges of the container they are restored into.

CRIU restores credentials, capabilities, securebits, no_new_privs, the LSM
profile, seccomp, scheduling, rlimits, oom_score_adj, namespaces and mounts
from the images, running as root; runc passes the new container's config
only for what it sets up around them (its namespaces to join, the sources
of its bind mounts, cgroups). So whoever wrote the images decides what the
restored processes may do, unless the images are checked first. `findings`
names every grant the images (`criu_bridge.taskimages`) make beyond the
OCI config (`config.json`) that runc restores with; the restore wrapper
refuses the restore when there is any. The rule: the restored processes
may hold only what a process started from that config could hold, or could
have given itself with the privileges that config grants.

docs/security.md lists each image field and the rule that holds it.
Standard library only: the restore wrapper imports it.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable, Mapping
from typing import Any

from criu_bridge.taskimages import TASK_DEAD, TASK_HELPER, Images, Mount, Task, Thread

# Linux capability numbers (linux/capability.h).
CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID",
    "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE", "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
)
_CAP_NUMBER = {name: i for i, name in enumerate(CAPABILITIES)}
CAP_SETGID, CAP_SETUID, CAP_SYS_ADMIN, CAP_SYS_NICE = (1 << _CAP_NUMBER[n] for n in (
    "CAP_SETGID", "CAP_SETUID", "CAP_SYS_ADMIN", "CAP_SYS_NICE"))

# Securebits that take privilege away, and every lock bit (locking only
# restricts): a process may set them on itself. keep-caps (bit 4) and
# no-setuid-fixup (bit 2) let a process keep capabilities across a change of
# uid; the OCI config has no securebits, so a restore never sets those.
SECBITS_ALLOWED = (1 << 0) | (1 << 1) | (1 << 3) | (1 << 5) | (1 << 6) | (1 << 7)
SECBIT_NAMES = {0: "noroot", 1: "noroot-locked", 2: "no-setuid-fixup", 3: "no-setuid-fixup-locked",
                4: "keep-caps", 5: "keep-caps-locked", 6: "no-cap-ambient-raise", 7: "no-cap-ambient-raise-locked"}
SECCOMP_DISABLED = 0
SCHED_NORMAL, SCHED_BATCH, SCHED_IDLE = 0, 3, 5
RLIMIT_NAMES = ("RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_DATA", "RLIMIT_STACK", "RLIMIT_CORE", "RLIMIT_RSS",
                "RLIMIT_NPROC", "RLIMIT_NOFILE", "RLIMIT_MEMLOCK", "RLIMIT_AS", "RLIMIT_LOCKS", "RLIMIT_SIGPENDING",
                "RLIMIT_MSGQUEUE", "RLIMIT_NICE", "RLIMIT_RTPRIO", "RLIMIT_RTTIME")
RLIM_INFINITY = (1 << 64) - 1

# CRIU's fstype codes (mnt.proto) of the filesystems a container's config
# mounts itself: a fresh mount of one of these can be allowed. Every other
# type (a disk filesystem from a device, FUSE, overlay, debugfs, tracefs,
# securityfs, binfmt_misc, devtmpfs, ...) is never mounted by a restore.
FSTYPES = {1: "proc", 2: "sysfs", 5: "tmpfs", 6: "devpts", 12: "cgroup", 14: "mqueue", 23: "cgroup2"}
TMPFS = 5
FSTYPE_NAMES = {0: "an unsupported filesystem", 3: "devtmpfs", 4: "binfmt_misc", 7: "simfs", 8: "pstore",
                9: "securityfs", 10: "fusectl", 11: "debugfs", 13: "aufs", 15: "fuse", 16: "a filesystem by name",
                17: "overlay", 18: "autofs", 19: "tracefs", **FSTYPES}
MS_RDONLY = 1
MAX_FINDINGS = 12


def capability_mask(names: Iterable[Any]) -> int:
    """The bit mask of OCI capability names (unknown names have no bit here)."""
    mask = 0
    for name in names:
        n = _CAP_NUMBER.get(str(name).upper())
        if n is not None:
            mask |= 1 << n
    return mask


def capability_names(mask: int) -> str:
    out = []
    n = 0
    while mask >> n:
        if mask >> n & 1:
            out.append(CAPABILITIES[n] if n < len(CAPABILITIES) else f"capability {n}")
        n += 1
    return ", ".join(out)


def _m(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _l(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


class _Config:
    """What the OCI config grants, read once (the spec is runc's input: trusted, but read defensively)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        process = _m(spec.get("process"))
        linux = _m(spec.get("linux"))
        user = _m(process.get("user"))
        self.uid = _int(user.get("uid"))
        self.gid = _int(user.get("gid"))
        self.groups = {self.gid, *(_int(g, -1) for g in _l(user.get("additionalGids")))}
        caps = _m(process.get("capabilities"))
        self.caps = {k: capability_mask(_l(caps.get(k))) for k in
                     ("bounding", "effective", "permitted", "inheritable", "ambient")}
        self.bounding = self.caps["bounding"]
        self.permitted = self.caps["permitted"] & self.bounding
        self.no_new_privs = process.get("noNewPrivileges") is True
        self.lsm_profile = str(process.get("apparmorProfile") or process.get("selinuxLabel") or "")
        self.seccomp = bool(linux.get("seccomp"))
        self.oom_score_adj = process.get("oomScoreAdj") if isinstance(process.get("oomScoreAdj"), int) else None
        self.rlimits: dict[int, int] = {}
        for r in _l(process.get("rlimits")):
            name = str(_m(r).get("type", ""))
            if name in RLIMIT_NAMES:
                self.rlimits[RLIMIT_NAMES.index(name)] = _int(_m(r).get("hard"))
        self.namespaces = {str(_m(n).get("type", "")) for n in _l(linux.get("namespaces"))}
        self.uid_map = sorted((_int(_m(e).get("containerID")), _int(_m(e).get("hostID")), _int(_m(e).get("size")))
                              for e in _l(linux.get("uidMappings")))
        self.gid_map = sorted((_int(_m(e).get("containerID")), _int(_m(e).get("hostID")), _int(_m(e).get("size")))
                              for e in _l(linux.get("gidMappings")))
        self.mounts: dict[str, Mapping[str, Any]] = {}
        for m in _l(spec.get("mounts")):
            dest = _norm(str(_m(m).get("destination", "")))
            if dest:
                self.mounts[dest] = _m(m)
        self.masked = [_norm(str(p)) for p in _l(linux.get("maskedPaths")) if isinstance(p, str)]
        self.readonly = [_norm(str(p)) for p in _l(linux.get("readonlyPaths")) if isinstance(p, str)]

    def may_mount(self) -> bool:
        """The container could mount and unmount on its own (CAP_SYS_ADMIN)."""
        return bool(self.permitted & CAP_SYS_ADMIN)

    def _ro(self, dest: str) -> bool:
        m = self.mounts.get(dest)
        return m is not None and "ro" in [str(o) for o in _l(m.get("options"))]

    def _type(self, dest: str) -> str:
        return str(_m(self.mounts.get(dest)).get("type", ""))

    def wants_readonly(self, dest: str, kind: str = "") -> bool:
        """Must a mount at `dest` be read-only? `kind`: its filesystem type, "" for an external bind.

        A read-only cgroup mount is, on cgroup v1, a tmpfs holding one bind
        per controller: the binds must be read-only, the tmpfs need not.
        """
        if dest in self.readonly:
            return True
        if self._ro(dest):
            return not (self._type(dest) == "cgroup" and kind == "tmpfs")
        parent = posixpath.dirname(dest)
        return self._type(parent) == "cgroup" and self._ro(parent)


def _norm(path: str) -> str:
    if not path.startswith("/"):
        return ""
    return posixpath.normpath(path).replace("//", "/")


# ---- credentials --------------------------------------------------------------------


def _thread_findings(task: Task, thread: Thread, cfg: _Config) -> list[str]:
    where = task.name if thread.tid == task.pid else f"{task.name}, thread {thread.tid}"
    out: list[str] = []
    creds = thread.creds
    if creds is None:
        return [f"{where} has no credentials in its images (CRIU would leave it with its own, root's)"]
    by_extra: dict[int, list[str]] = {}
    for name, mask in creds.caps.items():
        extra = mask & ~cfg.bounding
        if extra:
            by_extra.setdefault(extra, []).append(name)
    for extra, sets in by_extra.items():
        named = sets[0] if len(sets) == 1 else ", ".join(sets[:-1]) + " and " + sets[-1]
        out.append(f"{where}: capabilities {capability_names(extra)} in its {named} set{'s' if len(sets) > 1 else ''} "
                   "are outside the container's bounding set")
    if any(u != cfg.uid for u in creds.uids) and not (cfg.uid == 0 and cfg.permitted & CAP_SETUID):
        out.append(f"{where}: uid {'/'.join(map(str, creds.uids))} (real/effective/saved/fs) is not the "
                   f"container's user {cfg.uid}" + ("" if cfg.uid else ", which lacks CAP_SETUID"))
    may_setgid = cfg.uid == 0 and cfg.permitted & CAP_SETGID
    if any(g != cfg.gid for g in creds.gids) and not may_setgid:
        out.append(f"{where}: gid {'/'.join(map(str, creds.gids))} (real/effective/saved/fs) is not the "
                   f"container's group {cfg.gid}")
    others = sorted(set(creds.groups) - cfg.groups)
    if others and not may_setgid:
        out.append(f"{where}: supplementary groups {', '.join(map(str, others))} are not the container's "
                   f"({', '.join(map(str, sorted(cfg.groups)))})")
    bad_bits = creds.secbits & ~SECBITS_ALLOWED
    if bad_bits:
        names = [SECBIT_NAMES.get(b, f"bit {b}") for b in range(32) if bad_bits >> b & 1]
        out.append(f"{where}: securebits {', '.join(names)}, which the container's config does not set")
    if cfg.no_new_privs and not creds.no_new_privs:
        out.append(f"{where}: no_new_privs is off, and the container's config sets it")
    if creds.apparmor_data:
        out.append(f"{where}: carries AppArmor policy for CRIU to load into the kernel")
    if cfg.lsm_profile and creds.lsm_profile != cfg.lsm_profile:
        out.append(f"{where}: LSM profile {creds.lsm_profile or '(none)'!r}, not the container's "
                   f"{cfg.lsm_profile!r}")
    if cfg.seccomp and thread.seccomp_mode == SECCOMP_DISABLED:
        out.append(f"{where}: seccomp is disabled, and the container's config has a seccomp profile")
    if not cfg.permitted & CAP_SYS_NICE:
        if thread.sched_policy not in (SCHED_NORMAL, SCHED_BATCH, SCHED_IDLE):
            out.append(f"{where}: real-time scheduling policy {thread.sched_policy} needs CAP_SYS_NICE, "
                       "which the container's config does not grant")
        elif thread.sched_nice < 0:
            out.append(f"{where}: nice value {thread.sched_nice} needs CAP_SYS_NICE, which the container's "
                       "config does not grant")
    return out


def _task_findings(task: Task, cfg: _Config) -> list[str]:
    out: list[str] = []
    for resource, (soft, hard) in enumerate(task.rlimits):
        limit = cfg.rlimits.get(resource)
        if limit is not None and (hard > limit or soft > limit) and limit != RLIM_INFINITY:
            out.append(f"{task.name}: {RLIMIT_NAMES[resource]} {soft}/{hard} (soft/hard) is above the "
                       f"container's limit {limit}")
    if cfg.oom_score_adj is not None and task.oom_score_adj is not None and task.oom_score_adj < cfg.oom_score_adj:
        out.append(f"{task.name}: oom_score_adj {task.oom_score_adj} is below the container's "
                   f"{cfg.oom_score_adj}")
    for thread in task.threads:
        out += _thread_findings(task, thread, cfg)
    return out


# ---- namespaces ------------------------------------------------------------------------


def _namespace_findings(images: Images, cfg: _Config) -> list[str]:
    out: list[str] = []
    roots = images.root_namespaces
    for task in images.tasks:
        ids = task.namespaces
        if ids is None:
            if task is images.root_task:
                out.append(f"{task.name} has no namespace ids (ids-{task.pid}.img)")
            continue  # CRIU puts such a task in its parent's namespaces
        for ns in sorted(cfg.namespaces):
            if ns not in ids or ns not in roots:
                out.append(f"{task.name}: its images name no {ns} namespace, and the container has one")
            elif ids[ns] == roots[ns]:
                out.append(f"{task.name}: its images put it in the {ns} namespace of the node (where CRIU "
                           "runs), not the container's")
        if "user" not in cfg.namespaces and "user" in ids and "user" in roots and ids["user"] != roots["user"]:
            out.append(f"{task.name}: its images give it a user namespace, and the container's config has none")
    if images.user_namespaces and "user" not in cfg.namespaces:
        out.append("the images hold user namespaces (userns-*.img), and the container's config has none")
    for ns_id, (uid_map, gid_map) in sorted(images.user_namespaces.items()):
        if "user" in cfg.namespaces and (sorted(uid_map) != cfg.uid_map or sorted(gid_map) != cfg.gid_map):
            out.append(f"user namespace {ns_id}: its uid/gid maps are not the container's")
    if images.apparmor_policy:
        out.append("the images hold AppArmor policy (apparmor.img) for CRIU to load into the kernel")
    return out


# ---- mounts ----------------------------------------------------------------------------


def _readonly(m: Mount) -> bool:
    return bool(m.flags & MS_RDONLY or m.sb_flags & MS_RDONLY)


def _where(m: Mount) -> str:
    return f"mount {m.mnt_id} at {m.mountpoint or '?'}"


def _in_place(m: Mount, mounts: tuple[Mount, ...], ids: set[int]) -> bool:
    """A bind of part of another mount onto that very part (runc's read-only paths, Podman's and CRI-O's
    alike): the same superblock as a mount `p` (the container's root, or one of the filesystems a config
    mounts), at p's mountpoint plus the part of p's tree it shows. The same content at the same place."""
    for p in mounts:
        if p.mnt_id == m.mnt_id or p.root_dev != m.root_dev or p.ext_key:
            continue
        if p.fstype not in FSTYPES and not (_norm(p.mountpoint) == "/" and p.parent not in ids):
            continue
        rel = posixpath.relpath(m.root or "/", p.root or "/")
        if rel == "." or rel == ".." or rel.startswith("../"):
            continue
        if _norm(posixpath.join(p.mountpoint, rel)) == _norm(m.mountpoint):
            return True
    return False


def _fresh_allowed(m: Mount, dest: str, cfg: _Config, mounts: tuple[Mount, ...], ids: set[int]) -> bool:
    """May CRIU make this (non-external) mount at `dest` for this container?

    What only takes access away needs no privilege: an empty read-only tmpfs
    (a masked directory), or a path made read-only in place.
    """
    if _readonly(m) and (m.fstype == TMPFS or _in_place(m, mounts, ids)):
        return True
    kind = FSTYPES.get(m.fstype)
    if kind is None:
        return False
    given = cfg.mounts.get(dest)
    if given is not None:
        want = str(given.get("type", ""))
        if want == kind or (want == "cgroup" and kind in ("cgroup", "cgroup2", "tmpfs")):
            return True
    parent = posixpath.dirname(dest)
    if kind == "cgroup" and str(_m(cfg.mounts.get(parent)).get("type", "")) == "cgroup":
        return True  # cgroup v1 with a cgroup namespace: one mount per controller under the cgroup mount
    if dest in cfg.masked and kind == "tmpfs":
        return True  # a masked directory (read-only, or found writable below)
    return cfg.may_mount()


def _mount_findings(images: Images, cfg: _Config, host_exists: Any) -> list[str]:
    out: list[str] = []
    root_ns = (images.root_task.namespaces or {}).get("mount")
    for ns_id, mounts in sorted(images.mount_namespaces.items()):
        ids = {m.mnt_id for m in mounts}
        at: dict[str, list[Mount]] = {}
        for m in mounts:
            dest = _norm(m.mountpoint)
            if not dest:
                out.append(f"{_where(m)}: not an absolute path")
                continue
            at.setdefault(dest, []).append(m)
            if dest == "/" and ns_id == root_ns and m.parent not in ids:
                continue  # the container's root: CRIU mounts runc's rootfs there, not this entry
            if m.ext_key:
                if m.ext_key.startswith("CRIU:"):
                    out.append(f"{_where(m)}: asks CRIU for an external mount of its own ({m.ext_key})")
                elif cfg.wants_readonly(_norm(m.ext_key)) and not _readonly(m):
                    out.append(f"{_where(m)}: the container's mount at {m.ext_key} is read-only, this one is not")
                continue  # otherwise runc maps the key to the source it gives, or CRIU fails
            if not _fresh_allowed(m, dest, cfg, mounts, ids):
                kind = FSTYPE_NAMES.get(m.fstype, f"filesystem type {m.fstype}")
                if m.fsname:
                    kind += f" {m.fsname!r}"
                out.append(f"{_where(m)}: {kind} from {m.source or '(none)'}, which the container's config "
                           "does not mount there")
            elif cfg.wants_readonly(dest, FSTYPES[m.fstype]) and not _readonly(m):
                out.append(f"{_where(m)}: the container's config mounts {dest} read-only, this mount is not")
        if cfg.may_mount() or ns_id != root_ns:
            continue
        for dest, found in sorted(at.items()):
            if len(found) > 1:
                out.append(f"{len(found)} mounts at {dest}: one would hide another (mounting needs "
                           "CAP_SYS_ADMIN, which the container's config does not grant)")
        out += _required(at, mounts, cfg, host_exists)
    return out


def _required(at: Mapping[str, list[Mount]], mounts: tuple[Mount, ...], cfg: _Config, host_exists: Any) -> list[str]:
    """The masked and read-only paths of the config must be there, on top of their parents."""
    out: list[str] = []
    by_id = {m.mnt_id: m for m in mounts}
    for dest, what in [(p, "masked") for p in cfg.masked] + [(p, "read-only") for p in cfg.readonly]:
        if not host_exists(dest):
            continue  # runc skips a path this node does not have
        found = at.get(dest, [])
        if not found:
            out.append(f"the container's config makes {dest} {what}, and the images have no mount there")
            continue
        m = found[-1]
        if not _readonly(m) and not (what == "masked" and m.ext_key == "/dev/null"):
            out.append(f"{_where(m)}: the container's config makes {dest} {what}, this mount is writable")
        parents = [p for p in at if p != dest and (p == "/" or dest.startswith(p.rstrip("/") + "/"))]
        nearest = max(parents, key=len) if parents else ""
        parent = by_id.get(m.parent)
        if parent is None or _norm(parent.mountpoint) != nearest:
            out.append(f"{_where(m)}: not mounted on the mount at {nearest or '/'}, so it would not cover "
                       f"{dest}")
    return out


def path_exists(rootfs: str) -> Any:
    """Whether a masked or read-only path exists in a container (runc skips those that do not).

    Paths under /proc and /sys are the node's own (the container's procfs
    and sysfs are this kernel's); the others are looked up in its rootfs.
    """
    def exists(dest: str) -> bool:
        if dest.startswith(("/proc/", "/sys/")):
            return os.path.lexists(dest)
        return os.path.lexists(os.path.join(rootfs, dest.lstrip("/")))

    return exists


def findings(images: Images, spec: Mapping[str, Any], *, exists: Any) -> list[str]:
    """Every grant in the images beyond what `spec` (the container's OCI config) gives; [] when none.

    `exists(path)`: whether a masked or read-only path exists for this
    container (`path_exists`).
    """
    cfg = _Config(spec)
    out: list[str] = []
    for task in images.tasks:
        if task.state in (TASK_DEAD, TASK_HELPER):
            continue  # a zombie or a restore helper: exits during the restore, runs nothing of its own
        out += _task_findings(task, cfg)
    out += _namespace_findings(images, cfg)
    out += _mount_findings(images, cfg, exists)
    if len(out) > MAX_FINDINGS:
        out = out[:MAX_FINDINGS] + [f"and {len(out) - MAX_FINDINGS} more"]
    return out
