"""Strict JSON for hostile documents: UTF-8, no duplicate keys, no NaN or Infinity, bounded nesting.

One parser for every document that comes from outside (checkpoint
manifests and configs, registry manifests, archive members); each caller
bounds the size first and turns `StrictJsonError` into its own error class.
"""

from __future__ import annotations

import json
from typing import Any


class StrictJsonError(ValueError):
    """Why the bytes are not acceptable JSON, worded to follow the document's name."""


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:64]!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


MAX_DEPTH = 64  # far beyond any document the agent reads (a CRI config nests about 8 deep)


def _depth_ok(doc: Any, limit: int) -> bool:
    """Whether no object or array in `doc` lies deeper than `limit` (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            return False
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return True


def loads(data: bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """The document in ``data``; StrictJsonError ("is not UTF-8: ...", "is nested too deeply",
    "is not valid JSON: ...") otherwise. Objects and arrays may nest `max_depth` deep."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StrictJsonError(f"is not UTF-8: {exc}") from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant)
    except RecursionError:
        raise StrictJsonError("is nested too deeply") from None
    except ValueError as exc:
        raise StrictJsonError(f"is not valid JSON: {str(exc)[:200]}") from None
    if not _depth_ok(doc, max_depth):
        raise StrictJsonError(f"is nested more than {max_depth} deep")
    return doc
