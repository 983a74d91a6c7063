"""OCI names, descriptors and documents: what the checkpoint store, the registry client and signing speak.

Rule: a descriptor is hostile until ``read_descriptor`` has checked it, and
an image index or image manifest until ``read_index`` or ``read_manifest``
has. This module holds the OCI media types, the checkpoint's artifact type,
the manifest size bound, canonical JSON, the ``sha256:<hex>`` digest form,
the ``Descriptor`` value, the one reader of descriptors and the one reader
of each of the two OCI documents (each caller adds its own rules on top:
the store's checkpoint manifests, the registry client's pulls, referrers,
signatures). It does no I/O and words no caller's errors:
``DescriptorError`` and ``DocumentError`` name the field that is wrong, and
each caller says so in its own terms.
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


# -- documents ------------------------------------------------------------------------------

DocumentField = Literal[
    "object", "keys", "schemaVersion", "mediaType", "artifactType", "manifests", "entries", "config", "layers",
    "subject",
]


class DocumentError(ValueError):
    """An image index or image manifest that ``read_index`` or ``read_manifest`` refused.

    ``field`` says what is wrong: ``"object"`` (not a JSON object),
    ``"keys"`` (``value`` the missing and the unexpected keys, sorted),
    ``"schemaVersion"``, ``"mediaType"``, ``"artifactType"``, ``"manifests"``
    or ``"layers"`` (not a list, or too long: ``value`` is then its length),
    ``"entries"``, ``"config"`` or ``"subject"`` (a descriptor: ``where``
    names it, ``descriptor`` says what is wrong with it). ``detail`` is the
    reason in words.
    """

    def __init__(self, field: DocumentField, value: object, detail: str, *, where: str = "",
                 descriptor: DescriptorError | None = None) -> None:
        super().__init__(detail)
        self.field: DocumentField = field
        self.value = value
        self.detail = detail
        self.where = where or field
        self.descriptor = descriptor


def _is_schema_2(value: object, strict: bool) -> bool:
    if strict:
        return isinstance(value, int) and not isinstance(value, bool) and value == 2
    return value == 2 and not isinstance(value, bool)


def _check_keys(doc: dict[str, Any], required: frozenset[str], allowed: frozenset[str] | None) -> None:
    found = set(doc)
    missing = sorted(required - found)
    extra = sorted(found - allowed) if allowed is not None else []
    if missing or extra:
        raise DocumentError("keys", (missing, extra), f"wrong top-level keys (missing {missing}, unexpected {extra})")


def read_index(
    doc: object, *, allowed: frozenset[str] | None = None, strict_version: bool = False, max_entries: int,
) -> list[dict[str, Any]]:
    """Check an OCI image index read from a hostile document; its ``manifests``, or DocumentError.

    ``allowed`` bounds the top-level keys (None: any); ``strict_version``
    wants ``schemaVersion`` an integer (otherwise any number equal to 2);
    ``mediaType``, when present, is that of an image index; each of at most
    ``max_entries`` records is a descriptor with at least the descriptor
    keys (``read_descriptor``), kept as it is.
    """
    if not isinstance(doc, dict):
        raise DocumentError("object", doc, "top level is not an object")
    _check_keys(doc, frozenset(), allowed)
    if not _is_schema_2(doc.get("schemaVersion"), strict_version):
        raise DocumentError("schemaVersion", doc.get("schemaVersion"), f"unsupported schemaVersion {doc.get('schemaVersion')!r}")
    if doc.get("mediaType", OCI_INDEX_MEDIA_TYPE) != OCI_INDEX_MEDIA_TYPE:
        raise DocumentError("mediaType", doc.get("mediaType"), f"unsupported mediaType {doc.get('mediaType')!r}")
    manifests = doc.get("manifests")
    if not isinstance(manifests, list):
        raise DocumentError("manifests", None, "manifests is not a list")
    if len(manifests) > max_entries:
        raise DocumentError("manifests", len(manifests), f"{len(manifests)} entries exceeds the limit of {max_entries}")
    for i, raw in enumerate(manifests):
        try:
            read_descriptor(raw, keys="required")
        except DescriptorError as exc:
            raise DocumentError("entries", raw, exc.detail, where=f"manifests[{i}]", descriptor=exc) from None
    return manifests


@dataclass(frozen=True)
class ImageManifest:
    """An OCI image manifest as ``read_manifest`` found it: the descriptors checked, the rest as it was."""

    artifact_type: object
    config: Descriptor
    layers: tuple[Descriptor, ...]
    subject: Descriptor | None
    annotations: object
    """``annotations`` as the document has it (None when absent): each caller has its own rules for them."""


def read_manifest(
    doc: object,
    *,
    required: frozenset[str] = frozenset(),
    allowed: frozenset[str] | None = None,
    strict_version: bool = False,
    artifact_type: Callable[[object], bool],
    max_layers: int | None = None,
    keys: Literal["exact", "required"] | None = "exact",
    media_type: Callable[[object], TypeGuard[str]] = is_media_type,
    max_size: int | None = None,
    subject: bool = False,
) -> ImageManifest:
    """Check an OCI image manifest read from a hostile document; DocumentError for the first bad field.

    ``required`` and ``allowed`` bound the top-level keys (``allowed`` None:
    any); ``strict_version`` as for ``read_index``; ``mediaType`` is that of
    an image manifest; ``artifact_type`` decides which ``artifactType`` is
    believed; ``layers`` is a list of at most ``max_layers``. The config
    and every layer are read by ``read_descriptor`` with ``keys``,
    ``media_type`` and ``max_size``; with ``subject``, so is the
    ``subject`` (``keys`` alone: its size is not a blob's). Fields are
    checked in that order.
    """
    if not isinstance(doc, dict):
        raise DocumentError("object", doc, "top level is not an object")
    _check_keys(doc, required, allowed)
    if not _is_schema_2(doc.get("schemaVersion"), strict_version):
        raise DocumentError("schemaVersion", doc.get("schemaVersion"), f"unsupported schemaVersion {doc.get('schemaVersion')!r}")
    if doc.get("mediaType") != OCI_MANIFEST_MEDIA_TYPE:
        raise DocumentError("mediaType", doc.get("mediaType"), f"unsupported mediaType {doc.get('mediaType')!r}")
    kind = doc.get("artifactType")
    if not artifact_type(kind):
        raise DocumentError("artifactType", kind, f"unsupported artifactType {kind!r}")
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list):
        raise DocumentError("layers", None, "layers is not a list")
    if max_layers is not None and len(raw_layers) > max_layers:
        raise DocumentError("layers", len(raw_layers), f"{len(raw_layers)} layers exceeds the limit of {max_layers}")

    def descriptor(field: Literal["config", "layers", "subject"], where: str, raw: object, **options: Any) -> Descriptor:
        try:
            return read_descriptor(raw, keys=keys, **options)
        except DescriptorError as exc:
            raise DocumentError(field, raw, exc.detail, where=where, descriptor=exc) from None

    config = descriptor("config", "config", doc.get("config"), media_type=media_type, max_size=max_size)
    layers = tuple(descriptor("layers", f"layers[{i}]", raw, media_type=media_type, max_size=max_size)
                   for i, raw in enumerate(raw_layers))
    about = descriptor("subject", "subject", doc.get("subject")) if subject else None
    return ImageManifest(kind, config, layers, about, doc.get("annotations"))
