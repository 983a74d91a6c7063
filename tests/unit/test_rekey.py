"""`checkpoints rekey` signs its copy only when the source is vouched for (signing.sign_copy).

The copy is signed by the node only when the source carries a signature
that verifies under a key trusted for the source's namespace (its
`restore.trusted-keys` entry or "*") or under the node's own signing key;
an unsigned, foreign-signed or tampered source gives an unsigned copy, and
the result says why. The rekeyer runs on a real store; no pod is
involved (a rekey reads and writes the store only).
"""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node_agent import signing
from node_agent.config.loading import from_mapping
from node_agent.config.schema import Settings
from node_agent.oci import EMPTY_DIGEST, OCI_MANIFEST_MEDIA_TYPE, Descriptor, sha256_digest
from node_agent.rekeying import Rekeyer
from node_agent.store import CheckpointRecord, Store
from node_agent.store.sealing import SealKey, StaticKeyring

KEY = SealKey("ns-1", bytes(range(32)), "ns")


def _pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _inline(key: Ed25519PrivateKey) -> str:
    return "ed25519:" + base64.b64encode(signing.raw_public(key.public_key())).decode()


def _key_file(tmp_path: Path, name: str, key: Ed25519PrivateKey) -> str:
    path = tmp_path / f"{name}.pem"
    path.write_bytes(_pem(key))
    path.chmod(0o600)
    return str(path)


class _Sealing(Rekeyer):
    """Seals namespace "ns" under KEY, so a rekey of a clear checkpoint makes a new one."""

    def seal_key(self, namespace: str) -> SealKey | None:
        return KEY if namespace == "ns" else None


class Node:
    def __init__(self, tmp_path: Path, trusted: dict[str, list[str]]) -> None:
        self.key = Ed25519PrivateKey.generate()
        self.key_file = _key_file(tmp_path, "node", self.key)
        self.settings: Settings = from_mapping({
            "store": str(tmp_path / "store"), "signing": {"key-file": self.key_file},
            "restore": {"trusted-keys": trusted},
        })
        self.store = Store(self.settings.store, chunk_size=256, keys=StaticKeyring([KEY]))
        self.rekeyer = _Sealing(self.settings, self.store)

    @property
    def key_id(self) -> str:
        return signing.key_id(self.key.public_key())

    def source(self, data: bytes = b"the source " * 100) -> CheckpointRecord:
        """A clear checkpoint of a pod of namespace "ns", unsigned."""
        meta = {"pod": {"namespace": "ns", "name": "web", "uid": "u1"}}
        with self.store.writer() as w:
            w.add_bytes("containers/app/file", data)
            return w.commit(meta, {"io.node-agent.pod": "ns/web"})


@pytest.fixture
def other() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def _sign(tmp_path: Path, node: Node, record: CheckpointRecord, key: Ed25519PrivateKey) -> None:
    signing.Signer(_key_file(tmp_path, signing.key_id(key.public_key())[8:], key)).sign_into(node.store, record.id)


def _assert_signed_copy(node: Node, source: CheckpointRecord) -> None:
    new, signed = node.rekeyer.rekey(source)
    assert new.id != source.id and new.key_id == KEY.key_id
    assert (signed.signer, signed.unsigned) == (node.key_id, "")
    assert signing.signers(node.store, new.id) == [node.key_id]


def _assert_unsigned_copy(node: Node, source: CheckpointRecord, why: str) -> str:
    new, signed = node.rekeyer.rekey(source)
    assert new.id != source.id and new.key_id == KEY.key_id
    assert signed.signer == "" and why in signed.unsigned, signed.unsigned
    assert signed.unsigned.startswith(f"its source {source.id} carries no signature that verifies under a key "
                                      "trusted for namespace 'ns' or under this node's key: ")
    assert node.store.referrers(new.id) == []
    assert {r.id for r in node.store.list()} == {source.id, new.id}
    return signed.unsigned


def test_an_unsigned_source_gives_an_unsigned_copy(tmp_path: Path, other: Ed25519PrivateKey,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    node = Node(tmp_path, {"*": [_inline(other)]})
    source = node.source()
    with caplog.at_level(logging.WARNING, logger="node_agent.signing"):
        _assert_unsigned_copy(node, source, "it has no signature")
    assert "is left unsigned" in caplog.text and source.id in caplog.text


@pytest.mark.parametrize("scope", ["ns", "*"])
def test_a_source_signed_by_a_trusted_key_gives_a_signed_copy(tmp_path: Path, other: Ed25519PrivateKey,
                                                             scope: str) -> None:
    node = Node(tmp_path, {scope: [_inline(other)]})
    source = node.source()
    _sign(tmp_path, node, source, other)
    _assert_signed_copy(node, source)


def test_a_source_signed_by_an_untrusted_key_gives_an_unsigned_copy(tmp_path: Path, other: Ed25519PrivateKey) -> None:
    stranger = Ed25519PrivateKey.generate()
    # `other` is trusted, but for another namespace only; `stranger` for none.
    node = Node(tmp_path, {"elsewhere": [_inline(other)]})
    source = node.source()
    _sign(tmp_path, node, source, other)
    _sign(tmp_path, node, source, stranger)
    why = _assert_unsigned_copy(node, source, "which is not trusted for namespace 'ns' nor this node's key")
    assert signing.key_id(other.public_key()) in why and signing.key_id(stranger.public_key()) in why


def test_a_source_signed_by_the_nodes_own_key_gives_a_signed_copy(tmp_path: Path) -> None:
    node = Node(tmp_path, {})  # nothing trusted: the node's own key is enough
    source = node.source()
    _sign(tmp_path, node, source, node.key)
    _assert_signed_copy(node, source)


def test_a_tampered_signature_gives_an_unsigned_copy(tmp_path: Path, other: Ed25519PrivateKey) -> None:
    node = Node(tmp_path, {"*": [_inline(other)]})
    source = node.source()
    size = Path(node.store.manifest_path(source.id)).stat().st_size
    art = signing.signature_artifact(other, Descriptor(OCI_MANIFEST_MEDIA_TYPE, source.id, size))
    manifest: dict[str, Any] = json.loads(art.manifest)
    blob = json.loads(art.blobs[manifest["layers"][0]["digest"]])
    forged = bytearray(base64.b64decode(blob["signature"]))
    forged[7] ^= 0x01
    layer = json.dumps(dict(blob, signature=base64.b64encode(forged).decode()), sort_keys=True,
                       separators=(",", ":")).encode()
    manifest["layers"] = [dict(manifest["layers"][0], digest=sha256_digest(layer), size=len(layer))]
    data = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    node.store.attach(source.id, data, {sha256_digest(layer): layer, EMPTY_DIGEST: b"{}"})
    _assert_unsigned_copy(node, source, "a signature does not verify, so it was tampered with")


def test_a_copy_that_is_the_source_is_left_as_it_is(tmp_path: Path) -> None:
    node = Node(tmp_path, {})
    sealed, _ = node.rekeyer.rekey(node.source())  # unsigned source: an unsigned sealed copy
    again, signed = node.rekeyer.rekey(sealed)
    assert again.id == sealed.id and signed == signing.CopySignature()
    assert node.store.referrers(sealed.id) == []


def test_without_a_signing_key_nothing_is_signed(tmp_path: Path, other: Ed25519PrivateKey) -> None:
    node = Node(tmp_path, {"*": [_inline(other)]})
    node.rekeyer.settings = from_mapping({"store": node.settings.store, "restore": {"trusted-keys": {"*": [_inline(other)]}}})
    source = node.source()
    _sign(tmp_path, node, source, other)
    new, signed = node.rekeyer.rekey(source)
    assert new.id != source.id and signed == signing.CopySignature()
    assert node.store.referrers(new.id) == []
