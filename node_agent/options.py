"""The one parser of boolean options and annotations.

Every option a caller passes (`--option K=V`, the API's and CRI's `options`
maps) and every annotation the agent reads is a string; a boolean one is
exactly `true` or `false`. Anything else, an empty value included, is
INVALID_ARGUMENT: an option that silently reads as "yes" (or "no") is a
hole, not a convenience.
"""

from __future__ import annotations

from node_agent import errors


def boolean(value: object, what: str) -> bool:
    """`true` or `false`, nothing else; `what` names the option or annotation in the error."""
    if value == "true":
        return True
    if value == "false":
        return False
    raise errors.InvalidArgument(f"{what}: expected true or false, got {value!r}")
