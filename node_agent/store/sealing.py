"""Sealed blobs: chunks and config blobs encrypted with AES-256-GCM under a key domain's key.

Rule: the same plaintext under the same domain key always gives the same
sealed bytes (convergent encryption, so dedup survives within a domain and
never crosses domains), and nothing outside the ciphertext is a plaintext
digest. Each blob's key and nonce are derived from the domain key and the
plaintext's sha256 with HMAC-SHA256: ``ident = HMAC(K, kind || sha256(P))``,
``key = HMAC(K, "key" || ident)``, ``nonce = ident[:12]``. The header holds
the key id, the nonce and ``ident`` (an HMAC, useless without ``K``), so the
reader derives the key from the header alone. The associated data is the
header, and for a chunk also the plaintext digest the checkpoint's (sealed)
config records for it: a chunk swapped for another, even one sealed under
the same key, fails to open. Opening treats the bytes as hostile: a bad
header, an unknown version or a failed tag is ``SealError``; a key id no key
source has is ``MissingKey``. This module does no I/O.

Framing (big-endian)::

    b"NAS1" | kind (1: chunk, 2: config) | key id length (1) | key id (ASCII)
            | nonce (12) | ident (32) | ciphertext with its 16-byte tag
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from typing import Final, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC: Final = b"NAS1"
CHUNK: Final = 1
CONFIG: Final = 2
KEY_BYTES: Final = 32
NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
IDENT_BYTES: Final = 32
KEY_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_LABELS: Final = {CHUNK: b"node-agent chunk v1\0", CONFIG: b"node-agent config v1\0"}
_KEY_LABEL: Final = b"node-agent key v1\0"
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

    def _header(self, kind: int, plain_digest: bytes) -> tuple[bytes, bytes]:
        ident = hmac.digest(self.secret, _LABELS[kind] + plain_digest, "sha256")
        kid = self.key_id.encode("ascii")
        return MAGIC + bytes((kind, len(kid))) + kid + ident[:NONCE_BYTES] + ident, ident

    def _cipher(self, ident: bytes) -> AESGCM:
        return AESGCM(hmac.digest(self.secret, _KEY_LABEL + ident, "sha256"))

    def seal(self, kind: int, data: bytes | bytearray | memoryview, plain_digest: bytes) -> bytes:
        """``data`` sealed; ``plain_digest``: the raw sha256 of the plaintext the blob stands for."""
        out = bytearray(len(data) + overhead(self.key_id))
        return bytes(self.seal_into(kind, data, plain_digest, out))

    def seal_into(
        self, kind: int, data: bytes | bytearray | memoryview, plain_digest: bytes, out: bytearray
    ) -> memoryview:
        """``data`` sealed into ``out`` (at least ``len(data) + overhead(key_id)`` long); the part used.

        Encrypted straight into the caller's buffer, after the header: a
        writer reuses one buffer per thread, so sealing costs no fresh pages.
        """
        header, ident = self._header(kind, plain_digest)
        aad = header + plain_digest if kind == CHUNK else header
        cipher = self._cipher(ident)
        used = len(header) + len(data) + TAG_BYTES
        view = memoryview(out)[:used]
        view[: len(header)] = header
        if _INTO:
            cipher.encrypt_into(ident[:NONCE_BYTES], data, aad, view[len(header) :])
        else:  # cryptography before encrypt_into
            view[len(header) :] = cipher.encrypt(ident[:NONCE_BYTES], bytes(data), aad)
        return view

    def open(self, kind: int, blob: bytes, plain_digest: bytes = b"") -> bytes:
        """The bytes sealed in ``blob``; SealError if it is not one of this key's, or altered."""
        start, key_id = parse_header(blob, kind)
        if key_id != self.key_id:
            raise SealError(f"sealed with key {key_id}, not {self.key_id}")
        nonce = blob[start - IDENT_BYTES - NONCE_BYTES : start - IDENT_BYTES]
        ident = blob[start - IDENT_BYTES : start]
        if nonce != ident[:NONCE_BYTES]:
            raise SealError("nonce does not match the blob's identifier")
        header = blob[:start]
        aad = header + plain_digest if kind == CHUNK else header
        try:
            return self._cipher(ident).decrypt(nonce, memoryview(blob)[start:], aad)
        except InvalidTag:
            raise SealError("authentication failed (altered, swapped or sealed with another key)") from None


def parse_header(blob: bytes, kind: int) -> tuple[int, str]:
    """(where the ciphertext starts, the key id) of a sealed blob of ``kind``; SealError otherwise."""
    if len(blob) < len(MAGIC) + 2 or blob[: len(MAGIC)] != MAGIC:
        raise SealError("not a sealed blob (no NAS1 header)")
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
    return start, key_id


def key_id_of(blob: bytes, kind: int) -> str:
    """The key id a sealed blob names; SealError if it is not one."""
    return parse_header(blob, kind)[1]


def plain_digest(data: bytes | bytearray | memoryview) -> bytes:
    """The raw sha256 a sealed blob's key derives from."""
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
