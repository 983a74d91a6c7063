"""Signatures through registries: push and pull of a checkpoint's referrers (node_agent.registry.referrers_api).

A small in-memory registry on loopback plays both kinds of registry: one
with the OCI 1.1 referrers API (it answers a manifest with a subject with
`OCI-Subject` and serves `/referrers/<digest>`) and one without (the
fallback tag `sha256-<hex>`), and records what it is sent. Hostile answers
come from the same registry, altered. The real docker-registry 2.8 (no
referrers API) is the last test.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import parse_qs, urlsplit

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node_agent import signing
from node_agent.config.loading import from_mapping
from node_agent.errors import FailedPrecondition, PermissionDenied
from node_agent.oci import OCI_INDEX_MEDIA_TYPE, OCI_MANIFEST_MEDIA_TYPE, sha256_digest
from node_agent.registry import Credentials, pull, push
from node_agent.registry.referrers_api import fallback_tag
from node_agent.store import CheckpointRecord, Store

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests/unit is not a package: make the repository's tests/ importable
    sys.path.insert(0, str(REPO))

from testbed.httpanswers import FakeServer, answer  # noqa: E402
from testbed.registry import Registry  # noqa: E402

PLAIN = Credentials(plain_http=True)
SIG = signing.SIGNATURE_ARTIFACT_TYPE


class MemoryRegistry:
    """The distribution API in memory, for one repository; `seen` is (method, path, content type, body)."""

    def __init__(self, *, referrers_api: bool) -> None:
        self.api = referrers_api
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[str, tuple[str, bytes]] = {}  # tag or digest -> (media type, bytes)
        self.seen: list[tuple[str, str, str, bytes]] = []
        self.lock = threading.Lock()
        self.server = FakeServer(self.serve)
        self.ref = f"{self.server.netloc}/ckpt/web"

    def close(self) -> None:
        self.server.close()

    def requests(self, method: str, contains: str = "") -> list[tuple[str, str, str, bytes]]:
        return [s for s in self.seen if s[0] == method and contains in s[1]]

    def referrers_of(self, subject: str) -> list[dict[str, Any]]:
        out = []
        for key, (kind, data) in sorted(self.manifests.items()):
            doc = json.loads(data)
            if key.startswith("sha256:") and kind == OCI_MANIFEST_MEDIA_TYPE and doc.get("subject", {}).get("digest") == subject:
                entry = {"mediaType": kind, "digest": key, "size": len(data), "artifactType": doc["artifactType"]}
                if doc.get("annotations"):
                    entry["annotations"] = doc["annotations"]
                out.append(entry)
        return out

    def serve(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        parts = urlsplit(h.path)
        with self.lock:
            self.seen.append((h.command, h.path, h.headers.get("Content-Type", ""), body))
            self._answer(h, h.command, parts.path, parse_qs(parts.query), body)

    def _answer(self, h: BaseHTTPRequestHandler, method: str, path: str, query: dict[str, list[str]], body: bytes) -> None:
        prefix = "/v2/ckpt/web/"
        if not path.startswith(prefix):
            return answer(h, 200 if path == "/v2/" else 404)
        rest = path[len(prefix):]
        if rest == "blobs/uploads/" and method == "POST":
            return answer(h, 202, headers={"Location": f"/v2/ckpt/web/blobs/uploads/{uuid.uuid4()}"})
        if rest.startswith("blobs/uploads/") and method == "PUT":
            digest = query["digest"][0]
            assert sha256_digest(body) == digest
            self.blobs[digest] = body
            return answer(h, 201, headers={"Docker-Content-Digest": digest})
        if rest.startswith("blobs/"):
            data = self.blobs.get(rest[len("blobs/"):])
            return answer(h, 404) if data is None else answer(h, 200, data)
        if rest.startswith("manifests/"):
            target = rest[len("manifests/"):]
            if method == "PUT":
                digest = sha256_digest(body)
                self.manifests[target] = self.manifests[digest] = (h.headers["Content-Type"], body)
                headers = {"Docker-Content-Digest": digest}
                subject = json.loads(body).get("subject")
                if self.api and subject:
                    headers["OCI-Subject"] = subject["digest"]
                return answer(h, 201, headers=headers)
            found = self.manifests.get(target)
            if found is None:
                return answer(h, 404)
            return answer(h, 200, found[1], {"Content-Type": found[0], "Docker-Content-Digest": sha256_digest(found[1])})
        if rest.startswith("referrers/") and self.api and method == "GET":
            entries = self.referrers_of(rest[len("referrers/"):])
            kinds = query.get("artifactType")
            if kinds:
                entries = [e for e in entries if e["artifactType"] in kinds]
            doc = {"schemaVersion": 2, "mediaType": OCI_INDEX_MEDIA_TYPE, "manifests": entries}
            return answer(h, 200, json.dumps(doc).encode(), {"Content-Type": OCI_INDEX_MEDIA_TYPE})
        return answer(h, 404)


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture
def signed(tmp_path: Path, key: Ed25519PrivateKey) -> tuple[Store, CheckpointRecord, str]:
    path = tmp_path / "signing.pem"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    store = Store(tmp_path / "source", chunk_size=256)
    with store.writer() as w:
        w.add_bytes("containers/app/file", b"memory " * 500)
        record = w.commit({"kind": "test"})
    sig = signing.sign_published(str(path), store, record.id)
    assert sig is not None
    return store, record, sig


@pytest.fixture(params=[True, False], ids=["referrers-api", "fallback-tag"])
def registry(request: pytest.FixtureRequest) -> Iterator[MemoryRegistry]:
    reg = MemoryRegistry(referrers_api=request.param)
    try:
        yield reg
    finally:
        reg.close()


def _trusting(key: Ed25519PrivateKey) -> Any:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return from_mapping({"restore": {"trusted-keys": {"*": ["ed25519:" + base64.b64encode(raw).decode()]}}})


def test_push_sends_the_signature_after_the_checkpoint(
    registry: MemoryRegistry, signed: tuple[Store, CheckpointRecord, str], key: Ed25519PrivateKey
) -> None:
    store, record, sig = signed
    push(store, record.id, registry.ref + ":v1", PLAIN)
    puts = registry.requests("PUT", "/manifests/")
    assert [p[1] for p in puts[:2]] == ["/v2/ckpt/web/manifests/v1", f"/v2/ckpt/web/manifests/{sig}"]
    _, _, content_type, body = puts[1]
    assert content_type == OCI_MANIFEST_MEDIA_TYPE and sha256_digest(body) == sig
    manifest = json.loads(body)
    size = len(store.manifest_bytes(record.id))
    assert manifest["subject"] == {"mediaType": OCI_MANIFEST_MEDIA_TYPE, "digest": record.id, "size": size}
    assert manifest["artifactType"] == SIG
    layer = manifest["layers"][0]["digest"]
    assert {manifest["config"]["digest"], layer} <= set(registry.blobs)  # its blobs went before it
    first_blob_put = min(i for i, s in enumerate(registry.seen) if s[0] == "PUT" and layer[7:] in s[1])
    assert first_blob_put < registry.seen.index(puts[1])
    tag = fallback_tag(record.id)
    assert tag == "sha256-" + record.id[7:]
    if registry.api:
        assert len(puts) == 2 and not [s for s in registry.seen if tag in s[1]]  # the registry keeps the referrer
    else:
        assert [(s[0], s[1]) for s in registry.seen if tag in s[1]] == [
            ("GET", f"/v2/ckpt/web/manifests/{tag}"), ("PUT", f"/v2/ckpt/web/manifests/{tag}")]
        _, _, content_type, body = puts[2]
        assert content_type == OCI_INDEX_MEDIA_TYPE
        index = json.loads(body)
        assert index["mediaType"] == OCI_INDEX_MEDIA_TYPE and index["schemaVersion"] == 2
        assert index["manifests"] == [{
            "mediaType": OCI_MANIFEST_MEDIA_TYPE, "digest": sig, "size": len(puts[1][3]), "artifactType": SIG,
            "annotations": {signing.KEY_ID_ANNOTATION: signing.key_id(key.public_key())},
        }]
    # Pushing again adds nothing to the tag.
    push(store, record.id, registry.ref + ":v1", PLAIN)
    if not registry.api:
        assert len(json.loads(registry.manifests[tag][1])["manifests"]) == 1


def test_the_fallback_tag_keeps_what_else_it_lists(signed: tuple[Store, CheckpointRecord, str]) -> None:
    store, record, sig = signed
    reg = MemoryRegistry(referrers_api=False)
    try:
        other = {"mediaType": OCI_MANIFEST_MEDIA_TYPE, "digest": "sha256:" + "5" * 64, "size": 10,
                 "artifactType": "application/vnd.example.sbom"}
        tag = fallback_tag(record.id)
        reg.manifests[tag] = (OCI_INDEX_MEDIA_TYPE, json.dumps(
            {"schemaVersion": 2, "mediaType": OCI_INDEX_MEDIA_TYPE, "manifests": [other]}).encode())
        push(store, record.id, reg.ref + ":v1", PLAIN)
        assert [m["digest"] for m in json.loads(reg.manifests[tag][1])["manifests"]] == [other["digest"], sig]
        # A tag that holds something else is not replaced.
        reg.manifests[tag] = (OCI_MANIFEST_MEDIA_TYPE, b'{"schemaVersion":2}')
        with pytest.raises(FailedPrecondition, match=f"referrers tag {tag}.*refusing to replace it"):
            push(store, record.id, reg.ref + ":v1", PLAIN)
    finally:
        reg.close()


def test_pull_brings_the_signature(
    tmp_path: Path, registry: MemoryRegistry, signed: tuple[Store, CheckpointRecord, str], key: Ed25519PrivateKey
) -> None:
    store, record, sig = signed
    push(store, record.id, registry.ref + ":v1", PLAIN)
    registry.seen.clear()
    dest = Store(tmp_path / "dest")
    assert pull(dest, registry.ref + ":v1", PLAIN).checkpoint_id == record.id
    assert dest.referrers(record.id) == store.referrers(record.id)
    pulled = dest.get(record.id)
    assert signing.require_trusted(dest, pulled, _trusting(key), "prod") == signing.key_id(key.public_key())
    with pytest.raises(PermissionDenied, match="not trusted for namespace 'prod'"):
        signing.require_trusted(dest, pulled, _trusting(Ed25519PrivateKey.generate()), "prod")
    gets = [s[1] for s in registry.requests("GET")]
    listing = f"/v2/ckpt/web/referrers/{record.id}?artifactType=application%2Fvnd.node-agent.signature.v1"
    assert listing in gets
    assert (f"/v2/ckpt/web/manifests/{fallback_tag(record.id)}" in gets) is not registry.api
    assert f"/v2/ckpt/web/manifests/{sig}" in gets
    assert [r.id for r in dest.list()] == [record.id]


def test_an_unsigned_pull_fetches_no_signature(tmp_path: Path, registry: MemoryRegistry) -> None:
    store = Store(tmp_path / "source")
    with store.writer() as w:
        w.add_bytes("f", b"plain")
        record = w.commit({})
    push(store, record.id, registry.ref + ":v1", PLAIN)
    dest = Store(tmp_path / "dest")
    assert pull(dest, registry.ref + ":v1", PLAIN).checkpoint_id == record.id
    assert dest.referrers(record.id) == []
    with pytest.raises(PermissionDenied, match="it has no signature"):
        signing.require_trusted(dest, dest.get(record.id), from_mapping({}), "prod")


def _forged(manifest: bytes, blobs: dict[str, bytes]) -> tuple[bytes, bytes]:
    """The signature with its signature bytes changed (documents consistent, signature wrong)."""
    doc = json.loads(manifest)
    layer = doc["layers"][0]["digest"]
    blob = json.loads(blobs[layer])
    raw = bytearray(base64.b64decode(blob["signature"]))
    raw[3] ^= 1
    new_blob = json.dumps(dict(blob, signature=base64.b64encode(raw).decode()), sort_keys=True,
                          separators=(",", ":")).encode()
    doc["layers"][0] = dict(doc["layers"][0], digest=sha256_digest(new_blob), size=len(new_blob))
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode(), new_blob


def test_hostile_signatures_are_left_out(
    tmp_path: Path, registry: MemoryRegistry, signed: tuple[Store, CheckpointRecord, str], caplog: pytest.LogCaptureFixture
) -> None:
    store, record, sig = signed
    push(store, record.id, registry.ref + ":v1", PLAIN)
    manifest = registry.manifests[sig][1]
    forged, forged_blob = _forged(manifest, registry.blobs)
    forged_digest = sha256_digest(forged)
    registry.blobs[sha256_digest(forged_blob)] = forged_blob
    registry.manifests[forged_digest] = (OCI_MANIFEST_MEDIA_TYPE, forged)
    # The good signature's manifest now answers with other bytes than its digest.
    registry.manifests[sig] = (OCI_MANIFEST_MEDIA_TYPE, manifest.replace(b'"schemaVersion":2', b'"schemaVersion": 2'))
    tag = fallback_tag(record.id)
    if not registry.api:
        entries = json.loads(registry.manifests[tag][1])["manifests"]
        entries.append(dict(entries[0], digest=forged_digest, size=len(forged)))
        registry.manifests[tag] = (OCI_INDEX_MEDIA_TYPE, json.dumps(
            {"schemaVersion": 2, "mediaType": OCI_INDEX_MEDIA_TYPE, "manifests": entries}).encode())
    dest = Store(tmp_path / "dest")
    assert pull(dest, registry.ref + ":v1", PLAIN).checkpoint_id == record.id  # the checkpoint itself is fine
    assert dest.referrers(record.id) == []
    assert f"leaving out signature {sig}" in caplog.text and "hashes to" in caplog.text
    assert f"leaving out signature {forged_digest}" in caplog.text and "does not verify" in caplog.text


def test_a_referrers_api_that_answers_no_index_falls_back_to_the_tag(
    tmp_path: Path, signed: tuple[Store, CheckpointRecord, str]
) -> None:
    store, record, sig = signed
    reg = MemoryRegistry(referrers_api=False)
    try:
        push(store, record.id, reg.ref + ":v1", PLAIN)
        reg.api = True  # now it "has" an API, but it answers every listing with something that is no index
        original = reg._answer

        def garbage(h: BaseHTTPRequestHandler, method: str, path: str, query: dict[str, list[str]], body: bytes) -> None:
            if "/referrers/" in path:
                return answer(h, 200, b"<html>not here</html>", {"Content-Type": "text/html"})
            return original(h, method, path, query, body)

        reg._answer = garbage  # type: ignore[method-assign]
        dest = Store(tmp_path / "dest")
        pull(dest, reg.ref + ":v1", PLAIN)
        assert [d for d, _ in dest.referrers(record.id)] == [sig]
    finally:
        reg.close()


def test_docker_registry_without_a_referrers_api(tmp_path: Path, signed: tuple[Store, CheckpointRecord, str],
                                                 key: Ed25519PrivateKey) -> None:
    store, record, sig = signed
    with Registry(tmp_path / "registry") as reg:
        ref = reg.ref("ckpt/web:v1")
        push(store, record.id, ref, PLAIN)
        status, body = reg.request("GET", f"/v2/ckpt/web/manifests/{fallback_tag(record.id)}",
                                   headers={"Accept": OCI_INDEX_MEDIA_TYPE})
        assert status == 200 and [m["digest"] for m in json.loads(body)["manifests"]] == [sig]
        dest = Store(tmp_path / "dest")
        pull(dest, reg.ref(f"ckpt/web@{record.id}"), PLAIN)
        assert [d for d, _ in dest.referrers(record.id)] == [sig]
        assert signing.require_trusted(dest, dest.get(record.id), _trusting(key), "ns") == signing.key_id(
            key.public_key())
    assert hashlib.sha256(store.manifest_bytes(record.id)).hexdigest() == record.id[7:]
