"""A checkpoint's referrers (its signatures) in a registry: the OCI 1.1 referrers API, or the tag scheme.

Rule: what a registry says about referrers is hostile. Push puts a
referrer's manifest by digest after its blobs; a registry that does not
answer with ``OCI-Subject`` has no referrers API, and the referrer is added
to the OCI image index at the tag ``sha256-<hex of the checkpoint>`` (the
fallback scheme: read, add, put back; what else it lists is kept). Pull asks
``GET /v2/<repo>/referrers/<digest>?artifactType=...`` and, where that is
not found or not an index, reads the tag. Only node-agent signatures are
fetched, at most ``MAX_SIGNATURES``: each manifest and blob bounded, checked
against its digest, decoded strictly and verified (``signing.verify``); one
that fails any check is left out with a warning, while a transport failure
fails the pull. Whether a signer is trusted is decided at restore, not here.
"""

from __future__ import annotations

import logging
from typing import Any, Final
from urllib.parse import quote

from node_agent import signing, strictjson
from node_agent.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from node_agent.oci import (
    EMPTY_BLOB,
    EMPTY_DESCRIPTOR,
    OCI_INDEX_MEDIA_TYPE,
    OCI_MANIFEST_MEDIA_TYPE,
    Descriptor,
    DocumentError,
    canonical_json,
    digest_hex,
    read_descriptor,
    read_index,
    sha256_digest,
)
from node_agent.registry.transport import Session
from node_agent.store.referrers import decode_referrer

log = logging.getLogger(__name__)

MAX_INDEX_BYTES: Final = 4 << 20
"""Largest referrers index (from the API or the fallback tag) read."""
MAX_INDEX_ENTRIES: Final = 10_000
MAX_SIGNATURES: Final = 16
"""Most signatures of one checkpoint fetched by a pull."""
_NO_API: Final = frozenset({400, 404, 405, 406, 501})


def fallback_tag(subject: str) -> str:
    """The tag that holds the referrers of ``subject`` where a registry has no referrers API."""
    return "sha256-" + digest_hex(subject)


def describe(manifest: bytes) -> tuple[dict[str, Any], list[Descriptor]]:
    """A referrer manifest's descriptor for an index (with its artifactType and annotations) and its blobs.

    The manifest is decoded as the store decodes every referrer (``decode_referrer``).
    """
    ref = decode_referrer(manifest)
    entry: dict[str, Any] = {
        "mediaType": OCI_MANIFEST_MEDIA_TYPE, "digest": sha256_digest(manifest), "size": len(manifest),
        "artifactType": ref.artifact_type,
    }
    if ref.annotations:
        entry["annotations"] = dict(ref.annotations)
    return entry, list(ref.blobs)


def _index_entries(data: bytes, what: str) -> list[dict[str, Any]]:
    """The ``manifests`` of an OCI image index from a registry (``oci.read_index``); InvalidArgument if it is not one."""
    try:
        doc = strictjson.loads(data)
    except strictjson.StrictJsonError as exc:
        raise InvalidArgument(f"{what} {exc}") from None
    try:
        return read_index(doc, max_entries=MAX_INDEX_ENTRIES)
    except DocumentError as exc:
        if exc.field in ("object", "schemaVersion"):
            raise InvalidArgument(f"{what} is not an OCI image index (schemaVersion 2)") from None
        if exc.field == "mediaType":
            raise InvalidArgument(f"{what} is {str(exc.value)[:100]!r}, not an OCI image index") from None
        if exc.field == "manifests":
            raise InvalidArgument(f"{what}: manifests is not a list of at most {MAX_INDEX_ENTRIES} descriptors") from None
        raise InvalidArgument(f"{what}: {exc.where}: {exc.detail}") from None


def _get_index(session: Session, url: str, what: str) -> list[dict[str, Any]] | None:
    """The entries of the index at ``url``; None when the registry has none there; InvalidArgument for another document."""
    with session.request("GET", url, what, headers={"Accept": OCI_INDEX_MEDIA_TYPE}, follow_redirects=True) as resp:
        if resp.status in _NO_API:
            return None
        if resp.status != 200:
            raise resp.error(what)
        content_type = (resp.header("Content-Type") or "").split(";")[0].strip()
        data = resp.read(MAX_INDEX_BYTES, what)
    if content_type and content_type != OCI_INDEX_MEDIA_TYPE:
        raise InvalidArgument(f"{session.where}: {what}: the registry sent {content_type[:100]!r}, not an OCI image index")
    return _index_entries(data, f"{session.where}: {what}")


# -- push ---------------------------------------------------------------------------------


def put_referrer(session: Session, manifest: bytes, subject: str) -> bool:
    """PUT a referrer manifest by digest (its blobs are there already); True when the fallback tag was updated.

    Where the registry's answer has no ``OCI-Subject`` (no referrers API),
    the referrer is added to the index at ``fallback_tag(subject)``.
    """
    entry, _ = describe(manifest)
    digest = entry["digest"]
    what = f"putting referrer {digest} of {subject}"
    url = session.url(f"/v2/{session.ref.repository}/manifests/{digest}")
    with session.request("PUT", url, what, headers={"Content-Type": OCI_MANIFEST_MEDIA_TYPE}, body=manifest) as resp:
        if resp.status != 201:
            raise resp.error(what)
        stored = resp.header("Docker-Content-Digest")
        api = resp.header("OCI-Subject")
    if stored is not None and stored.strip() != digest:
        raise DataLoss(f"{session.where}: the registry stored referrer {digest} as {stored.strip()[:80]}")
    if api is not None:
        return False
    _add_to_tag(session, subject, entry)
    return True


def _add_to_tag(session: Session, subject: str, entry: dict[str, Any]) -> None:
    tag = fallback_tag(subject)
    url = session.url(f"/v2/{session.ref.repository}/manifests/{tag}")
    try:
        manifests = _get_index(session, url, f"reading the referrers tag {tag}") or []
    except InvalidArgument as exc:
        raise FailedPrecondition(f"{exc}; refusing to replace it") from None
    if any(m.get("digest") == entry["digest"] for m in manifests):
        return
    body = canonical_json({"schemaVersion": 2, "mediaType": OCI_INDEX_MEDIA_TYPE, "manifests": [*manifests, entry]})
    if len(body) > MAX_INDEX_BYTES:
        raise ResourceExhausted(f"{session.where}: the referrers tag {tag} would be more than {MAX_INDEX_BYTES} bytes")
    what = f"putting the referrers tag {tag}"
    with session.request("PUT", url, what, headers={"Content-Type": OCI_INDEX_MEDIA_TYPE}, body=body) as resp:
        if resp.status != 201:
            raise resp.error(what)


# -- pull ---------------------------------------------------------------------------------


def listed_signatures(session: Session, subject: str) -> list[Descriptor]:
    """The signature manifests a registry lists for ``subject``: its referrers API, else the fallback tag."""
    kind = signing.SIGNATURE_ARTIFACT_TYPE
    repo = session.ref.repository
    api = session.url(f"/v2/{repo}/referrers/{subject}?artifactType={quote(kind, safe='')}")
    entries: list[dict[str, Any]] | None
    try:
        entries = _get_index(session, api, f"listing the referrers of {subject}")
    except InvalidArgument as exc:
        log.debug("%s; reading the referrers tag instead", exc)
        entries = None
    if entries is None:
        tag = fallback_tag(subject)
        try:
            entries = _get_index(session, session.url(f"/v2/{repo}/manifests/{tag}"), f"reading the referrers tag {tag}")
        except InvalidArgument as exc:
            log.warning("%s; no signatures taken from it", exc)
            entries = None
    out: dict[str, Descriptor] = {}
    for raw in entries or []:
        if raw.get("artifactType") != kind or raw.get("mediaType") != OCI_MANIFEST_MEDIA_TYPE:
            continue  # another kind of referrer (the API's filter is only a hint)
        desc = read_descriptor(raw, keys="required")  # read_index has checked it
        out.setdefault(desc.digest, desc)
    found = list(out.values())
    if len(found) > MAX_SIGNATURES:
        log.warning("%s: %s has %d signatures; taking the first %d", session.where, subject, len(found), MAX_SIGNATURES)
    return found[:MAX_SIGNATURES]


def _get_signature(session: Session, subject: str, desc: Descriptor) -> signing.SignatureArtifact:
    digest = desc.digest
    if desc.size > signing.MAX_SIGNATURE_MANIFEST_BYTES:
        raise InvalidArgument(f"signature {digest} is listed as {desc.size} bytes, more than a signature is")
    what = f"fetching signature {digest}"
    url = session.url(f"/v2/{session.ref.repository}/manifests/{digest}")
    with session.request("GET", url, what, headers={"Accept": OCI_MANIFEST_MEDIA_TYPE}, follow_redirects=True) as resp:
        if resp.status == 404:
            raise NotFound(f"{session.where}: signature {digest} is listed but not there")
        if resp.status != 200:
            raise resp.error(what)
        data = resp.read(signing.MAX_SIGNATURE_MANIFEST_BYTES, f"signature {digest}")
    if sha256_digest(data) != digest:
        raise DataLoss(f"{session.where}: the manifest sent for signature {digest} hashes to {sha256_digest(data)}")
    layer = signing.decode_signature_manifest(data).layer
    blob = _get_blob(session, layer, f"signature {digest}")
    key = signing.verify(data, blob, subject)
    return signing.SignatureArtifact(digest, data, {EMPTY_DESCRIPTOR.digest: EMPTY_BLOB, layer.digest: blob}, key)


def _get_blob(session: Session, desc: Descriptor, of: str) -> bytes:
    what = f"downloading blob {desc.digest} of {of}"
    url = session.url(f"/v2/{session.ref.repository}/blobs/{desc.digest}")
    with session.request("GET", url, what, follow_redirects=True, size=desc.size) as resp:
        if resp.status == 404:
            raise NotFound(f"{session.where}: blob {desc.digest} of {of} is not in the registry")
        if resp.status != 200:
            raise resp.error(what)
        data = b"".join(resp.chunks(desc.size, f"blob {desc.digest}"))
    if sha256_digest(data) != desc.digest:
        raise DataLoss(f"{session.where}: blob {desc.digest} of {of} hashes to {sha256_digest(data)}")
    return data


def fetch_signatures(session: Session, subject: str) -> list[signing.SignatureArtifact]:
    """Every signature of ``subject`` the registry has that verifies (its signer trusted or not)."""
    out: list[signing.SignatureArtifact] = []
    for desc in listed_signatures(session, subject):
        try:
            out.append(_get_signature(session, subject, desc))
        except (signing.SignatureError, DataLoss, NotFound, InvalidArgument, ResourceExhausted) as exc:
            log.warning("%s: leaving out signature %s of %s: %s", session.where, desc.digest, subject, exc)
    return out

