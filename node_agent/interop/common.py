"""Names, bounds and JSON rules shared by export and import."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from node_agent import strictjson
from node_agent import errors
from node_agent.podformat import CONTAINER_NAME_RE, NAME_RE

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
OWN_POD_CONFIG = "node-agent/pod/config.json"
EXPORT_KIND = "node-agent.container-export"

# What an export writes first, in this order, so that an import knows the
# archive's kind and has its small required documents before any bulk
# (docs/interop.md, "Required members first").
LEAD_MEMBERS = (OWN_MANIFEST, CONFIG_DUMP, SPEC_DUMP, OWN_POD_DIR, OWN_POD_CONFIG)

# Top-level names an export writes itself: a container file may not use them.
RESERVED_TOP = {STATS_DUMP, DEVSHM_TAR, NETWORK_STATUS, STATUS_DUMP, OWN_DIR}

DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
CHECKPOINT_ID_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class ImportLimits:
    """Bounds on an archive taken in as hostile input (docs/interop.md, "Hostile input").

    Sizes count file content after decompression. `max_total_bytes` bounds
    the file content of the whole archive and `max_member_bytes` one file;
    None (the default) derives them from the staging filesystem when the
    import starts: what it has free beyond `min_free_bytes`. Every write
    into staging also checks, at least every `free_check_bytes`, that
    `min_free_bytes` stay free on that filesystem (the store's
    `min-free-bytes` setting). Until config.dump and spec.dump (and, once
    node-agent's manifest has come, node-agent/pod/config.json) have come,
    at most `max_staged_before_required` bytes are staged; an archive that
    puts more in front of them is looked ahead in without staging, and read
    again once they are found.
    """

    max_members: int = 100_000
    max_member_bytes: int | None = None
    max_total_bytes: int | None = None
    max_json_bytes: int = 16 << 20
    max_path_bytes: int = 4096
    max_staged_before_required: int = 16 << 20
    min_free_bytes: int = 256 << 20
    free_check_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        for name in ("max_members", "max_member_bytes", "max_total_bytes", "max_json_bytes", "max_path_bytes",
                     "max_staged_before_required", "min_free_bytes", "free_check_bytes"):
            value = getattr(self, name)
            if value is None and name in ("max_member_bytes", "max_total_bytes"):
                continue
            if type(value) is not int or value < 0:
                raise errors.InvalidArgument(f"ImportLimits.{name} must be a non-negative int, not {value!r}")

    def bounds(self, free_bytes: int) -> StagingBounds:
        """The size bounds of one import, where the staging filesystem has `free_bytes` free at its start."""
        room = max(0, free_bytes - self.min_free_bytes)
        return StagingBounds(
            total_bytes=room if self.max_total_bytes is None else self.max_total_bytes,
            member_bytes=room if self.max_member_bytes is None else self.max_member_bytes,
            free_bytes=free_bytes,
            total_derived=self.max_total_bytes is None,
            member_derived=self.max_member_bytes is None,
        )


@dataclass(frozen=True)
class StagingBounds:
    """`ImportLimits` resolved against the staging filesystem's free space at the start of one import."""

    total_bytes: int  # file content of the whole archive
    member_bytes: int  # one file
    free_bytes: int  # free on the staging filesystem when the import started
    total_derived: bool  # total_bytes came from the free space, not from max_total_bytes
    member_derived: bool

    def _name(self, name: str, derived: bool) -> str:
        if derived:
            return (f"{name}: by default what the staging filesystem had free ({self.free_bytes} bytes) "
                    "less min_free_bytes")
        return name

    def total_name(self) -> str:
        """How messages name the bound on all file content."""
        return self._name("max_total_bytes", self.total_derived)

    def member_name(self) -> str:
        """How messages name the bound on one file."""
        return self._name("max_member_bytes", self.member_derived)


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
