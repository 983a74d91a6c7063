"""Sealed (encrypted) checkpoints in the store: round trips, dedup per domain, what stays in the clear, versions."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from node_agent.errors import DataLoss, FailedPrecondition
from node_agent.store import Store, codec
from node_agent.store.documents import (
    CHUNK_SEALED_MEDIA_TYPE,
    CONFIG_SEALED_MEDIA_TYPE,
    IDENTITY,
    KEY_ID_ANNOTATION,
    ZSTD,
)
from node_agent.store.sealing import (
    CHUNK,
    CONFIG,
    SealError,
    SealKey,
    StaticKeyring,
    is_sealed,
    key_id_of,
    overhead,
    parse_header,
)

SECRET = b"na-secret-" + b"7f3a9c" * 6
KEY_A = SealKey("team-a-1", bytes(range(32)), "team-a")
KEY_A2 = SealKey("team-a-2", bytes(range(1, 33)), "team-a")
KEY_B = SealKey("team-b-1", bytes(range(2, 34)), "team-b")


def _tree(root: Path) -> Path:
    src = root / "src"
    (src / "d").mkdir(parents=True)
    rnd = os.urandom(3 << 20)
    (src / "pages-1.img").write_bytes(rnd[: 1 << 20] + SECRET + rnd[1 << 20 :])
    (src / "d" / "zeros.img").write_bytes(bytes(2 << 20) + SECRET * 100)
    (src / "empty").write_bytes(b"")
    return src


def _commit(store: Store, src: Path, seal: SealKey | None, **meta: object) -> str:
    with store.writer(seal=seal) as w:
        w.add_tree("", str(src))
        return w.commit({"pod": "ns/p", **meta}, {"io.node-agent.pod": "ns/p"}).id


def _stored_bytes(store: Store) -> bytes:
    return b"".join(p.read_bytes() for p in Path(store.blobs.dir).iterdir())


def _plain_digests(src: Path, store: Store, cid: str) -> set[str]:
    out: set[str] = set()
    rec = store.get(cid)
    for entry in rec.files:
        if entry.is_dir:
            continue
        data = (src / entry.path).read_bytes()
        for chunk in entry.chunks:
            out.add(hashlib.sha256(data[chunk.offset : chunk.offset + chunk.size]).hexdigest())
    return out


def test_round_trip_and_nothing_readable_in_the_clear(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    store = Store(tmp_path / "store", keys=StaticKeyring([KEY_A]))
    cid = _commit(store, src, KEY_A)
    rec = store.get(cid)
    assert rec.key_id == "team-a-1" and not rec.locked and rec.annotations[KEY_ID_ANNOTATION] == "team-a-1"
    assert all(c.sealed and c.plain for e in rec.files for c in e.chunks)
    dest = tmp_path / "out"
    dest.mkdir()
    store.materialize(cid, dest)
    for name in ("pages-1.img", "d/zeros.img", "empty"):
        assert (dest / name).read_bytes() == (src / name).read_bytes()
    with store.open(cid, "pages-1.img") as r:
        assert r.pread(1 << 20, len(SECRET)) == SECRET
    assert store.verify(cid) == []
    blobs = _stored_bytes(store)
    assert SECRET not in blobs and b"7f3a9c" not in blobs
    manifest = store.manifest_bytes(cid)
    assert CONFIG_SEALED_MEDIA_TYPE.encode() in manifest and CHUNK_SEALED_MEDIA_TYPE.encode() in manifest
    # No plaintext digest anywhere outside the ciphertext: not in the manifest, the index, any blob.
    clear = blobs + Path(store.index_path).read_bytes()
    for hexd in _plain_digests(src, store, cid):
        assert hexd.encode() not in clear
    # Descriptors name the ciphertext: every layer hashes to its digest.
    for desc in store.descriptors(cid):
        assert hashlib.sha256(Path(store.blob_path(desc.digest)).read_bytes()).hexdigest() == desc.digest[7:]


def test_dedup_within_a_domain_and_never_across(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    store = Store(tmp_path / "store", keys=StaticKeyring([KEY_A, KEY_B]))
    first = _commit(store, src, KEY_A)
    before = store.usage()
    second = _commit(store, src, KEY_A, again=True)
    grown = store.usage() - before
    assert first != second and grown < 16 << 10  # a new config and manifest only
    layers_a = {d.digest for d in store.descriptors(first)[1:]}
    assert layers_a == {d.digest for d in store.descriptors(second)[1:]}
    other = _commit(store, src, KEY_B)
    layers_b = {d.digest for d in store.descriptors(other)[1:]}
    assert not layers_a & layers_b
    plain = _commit(store, src, None)
    assert not {d.digest for d in store.descriptors(plain)[1:]} & (layers_a | layers_b)


def test_flipped_ciphertext_bit_is_data_loss_naming_the_chunk(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    store = Store(tmp_path / "store", keys=StaticKeyring([KEY_A]))
    cid = _commit(store, src, KEY_A)
    chunk = store.get(cid).entry("pages-1.img").chunks[0]
    path = Path(store.blob_path(chunk.digest))
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01
    path.write_bytes(bytes(data))
    bad = store.verify(cid)
    assert [b.digest for b in bad] == [chunk.digest] and bad[0].paths == ("pages-1.img",)
    (tmp_path / "o").mkdir()
    with pytest.raises(DataLoss, match=chunk.digest):
        store.materialize(cid, tmp_path / "o", prefix="pages-1.img")
    assert not list((tmp_path / "o").iterdir())


def test_altered_sealed_bytes_fail_authentication() -> None:
    plain = hashlib.sha256(b"content").digest()
    blob = KEY_A.seal(CHUNK, b"content", plain)
    assert len(blob) == len(b"content") + overhead(KEY_A.key_id)
    assert KEY_A.seal(CHUNK, b"content", plain) == blob  # convergent
    assert KEY_A.open(CHUNK, blob, plain) == b"content"
    for i in (0, 5, 10, 30, len(blob) - 1):
        bad = bytearray(blob)
        bad[i] ^= 0x80
        with pytest.raises(SealError):
            KEY_A.open(CHUNK, bytes(bad), plain)
    with pytest.raises(SealError, match="authentication"):  # a chunk given another's place
        KEY_A.open(CHUNK, blob, hashlib.sha256(b"other").digest())
    with pytest.raises(SealError):
        KEY_A.open(CONFIG, blob)
    with pytest.raises(SealError, match="team-a-1"):
        KEY_A2.open(CHUNK, blob, plain)
    impostor = SealKey("team-a-1", bytes(32))
    with pytest.raises(SealError, match="authentication"):
        impostor.open(CHUNK, blob, plain)
    with pytest.raises(SealError):
        KEY_A.open(CHUNK, blob[:20], plain)


def test_missing_key_names_it_and_listing_removal_gc_still_work(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    root = tmp_path / "store"
    made = Store(root, keys=StaticKeyring([KEY_A]))
    cid = _commit(made, src, KEY_A)
    plain = _commit(made, src, None)
    bare = Store(root)
    (rec,) = [r for r in bare.list() if r.id == cid]
    assert rec.locked and rec.key_id == "team-a-1" and rec.files == () and rec.size == -1 and rec.stored_size > 0
    assert rec.annotations["io.node-agent.pod"] == "ns/p"
    for call in (lambda: bare.materialize(cid, tmp_path), lambda: bare.open(cid, "empty"), lambda: bare.verify(cid)):
        with pytest.raises(FailedPrecondition, match="key id team-a-1"):
            call()
    # Old, unsealed checkpoints are untouched by keys.
    assert bare.get(plain).files and bare.verify(plain) == []
    wrong = Store(root, keys=StaticKeyring([SealKey("team-a-1", bytes(32))]))
    with pytest.raises(DataLoss, match="authentication"):
        wrong.get(cid)
    assert bare.gc(dry_run=True).removed_blobs == ()
    bare.remove(cid)
    assert [r.id for r in bare.list()] == [plain]
    left = _stored_bytes(bare)
    assert bare.verify(plain) == [] and left


def test_rotation_old_keys_keep_reading(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    root = tmp_path / "store"
    old = _commit(Store(root, keys=StaticKeyring([KEY_A])), src, KEY_A)
    store = Store(root, keys=StaticKeyring([KEY_A2, KEY_A]))
    new = _commit(store, src, KEY_A2)
    assert store.get(old).key_id == "team-a-1" and store.get(new).key_id == "team-a-2"
    for cid in (old, new):
        with store.open(cid, "d/zeros.img") as r:
            assert r.read() == (src / "d" / "zeros.img").read_bytes()
    assert Store(root, keys=StaticKeyring([KEY_A2])).get(old).locked
    # Documents a store kept open only while a key source still has their key.
    store.chunks.keys = StaticKeyring([KEY_A2])
    assert store.get(old).locked and not store.get(new).locked


def test_copy_reseals_under_a_new_key_keeping_files_metadata_and_created(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    store = Store(tmp_path / "store", keys=StaticKeyring([KEY_A, KEY_A2]))
    old = store.get(_commit(store, src, KEY_A))
    new = store.copy(old, seal=KEY_A2)
    assert new.id != old.id and new.key_id == "team-a-2" and new.created == old.created
    assert dict(new.metadata) == dict(old.metadata) and new.annotations["io.node-agent.pod"] == "ns/p"
    assert [(e.path, e.size, e.mode) for e in new.files] == [(e.path, e.size, e.mode) for e in old.files]
    assert not {d.digest for d in store.descriptors(new.id)} & {d.digest for d in store.descriptors(old.id)}
    assert store.copy(old, seal=KEY_A).id == old.id  # the same key gives the same bytes
    clear = store.copy(new, seal=None)
    assert clear.key_id == "" and KEY_ID_ANNOTATION not in clear.annotations
    dest = tmp_path / "out"
    dest.mkdir()
    store.materialize(clear.id, dest)
    assert (dest / "pages-1.img").read_bytes() == (src / "pages-1.img").read_bytes()


# Format versions: the key and nonce derive from the exact bytes sealed (version 2); version 1 still opens.

TEXT = b"".join(b"line %d holds %d and %d\n" % (i, i * i % 977, i % 13) for i in range(20000))


def _seal_v1(key: SealKey, kind: int, data: bytes | bytearray | memoryview, plain_digest: bytes,
             out: bytearray, *, data_digest: bytes | None = None) -> memoryview:
    """A blob as version 1 sealed it: ``ident`` from the plaintext's digest, whatever bytes are encrypted."""
    digest = plain_digest if kind == CHUNK else hashlib.sha256(data).digest()
    label = {CHUNK: b"node-agent chunk v1\0", CONFIG: b"node-agent config v1\0"}[kind]
    ident = hmac.digest(key.secret, label + digest, "sha256")
    kid = key.key_id.encode("ascii")
    header = b"NAS1" + bytes((kind, len(kid))) + kid + ident[:12] + ident
    cipher = AESGCM(hmac.digest(key.secret, b"node-agent key v1\0" + ident, "sha256"))
    sealed = header + cipher.encrypt(ident[:12], bytes(data), header + plain_digest if kind == CHUNK else header)
    out[: len(sealed)] = sealed
    return memoryview(out)[: len(sealed)]


def _v1(kind: int, data: bytes, plain_digest: bytes = b"") -> bytes:
    return bytes(_seal_v1(KEY_A, kind, data, plain_digest, bytearray(len(data) + overhead(KEY_A.key_id))))


def _parts(blob: bytes) -> tuple[bytes, bytes]:
    """(nonce and ident, ciphertext without its tag) of a sealed chunk."""
    _, start, _ = parse_header(blob, CHUNK)
    return blob[start - 44 : start], blob[start:-16]


def _xor(a: bytes, b: bytes) -> bytes:
    n = min(len(a), len(b))
    return (int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")).to_bytes(n, "big")


def _encodings() -> list[bytes]:
    """Three different stored forms of TEXT: as it is, the store's zstd, and zstd at level 19."""
    fast, name = codec.encode(TEXT)
    assert name == ZSTD
    out = [TEXT, bytes(fast), zstandard.ZstdCompressor(level=19).compress(TEXT)]
    assert len(set(out)) == 3
    return out


def test_two_encodings_of_one_plaintext_never_share_a_key_and_nonce() -> None:
    plain = hashlib.sha256(TEXT).digest()
    encodings = _encodings()
    blobs = [KEY_A.seal(CHUNK, e, plain) for e in encodings]
    assert all(b.startswith(b"NAS2") for b in blobs)
    idents = [_parts(b)[0] for b in blobs]
    assert len({i[:12] for i in idents}) == 3 and len(set(idents)) == 3  # nonces, and keys (derived from ident)
    for i in range(3):
        assert KEY_A.open(CHUNK, blobs[i], plain) == encodings[i]
        for j in range(i + 1, 3):
            assert _xor(_parts(blobs[i])[1], _parts(blobs[j])[1]) != _xor(encodings[i], encodings[j])
    # What version 1 did: one (key, nonce) for every encoding, and C1 xor C2 = E1 xor E2.
    old = [_v1(CHUNK, e, plain) for e in encodings]
    assert len({_parts(b)[0] for b in old}) == 1
    assert _xor(_parts(old[0])[1], _parts(old[1])[1]) == _xor(encodings[0], encodings[1])


def test_the_same_encoding_still_dedups_and_domains_stay_apart() -> None:
    plain = hashlib.sha256(TEXT).digest()
    stored = _encodings()[1]
    blob = KEY_A.seal(CHUNK, stored, plain)
    assert KEY_A.seal(CHUNK, stored, plain) == blob
    assert KEY_A.seal(CHUNK, stored, plain, data_digest=hashlib.sha256(stored).digest()) == blob
    assert KEY_B.seal(CHUNK, stored, plain) != blob
    config = KEY_A.seal(CONFIG, TEXT)
    assert config.startswith(b"NAS2") and KEY_A.seal(CONFIG, TEXT) == config and KEY_A.open(CONFIG, config) == TEXT
    with pytest.raises(ValueError, match="plaintext digest"):
        KEY_A.seal(CHUNK, stored)
    with pytest.raises(ValueError, match="plaintext digest"):
        KEY_A.seal(CONFIG, TEXT, plain)
    with pytest.raises(ValueError, match="digest of the sealed bytes"):
        KEY_A.seal(CHUNK, stored, plain, data_digest=plain[:16])


def test_the_store_seals_each_chunk_from_its_stored_bytes(tmp_path: Path) -> None:
    """The writer's shortcut (a chunk stored as it is reuses its plaintext digest) derives what a full hash does."""
    src = _tree(tmp_path)
    (src / "text").write_bytes(TEXT)
    store = Store(tmp_path / "store", keys=StaticKeyring([KEY_A]))
    rec = store.get(_commit(store, src, KEY_A))
    encodings = set()
    for entry in rec.files:
        data = b"" if entry.is_dir else (src / entry.path).read_bytes()
        for chunk in entry.chunks:
            content = data[chunk.offset : chunk.offset + chunk.size]
            stored, name = codec.encode(content)
            encodings.add(name)
            expected = KEY_A.seal(CHUNK, stored, hashlib.sha256(content).digest())
            assert Path(store.blob_path(chunk.digest)).read_bytes() == expected
    assert encodings == {IDENTITY, ZSTD}
    assert Path(store.blob_path(store.descriptors(rec.id)[0].digest)).read_bytes().startswith(b"NAS2")


def test_version_1_blobs_and_checkpoints_still_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = hashlib.sha256(b"content").digest()
    blob = _v1(CHUNK, b"content", plain)
    assert blob.startswith(b"NAS1") and key_id_of(blob, CHUNK) == "team-a-1"
    assert KEY_A.open(CHUNK, blob, plain) == b"content"
    with pytest.raises(SealError, match="authentication"):  # swapped
        KEY_A.open(CHUNK, blob, hashlib.sha256(b"other").digest())
    with pytest.raises(SealError, match="authentication"):  # relabelled as version 2
        KEY_A.open(CHUNK, b"NAS2" + blob[4:], plain)
    assert KEY_A.open(CONFIG, _v1(CONFIG, b"{}")) == b"{}"
    # A whole checkpoint sealed before version 2.
    src = _tree(tmp_path)
    root = tmp_path / "store"
    with monkeypatch.context() as m:
        m.setattr(SealKey, "seal_into", _seal_v1)
        old = _commit(Store(root, keys=StaticKeyring([KEY_A])), src, KEY_A)
    store = Store(root, keys=StaticKeyring([KEY_A]))
    assert all(Path(store.blob_path(d.digest)).read_bytes().startswith(b"NAS1") for d in store.descriptors(old))
    assert store.verify(old) == []
    dest = tmp_path / "out"
    dest.mkdir()
    store.materialize(old, dest)
    for name in ("pages-1.img", "d/zeros.img", "empty"):
        assert (dest / name).read_bytes() == (src / name).read_bytes()
    # Sealed again now, the same files become version 2 blobs: nothing is shared with the old ones.
    new = store.copy(old, seal=KEY_A)
    assert new.id != old and not {d.digest for d in store.descriptors(new.id)} & {
        d.digest for d in store.descriptors(old)}


@pytest.mark.parametrize("mangle, message", [
    (lambda b: b"NAS3" + b[4:], "unknown version b'NAS3'"),
    (lambda b: b"NAS\x00" + b[4:], "unknown version"),
    (lambda b: b"XXXX" + b[4:], "not a sealed blob"),
    (lambda b: b[:3], "not a sealed blob"),
    (lambda b: b[:5], "truncated"),
    (lambda b: b[:40], "truncated"),
    (lambda b: b[: len(b) - len(b"content") - 1], "truncated"),
    (lambda b: b[:4] + b"\x01\x00" + b[6:], "truncated"),
    (lambda b: b[:4] + b"\x01\x41" + b[6:], "truncated"),
    (lambda b: b[:6] + b"\xff" + b[7:], "not ASCII"),
    (lambda b: b[:6] + b"/" + b[7:], "malformed key id"),
    (lambda b: b[:4] + b"\x02" + b[5:], "kind 2, expected 1"),
])
def test_hostile_headers_are_seal_errors(mangle: Callable[[bytes], bytes], message: str) -> None:
    plain = hashlib.sha256(b"content").digest()
    blob = mangle(KEY_A.seal(CHUNK, b"content", plain))
    with pytest.raises(SealError, match=message):
        KEY_A.open(CHUNK, blob, plain)
    with pytest.raises(SealError, match=message):
        key_id_of(blob, CHUNK)
    assert is_sealed(blob) == blob.startswith((b"NAS1", b"NAS2"))
