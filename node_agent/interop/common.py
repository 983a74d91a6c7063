"""Names, bounds and JSON rules shared by export and import."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from node_agent import strictjson
from node_agent import errors

# The archive's own files (the layout CRI-O, Podman and checkpointctl read).
CHECKPOINT_DIR = "checkpoint"
CONFIG_DUMP = "config.dump"
SPEC_DUMP = "spec.dump"
ROOTFS_DIFF = "rootfs-diff.tar"
DELETED_FILES = "deleted.files"
OPAQUE_DIRS = "opaque.dirs"
DUMP_LOG = "dump.log"
STATS_DUMP = "stats-dump"
DEVSHM_TAR = "devshm-checkpoint.tar"
NETWORK_STATUS = "network.status"
STATUS_DUMP = "status.dump"

# node-agent's additions, which other tools ignore.
OWN_DIR = "node-agent"
OWN_MANIFEST = "node-agent/manifest.json"
OWN_POD_DIR = "node-agent/pod"
EXPORT_KIND = "node-agent.container-export"

# Top-level names an export writes itself: a container file may not use them.
RESERVED_TOP = {STATS_DUMP, DEVSHM_TAR, NETWORK_STATUS, STATUS_DUMP, OWN_DIR}

# Pieces of the store's tree (see checkpointing.py).
STORE_POD = "pod"
STORE_POD_CONFIG = "pod/config.json"
STORE_DEVSHM = "pod/devshm.tar"
STORE_CPUINFO = "pod/cpuinfo/cpuinfo.img"

CONTAINER_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,251}[A-Za-z0-9])?$")
DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
CHECKPOINT_ID_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class ImportLimits:
    """Bounds on an archive taken in as hostile input."""

    max_members: int = 100_000
    max_member_bytes: int = 32 << 30
    max_total_bytes: int = 64 << 30
    max_json_bytes: int = 16 << 20
    max_path_bytes: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_members", "max_member_bytes", "max_total_bytes", "max_json_bytes", "max_path_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise errors.InvalidArgument(f"ImportLimits.{name} must be a non-negative int, not {value!r}")


def dns_label(raw: str, fallback: str) -> str:
    """`raw` made into a DNS label (lowercase letters, digits, '-', at most 63); `fallback` if nothing is left."""
    text = re.sub(r"[^a-z0-9-]+", "-", raw.lower())
    text = re.sub(r"-{2,}", "-", text).strip("-")[:63].strip("-")
    return text if DNS_LABEL_RE.fullmatch(text) else fallback


def check_container_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not CONTAINER_NAME_RE.fullmatch(value):
        raise errors.InvalidArgument(f"{what} {value!r} is not a valid container name")
    return value


def check_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise errors.InvalidArgument(f"{what} {value!r} is not a valid name (lowercase DNS subdomain)")
    return value


def parse_json(data: bytes, what: str, limit: int) -> Any:
    """Strict JSON: bounded, UTF-8, no duplicate keys, no NaN, nesting bounded by the interpreter."""
    if len(data) > limit:
        raise errors.ResourceExhausted(f"{what}: {len(data)} bytes is more than the limit of {limit}")
    try:
        return strictjson.loads(data)
    except strictjson.StrictJsonError as exc:
        raise errors.InvalidArgument(f"{what} {exc}") from None


def bounded_str(value: object, what: str, limit: int = 4096, *, allow_empty: bool = False) -> str:
    """A string without control characters, at most `limit` characters."""
    if not isinstance(value, str) or (not value and not allow_empty) or len(value) > limit:
        raise errors.InvalidArgument(f"{what} must be a string of 1 to {limit} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise errors.InvalidArgument(f"{what} holds control characters")
    return value
