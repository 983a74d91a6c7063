"""Ending a task from another one: cancel it, wait until it has ended, and stay cancellable.

Rule: the task's own CancelledError is expected and swallowed; the caller's is not. When the
caller is itself being cancelled while it waits, that cancellation goes on up. Work in a thread,
which cannot be stopped, is waited for to its end before a cancellation goes on
(`thread_to_the_end`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait for it to end (its other exceptions are raised here)."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if me is not None and me.cancelling():
            raise  # the caller is being cancelled, not just the task it ended


async def thread_to_the_end(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a thread; a caller cancelled meanwhile waits for it to end before the
    cancellation goes on (a thread cannot be stopped: whatever cleans up after it must come after it)."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await asyncio.shield(task)
        raise
