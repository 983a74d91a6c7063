"""Errors shared by the whole agent, one class per gRPC status code.

Rule: every error the agent raises on purpose is an ``AgentError``; its
``code`` is the gRPC status name, so each edge (servicer, CLI) maps it in one
place. Nothing here imports gRPC.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base class of the agent's own errors."""

    code: str = "UNKNOWN"


class NotFound(AgentError):
    """The named object does not exist."""

    code = "NOT_FOUND"


class AlreadyExists(AgentError):
    """The object to create exists already."""

    code = "ALREADY_EXISTS"


class FailedPrecondition(AgentError):
    """The system is not in a state that allows the operation."""

    code = "FAILED_PRECONDITION"


class InvalidArgument(AgentError):
    """The caller passed a malformed or unsupported value."""

    code = "INVALID_ARGUMENT"


class DeadlineExceeded(AgentError):
    """The operation did not finish before its deadline."""

    code = "DEADLINE_EXCEEDED"


class Unavailable(AgentError):
    """A dependency is unreachable; retrying later may succeed."""

    code = "UNAVAILABLE"


class Internal(AgentError):
    """An invariant broke or an unexpected system error happened."""

    code = "INTERNAL"


class DataLoss(AgentError):
    """Stored data is missing or corrupt."""

    code = "DATA_LOSS"


class Aborted(AgentError):
    """A conflicting operation is in progress on the same object."""

    code = "ABORTED"


class Cancelled(AgentError):
    """The operation was cancelled by its caller."""

    code = "CANCELLED"


class ResourceExhausted(AgentError):
    """A resource (disk space, a quota) ran out."""

    code = "RESOURCE_EXHAUSTED"


class PermissionDenied(AgentError):
    """The caller is known but not allowed to do this."""

    code = "PERMISSION_DENIED"


class Unauthenticated(AgentError):
    """Credentials are missing or were rejected."""

    code = "UNAUTHENTICATED"


BY_CODE: dict[str, type[AgentError]] = {
    cls.code: cls
    for cls in (
        Aborted,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        InvalidArgument,
        DeadlineExceeded,
        Unavailable,
        Internal,
        DataLoss,
        Cancelled,
        ResourceExhausted,
        PermissionDenied,
        Unauthenticated,
    )
}
"""Error class for each gRPC status name."""
