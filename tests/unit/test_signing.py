"""Checkpoint signatures (node_agent.signing) and referrers in the store (node_agent.store.referrers).

Keys from files and inline; the signature documents as hostile input; a
tampered signature, an unknown signer and an unsigned checkpoint refused by
`require_trusted` with the checkpoint and the reason named; referrers in a
real store: attached, listed, never taken for checkpoints, and gone with
their checkpoint (remove, retention, a rebuilt index keeps them).
"""

from __future__ import annotations

import base64
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Callable

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node_agent import signing
from node_agent.config.loading import from_mapping
from node_agent.config.schema import Settings
from node_agent.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from node_agent.oci import EMPTY_DIGEST, OCI_MANIFEST_MEDIA_TYPE, Descriptor, sha256_digest
from node_agent.store import CheckpointRecord, RetentionPolicy, Store
from node_agent.store.documents import CREATED_ANNOTATION
from node_agent.store.referrers import SUBJECT_ANNOTATION

T0 = datetime(2026, 3, 1, tzinfo=UTC).timestamp()
SUBJECT = "sha256:" + "ab" * 32


def _pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _pub_pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _inline(key: Ed25519PrivateKey) -> str:
    return "ed25519:" + base64.b64encode(signing.raw_public(key.public_key())).decode()


def _trusting(table: dict[str, list[str]]) -> Settings:
    return from_mapping({"restore": {"require-signature": True, "trusted-keys": table}})


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture
def key_file(tmp_path: Path, key: Ed25519PrivateKey) -> str:
    path = tmp_path / "signing.pem"
    path.write_bytes(_pem(key))
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store", chunk_size=256)


def _commit(store: Store, data: bytes = b"hello " * 100, *, at: float = 0, pod: str = "ns/web") -> CheckpointRecord:
    created = datetime.fromtimestamp(T0 + at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    with store.writer() as w:
        w.add_bytes("containers/app/file", data)
        return w.commit({"kind": "test"}, {CREATED_ANNOTATION: created, "io.node-agent.pod": pod})


def _index(store: Store) -> list[dict[str, Any]]:
    return list(json.loads(Path(store.index_path).read_bytes())["manifests"])


def _blobs(store: Store) -> set[str]:
    return {"sha256:" + name for name in os.listdir(store.blobs.dir)}


# -- keys ---------------------------------------------------------------------------------


def test_key_ids_and_key_files(tmp_path: Path, key: Ed25519PrivateKey, key_file: str) -> None:
    raw = signing.raw_public(key.public_key())
    kid = signing.key_id(key.public_key())
    assert kid == "ed25519:" + __import__("hashlib").sha256(raw).hexdigest()[:16] == signing.key_id(raw)
    assert signing.key_id(signing.load_private_key(key_file).public_key()) == kid

    missing = str(tmp_path / "nope.pem")
    with pytest.raises(FailedPrecondition, match=f"signing.key-file {missing}: cannot read it"):
        signing.load_private_key(missing)
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    with pytest.raises(InvalidArgument, match=f"{garbage}: not a PEM private key"):
        signing.load_private_key(str(garbage))
    other = tmp_path / "ec.pem"
    other.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(InvalidArgument, match=f"{other}: .*not an Ed25519 key"):
        signing.load_private_key(str(other))
    locked = tmp_path / "locked.pem"
    locked.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.BestAvailableEncryption(b"pw")))
    with pytest.raises(InvalidArgument, match=f"{locked}: the key is encrypted"):
        signing.load_private_key(str(locked))
    huge = tmp_path / "huge.pem"
    huge.write_bytes(b"x" * (signing.MAX_KEY_FILE_BYTES + 1))
    with pytest.raises(InvalidArgument, match="more than"):
        signing.load_private_key(str(huge))
    fifo = tmp_path / "fifo.pem"
    os.mkfifo(fifo)
    with pytest.raises(FailedPrecondition, match=f"{fifo}: not a regular file"):
        signing.load_private_key(str(fifo))  # refused, not waited on


def test_trusted_keys_inline_and_in_files(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    raw = signing.raw_public(key.public_key())
    assert signing.raw_public(signing.load_public_key(_inline(key))) == raw
    pub = tmp_path / "k.pub"
    pub.write_bytes(_pub_pem(key))
    assert signing.raw_public(signing.load_public_key(str(pub))) == raw
    other = Ed25519PrivateKey.generate()
    table = {"prod": [str(pub)], "*": [_inline(other)]}
    assert set(signing.trusted_keys(table, "prod").values()) == {signing.key_id(raw), signing.key_id(other.public_key())}
    assert set(signing.trusted_keys(table, "dev").values()) == {signing.key_id(other.public_key())}

    with pytest.raises(InvalidArgument, match="32"):
        signing.load_public_key("ed25519:" + base64.b64encode(b"short").decode())
    with pytest.raises(InvalidArgument, match="a key id names a key"):
        signing.load_public_key(signing.key_id(raw))
    for bad in ("ed25519:not base64!", "ed25519:" + base64.b64encode(raw).decode().rstrip("=")):
        with pytest.raises(InvalidArgument, match="base64"):
            signing.load_public_key(bad)
    with pytest.raises(InvalidArgument, match="neither an absolute path"):
        signing.load_public_key("keys/k.pub")
    private = tmp_path / "private.pem"
    private.write_bytes(_pem(key))
    with pytest.raises(InvalidArgument, match=f"{private}: not a PEM public key"):
        signing.load_public_key(str(private))
    with pytest.raises(FailedPrecondition, match=r"restore.trusted-keys\['x'\] /gone.pub: cannot read it"):
        signing.trusted_keys({"x": ["/gone.pub"]}, "x")


def test_the_signer_reads_the_key_again_when_the_file_changes(tmp_path: Path, key: Ed25519PrivateKey, key_file: str) -> None:
    signer = signing.Signer(key_file)
    assert signer.key_id == signing.key_id(key.public_key())
    new = Ed25519PrivateKey.generate()
    swapped = tmp_path / "swapped.pem"
    swapped.write_bytes(_pem(new))
    os.replace(swapped, key_file)  # as a Secret's update does: a new inode
    assert signer.key_id == signing.key_id(new.public_key())
    Path(key_file).write_bytes(b"-----BEGIN PRIVATE KEY-----\nbroken\n-----END PRIVATE KEY-----\n")
    with pytest.raises(InvalidArgument, match=key_file):
        signer.sign(Descriptor(OCI_MANIFEST_MEDIA_TYPE, SUBJECT, 100))  # never the old key instead
    os.unlink(key_file)
    with pytest.raises(FailedPrecondition, match=key_file):
        signer.key()


# -- the documents, as hostile input ------------------------------------------------------


def _artifact(key: Ed25519PrivateKey, subject: str = SUBJECT) -> signing.SignatureArtifact:
    return signing.signature_artifact(key, Descriptor(OCI_MANIFEST_MEDIA_TYPE, subject, 548))


def _parts(art: signing.SignatureArtifact) -> tuple[dict[str, Any], dict[str, Any]]:
    manifest = json.loads(art.manifest)
    return manifest, json.loads(art.blobs[manifest["layers"][0]["digest"]])


def _encode(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _rebuilt(manifest: dict[str, Any], blob: dict[str, Any] | bytes) -> tuple[bytes, bytes]:
    """The documents again, with the manifest's layer descriptor fitted to the (changed) blob."""
    data = blob if isinstance(blob, bytes) else _encode(blob)
    manifest = dict(manifest, layers=[dict(manifest["layers"][0], digest=sha256_digest(data), size=len(data))])
    return _encode(manifest), data


def test_a_signature_verifies_and_is_canonical(key: Ed25519PrivateKey) -> None:
    art = _artifact(key)
    manifest, blob = _parts(art)
    assert manifest["artifactType"] == signing.SIGNATURE_ARTIFACT_TYPE
    assert manifest["config"] == {"mediaType": "application/vnd.oci.empty.v1+json", "digest": EMPTY_DIGEST, "size": 2}
    assert manifest["subject"] == {"mediaType": OCI_MANIFEST_MEDIA_TYPE, "digest": SUBJECT, "size": 548}
    assert manifest["annotations"] == {signing.KEY_ID_ANNOTATION: art.key_id}
    assert set(blob) == {"keyId", "publicKey", "signature", "subject"} and blob["subject"] == SUBJECT
    assert art.blobs[EMPTY_DIGEST] == b"{}" and art.digest == sha256_digest(art.manifest)
    layer = art.blobs[manifest["layers"][0]["digest"]]
    assert signing.verify(art.manifest, layer, SUBJECT) == art.key_id == signing.key_id(key.public_key())
    assert _artifact(key).manifest == art.manifest  # deterministic: signing again changes nothing
    key.public_key().verify(base64.b64decode(blob["signature"]), signing.CONTEXT + SUBJECT.encode())


MANIFEST_FAULTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "an unknown key": lambda m: m.update(extra=1),
    "a missing key": lambda m: m.pop("annotations"),
    "another artifact type": lambda m: m.update(artifactType="application/vnd.node-agent.checkpoint.v1"),
    "a config that is not empty": lambda m: m.update(config=dict(m["config"], size=3)),
    "two layers": lambda m: m.update(layers=m["layers"] * 2),
    "a layer of another type": lambda m: m.update(layers=[dict(m["layers"][0], mediaType="text/plain")]),
    "a descriptor with more keys": lambda m: m.update(subject=dict(m["subject"], urls=[])),
    "a subject that is not a manifest": lambda m: m.update(subject=dict(m["subject"], mediaType="text/plain")),
    "a boolean schemaVersion": lambda m: m.update(schemaVersion=True),
    "a malformed key id": lambda m: m.update(annotations={signing.KEY_ID_ANNOTATION: "ed25519:XYZ"}),
    "another annotation": lambda m: m["annotations"].update(more="x"),
}


@pytest.mark.parametrize("fault", sorted(MANIFEST_FAULTS))
def test_malformed_manifests_are_refused(key: Ed25519PrivateKey, fault: str) -> None:
    manifest, blob = _parts(_artifact(key))
    MANIFEST_FAULTS[fault](manifest)
    data, layer = _encode(manifest), _encode(blob)
    with pytest.raises(signing.SignatureError) as err:
        signing.verify(data, layer, SUBJECT)
    assert err.value.kind == "malformed" and isinstance(err.value, PermissionDenied)


BLOB_FAULTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "an unknown key": lambda b: b.update(extra=1),
    "a key id not of its key": lambda b: b.update(keyId="ed25519:" + "0" * 16),
    "unpadded base64": lambda b: b.update(signature=b["signature"].rstrip("=")),
    "a short key": lambda b: b.update(publicKey=base64.b64encode(b"k" * 31).decode()),
    "a signature that is not a string": lambda b: b.update(signature=7),
    "a malformed subject": lambda b: b.update(subject="sha256:XY"),
}


@pytest.mark.parametrize("fault", sorted(BLOB_FAULTS))
def test_malformed_blobs_are_refused(key: Ed25519PrivateKey, fault: str) -> None:
    manifest, blob = _parts(_artifact(key))
    BLOB_FAULTS[fault](blob)
    with pytest.raises(signing.SignatureError) as err:
        signing.verify(*_rebuilt(manifest, blob), SUBJECT)
    assert err.value.kind == "malformed"


@pytest.mark.parametrize("raw", [
    b'{"a":1,"a":2}', b"[]", b"\xff", b'{"schemaVersion": NaN}', b"{" * 100, b" " * (signing.MAX_SIGNATURE_MANIFEST_BYTES + 1),
])
def test_what_is_not_a_document_is_refused(raw: bytes) -> None:
    with pytest.raises(signing.SignatureError, match="signature manifest"):
        signing.decode_signature_manifest(raw)
    with pytest.raises(signing.SignatureError, match="signature blob"):
        signing.decode_signature_blob(raw)


def test_a_tampered_signature_and_another_subject(key: Ed25519PrivateKey) -> None:
    manifest, blob = _parts(_artifact(key))
    forged = bytearray(base64.b64decode(blob["signature"]))
    forged[0] ^= 1
    with pytest.raises(signing.SignatureError, match="does not verify") as err:
        signing.verify(*_rebuilt(manifest, dict(blob, signature=base64.b64encode(forged).decode())), SUBJECT)
    assert err.value.kind == "tampered"
    # A whole other key's signature under this key's name: the key id no longer fits.
    other = _parts(_artifact(Ed25519PrivateKey.generate()))[1]
    with pytest.raises(signing.SignatureError, match="keyId"):
        signing.verify(*_rebuilt(manifest, dict(other, keyId=blob["keyId"])), SUBJECT)
    # The blob changed but the manifest not: it no longer matches its descriptor.
    data = _encode(manifest)
    with pytest.raises(signing.SignatureError, match="does not match") as err:
        signing.verify(data, _encode(dict(blob, signature=base64.b64encode(forged).decode())), SUBJECT)
    assert err.value.kind == "tampered"
    # A good signature of another checkpoint.
    with pytest.raises(signing.SignatureError, match="not sha256:cd") as err:
        signing.verify(data, _encode(blob), "sha256:" + "cd" * 32)
    assert err.value.kind == "subject"
    moved = dict(manifest, subject=dict(manifest["subject"], digest="sha256:" + "cd" * 32))
    with pytest.raises(signing.SignatureError, match="signs " + SUBJECT) as err:
        signing.verify(*_rebuilt(moved, blob), "sha256:" + "cd" * 32)
    assert err.value.kind == "subject"


# -- require_trusted ----------------------------------------------------------------------


def test_an_unsigned_checkpoint_is_refused(store: Store, key: Ed25519PrivateKey) -> None:
    record = _commit(store)
    with pytest.raises(PermissionDenied) as err:
        signing.require_trusted(store, record, _trusting({"*": [_inline(key)]}), "prod")
    assert str(err.value) == f"checkpoint {record.id} may not be restored into namespace 'prod': it has no signature"


def test_trusted_and_untrusted_signers(tmp_path: Path, store: Store, key: Ed25519PrivateKey, key_file: str) -> None:
    record = _commit(store)
    signing.Signer(key_file).sign_into(store, record.id)
    kid = signing.key_id(key.public_key())
    pub = tmp_path / "node.pub"
    pub.write_bytes(_pub_pem(key))
    assert signing.require_trusted(store, record, _trusting({"*": [_inline(key)]}), "prod") == kid
    assert signing.require_trusted(store, record, _trusting({"prod": [str(pub)]}), "prod") == kid

    other = Ed25519PrivateKey.generate()
    with pytest.raises(PermissionDenied) as err:
        signing.require_trusted(store, record, _trusting({"prod": [str(pub)], "*": [_inline(other)]}), "dev")
    assert str(err.value).startswith(f"checkpoint {record.id} may not be restored into namespace 'dev': it is signed "
                                     f"by {kid}, which is not trusted for namespace 'dev'")
    assert signing.key_id(other.public_key()) in str(err.value)
    with pytest.raises(PermissionDenied, match=f"signed by {kid}, .*trusts no key there"):
        signing.require_trusted(store, record, _trusting({}), "prod")

    # Signed by two keys: one trusted is enough.
    other_file = tmp_path / "other.pem"
    other_file.write_bytes(_pem(other))
    signing.Signer(str(other_file)).sign_into(store, record.id)
    assert len(store.referrers(record.id)) == 2
    assert signing.require_trusted(store, record, _trusting({"dev": [_inline(other)]}), "dev") == signing.key_id(
        other.public_key())


def test_a_tampered_signature_is_refused(store: Store, key: Ed25519PrivateKey) -> None:
    record = _commit(store)
    manifest, blob = _parts(_artifact(key, record.id))
    manifest["subject"]["size"] = os.path.getsize(store.manifest_path(record.id))
    forged = bytearray(base64.b64decode(blob["signature"]))
    forged[5] ^= 0x40
    data, layer = _rebuilt(manifest, dict(blob, signature=base64.b64encode(forged).decode()))
    store.attach(record.id, data, {sha256_digest(layer): layer, EMPTY_DIGEST: b"{}"})  # the store keeps any referrer
    with pytest.raises(PermissionDenied) as err:
        signing.require_trusted(store, record, _trusting({"*": [_inline(key)]}), "prod")
    text = str(err.value)
    assert text.startswith(f"checkpoint {record.id} may not be restored into namespace 'prod': a signature does not "
                           "verify, so it was tampered with")
    assert signing.key_id(key.public_key()) in text
    assert signing.signers(store, record.id) == []  # a forged signature names nobody


def test_signers_are_the_keys_whose_signatures_verify(store: Store, key_file: str, key: Ed25519PrivateKey) -> None:
    record = _commit(store)
    assert signing.signers(store, record.id) == []
    signing.Signer(key_file).sign_into(store, record.id)
    assert signing.signers(store, record.id) == [signing.key_id(key.public_key())]


def test_a_signature_damaged_on_disk_is_refused(store: Store, key_file: str, key: Ed25519PrivateKey) -> None:
    record = _commit(store)
    signing.Signer(key_file).sign_into(store, record.id)
    (_, manifest), = store.referrers(record.id)
    layer = json.loads(manifest)["layers"][0]["digest"]
    path = Path(store.blob_path(layer))
    path.write_bytes(path.read_bytes().replace(b'"subject"', b'"subjekt"'))
    with pytest.raises(PermissionDenied, match=f"does not verify.*{layer}.*digest mismatch"):
        signing.require_trusted(store, record, _trusting({"*": [_inline(key)]}), "prod")


def test_sign_published(store: Store, key_file: str, tmp_path: Path) -> None:
    record = _commit(store)
    assert signing.sign_published("", store, record.id) is None and store.referrers(record.id) == []
    digest = signing.sign_published(key_file, store, record.id)
    assert [d for d, _ in store.referrers(record.id, signing.SIGNATURE_ARTIFACT_TYPE)] == [digest]
    assert signing.sign_published(key_file, store, record.id) == digest  # the same signature: attached once
    assert len([e for e in _index(store) if SUBJECT_ANNOTATION in e.get("annotations", {})]) == 1
    # A key that cannot be read: the checkpoint does not stay, unsigned.
    second = _commit(store, b"other content")
    with pytest.raises(FailedPrecondition, match=f"checkpoint {second.id} was not kept: signing it failed: .*nope.pem"):
        signing.sign_published(str(tmp_path / "nope.pem"), store, second.id)
    assert [r.id for r in store.list()] == [record.id]


# -- referrers in the store ---------------------------------------------------------------


def test_referrers_are_kept_beside_their_checkpoint_and_never_listed_as_one(store: Store, key_file: str) -> None:
    record = _commit(store)
    digest = signing.Signer(key_file).sign_into(store, record.id)
    (got, manifest), = store.referrers(record.id)
    assert got == digest == sha256_digest(manifest)
    assert store.referrers(record.id[:19]) == [(got, manifest)]
    assert store.referrers(record.id, "application/x-other") == []
    entry = [e for e in _index(store) if e["digest"] == digest][0]
    assert entry["artifactType"] == signing.SIGNATURE_ARTIFACT_TYPE and entry["mediaType"] == OCI_MANIFEST_MEDIA_TYPE
    assert entry["annotations"][SUBJECT_ANNOTATION] == record.id
    assert [r.id for r in store.list()] == [record.id] and store.scan()[1] == []
    for name in (digest, digest[7:19]):
        with pytest.raises(NotFound):
            store.get(name)
    with pytest.raises(NotFound):
        store.remove(digest)
    assert store.verify(record.id) == []
    assert store.gc().removed_blobs == ()  # nothing of it is garbage


def test_attach_checks_everything_first(store: Store, key: Ed25519PrivateKey) -> None:
    record = _commit(store)
    size = os.path.getsize(store.manifest_path(record.id))
    art = signing.signature_artifact(key, Descriptor(OCI_MANIFEST_MEDIA_TYPE, record.id, size))
    before = _blobs(store)
    with pytest.raises(NotFound):
        store.attach("sha256:" + "12" * 32, art.manifest, art.blobs)
    with pytest.raises(InvalidArgument, match="not checkpoint"):
        store.attach(_commit(store, b"second").id, art.manifest, art.blobs)
    wrong_size = signing.signature_artifact(key, Descriptor(OCI_MANIFEST_MEDIA_TYPE, record.id, size + 1))
    with pytest.raises(InvalidArgument, match="size"):
        store.attach(record.id, wrong_size.manifest, wrong_size.blobs)
    layer = next(d for d in art.blobs if d != EMPTY_DIGEST)
    with pytest.raises(InvalidArgument, match="does not match its descriptor"):
        store.attach(record.id, art.manifest, {**art.blobs, layer: art.blobs[layer][:-1] + b" "})
    with pytest.raises(InvalidArgument, match="does not name blob"):
        store.attach(record.id, art.manifest, {**art.blobs, sha256_digest(b"x"): b"x"})
    with pytest.raises(FailedPrecondition, match=f"blob {layer} is not stored"):
        store.attach(record.id, art.manifest, {EMPTY_DIGEST: b"{}"})
    with pytest.raises(InvalidArgument, match="referrer manifest"):
        store.attach(record.id, store.manifest_bytes(record.id))  # a checkpoint is no referrer
    assert store.referrers(record.id) == []
    store.gc()
    assert not store.has_blob(layer) and not store.has_blob(art.digest)  # nothing of it was kept
    assert store.attach(record.id, art.manifest, art.blobs) == art.digest
    assert store.has_blob(layer) and store.has_blob(art.digest) and before < _blobs(store)


def test_removing_a_checkpoint_removes_its_referrers(store: Store, key_file: str) -> None:
    empty = _blobs(store)
    record = _commit(store)
    signing.Signer(key_file).sign_into(store, record.id)
    report = store.remove(record.id)
    assert report.removed_checkpoints == (record.id,)
    assert _index(store) == [] and _blobs(store) == empty
    assert store.referrers(record.id) == []


def test_retention_drops_referrers_with_their_checkpoints(store: Store, key_file: str) -> None:
    signer = signing.Signer(key_file)
    old = _commit(store, b"old " * 100, at=0)
    new = _commit(store, b"new " * 100, at=60)
    old_sig, new_sig = signer.sign_into(store, old.id), signer.sign_into(store, new.id)
    dry = store.gc(RetentionPolicy(max_per_group=1), dry_run=True)
    assert dry.removed_checkpoints == (old.id,) and old_sig in dry.removed_blobs and new_sig not in dry.removed_blobs
    assert len(store.referrers(old.id)) == 1  # a dry run touches nothing
    report = store.gc(RetentionPolicy(max_per_group=1))
    assert report.removed_checkpoints == (old.id,) and old_sig in report.removed_blobs
    assert [e["digest"] for e in _index(store)] == [new.id, new_sig]
    assert [d for d, _ in store.referrers(new.id)] == [new_sig]
    assert not os.path.exists(store.blob_path(old_sig))


def test_retention_by_size_counts_a_signature_with_its_checkpoint(store: Store, key_file: str) -> None:
    signer = signing.Signer(key_file)
    old = _commit(store, os.urandom(4000), at=0)
    new = _commit(store, os.urandom(4000), at=60)
    signer.sign_into(store, old.id)
    signer.sign_into(store, new.id)
    usage = store.usage()
    report = store.gc(RetentionPolicy(max_total_bytes=usage - 1))
    assert report.removed_checkpoints == (old.id,)  # what the old one and its signature free is enough
    assert [r.id for r in store.list()] == [new.id] and len(store.referrers(new.id)) == 1


def test_a_rebuilt_index_finds_the_signatures_again(store: Store, key_file: str, key: Ed25519PrivateKey) -> None:
    record = _commit(store)
    digest = signing.Signer(key_file).sign_into(store, record.id)
    Path(store.index_path).write_bytes(b"{broken")
    report = store.recover()
    assert report.index_rebuilt
    assert [d for d, _ in store.referrers(record.id)] == [digest]
    assert signing.require_trusted(store, record, _trusting({"*": [_inline(key)]}), "ns") == signing.key_id(
        key.public_key())


def test_an_unreadable_referrer_is_left_out(store: Store, key_file: str, caplog: pytest.LogCaptureFixture) -> None:
    record = _commit(store)
    digest = signing.Signer(key_file).sign_into(store, record.id)
    os.unlink(store.blob_path(digest))
    assert store.referrers(record.id) == []
    assert "skipping unreadable referrer" in caplog.text
    with pytest.raises(InvalidArgument):
        store.read_blob(EMPTY_DIGEST, 5 << 20)
    with pytest.raises(DataLoss):
        store.read_blob(digest, 10)


def test_the_checkpointer_signs_what_it_publishes(tmp_path: Path, key_file: str, key: Ed25519PrivateKey) -> None:
    from node_agent.checkpointing import Checkpointer
    from node_agent.metrics import Metrics

    work = tmp_path / "work"
    (work / "containers" / "app").mkdir(parents=True)
    (work / "containers" / "app" / "config.dump").write_bytes(b"{}")
    meta = {"pod": {"namespace": "ns", "name": "web", "uid": "u1"}, "containers": [{"name": "app", "image": "img"}]}

    def checkpointer(signing_key: str) -> tuple[Checkpointer, Store]:
        settings = from_mapping({"store": str(tmp_path / "store"), "signing": {"key-file": signing_key}})
        store = Store(settings.store, chunk_size=256)
        return Checkpointer(settings, None, store, None, None, Metrics()), store  # type: ignore[arg-type]

    ckpt, store = checkpointer(key_file)
    record = ckpt._ingest(str(work), meta)
    assert signing.require_trusted(store, record, _trusting({"ns": [_inline(key)]}), "ns") == signing.key_id(
        key.public_key())
    ckpt, store = checkpointer(str(tmp_path / "gone.pem"))
    meta["pod"]["uid"] = "u2"
    with pytest.raises(FailedPrecondition, match="was not kept: signing it failed"):
        ckpt._ingest(str(work), meta)
    assert [r.id for r in store.list()] == [record.id]  # the unsigned one did not stay
    ckpt, store = checkpointer("")
    unsigned = ckpt._ingest(str(work), meta)
    assert store.referrers(unsigned.id) == []
