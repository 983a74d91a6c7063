"""Ed25519 signatures of checkpoints, as OCI 1.1 referrer artifacts.

Rule: a signature is trusted only once ``verify`` has checked it, and only
for the namespaces whose ``restore.trusted-keys`` name its key by its full
public key (never by its key id alone). The node signs what it makes; a copy
it makes of another checkpoint (``checkpoints rekey``) it signs only when the
source carries a signature that verifies under a key trusted for the
source's namespace or under the node's own key (``sign_copy``), so a copy
never vouches for more than its source did. Every signature document comes from
a store or a registry and is hostile: bounded, strict JSON, exact keys,
digests checked, base64 canonical. The signed message is a fixed context
followed by the checkpoint's manifest digest, so a signature can stand for
nothing else. Keys are read from files the operator names; a problem with
one is an error naming the file, never a silent fall back to unsigned. The
store is reached through the small interfaces below (``node_agent.store``'s
``Store`` provides them); nothing here imports it.

The artifact (docs/registry.md, "Signatures"): an OCI image manifest with
``artifactType`` ``SIGNATURE_ARTIFACT_TYPE``, the OCI empty config, one
layer of ``SIGNATURE_MEDIA_TYPE`` holding ``{"keyId", "publicKey",
"signature", "subject"}``, ``subject`` the checkpoint's manifest, and the
key id as an annotation.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import re
import stat
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from node_agent import strictjson
from node_agent.errors import AgentError, FailedPrecondition, InvalidArgument, PermissionDenied
from node_agent.oci import (
    EMPTY_BLOB,
    EMPTY_DESCRIPTOR,
    OCI_MANIFEST_MEDIA_TYPE,
    Descriptor,
    DocumentError,
    canonical_json,
    digest_hex,
    read_manifest,
    sha256_digest,
)

log = logging.getLogger(__name__)

SIGNATURE_ARTIFACT_TYPE: Final = "application/vnd.node-agent.signature.v1"
SIGNATURE_MEDIA_TYPE: Final = "application/vnd.node-agent.signature.v1+json"
KEY_ID_ANNOTATION: Final = "io.node-agent.signature.key-id"
CONTEXT: Final = b"node-agent checkpoint signature v1\n"
"""What every signed message starts with; the checkpoint's manifest digest follows."""

MAX_SIGNATURE_MANIFEST_BYTES: Final = 4096
MAX_SIGNATURE_BLOB_BYTES: Final = 1024
MAX_KEY_FILE_BYTES: Final = 64 << 10
INLINE_PREFIX: Final = "ed25519:"

_MANIFEST_KEYS: Final = frozenset({"schemaVersion", "mediaType", "artifactType", "config", "layers", "subject", "annotations"})
_BLOB_KEYS: Final = frozenset({"keyId", "publicKey", "signature", "subject"})
_KEY_ID_RE: Final = re.compile(r"ed25519:[0-9a-f]{16}")


# -- keys ---------------------------------------------------------------------------------


def raw_public(key: Ed25519PublicKey) -> bytes:
    """The 32 raw bytes of a public key."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: Ed25519PublicKey | bytes) -> str:
    """``ed25519:`` and the first 16 hex digits of the sha256 of the raw public key: how messages name a signer."""
    raw = key if isinstance(key, bytes) else raw_public(key)
    return INLINE_PREFIX + hashlib.sha256(raw).hexdigest()[:16]


def _stamp(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns, st.st_size


def _read_key_file(path: str, what: str) -> bytes:
    """A key file's bytes (bounded; a Secret's symlinks are followed); FailedPrecondition naming it otherwise."""
    try:
        # Non-blocking: a FIFO put there is refused, not waited on.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FailedPrecondition(f"{what} {path}: not a regular file")
            data = fh.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise FailedPrecondition(f"{what} {path}: cannot read it: {exc.strerror or exc}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise InvalidArgument(f"{what} {path}: more than {MAX_KEY_FILE_BYTES} bytes, not a PEM key")
    return data


def load_private_key(path: str) -> Ed25519PrivateKey:
    """The Ed25519 private key in a PEM (PKCS#8, unencrypted) file; FailedPrecondition/InvalidArgument naming it."""
    what = "signing.key-file"
    data = _read_key_file(path, what)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise InvalidArgument(f"{what} {path}: the key is encrypted; give it unencrypted (PKCS#8 PEM)") from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise InvalidArgument(f"{what} {path}: not a PEM private key ({str(exc)[:120]})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise InvalidArgument(f"{what} {path}: a {type(key).__name__.removeprefix('_')} key, not an Ed25519 key")
    return key


def load_public_key(entry: str, what: str = "restore.trusted-keys") -> Ed25519PublicKey:
    """A trusted key: ``ed25519:<base64 of the 32 raw bytes>``, or the absolute path of a PEM public key file."""
    if entry.startswith(INLINE_PREFIX):
        text = entry[len(INLINE_PREFIX):]
        raw = _b64(text, f"{what}: {entry[:80]!r}")
        if len(raw) != 32:
            hint = " (a key id names a key, it is not one: give the public key)" if len(text) == 16 else ""
            raise InvalidArgument(f"{what}: {entry[:80]!r} is {len(raw)} bytes, an Ed25519 key is 32{hint}")
        return Ed25519PublicKey.from_public_bytes(raw)
    if not os.path.isabs(entry):
        raise InvalidArgument(f"{what}: {entry[:80]!r} is neither an absolute path nor ed25519:<base64>")
    data = _read_key_file(entry, what)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise InvalidArgument(f"{what} {entry}: not a PEM public key ({str(exc)[:120]})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise InvalidArgument(f"{what} {entry}: a {type(key).__name__.removeprefix('_')} key, not an Ed25519 key")
    return key


def trusted_keys(table: Mapping[str, Sequence[str]], namespace: str) -> dict[bytes, str]:
    """The keys trusted for ``namespace`` (its entries and those of ``"*"``): raw public key -> key id."""
    out: dict[bytes, str] = {}
    for name in dict.fromkeys((namespace, "*")):
        for entry in table.get(name, ()):
            raw = raw_public(load_public_key(entry, f"restore.trusted-keys[{name!r}]"))
            out[raw] = key_id(raw)
    return out


def _b64(text: object, what: str) -> bytes:
    """Canonical standard base64 (padded, nothing else); InvalidArgument otherwise."""
    if not isinstance(text, str) or not text.isascii():
        raise InvalidArgument(f"{what} is not base64")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"{what} is not base64") from None
    if base64.b64encode(raw).decode("ascii") != text:
        raise InvalidArgument(f"{what} is not canonical base64")
    return raw


# -- the documents ------------------------------------------------------------------------


SignatureProblem = Literal["malformed", "subject", "tampered"]


class SignatureError(PermissionDenied):
    """A signature that cannot be trusted: ``kind`` says whether it is malformed, about another
    checkpoint (``subject``), or does not verify (``tampered``)."""

    def __init__(self, kind: SignatureProblem, message: str) -> None:
        super().__init__(message)
        self.kind: SignatureProblem = kind


@dataclass(frozen=True)
class SignatureManifest:
    """A decoded signature manifest: what it signs, its one layer, the key id it claims."""

    subject: Descriptor
    layer: Descriptor
    key_id: str


@dataclass(frozen=True)
class SignatureBlob:
    """A decoded signature layer: the signer's key (raw) and id, the signature, the digest signed."""

    key_id: str
    public_key: bytes
    signature: bytes
    subject: str


@dataclass(frozen=True)
class SignatureArtifact:
    """A signature ready to be stored or pushed: its manifest (and digest) and every blob it names."""

    digest: str
    manifest: bytes
    blobs: Mapping[str, bytes]
    key_id: str


def message(subject: str) -> bytes:
    """The bytes an Ed25519 signature of checkpoint ``subject`` (``sha256:<hex>``) signs."""
    digest_hex(subject)
    return CONTEXT + subject.encode("ascii")


def signature_artifact(key: Ed25519PrivateKey, subject: Descriptor) -> SignatureArtifact:
    """Sign the checkpoint manifest ``subject`` (its descriptor) and build the referrer artifact."""
    if subject.media_type != OCI_MANIFEST_MEDIA_TYPE:
        raise InvalidArgument(f"a signature's subject is an OCI image manifest, not {subject.media_type!r}")
    public = raw_public(key.public_key())
    kid = key_id(public)
    blob = canonical_json({
        "keyId": kid,
        "publicKey": base64.b64encode(public).decode("ascii"),
        "signature": base64.b64encode(key.sign(message(subject.digest))).decode("ascii"),
        "subject": subject.digest,
    })
    layer = Descriptor(SIGNATURE_MEDIA_TYPE, sha256_digest(blob), len(blob))
    manifest = canonical_json({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST_MEDIA_TYPE,
        "artifactType": SIGNATURE_ARTIFACT_TYPE,
        "config": EMPTY_DESCRIPTOR.to_json(),
        "layers": [layer.to_json()],
        "subject": Descriptor(subject.media_type, subject.digest, subject.size).to_json(),
        "annotations": {KEY_ID_ANNOTATION: kid},
    })
    return SignatureArtifact(sha256_digest(manifest), manifest, {EMPTY_DESCRIPTOR.digest: EMPTY_BLOB, layer.digest: blob}, kid)


def _load(data: bytes, limit: int, what: str) -> dict[str, Any]:
    if len(data) > limit:
        raise SignatureError("malformed", f"{what} is more than {limit} bytes")
    try:
        doc = strictjson.loads(bytes(data), max_depth=4)
    except strictjson.StrictJsonError as exc:
        raise SignatureError("malformed", f"{what} {exc}") from None
    if not isinstance(doc, dict):
        raise SignatureError("malformed", f"{what} is not a JSON object")
    return doc


def _is_signature_type(kind: object) -> bool:
    return kind == SIGNATURE_ARTIFACT_TYPE


def _check_descriptor(desc: Descriptor, where: str, media_type: str, limit: int) -> Descriptor:
    """A descriptor of the signature manifest with the one media type and the size bound its place has."""
    if desc.size > limit:
        raise SignatureError("malformed", f"signature manifest: {where}: size {desc.size!r}")
    if desc.media_type != media_type:
        raise SignatureError("malformed", f"signature manifest: {where} is {desc.media_type!r}, not {media_type}")
    return desc


def decode_signature_manifest(data: bytes) -> SignatureManifest:
    """A signature manifest read as hostile input; SignatureError("malformed") on anything unexpected."""
    doc = _load(data, MAX_SIGNATURE_MANIFEST_BYTES, "signature manifest")
    try:
        read = read_manifest(doc, required=_MANIFEST_KEYS, allowed=_MANIFEST_KEYS, artifact_type=_is_signature_type,
                             max_layers=1, subject=True)
    except DocumentError as exc:
        if exc.descriptor is not None:
            raise SignatureError("malformed", f"signature manifest: {exc.where}: {exc.detail}") from None
        if exc.field == "keys":
            raise SignatureError("malformed", f"signature manifest: keys {sorted(doc)[:10]}, want {sorted(_MANIFEST_KEYS)}") from None
        if exc.field == "schemaVersion":
            raise SignatureError("malformed", "signature manifest: schemaVersion is not 2") from None
        if exc.field in ("mediaType", "artifactType"):
            raise SignatureError("malformed", "signature manifest: not an OCI image manifest of a node-agent signature") from None
        raise SignatureError("malformed", "signature manifest: layers is not a list of one descriptor") from None
    config = _check_descriptor(read.config, "config", EMPTY_DESCRIPTOR.media_type, EMPTY_DESCRIPTOR.size)
    if config != EMPTY_DESCRIPTOR:
        raise SignatureError("malformed", "signature manifest: config is not the OCI empty descriptor")
    if len(read.layers) != 1:
        raise SignatureError("malformed", "signature manifest: layers is not a list of one descriptor")
    layer = _check_descriptor(read.layers[0], "layers[0]", SIGNATURE_MEDIA_TYPE, MAX_SIGNATURE_BLOB_BYTES)
    assert read.subject is not None  # read with subject=True
    subject = _check_descriptor(read.subject, "subject", OCI_MANIFEST_MEDIA_TYPE, 1 << 40)
    notes = read.annotations
    if not isinstance(notes, dict) or set(notes) != {KEY_ID_ANNOTATION}:
        raise SignatureError("malformed", f"signature manifest: annotations must be exactly {KEY_ID_ANNOTATION}")
    kid = notes[KEY_ID_ANNOTATION]
    if not isinstance(kid, str) or not _KEY_ID_RE.fullmatch(kid):
        raise SignatureError("malformed", f"signature manifest: malformed key id {str(kid)[:40]!r}")
    return SignatureManifest(subject, layer, kid)


def decode_signature_blob(data: bytes) -> SignatureBlob:
    """A signature layer read as hostile input; its key id must be that of its key."""
    doc = _load(data, MAX_SIGNATURE_BLOB_BYTES, "signature blob")
    if set(doc) != _BLOB_KEYS:
        raise SignatureError("malformed", f"signature blob: keys {sorted(doc)[:10]}, want {sorted(_BLOB_KEYS)}")
    try:
        public = _b64(doc["publicKey"], "signature blob: publicKey")
        signature = _b64(doc["signature"], "signature blob: signature")
        subject = doc["subject"]
        digest_hex(subject)
    except InvalidArgument as exc:
        raise SignatureError("malformed", str(exc)) from None
    if len(public) != 32 or len(signature) != 64:
        raise SignatureError("malformed", "signature blob: an Ed25519 key is 32 bytes and a signature 64")
    if doc["keyId"] != key_id(public):
        raise SignatureError("malformed", f"signature blob: keyId {str(doc['keyId'])[:40]!r} is not its key's ({key_id(public)})")
    return SignatureBlob(key_id(public), public, signature, subject)


def check(manifest: bytes, blob: bytes, subject: str) -> SignatureBlob:
    """Verify a signature of checkpoint ``subject`` completely; the signer (with the full public key) or SignatureError."""
    doc = decode_signature_manifest(manifest)
    if doc.subject.digest != subject:
        raise SignatureError("subject", f"the signature by {doc.key_id} is of {doc.subject.digest}, not {subject}")
    if len(blob) != doc.layer.size or sha256_digest(blob) != doc.layer.digest:
        raise SignatureError("tampered", f"the signature by {doc.key_id}: its blob does not match {doc.layer.digest}")
    sig = decode_signature_blob(blob)
    if sig.subject != subject:
        raise SignatureError("subject", f"the signature by {sig.key_id} signs {sig.subject}, not {subject}")
    if sig.key_id != doc.key_id:
        raise SignatureError("malformed", f"the signature names {doc.key_id} in its manifest but is by {sig.key_id}")
    try:
        Ed25519PublicKey.from_public_bytes(sig.public_key).verify(sig.signature, message(subject))
    except (InvalidSignature, ValueError):
        raise SignatureError("tampered", f"the signature by {sig.key_id} does not verify (tampered with)") from None
    return sig


def verify(manifest: bytes, blob: bytes, subject: str) -> str:
    """The key id of the signer of checkpoint ``subject``, once its signature verifies; SignatureError otherwise.

    ``manifest`` is the signature manifest's bytes, ``blob`` its layer's.
    Whether the signer is trusted is ``require_trusted``'s question.
    """
    return check(manifest, blob, subject).key_id


# -- what is needed of the store and the settings ------------------------------------------


class Record(Protocol):
    """A checkpoint; only its id (the manifest digest) is used."""

    @property
    def id(self) -> str: ...


class ReferrerReader(Protocol):
    """The store, as the restore's check sees it."""

    def referrers(self, subject_id: str, artifact_type: str | None = None) -> Sequence[tuple[str, bytes]]: ...

    def read_blob(self, digest: str, size: int) -> bytes: ...


class ReferrerStore(ReferrerReader, Protocol):
    """The store, as signing sees it."""

    def manifest_bytes(self, checkpoint_id: str) -> bytes: ...

    def attach(self, subject_id: str, manifest: bytes, blobs: Mapping[str, bytes]) -> str: ...

    def remove(self, checkpoint_id: str) -> object: ...


class RestoreRules(Protocol):
    @property
    def trusted_keys(self) -> Mapping[str, Sequence[str]]: ...


class TrustSettings(Protocol):
    """The agent's settings, as far as trusting signatures goes."""

    @property
    def restore(self) -> RestoreRules: ...


# -- signing ------------------------------------------------------------------------------


class Signer:
    """The node's signing key, read from ``key_file`` (PEM PKCS#8 Ed25519) and read again when the file changes.

    A change is noticed by (inode, mtime, size), as a Secret's swapped
    symlink or a rewritten file shows; a new file that is not a usable key
    is an error at the next signature (the old key is not used instead).
    Safe to use from several threads.
    """

    def __init__(self, key_file: str) -> None:
        self.path = key_file
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._key: Ed25519PrivateKey | None = None
        self.key()

    def key(self) -> Ed25519PrivateKey:
        """The current key (the file is read again if it changed since)."""
        with self._lock:
            try:
                stamp = _stamp(self.path)
            except OSError as exc:
                raise FailedPrecondition(f"signing.key-file {self.path}: cannot read it: {exc.strerror or exc}") from None
            if self._key is None or stamp != self._stamp:
                key = load_private_key(self.path)
                try:
                    after: tuple[int, int, int] | None = _stamp(self.path)
                except OSError:
                    after = None
                if self._key is not None:
                    log.info("signing key reloaded from %s: now %s", self.path, key_id(key.public_key()))
                # A file replaced while it was read is read again at the next use.
                self._key, self._stamp = key, stamp if after == stamp else None
            return self._key

    @property
    def key_id(self) -> str:
        return key_id(self.key().public_key())

    def sign(self, subject: Descriptor) -> SignatureArtifact:
        """The signature artifact of the checkpoint manifest ``subject``."""
        return signature_artifact(self.key(), subject)

    def sign_into(self, store: ReferrerStore, checkpoint_id: str) -> str:
        """Sign a published checkpoint and attach the signature to it in ``store``; the signature's digest."""
        manifest = store.manifest_bytes(checkpoint_id)
        artifact = self.sign(Descriptor(OCI_MANIFEST_MEDIA_TYPE, sha256_digest(manifest), len(manifest)))
        return store.attach(sha256_digest(manifest), artifact.manifest, artifact.blobs)


_signers: dict[str, Signer] = {}
_signers_lock = threading.Lock()


def signer_for(key_file: str) -> Signer:
    """The one Signer of ``key_file`` in this process (made, and the key read, on first use)."""
    with _signers_lock:
        signer = _signers.get(key_file)
        if signer is None:
            signer = _signers[key_file] = Signer(key_file)
        return signer


def sign_published(key_file: str, store: ReferrerStore, checkpoint_id: str) -> str | None:
    """Sign a checkpoint just published, when ``key_file`` (``signing.key-file``) is set; the signature's digest.

    Nothing happens (None) without a key file. When signing fails the
    checkpoint is removed again and FailedPrecondition raised (and logged):
    a node that is to sign never reports a checkpoint of its own made unsigned.
    """
    if not key_file:
        return None
    try:
        signer = signer_for(key_file)
        digest = signer.sign_into(store, checkpoint_id)
    except Exception as exc:
        log.error("checkpoint %s: signing it failed, removing it: %s", checkpoint_id, exc,
                  extra={"checkpoint": checkpoint_id, "phase": "sign"})
        try:
            store.remove(checkpoint_id)
        except AgentError as gone:
            log.error("checkpoint %s: cannot remove it: %s", checkpoint_id, gone, extra={"checkpoint": checkpoint_id})
        raise FailedPrecondition(f"checkpoint {checkpoint_id} was not kept: signing it failed: {exc}") from exc
    log.info("checkpoint %s signed by %s", checkpoint_id, signer.key_id, extra={"checkpoint": checkpoint_id, "phase": "sign"})
    return digest


# -- trusting -----------------------------------------------------------------------------


def _verified(store: ReferrerReader, checkpoint_id: str) -> tuple[list[SignatureBlob], list[str]]:
    """The signatures of a checkpoint that verify (in the store's order), and why each other one does not."""
    good: list[SignatureBlob] = []
    broken: list[str] = []
    for digest, manifest in store.referrers(checkpoint_id, SIGNATURE_ARTIFACT_TYPE):
        try:
            doc = decode_signature_manifest(manifest)
            good.append(check(manifest, store.read_blob(doc.layer.digest, doc.layer.size), checkpoint_id))
        except SignatureError as exc:
            broken.append(str(exc))
        except AgentError as exc:  # the blob is missing or damaged in the store
            broken.append(f"signature {digest}: {exc}")
    return good, broken


def _judge(store: ReferrerReader, checkpoint_id: str, trusted: Mapping[bytes, str], trusted_for: str,
           own: bytes | None = None) -> tuple[SignatureBlob | None, list[str]]:
    """(the first verified signature by a ``trusted`` key or by ``own``, or None; why none is, when it is None).

    ``trusted_for`` says in messages whom the keys are trusted for.
    """
    good, broken = _verified(store, checkpoint_id)
    for sig in good:
        if sig.public_key in trusted or sig.public_key == own:
            return sig, []
    why: list[str] = []
    untrusted = sorted({sig.key_id for sig in good})
    if untrusted:
        whom = "no key" if not trusted else ", ".join(sorted(set(trusted.values())))
        why.append(f"it is signed by {', '.join(untrusted)}, which is not trusted for {trusted_for} "
                   f"(restore.trusted-keys trusts {whom} there)")
    if broken:
        why.append("a signature does not verify, so it was tampered with: " + "; ".join(broken[:4]))
    if not why:
        why.append("it has no signature")
    return None, why


def signers(store: ReferrerReader, checkpoint_id: str) -> list[str]:
    """The key ids of the signatures of a checkpoint that verify (whether trusted or not), for people."""
    return sorted({sig.key_id for sig in _verified(store, checkpoint_id)[0]})


def require_trusted(store: ReferrerReader, record: Record, settings: TrustSettings, namespace: str) -> str:
    """The key id of a valid signature of ``record`` by a key trusted for ``namespace``; PermissionDenied otherwise.

    Trusted are the keys of ``settings.restore.trusted_keys[namespace]`` and
    ``["*"]``, compared by their full public key. The error names the
    checkpoint and why: it has no signature, its signers are not trusted for
    the namespace, or a signature does not verify. A trusted key that cannot
    be read is FailedPrecondition/InvalidArgument naming it.
    """
    cid = record.id
    sig, why = _judge(store, cid, trusted_keys(settings.restore.trusted_keys, namespace), f"namespace {namespace!r}")
    if sig is not None:
        log.info("checkpoint %s: signed by %s, trusted for namespace %s", cid, sig.key_id, namespace,
                 extra={"checkpoint": cid})
        return sig.key_id
    raise PermissionDenied(f"checkpoint {cid} may not be restored into namespace {namespace!r}: {'; '.join(why)}")


@dataclass(frozen=True)
class CopySignature:
    """Whether the node signed a copy it made of a checkpoint: ``signer`` (its key id) or why not (``unsigned``)."""

    signer: str = ""
    unsigned: str = ""


def sign_copy(key_file: str, store: ReferrerStore, source: Record, copy_id: str, settings: TrustSettings,
              namespace: str) -> CopySignature:
    """Sign ``copy_id``, a copy of ``source`` just published (``checkpoints rekey``), if the source is vouched for.

    A node's signature says the node vouches for the checkpoint. A copy is
    signed (``sign_published``) only when a signature of ``source``
    verifies under a key trusted for ``namespace`` (its
    ``restore.trusted-keys`` entries and ``"*"``'s) or under the node's own
    signing key; otherwise it is published unsigned, and the result (and a
    warning) says why. Without ``key_file`` nothing is signed, as for every
    checkpoint. A trusted-key entry that cannot be read fails the call,
    naming it.
    """
    if not key_file:
        return CopySignature()
    own = raw_public(signer_for(key_file).key().public_key())
    trusted = trusted_keys(settings.restore.trusted_keys, namespace)
    sig, why = _judge(store, source.id, trusted, f"namespace {namespace!r} nor this node's key", own)
    if sig is None:
        reason = (f"its source {source.id} carries no signature that verifies under a key trusted for namespace "
                  f"{namespace!r} or under this node's key: {'; '.join(why)}")
        log.warning("checkpoint %s (a copy of %s) is left unsigned: %s", copy_id, source.id, reason,
                    extra={"checkpoint": copy_id, "phase": "sign"})
        return CopySignature(unsigned=reason)
    sign_published(key_file, store, copy_id)
    log.info("checkpoint %s (a copy of %s) signed: its source is signed by %s", copy_id, source.id, sig.key_id,
             extra={"checkpoint": copy_id, "phase": "sign"})
    return CopySignature(signer=key_id(own))
