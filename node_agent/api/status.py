"""Where the agent's errors become gRPC statuses, and how long an operation may take of its call's time.

Rule: `abort_with` is the one place an agent error becomes a status; anything
else is INTERNAL, logged with its traceback.
"""

from __future__ import annotations

import logging

import grpc

from node_agent import errors

log = logging.getLogger(__name__)

_STATUS = {name: getattr(grpc.StatusCode, name) for name in errors.BY_CODE}


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """The one place agent errors become gRPC statuses."""
    if isinstance(exc, errors.AgentError):
        await context.abort(_STATUS.get(exc.code, grpc.StatusCode.UNKNOWN), str(exc))
    log.exception("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")


def operation_timeout(context: grpc.aio.ServicerContext) -> float | None:
    """The operation's own deadline: a little before the caller's.

    The operation then gives up first, and its cleanup begins (a frozen pod
    is thawed at once) before the caller sees DEADLINE_EXCEEDED on its side.
    """
    left = context.time_remaining()
    if left is None:
        return None
    # A quarter of the call's time, at least 50 ms and at most a second, is
    # left for the cleanup to start (a thaw can take tens of milliseconds).
    return float(max(left - min(max(left * 0.25, 0.05), 1.0), 0.0))
