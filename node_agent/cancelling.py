"""Ending a task from another one: cancel it, wait until it has ended, and stay cancellable.

Rule: the task's own CancelledError is expected and swallowed; the caller's is not. When the
caller is itself being cancelled while it waits, that cancellation goes on up.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait for it to end (its other exceptions are raised here)."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if me is not None and me.cancelling():
            raise  # the caller is being cancelled, not just the task it ended
