"""Exceptions raised by criu_bridge (no gRPC or other heavy imports)."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable


class BridgeError(Exception):
    """Base class of every error raised by criu_bridge."""


class InvalidInput(BridgeError):
    """Hostile or malformed input: an archive member, a path list, an option."""


class LimitExceeded(InvalidInput):
    """A size or count bound was hit."""


class RuntimeFailure(BridgeError):
    """A runc or CRIU command failed.

    `phase` names the step ("dump", "restore", "runc create", ...), `decisive`
    holds the log lines that explain the failure, `log_path` the full log.
    """

    def __init__(
        self,
        phase: str,
        message: str = "",
        *,
        decisive: Iterable[str] = (),
        log_path: str | None = None,
    ) -> None:
        super().__init__(phase, message)
        self.phase = phase
        self.message = message
        self.decisive: list[str] = list(decisive)
        self.log_path = log_path

    def __str__(self) -> str:
        text = f"{self.phase} failed"
        if self.message:
            text += f": {self.message}"
        if self.decisive:
            text += ": " + "; ".join(f'"{line}"' for line in self.decisive)
        if self.log_path:
            text += f" (log: {self.log_path})"
        return text

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_runtime_failure,
            (type(self), self.phase, self.message, self.decisive, self.log_path),
        )


def _rebuild_runtime_failure(
    cls: type[RuntimeFailure],
    phase: str,
    message: str,
    decisive: list[str],
    log_path: str | None,
) -> RuntimeFailure:
    """Unpickle a RuntimeFailure (or subclass) with its keyword-only fields."""
    return cls(phase, message, decisive=decisive, log_path=log_path)
