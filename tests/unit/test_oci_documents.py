"""The one reader of each OCI document (``oci.read_index``, ``oci.read_manifest``): what each refuses, by field."""

from __future__ import annotations

from typing import Any

import pytest

from node_agent.oci import (
    ARTIFACT_TYPE,
    OCI_INDEX_MEDIA_TYPE,
    OCI_MANIFEST_MEDIA_TYPE,
    Descriptor,
    DocumentError,
    read_index,
    read_manifest,
)

D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64
_DESC = {"mediaType": "a/b", "digest": D1, "size": 3}


def _index(**changes: Any) -> dict[str, Any]:
    return {"schemaVersion": 2, "mediaType": OCI_INDEX_MEDIA_TYPE, "manifests": [dict(_DESC, extra=1)], **changes}


def _manifest(**changes: Any) -> dict[str, Any]:
    doc = {"schemaVersion": 2, "mediaType": OCI_MANIFEST_MEDIA_TYPE, "artifactType": ARTIFACT_TYPE, "config": _DESC,
           "layers": [{"mediaType": "c/d", "digest": D2, "size": 4}], "annotations": {"k": "v"}}
    return {**doc, **changes}


def _checkpoint(kind: object) -> bool:
    return kind == ARTIFACT_TYPE


def test_index_keeps_its_records_as_they_are() -> None:
    assert read_index(_index(), max_entries=1) == [dict(_DESC, extra=1)]
    assert read_index(_index(schemaVersion=2.0), max_entries=1)  # a number equal to 2, unless strict
    with pytest.raises(DocumentError) as err:
        read_index(_index(schemaVersion=2.0), max_entries=1, strict_version=True)
    assert err.value.field == "schemaVersion"


@pytest.mark.parametrize(("doc", "field", "where"), [
    ([], "object", "object"),
    (_index(other=1), "keys", "keys"),
    (_index(schemaVersion=True), "schemaVersion", "schemaVersion"),
    (_index(mediaType=OCI_MANIFEST_MEDIA_TYPE), "mediaType", "mediaType"),
    (_index(manifests={}), "manifests", "manifests"),
    (_index(manifests=[_DESC, _DESC]), "manifests", "manifests"),
    (_index(manifests=[{"digest": D1, "size": 3}]), "entries", "manifests[0]"),
])
def test_index_refusals_name_the_field(doc: object, field: str, where: str) -> None:
    with pytest.raises(DocumentError) as err:
        read_index(doc, allowed=frozenset({"schemaVersion", "mediaType", "manifests"}), max_entries=1)
    assert (err.value.field, err.value.where) == (field, where)


def test_manifest_descriptors_and_the_rest_as_found() -> None:
    read = read_manifest(_manifest(), artifact_type=_checkpoint)
    assert read.config == Descriptor("a/b", D1, 3)
    assert read.layers == (Descriptor("c/d", D2, 4),)
    assert (read.subject, read.annotations, read.artifact_type) == (None, {"k": "v"}, ARTIFACT_TYPE)
    about = read_manifest(_manifest(subject=dict(_DESC, mediaType=OCI_MANIFEST_MEDIA_TYPE)), artifact_type=_checkpoint,
                          subject=True).subject
    assert about == Descriptor(OCI_MANIFEST_MEDIA_TYPE, D1, 3)


@pytest.mark.parametrize(("doc", "field", "where"), [
    ("x", "object", "object"),
    (_manifest(extra=1), "keys", "keys"),
    (_manifest(schemaVersion=1), "schemaVersion", "schemaVersion"),
    (_manifest(mediaType=OCI_INDEX_MEDIA_TYPE), "mediaType", "mediaType"),
    (_manifest(artifactType="x/y"), "artifactType", "artifactType"),
    (_manifest(layers=None), "layers", "layers"),
    (_manifest(layers=[_DESC, _DESC]), "layers", "layers"),
    (_manifest(config=dict(_DESC, size=-1)), "config", "config"),
    (_manifest(layers=[dict(_DESC, digest="sha256:x")]), "layers", "layers[0]"),
    (_manifest(subject={"digest": D1}), "subject", "subject"),
])
def test_manifest_refusals_name_the_field(doc: object, field: str, where: str) -> None:
    keys = frozenset(_manifest(subject=None))
    with pytest.raises(DocumentError) as err:
        read_manifest(doc, required=keys - {"subject"}, allowed=keys, artifact_type=_checkpoint, max_layers=1,
                      subject=True)
    assert (err.value.field, err.value.where) == (field, where)
    if field in ("config", "subject") or where.startswith("layers["):
        assert err.value.descriptor is not None
