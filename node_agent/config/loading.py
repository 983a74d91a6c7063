"""Loading settings: built-in defaults, then a YAML config file, then command line flags.

`load` merges them in that order of precedence (flags last); `from_mapping`
and `parse_registry` take an already parsed document or `registry:` section.
Each runs the validation pass (`node_agent.config.validation`) before any
Struct is built. No I/O besides reading the config file.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import msgspec

from node_agent.config.messages import Problem, refusal
from node_agent.config.schema import Document, RegistrySettings, Settings
from node_agent.config.validation import decode, validate


def parse_registry(value: Any) -> RegistrySettings:
    """The `registry:` section; keys are the field names with dashes."""
    return decode(value, RegistrySettings, "registry")


def from_mapping(data: Mapping[str, Any]) -> Settings:
    """Settings from a parsed config document; unknown keys are errors."""
    document = decode(data, Document)
    return validate(Settings(**msgspec.structs.asdict(document)))


def load(path: str | None, overrides: Mapping[str, Any] | None = None) -> Settings:
    """Defaults, then the YAML file at `path` (if given), then `overrides`.

    An empty file sets nothing. `overrides` uses attribute names
    (cri_endpoint, ...); None values are ignored so argparse namespaces can
    be passed through unchanged.
    """
    settings = Settings()
    if path:
        try:
            with open(path, "rb") as fh:
                data = msgspec.yaml.decode(fh.read())
        except OSError as exc:
            raise refusal(Problem.UNREADABLE_FILE, path=path, reason=exc.strerror) from exc
        except msgspec.DecodeError as exc:
            raise refusal(Problem.NOT_YAML, path=path, reason=exc) from exc
        settings = msgspec.structs.replace(from_mapping({} if data is None else data), config_file=os.path.abspath(path))
    if overrides:
        changes = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(changes) - set(Settings.__struct_fields__)
        if unknown:
            raise refusal(Problem.UNKNOWN_SETTINGS, names=", ".join(sorted(unknown)))
        # A flag takes what its key takes.
        keys = {f.name: f.encode_name for f in msgspec.structs.fields(Document)}
        given = decode({keys[k]: v for k, v in changes.items() if k in keys}, Document)
        changes.update((k, getattr(given, k)) for k in changes if k in keys)
        settings = msgspec.structs.replace(settings, **changes)
    return validate(settings)
