"""msgspec's complaints about a config document, in the agent's words.

`refusal` turns a `msgspec.ValidationError` message into an InvalidArgument
that names the failing key (`devices.raise-polls`), what the key takes and
what it got, walking the settings' Struct types along the path msgspec
reports. No I/O; `node_agent.config` is its one caller.
"""

from __future__ import annotations

import re
from typing import Any, Literal, get_args, get_origin

import msgspec
from msgspec import Struct

from node_agent.errors import InvalidArgument

_AT = re.compile(r"(.*) - at `\$((?:\.[^.\[`]+|\[\d+\])*)`", re.S)
_STEP = re.compile(r"\.([^.\[`]+)|\[(\d+)\]")
_UNKNOWN = re.compile(r"Object contains unknown field `(.*)`", re.S)


def refusal(message: str, data: Any, kind: type, within: str) -> InvalidArgument:
    """msgspec's complaint in the agent's words: the key, what it takes, what it got."""
    at = _AT.fullmatch(message)
    if at is None and " - at `" in message:  # about a mapping's key itself (`key` in `$...`), not a value
        section = ".".join(filter(None, (within, message.rpartition("`$")[2].rstrip("`").lstrip("."))))
        return InvalidArgument(f"config{' key ' + repr(section) if section else ''}: every key must be a string")
    # msgspec leaves out the path where the document as a whole is wrong.
    what, where = (at[1], at[2]) if at else (message, "")
    steps = [(name, int(index) if index else None) for name, index in _STEP.findall(where)]
    key = ".".join(filter(None, (within, where.lstrip("."))))
    annotation: Any = kind
    value: Any = data
    for name, index in steps:
        annotation = _step_type(annotation, name, index)
        value = _step_value(value, name, index)
    unknown = _UNKNOWN.fullmatch(what)
    if unknown:
        name = f"{key}.{unknown[1]}" if key else unknown[1]
        known = sorted(f.encode_name for f in _fields(annotation))
        return InvalidArgument(f"unknown config key {name!r}" + (f" (known: {', '.join(known)})" if known else ""))
    wanted = _wanted(annotation)
    said = f"must be {wanted}, got {shown(value)}" if wanted and value is not _MISSING else what
    if not key:
        return InvalidArgument(f"config file: the top level {said}")
    return InvalidArgument(f"config key {key!r}: {said}")


_MISSING: Any = object()


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, Struct)


def _fields(annotation: Any) -> tuple[msgspec.structs.FieldInfo, ...]:
    return msgspec.structs.fields(annotation) if _is_section(annotation) else ()


def _step_type(annotation: Any, name: str, index: int | None) -> Any:
    """The type of a key (`name`) or list item (`index`) inside a value of type `annotation`; None if unknown."""
    if index is not None:
        items = get_args(annotation)
        return items[0] if get_origin(annotation) in (tuple, list) and items else None
    return next((f.type for f in _fields(annotation) if f.encode_name == name), None)


def _step_value(value: Any, name: str, index: int | None) -> Any:
    try:
        return value[index] if index is not None else value[name]
    except (LookupError, TypeError):
        return _MISSING


def _wanted(annotation: Any) -> str:
    """What a key of this type takes, in words ("" when its own parser says so)."""
    if annotation is None:
        return ""
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(map(str, get_args(annotation)))
    if _is_section(annotation):
        return "a mapping"
    it = msgspec.inspect
    info = it.type_info(annotation)
    if isinstance(info, it.FloatType):
        sign = "positive, " if info.gt == 0 else "non-negative, " if info.ge == 0 else ""
        return f"a {sign}finite number"
    if isinstance(info, it.IntType):
        if info.ge is None:
            return "an integer"
        return "a non-negative integer" if info.ge == 0 else f"an integer of at least {info.ge}"
    if isinstance(info, it.BoolType):
        return "true or false"
    if isinstance(info, it.StrType):
        return "a string"
    if isinstance(info, (it.VarTupleType, it.ListType)):
        return "a list"
    return ""


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
