"""Rendering for people (tables, IDs) and programs (JSON, YAML), and the one `-o/--output` flag.

Every command that prints what the daemon answered takes `-o/--output`
with the same spelling: its human form first and its default, then `json`
and `yaml`. The human form is `table` where the result is rows or a
summary, and `id` where it is an ID that a script captures; `text`, the
older name of the human form, still selects it. The human forms print
exactly what they always printed; only the flag's names are shared.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Literal, Sequence

from google.protobuf import json_format


DATA = ("json", "yaml")
"""The formats for programs, on every command; any other value is the command's human form."""


def add_flag(p: argparse.ArgumentParser, human: Literal["table", "id"] | None, default: str | None = None) -> None:
    """Give `p` the shared `-o/--output`: `human` (the default), `json` and `yaml`.

    `human` None: the command prints data only, in `default` (one of DATA).
    """
    choices = [*([human] if human else []), *DATA]
    chosen = default or human
    assert chosen in choices, (chosen, choices)
    aliases: dict[str, str] = {"text": human} if human else {}
    p.add_argument("-o", "--output", choices=choices, default=chosen, type=lambda v: aliases.get(v, v),
                   help=f"output format (default {chosen})")


def as_dict(msg: Any) -> dict[str, Any]:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def checkpoint_dict(info: Any) -> dict[str, Any]:
    d = as_dict(info)
    for key in ("size", "stored_size"):
        d[key] = int(d.get(key, 0))
    for c in d.get("containers", []):
        c["size"] = int(c.get("size", 0))
    return d


def emit(obj: Any, fmt: str) -> None:
    if fmt == "json":
        json.dump(obj, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    elif fmt == "yaml":
        import yaml

        sys.stdout.write(yaml.safe_dump(obj, sort_keys=True))
    else:
        raise ValueError(fmt)


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{n}B"


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> None:
    widths = [len(h) for h in header]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r)]
    for r in [header, *rows]:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
