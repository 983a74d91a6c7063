"""What a checkpoint's CRIU images say its processes are: credentials, seccomp, namespaces, mounts.

CRIU restores each task's credentials, capabilities, securebits,
no_new_privs, LSM profile, seccomp mode, scheduling, rlimits and
oom_score_adj from these images, and rebuilds its namespaces and mount
trees from them; runc, which runs CRIU as root, overrides none of it. The
images come out of checkpoints, so they are hostile input: `read` gathers,
strictly and within bounds, exactly what CRIU would read for those
decisions, the way CRIU reads it (`criu_bridge.criuimg.Message`), and
`criu_bridge.privileges` holds it to the container's OCI config.

Where CRIU reads it:
- ``pstree.img``: the tasks and their threads (pstree_entry);
- ``core-<tid>.img``: per thread, ``thread_core`` (creds, seccomp mode,
  scheduling) and, for the task, ``tc`` (state, comm, rlimits,
  oom_score_adj, the older per-task seccomp mode); a task whose main thread
  has no creds takes them from ``creds-<pid>.img``, the oldest layout;
- ``ids-<pid>.img``: the task's namespace ids; ``inventory.img``'s
  ``root_ids`` are the namespaces of the CRIU that dumped it, which CRIU
  restores as its own: a task in one of those shares the restoring CRIU's
  namespace, the host's;
- ``mountpoints-<id>.img``: each mount namespace's mounts;
- ``userns-<id>.img``: a user namespace's maps; ``apparmor.img``: AppArmor
  policy that CRIU would load into the kernel.

Standard library only: the restore wrapper imports it on every restore's path,
so its records are named tuples (the dataclasses module imports `inspect`: some
10 ms of the wrapper's start with the classes it makes).
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from criu_bridge import criuimg as img
from criu_bridge.errors import InvalidInput, LimitExceeded

INVENTORY_MAGIC = 0x58313116
PSTREE_MAGIC = 0x50273030
CREDS_MAGIC = 0x54023547
MNTS_MAGIC = 0x55563928
USERNS_MAGIC = 0x55474906

# task_core_entry.task_state (CRIU's task-state.h)
TASK_ALIVE, TASK_DEAD, TASK_STOPPED, TASK_HELPER, TASK_THREAD = 1, 2, 3, 4, 5
# task_kobj_ids_entry: namespace -> field number (the OCI config's names)
NAMESPACE_FIELDS = {"pid": 5, "network": 6, "ipc": 7, "uts": 8, "mount": 9, "user": 10, "cgroup": 11, "time": 12}
MAX_TASKS = 1 << 16
_NUMBERED = re.compile(r"^(core|ids|creds|mountpoints|userns)-([0-9]{1,10})\.img$")


class Creds(NamedTuple):
    uids: tuple[int, int, int, int]  # real, effective, saved, filesystem
    gids: tuple[int, int, int, int]
    groups: tuple[int, ...]
    caps: dict[str, int]  # set name -> bit mask: inheritable, permitted, effective, bounding, ambient
    secbits: int
    no_new_privs: bool
    lsm_profile: str  # "" when none
    apparmor_data: bool  # AppArmor policy carried in the creds (CRIU would load it)


class Thread(NamedTuple):
    tid: int
    creds: Creds | None  # None: no creds in its core (the task's creds image may stand in)
    seccomp_mode: int  # 0 disabled, 1 strict, 2 filter
    sched_policy: int
    sched_nice: int
    sched_prio: int


class Task(NamedTuple):
    pid: int
    comm: str
    state: int
    threads: tuple[Thread, ...]
    namespaces: dict[str, int] | None  # OCI name -> namespace id; None: no ids image
    rlimits: tuple[tuple[int, int], ...]  # (soft, hard) by resource number
    oom_score_adj: int | None

    @property
    def name(self) -> str:
        return f"task {self.pid} ({self.comm})" if self.comm else f"task {self.pid}"


class Mount(NamedTuple):
    mnt_id: int
    parent: int
    fstype: int  # CRIU's fstype enum (mnt.proto)
    fsname: str
    root_dev: int
    root: str
    mountpoint: str
    source: str
    flags: int
    sb_flags: int
    ext_key: str  # "" unless an external mount (runc maps the key to the source it gives)


class Images(NamedTuple):
    tasks: tuple[Task, ...]
    root_namespaces: dict[str, int]  # the dumping CRIU's own namespaces (inventory root_ids)
    mount_namespaces: dict[int, tuple[Mount, ...]]  # namespace id -> its mounts
    user_namespaces: dict[int, tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int, int], ...]]]
    apparmor_policy: bool
    files: frozenset[str] = frozenset()

    @property
    def root_task(self) -> Task:
        return self.tasks[0]


def _one(directory: str, name: str, magic: int, *, service: bool = False) -> img.Message | None:
    """The first entry of an image CRIU reads one entry of; None when the file is absent or empty."""
    data = img.read_image(directory, name)
    if data is None:
        return None
    found = img.read_messages(data, name, magic, first_only=True, service=service)
    return found[0] if found else None


def _namespace_ids(ids: img.Message) -> dict[str, int]:
    out = {}
    for ns, number in NAMESPACE_FIELDS.items():
        value = ids.uint32(number)
        if value is not None:
            out[ns] = value
    return out


def _creds(msg: img.Message) -> Creds:
    def mask(number: int) -> int:
        bits = 0
        for i, word in enumerate(msg.uint32s(number)[:64]):
            bits |= word << (32 * i)
        return bits

    def u(number: int) -> int:
        value = msg.uint32(number)
        if value is None:
            raise InvalidInput(f"{msg.what}: credentials lack field {number}")
        return value

    return Creds(
        uids=(u(1), u(3), u(5), u(7)),
        gids=(u(2), u(4), u(6), u(8)),
        groups=tuple(msg.uint32s(14)),
        caps={"inheritable": mask(9), "permitted": mask(10), "effective": mask(11), "bounding": mask(12),
              "ambient": mask(19)},
        secbits=u(13),
        no_new_privs=bool(msg.uint32(18) or 0),
        lsm_profile=msg.text(15) or "",
        apparmor_data=msg.has(17),
    )


def _thread(tid: int, core: img.Message, main: bool) -> tuple[Thread, img.Message | None]:
    tc = core.message(3) if main else None  # task_core_entry: CRIU reads the main thread's
    th = core.message(5)  # thread_core_entry
    creds = th.message(10) if th is not None else None
    mode = th.uint32(11) if th is not None else None
    if tc is not None and tc.has(11):
        mode = tc.uint32(11)  # the older per-task place: CRIU moves it over the main thread's own
    return Thread(
        tid=tid,
        creds=_creds(creds) if creds is not None else None,
        seccomp_mode=mode or 0,
        sched_policy=(th.uint32(4) if th is not None else None) or 0,
        sched_nice=(th.sint32(3) if th is not None else None) or 0,
        sched_prio=(th.uint32(5) if th is not None else None) or 0,
    ), tc


def _task(directory: str, entry: img.Message) -> Task:
    pid = entry.uint32(1)
    if pid is None:
        raise InvalidInput("pstree.img: an entry without a pid")
    tids = entry.uint32s(5) or [pid]
    threads = []
    tc: img.Message | None = None
    for tid in tids:
        core = _one(directory, f"core-{tid}.img", img.CORE_MAGIC)
        if core is None:
            raise InvalidInput(f"task {pid}: no core image for thread {tid}")
        thread, task_core = _thread(tid, core, tid == pid)
        if tid == pid:
            tc = task_core
        threads.append(thread)
    if tc is None:
        raise InvalidInput(f"task {pid}: its core image has no task state")
    if threads and threads[0].tid == pid and threads[0].creds is None:
        old = _one(directory, f"creds-{pid}.img", CREDS_MAGIC)
        if old is not None:
            threads[0] = Thread(pid, _creds(old), threads[0].seccomp_mode, threads[0].sched_policy,
                                threads[0].sched_nice, threads[0].sched_prio)
    ids = _one(directory, f"ids-{pid}.img", img.IDS_MAGIC)
    rl = tc.message(8)
    rlimits = tuple((r.uint64(1) or 0, r.uint64(2) or 0) for r in rl.messages(1)) if rl is not None else ()
    return Task(
        pid=pid,
        comm=(tc.text(6) or "")[:64],
        state=tc.uint32(1) or 0,
        threads=tuple(threads),
        namespaces=_namespace_ids(ids) if ids is not None else None,
        rlimits=rlimits,
        oom_score_adj=tc.int32(14),
    )


def _mount(msg: img.Message) -> Mount:
    ext_key = msg.text(18) or ""
    root = msg.text(6) or ""
    if msg.boolean(13) and not ext_key:
        ext_key = root  # the older layout kept an external mount's key in `root`
    return Mount(
        mnt_id=msg.uint32(2) or 0,
        parent=msg.uint32(4) or 0,
        fstype=msg.uint32(1) or 0,
        fsname=msg.text(14) or "",
        root_dev=msg.uint32(3) or 0,
        root=root,
        mountpoint=msg.text(7) or "",
        source=msg.text(8) or "",
        flags=msg.uint32(5) or 0,
        sb_flags=msg.uint32(17) or 0,
        ext_key=ext_key,
    )


def _extents(msg: img.Message, number: int) -> tuple[tuple[int, int, int], ...]:
    return tuple((e.uint32(1) or 0, e.uint32(2) or 0, e.uint32(3) or 0) for e in msg.messages(number))


def highest_pid(pstree: bytes) -> int:
    """The highest PID a restore of these images takes in its PID namespace (`pstree.img`'s bytes).

    Every task's PID and threads, and the process groups and sessions CRIU
    recreates with them (pstree_entry: pid 1, pgid 3, sid 4, threads 5).
    """
    entries = img.read_messages(pstree, "pstree.img", PSTREE_MAGIC)
    if len(entries) > MAX_TASKS:
        raise LimitExceeded(f"pstree.img lists more than {MAX_TASKS} tasks")
    top = 0
    for e in entries:
        top = max(top, e.uint32(1) or 0, e.uint32(3) or 0, e.uint32(4) or 0, *e.uint32s(5))
    return top


def read(directory: str) -> Images:
    """Everything in the images that decides what the restored processes may do."""
    pstree = img.read_image(directory, "pstree.img")
    if pstree is None:
        raise InvalidInput("no pstree.img")
    entries = img.read_messages(pstree, "pstree.img", PSTREE_MAGIC)
    if not entries:
        raise InvalidInput("pstree.img lists no task")
    if len(entries) > MAX_TASKS:
        raise LimitExceeded(f"pstree.img lists more than {MAX_TASKS} tasks")
    tasks = tuple(_task(directory, e) for e in entries)
    inventory = _one(directory, "inventory.img", INVENTORY_MAGIC, service=True)
    root_ids = inventory.message(3) if inventory is not None else None
    if root_ids is None:
        raise InvalidInput("inventory.img has no root namespace ids")
    names = os.listdir(directory)
    mounts: dict[int, tuple[Mount, ...]] = {}
    users = {}
    for name in names:
        m = _NUMBERED.match(name)
        if m is None:
            continue
        kind, number = m.group(1), int(m.group(2))
        if kind == "mountpoints":
            data = img.read_image(directory, name) or b""
            mounts[number] = tuple(_mount(e) for e in img.read_messages(data, name, MNTS_MAGIC))
        elif kind == "userns":
            ns = _one(directory, name, USERNS_MAGIC)
            users[number] = (_extents(ns, 1), _extents(ns, 2)) if ns is not None else ((), ())
    return Images(
        tasks=tasks,
        root_namespaces=_namespace_ids(root_ids),
        mount_namespaces=mounts,
        user_namespaces=users,
        apparmor_policy="apparmor.img" in names,
        files=frozenset(names),
    )
