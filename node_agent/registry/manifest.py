"""The OCI image manifest as a registry sends it, read as hostile input.

Only what pulling needs is checked here (media types, the descriptors to
fetch); the store validates the manifest in full when it is committed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from node_agent import strictjson
from node_agent.errors import InvalidArgument
from node_agent.registry.reference import check_digest

MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
"""The only manifest media type pushed and accepted."""

ARTIFACT_TYPE = "application/vnd.node-agent.checkpoint.v1"
"""The ``artifactType`` of a checkpoint manifest."""

MAX_MANIFEST_SIZE = 16 << 20
"""Largest manifest fetched (the bound is applied while reading)."""

MAX_DESCRIPTORS = 1_000_000
"""Most config + layer descriptors in one manifest."""

MAX_BLOB_SIZE = 1 << 50
"""Largest blob size believed (1 PiB)."""

MAX_MEDIA_TYPE_LENGTH = 255


@dataclass(frozen=True)
class BlobRef:
    """A descriptor of the manifest: one blob to fetch."""

    media_type: str
    digest: str
    size: int


def manifest_digest(data: bytes) -> str:
    """The digest of manifest bytes: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _media_type(value: object, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_MEDIA_TYPE_LENGTH or not value.isprintable():
        raise InvalidArgument(f"manifest {where}: bad mediaType")
    return value


def _descriptor(value: object, where: str) -> BlobRef:
    if not isinstance(value, dict):
        raise InvalidArgument(f"manifest {where}: a descriptor must be a JSON object")
    size = value.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_BLOB_SIZE:
        raise InvalidArgument(f"manifest {where}: size must be an integer from 0 to {MAX_BLOB_SIZE}")
    digest = value.get("digest")
    if not isinstance(digest, str):
        raise InvalidArgument(f"manifest {where}: digest must be a string")
    check_digest(digest, f"manifest {where}: digest")
    return BlobRef(_media_type(value.get("mediaType"), where), digest, size)


def parse_manifest(data: bytes) -> list[BlobRef]:
    """The config and layer descriptors of a checkpoint manifest, config first.

    Raises InvalidArgument if ``data`` is not an OCI image manifest of a checkpoint.
    """
    if len(data) > MAX_MANIFEST_SIZE:
        raise InvalidArgument(f"manifest is larger than {MAX_MANIFEST_SIZE} bytes")
    try:
        doc = strictjson.loads(data)
    except strictjson.StrictJsonError as exc:
        raise InvalidArgument(f"manifest {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("manifest is not a JSON object")
    if doc.get("schemaVersion") != 2 or isinstance(doc.get("schemaVersion"), bool):
        raise InvalidArgument("manifest schemaVersion is not 2")
    media_type = doc.get("mediaType")
    if media_type != MANIFEST_MEDIA_TYPE:
        raise InvalidArgument(f"manifest mediaType is {str(media_type)[:100]!r}, not {MANIFEST_MEDIA_TYPE}")
    artifact_type = doc.get("artifactType")
    if artifact_type != ARTIFACT_TYPE:
        raise InvalidArgument(
            f"not a node-agent checkpoint: artifactType is {str(artifact_type)[:100]!r}, not {ARTIFACT_TYPE}"
        )
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise InvalidArgument("manifest layers must be a list")
    if len(layers) + 1 > MAX_DESCRIPTORS:
        raise InvalidArgument(f"manifest has more than {MAX_DESCRIPTORS} descriptors")
    out = [_descriptor(doc.get("config"), "config")]
    out.extend(_descriptor(layer, f"layers[{i}]") for i, layer in enumerate(layers))
    return out
