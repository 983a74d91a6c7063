"""OCI names and descriptors: what the checkpoint store and the registry client both speak.

Rule: a descriptor is hostile until ``read_descriptor`` has checked it. This
module holds the OCI media types, the checkpoint's artifact type, the
manifest size bound, canonical JSON, the ``sha256:<hex>`` digest form, the ``Descriptor``
value and the one reader of descriptors. It does no I/O and words no
caller's errors: ``DescriptorError`` names the field that is wrong, and each
caller says so in its own terms.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal, TypeGuard

from node_agent.errors import InvalidArgument

OCI_INDEX_MEDIA_TYPE: Final = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST_MEDIA_TYPE: Final = "application/vnd.oci.image.manifest.v1+json"
"""The only manifest media type stored, pushed and pulled."""
ARTIFACT_TYPE: Final = "application/vnd.node-agent.checkpoint.v1"
"""The ``artifactType`` of a checkpoint manifest."""
EMPTY_MEDIA_TYPE: Final = "application/vnd.oci.empty.v1+json"
EMPTY_BLOB: Final = b"{}"
EMPTY_DIGEST: Final = "sha256:" + hashlib.sha256(EMPTY_BLOB).hexdigest()

MAX_MANIFEST_BYTES: Final = 16 << 20
"""Largest checkpoint manifest stored or fetched (the bound is applied while reading)."""

DESCRIPTOR_KEYS: Final = frozenset({"mediaType", "digest", "size"})

_HEX_RE: Final = re.compile(r"[0-9a-f]{64}")
_MEDIA_TYPE_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}")


def canonical_json(doc: Any) -> bytes:
    """Canonical bytes of a JSON document: sorted keys, no whitespace, ASCII only (the same content, the same digest)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True).encode("ascii")


def digest_hex(digest: str) -> str:
    """Return the hex part of ``sha256:<hex>``; InvalidArgument if malformed."""
    if not isinstance(digest, str) or not digest.startswith("sha256:"):
        raise InvalidArgument(f"malformed digest {digest!r}: want sha256:<64 hex>")
    hexpart = digest[len("sha256:") :]
    if not _HEX_RE.fullmatch(hexpart):
        raise InvalidArgument(f"malformed digest {digest!r}: want sha256:<64 hex>")
    return hexpart


def is_hex_digest(hexpart: str) -> bool:
    """Whether ``hexpart`` is 64 lowercase hex characters."""
    return _HEX_RE.fullmatch(hexpart) is not None


def sha256_digest(data: bytes | bytearray | memoryview) -> str:
    """``sha256:<hex>`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def is_media_type(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a media type name as RFC 6838 restricts them (``type/subtype``)."""
    return isinstance(value, str) and _MEDIA_TYPE_RE.fullmatch(value) is not None


def _empty_annotations() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor: what a blob is, its digest and its size."""

    media_type: str
    digest: str
    size: int
    annotations: Mapping[str, str] = field(default_factory=_empty_annotations)

    def to_json(self) -> dict[str, Any]:
        """The descriptor as OCI JSON (``annotations`` omitted when empty)."""
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        return out


EMPTY_DESCRIPTOR: Final = Descriptor(EMPTY_MEDIA_TYPE, EMPTY_DIGEST, len(EMPTY_BLOB))

DescriptorField = Literal["object", "keys", "mediaType", "digest", "size"]


class DescriptorError(ValueError):
    """A descriptor that ``read_descriptor`` refused.

    ``field`` says what is wrong: ``"object"`` (not a JSON object),
    ``"keys"``, ``"mediaType"``, ``"digest"`` or ``"size"``; ``value`` is
    what was found there (the key list for ``"keys"``) and ``detail`` the
    reason in words.
    """

    def __init__(self, field: DescriptorField, value: object, detail: str) -> None:
        super().__init__(detail)
        self.field: DescriptorField = field
        self.value = value
        self.detail = detail


def read_descriptor(
    raw: object,
    *,
    keys: Literal["exact", "required"] | None = "exact",
    media_type: Callable[[object], TypeGuard[str]] = is_media_type,
    max_size: int | None = None,
) -> Descriptor:
    """Check a descriptor read from a hostile document; DescriptorError for the first bad field.

    ``keys``: ``"exact"`` wants exactly ``mediaType``, ``digest`` and
    ``size``; ``"required"`` at least those; None reads a missing one as
    null (which then fails its own check). ``media_type`` decides which
    media type names are believed; ``max_size`` bounds ``size`` (which is
    always a non-negative integer). Fields are checked in that order:
    keys, media type, digest, size.
    """
    if not isinstance(raw, dict):
        raise DescriptorError("object", raw, "not an object")
    found = set(raw)
    if (keys == "exact" and found != DESCRIPTOR_KEYS) or (keys == "required" and not DESCRIPTOR_KEYS <= found):
        raise DescriptorError("keys", sorted(found), f"keys {sorted(found)}")
    kind = raw.get("mediaType")
    if not media_type(kind):
        raise DescriptorError("mediaType", kind, f"malformed mediaType {kind!r}")
    digest: Any = raw.get("digest")  # digest_hex checks its type too
    try:
        digest_hex(digest)
    except InvalidArgument as exc:
        raise DescriptorError("digest", digest, str(exc)) from None
    size = raw.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0 or (max_size is not None and size > max_size):
        raise DescriptorError("size", size, f"size {size!r}")
    return Descriptor(kind, digest, size)
