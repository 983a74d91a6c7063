"""Turns per pod: one operation at a time on a pod, the rest wait in line.

A bounded FIFO per key (a pod sandbox ID). Waiting happens inside the
caller's deadline; a full line is refused at once with RESOURCE_EXHAUSTED.
No I/O here.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import AsyncIterator

from node_agent import errors


@dataclass
class _Line:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: int = 0


class Turns:
    def __init__(self, max_waiting: int = 8) -> None:
        self.max_waiting = max_waiting
        self._lines: dict[str, _Line] = {}

    def busy(self, key: str) -> bool:
        line = self._lines.get(key)
        return line is not None and line.lock.locked()

    @contextlib.asynccontextmanager
    async def turn(self, key: str, what: str) -> AsyncIterator[None]:
        line = self._lines.setdefault(key, _Line())
        if line.lock.locked() and line.waiting >= self.max_waiting:
            raise errors.ResourceExhausted(f"{what}: {line.waiting} operations already wait for this pod")
        line.waiting += 1
        try:
            await line.lock.acquire()
        finally:
            line.waiting -= 1
            if not line.lock.locked() and line.waiting == 0:
                self._lines.pop(key, None)
        try:
            yield
        finally:
            line.lock.release()
            if line.waiting == 0:
                self._lines.pop(key, None)
