"""Sealed blobs: chunks and config blobs encrypted with AES-256-GCM under a key domain's key.

Rule: the same bytes under the same domain key always give the same sealed
bytes (convergent encryption, so dedup survives within a domain and never
crosses domains), two different messages never share a (key, nonce) pair,
and nothing outside the ciphertext is a plaintext digest. Each blob's key
and nonce are derived with HMAC-SHA256 from the domain key and everything
the AEAD authenticates: the exact bytes that are encrypted (a chunk's stored
encoding, not its plaintext, so a change of encoding can never reuse a
nonce), the header before the identifier, and the chunk's plaintext digest::

    ident = HMAC(K, "node-agent ident v2" || prefix || sha256(E) || bound)
    key   = HMAC(K, "node-agent key v2" || ident)       nonce = ident[:12]

with ``prefix`` the header's magic, kind, key id length and key id, ``E``
the sealed bytes and ``bound`` a chunk's plaintext digest (nothing for a
config blob). The header holds the key id, the nonce and ``ident`` (an
HMAC, useless without ``K``), so the reader derives the key from the header
alone. The associated data is the header, and for a chunk also the
plaintext digest the checkpoint's (sealed) config records for it: a chunk
swapped for another, even one sealed under the same key, fails to open.
Opening treats the bytes as hostile: a bad header, an unknown version or a
failed tag is ``SealError``; a key id no key source has is ``MissingKey``.
This module does no I/O.

Framing (big-endian)::

    b"NAS2" | kind (1: chunk, 2: config) | key id length (1) | key id (ASCII)
            | nonce (12) | ident (32) | ciphertext with its 16-byte tag

Version 1 (``NAS1``, the same framing) derived ``ident`` from the
plaintext's digest alone (``HMAC(K, kind label || sha256(P))``); blobs
sealed so still open, and nothing seals them any more.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Final, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from node_agent.names import KEY_ID_RE

MAGIC: Final = b"NAS2"
MAGIC_V1: Final = b"NAS1"
_VERSIONS: Final = {MAGIC_V1: 1, MAGIC: 2}
CHUNK: Final = 1
CONFIG: Final = 2
KEY_BYTES: Final = 32
NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
IDENT_BYTES: Final = 32
DIGEST_BYTES: Final = 32
_IDENT_LABEL: Final = b"node-agent ident v2\0"
_KEY_LABEL: Final = b"node-agent key v2\0"
_KEY_LABEL_V1: Final = b"node-agent key v1\0"
_INTO: Final = hasattr(AESGCM, "encrypt_into")


class SealError(ValueError):
    """Sealed bytes that are malformed or fail authentication."""


class MissingKey(LookupError):
    """A sealed blob's key id that no key source has."""

    def __init__(self, key_id: str) -> None:
        super().__init__(key_id)
        self.key_id = key_id


def overhead(key_id: str) -> int:
    """Bytes sealing adds to a blob under ``key_id``."""
    return len(MAGIC) + 2 + len(key_id) + NONCE_BYTES + IDENT_BYTES + TAG_BYTES


@dataclass(frozen=True)
class SealKey:
    """One domain key: its id (named in every blob it seals) and its 32 secret bytes."""

    key_id: str
    secret: bytes = field(repr=False)
    domain: str = ""

    def __post_init__(self) -> None:
        if not KEY_ID_RE.fullmatch(self.key_id):
            raise ValueError(f"key id {self.key_id!r}: want 1-64 of [A-Za-z0-9._-], starting alphanumeric")
        if len(self.secret) != KEY_BYTES:
            raise ValueError(f"key {self.key_id}: {len(self.secret)} bytes, want {KEY_BYTES}")

    def _cipher(self, label: bytes, ident: bytes) -> AESGCM:
        return AESGCM(hmac.digest(self.secret, label + ident, "sha256"))

    def seal(
        self, kind: int, data: bytes | bytearray | memoryview, plain_digest: bytes = b"",
        *, data_digest: bytes | None = None,
    ) -> bytes:
        """``data`` sealed (see ``seal_into``)."""
        out = bytearray(len(data) + overhead(self.key_id))
        return bytes(self.seal_into(kind, data, plain_digest, out, data_digest=data_digest))

    def seal_into(
        self, kind: int, data: bytes | bytearray | memoryview, plain_digest: bytes, out: bytearray,
        *, data_digest: bytes | None = None,
    ) -> memoryview:
        """``data`` sealed into ``out`` (at least ``len(data) + overhead(key_id)`` long); the part used.

        ``plain_digest``: for a chunk, the raw sha256 of the plaintext the
        blob stands for (bound as associated data); for a config blob, empty.
        ``data_digest``: the raw sha256 of exactly ``data``, when the caller
        already has it (a chunk stored as it is: its plaintext digest);
        computed here otherwise. Encrypted straight into the caller's buffer,
        after the header: a writer reuses one buffer per thread, so sealing
        costs no fresh pages.
        """
        if kind not in (CHUNK, CONFIG):
            raise ValueError(f"unknown sealed-blob kind {kind}")
        if len(plain_digest) != (DIGEST_BYTES if kind == CHUNK else 0):
            raise ValueError(f"plaintext digest of {len(plain_digest)} bytes for a blob of kind {kind}")
        if data_digest is None:
            data_digest = hashlib.sha256(data).digest()
        elif len(data_digest) != DIGEST_BYTES:
            raise ValueError(f"digest of the sealed bytes of {len(data_digest)} bytes, want {DIGEST_BYTES}")
        kid = self.key_id.encode("ascii")
        prefix = MAGIC + bytes((kind, len(kid))) + kid
        ident = hmac.digest(self.secret, _IDENT_LABEL + prefix + data_digest + plain_digest, "sha256")
        header = prefix + ident[:NONCE_BYTES] + ident
        cipher = self._cipher(_KEY_LABEL, ident)
        used = len(header) + len(data) + TAG_BYTES
        view = memoryview(out)[:used]
        view[: len(header)] = header
        aad = header + plain_digest
        if _INTO:
            cipher.encrypt_into(ident[:NONCE_BYTES], data, aad, view[len(header) :])
        else:  # cryptography before encrypt_into
            view[len(header) :] = cipher.encrypt(ident[:NONCE_BYTES], bytes(data), aad)
        return view

    def open(self, kind: int, blob: bytes, plain_digest: bytes = b"") -> bytes:
        """The bytes sealed in ``blob`` (either version); SealError if it is not one of this key's, or altered."""
        version, start, key_id = parse_header(blob, kind)
        if key_id != self.key_id:
            raise SealError(f"sealed with key {key_id}, not {self.key_id}")
        nonce = blob[start - IDENT_BYTES - NONCE_BYTES : start - IDENT_BYTES]
        ident = blob[start - IDENT_BYTES : start]
        if nonce != ident[:NONCE_BYTES]:
            raise SealError("nonce does not match the blob's identifier")
        header = blob[:start]
        aad = header + plain_digest if kind == CHUNK else header
        cipher = self._cipher(_KEY_LABEL if version == 2 else _KEY_LABEL_V1, ident)
        try:
            return cipher.decrypt(nonce, memoryview(blob)[start:], aad)
        except InvalidTag:
            raise SealError("authentication failed (altered, swapped or sealed with another key)") from None


def is_sealed(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` begins with a sealed-blob header of a known version."""
    return bytes(data[: len(MAGIC)]) in _VERSIONS


def parse_header(blob: bytes, kind: int) -> tuple[int, int, str]:
    """(format version, where the ciphertext starts, the key id) of a sealed blob of ``kind``; SealError otherwise."""
    magic = blob[: len(MAGIC)]
    version = _VERSIONS.get(magic)
    if version is None:
        if len(magic) == len(MAGIC) and magic[:3] == MAGIC[:3]:
            raise SealError(f"sealed blob of unknown version {magic!r} (this agent reads NAS1 and NAS2)")
        raise SealError("not a sealed blob (no NAS1 or NAS2 header)")
    if len(blob) < len(MAGIC) + 2:
        raise SealError("truncated sealed blob")
    got, n = blob[len(MAGIC)], blob[len(MAGIC) + 1]
    if got != kind:
        raise SealError(f"sealed blob of kind {got}, expected {kind}")
    start = len(MAGIC) + 2 + n + NONCE_BYTES + IDENT_BYTES
    if not 0 < n <= 64 or len(blob) < start + TAG_BYTES:
        raise SealError("truncated sealed blob")
    try:
        key_id = blob[len(MAGIC) + 2 : len(MAGIC) + 2 + n].decode("ascii")
    except UnicodeDecodeError:
        raise SealError("key id is not ASCII") from None
    if not KEY_ID_RE.fullmatch(key_id):
        raise SealError(f"malformed key id {key_id!r}")
    return version, start, key_id


def key_id_of(blob: bytes, kind: int) -> str:
    """The key id a sealed blob names; SealError if it is not one."""
    return parse_header(blob, kind)[2]


def plain_digest(data: bytes | bytearray | memoryview) -> bytes:
    """The raw sha256 of ``data``: a chunk's plaintext digest, which its seal binds."""
    return hashlib.sha256(data).digest()


class Keyring(Protocol):
    """Where the store finds the key a sealed blob names."""

    def key(self, key_id: str) -> SealKey | None:
        """The key with this id, or None if no source has it."""
        ...


class StaticKeyring:
    """A fixed set of keys (tests, and the lazy page source, which gets its checkpoint's key from the agent)."""

    def __init__(self, keys: tuple[SealKey, ...] | list[SealKey] = ()) -> None:
        self._keys = {k.key_id: k for k in keys}

    def key(self, key_id: str) -> SealKey | None:
        return self._keys.get(key_id)
