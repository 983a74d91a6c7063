"""The command line flags that override config file settings, derived from the schema.

Which config keys are flags, and where, is declared here (`SETTINGS`,
`LISTENERS`, `SERVE`, `HANDLER`); each flag's name, choices and help come
from its field in `node_agent.config.schema.Document` (the field's name with
dashes; a `Literal`'s values; the field's `Meta` description, with
`{default}` standing for its default). A flag's dest is the field's name, so
`settings_from` passes every flag given to `load`, which lets it override
the file.
"""

from __future__ import annotations

import argparse
from typing import Annotated, Any, Literal, get_args, get_origin

import msgspec
from msgspec import Meta

from node_agent.config.loading import load
from node_agent.config.schema import Document, Settings

# (field, metavar): the flags of every command that builds Settings, in --help order.
SETTINGS = (("cri_endpoint", "URL"), ("socket", "PATH"), ("cri_listen", "URL"), ("store", "DIR"),
            ("runtime_handler", "NAME"), ("runc_root", "DIR"), ("runc", "PATH"), ("criu", "PATH"),
            ("log_format", None), ("log_level", None))
# The daemon's listeners (`serve` only).
LISTENERS = (("listen", "HOST:PORT"), ("tls_cert", "FILE"), ("tls_key", "FILE"), ("tls_client_ca", "FILE"),
             ("health_listen", "[HOST:]PORT"), ("metrics_listen", "[HOST:]PORT"))
# The rest of `serve`'s.
SERVE = (("sysfs_root", "DIR"),)
# `containerd-config`'s: the settings the restore handler's launcher depends on.
HANDLER = (("runtime_handler", "NAME"), ("store", "DIR"), ("runc_root", "DIR"), ("runc", "PATH"))

_FIELDS = {f.name: f for f in msgspec.structs.fields(Document)}


def _help(field: msgspec.structs.FieldInfo) -> str | None:
    """The field's description, its default filled in; None when it has none."""
    if get_origin(field.type) is not Annotated:
        return None
    described = [m.description for m in get_args(field.type)[1:] if isinstance(m, Meta) and m.description]
    return described[0].format(default=field.default) if described else None


def _choices(field: msgspec.structs.FieldInfo) -> tuple[str, ...] | None:
    kind = get_args(field.type)[0] if get_origin(field.type) is Annotated else field.type
    return get_args(kind) if get_origin(kind) is Literal else None


def add_flags(p: argparse.ArgumentParser, flags: tuple[tuple[str, str | None], ...], *, described: bool = True) -> None:
    """A flag on `p` for each (field, metavar) of `flags`; without help unless `described`."""
    for name, metavar in flags:
        field = _FIELDS[name]
        options: dict[str, Any] = {"help": _help(field) if described else None}
        choices = _choices(field)
        if choices:
            options["choices"] = choices
        else:
            options["metavar"] = metavar
        p.add_argument("--" + field.encode_name, dest=name, **options)


def settings_parent() -> argparse.ArgumentParser:
    """Flags shared by commands that build Settings (serve, doctor, install-systemd, install-handler)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", metavar="FILE", help="YAML config file; flags override it")
    add_flags(p, SETTINGS)
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from `--config` and the flags given; a flag's dest is the attribute of its config key."""
    return load(args.config, {name: getattr(args, name, None) for name in _FIELDS})
