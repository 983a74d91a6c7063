"""Room for a checkpoint on the store's filesystem: asked for before the freeze, and a disk that fills anyway.

Rule: before anything is frozen or written, a checkpoint asks for the memory
its containers' cgroups hold (``memory.current`` on cgroup v2,
``memory.usage_in_bytes`` on v1: about what CRIU writes) plus
``min-free-bytes``, free on the filesystem of the store it is published into
and, when that is another one, of the agent's own store (the scratch space
CRIU dumps into). Less is RESOURCE_EXHAUSTED and the pod is never paused.
The estimate can be wrong, and the disk can fill meanwhile: a failure that a
full disk caused anywhere (CRIU's dump, the ingest into the store, a log) is
RESOURCE_EXHAUSTED too, naming the store, the space free then, the room
asked for and what failed (CRIU's decisive lines, when CRIU failed), never
the OSError that happened to come last.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from criu_bridge import freezer
from criu_bridge.errors import BridgeError, RuntimeFailure
from criu_bridge.freezer import Freezer
from node_agent.errors import AgentError, ResourceExhausted

log = logging.getLogger(__name__)

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How CRIU, runc and the kernel say it in text (CRIU's log lines, runc's messages).
FULL_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), "ENOSPC", "EDQUOT")


class Space(Protocol):
    """A store, as far as room goes."""

    @property
    def root(self) -> str: ...

    def free_bytes(self) -> int: ...


@dataclass(frozen=True)
class Room:
    """What one checkpoint asked for, and where (the first store is the one it is published into)."""

    stores: tuple[Space, ...]
    memory: int  # bytes its containers' cgroups held
    min_free: int

    @property
    def needed(self) -> int:
        return self.memory + self.min_free

    def asked(self) -> str:
        return (f"{_size(self.needed)} needed: the {_size(self.memory)} of memory its containers' cgroups use, "
                f"plus min-free-bytes ({_size(self.min_free)})")


def _size(n: int) -> str:
    return f"{n} bytes ({n / (1 << 20):.1f} MiB)"


def pod_memory(freezers: Sequence[Freezer]) -> int:
    """Bytes of memory the containers' cgroups hold (a cgroup that cannot be read counts 0)."""
    total = 0
    for fz in freezers:
        used = freezer.memory_usage(fz)
        if used is None:
            log.debug("cannot read the memory usage of cgroup %s; counted as 0", fz.path)
        total += used or 0
    return total


def _distinct(stores: Sequence[Space]) -> tuple[Space, ...]:
    """The stores, one per filesystem, in order."""
    seen: set[int] = set()
    out: list[Space] = []
    for store in stores:
        try:
            dev = os.stat(store.root).st_dev
        except OSError:
            dev = -len(out) - 1
        if dev not in seen:
            seen.add(dev)
            out.append(store)
    return tuple(out)


def require(pod: str, freezers: Sequence[Freezer], stores: Sequence[Space], min_free: int) -> Room:
    """The room the checkpoint of ``pod`` asks for; ResourceExhausted, before the freeze, when a store lacks it."""
    room = Room(_distinct(stores), pod_memory(freezers), min_free)
    for store in room.stores:
        free = store.free_bytes()
        if free < room.needed:
            raise ResourceExhausted(
                f"checkpoint of pod {pod}: not enough free space in store {store.root}: {_size(free)} free, "
                f"{room.asked()}; the pod was not paused and nothing was written"
            )
    return room


def disk_full(exc: BaseException, *, low: bool = False) -> bool:
    """Whether a full disk caused ``exc``: an ENOSPC or EDQUOT in its chain, or said in its text.

    ``low``: the store's filesystem has less than ``min-free-bytes`` free
    now, so a failed runc or CRIU run (whose own log the full disk may have
    cut short) counts as caused by it too.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in FULL_ERRNOS:
            return True
        if isinstance(cur, (OSError, AgentError, BridgeError)) and any(t in str(cur) for t in FULL_TEXTS):
            return True
        if low and isinstance(cur, RuntimeFailure):
            return True
        todo += [cur.__cause__, cur.__context__]
    return False


def exhausted(exc: BaseException, pod: str, phase: str, room: Room) -> ResourceExhausted | None:
    """The error a checkpoint of ``pod`` that failed with ``exc`` during ``phase`` reports; None if no disk filled."""
    if not isinstance(exc, Exception):  # cancelled: the deadline's own message says it
        return None
    frees: list[tuple[Space, int]] = []
    for store in room.stores:
        try:
            frees.append((store, store.free_bytes()))
        except AgentError:
            continue
    if not disk_full(exc, low=any(free < room.min_free for _, free in frees)):
        return None
    store, free = min(frees, key=lambda sf: sf[1]) if frees else (room.stores[0], -1)
    what = str(exc) if isinstance(exc, (AgentError, BridgeError)) else f"{type(exc).__name__}: {exc}"
    what = what.removeprefix(f"checkpoint of pod {pod}, ").removeprefix(f"checkpoint of pod {pod}: ")
    return ResourceExhausted(
        f"checkpoint of pod {pod}: store {store.root} ran out of space during {phase} "
        f"({_size(free) if free >= 0 else 'unknown'} free now; {room.asked()}): {what}; "
        "the pod runs on and nothing was kept"
    )
