"""The OCI image manifest as a registry sends it, read as hostile input.

Only what pulling needs is checked here (the media types, the descriptors to
fetch, read by ``node_agent.oci``); the store validates the manifest in full
when it is committed.
"""

from __future__ import annotations

from typing import Final, TypeGuard

from node_agent import strictjson
from node_agent.errors import InvalidArgument
from node_agent.oci import (
    ARTIFACT_TYPE,
    MAX_MANIFEST_BYTES,
    OCI_MANIFEST_MEDIA_TYPE,
    Descriptor,
    DescriptorError,
    read_descriptor,
)
from node_agent.registry.reference import check_digest

MAX_DESCRIPTORS = 1_000_000
"""Most config + layer descriptors in one manifest."""

MAX_BLOB_SIZE = 1 << 50
"""Largest blob size believed (1 PiB)."""

MAX_MEDIA_TYPE_LENGTH = 255


def _believable_media_type(value: object) -> TypeGuard[str]:
    """Any short, printable name: the store checks media types in full when it commits."""
    return isinstance(value, str) and bool(value) and len(value) <= MAX_MEDIA_TYPE_LENGTH and value.isprintable()


_FAULTS: Final = {
    "object": "a descriptor must be a JSON object",
    "mediaType": "bad mediaType",
    "digest": "digest must be a string",
    "size": f"size must be an integer from 0 to {MAX_BLOB_SIZE}",
}


def _descriptor(value: object, where: str) -> Descriptor:
    try:
        return read_descriptor(value, keys=None, media_type=_believable_media_type, max_size=MAX_BLOB_SIZE)
    except DescriptorError as exc:
        if exc.field == "digest" and isinstance(exc.value, str):
            check_digest(exc.value, f"manifest {where}: digest")  # raises, in the reference grammar's words
        raise InvalidArgument(f"manifest {where}: {_FAULTS.get(exc.field, exc.detail)}") from None


def parse_manifest(data: bytes) -> list[Descriptor]:
    """The config and layer descriptors of a checkpoint manifest, config first.

    Raises InvalidArgument if ``data`` is not an OCI image manifest of a checkpoint.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidArgument(f"manifest is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        doc = strictjson.loads(data)
    except strictjson.StrictJsonError as exc:
        raise InvalidArgument(f"manifest {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("manifest is not a JSON object")
    if doc.get("schemaVersion") != 2 or isinstance(doc.get("schemaVersion"), bool):
        raise InvalidArgument("manifest schemaVersion is not 2")
    media_type = doc.get("mediaType")
    if media_type != OCI_MANIFEST_MEDIA_TYPE:
        raise InvalidArgument(f"manifest mediaType is {str(media_type)[:100]!r}, not {OCI_MANIFEST_MEDIA_TYPE}")
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
