"""What stored blobs hold: chunks read, opened and decoded; sealed config blobs opened.

Rule: the content-addressed layer (``blobs``) knows bytes and digests only;
encodings (``codec``) and seals (``sealing``) are undone here, above it,
after the blob's digest and size have been verified. A chunk that does not
decode or open is DataLoss; one sealed under a key no source has is
FailedPrecondition naming the key id.
"""

from __future__ import annotations

from node_agent.errors import DataLoss, FailedPrecondition
from node_agent.oci import digest_hex
from node_agent.store import codec, sealing
from node_agent.store.blobs import BlobStore
from node_agent.store.documents import Chunk


class ChunkReader:
    """A store's blobs as content: ``blobs`` for the verified bytes, ``keys`` to open sealed ones."""

    def __init__(self, blobs: BlobStore, keys: sealing.Keyring | None = None) -> None:
        self.blobs = blobs
        # Where sealed blobs' keys come from (none: sealed blobs do not open).
        self.keys = keys

    def read_chunk(self, chunk: Chunk) -> bytes:
        """A chunk's content: its blob read, verified, opened and decoded.

        DataLoss when the blob is bad; FailedPrecondition naming the key id
        when it is sealed under a key no source has.
        """
        return self.decode_stored(chunk, self.blobs.read(chunk.digest, chunk.stored_size))

    def decode_stored(self, chunk: Chunk, data: bytes) -> bytes:
        """The content of a chunk's stored bytes, verified by whoever read them (see ``read_chunk``)."""
        try:
            if chunk.sealed:
                data = self._unseal(sealing.CHUNK, data, bytes.fromhex(digest_hex(chunk.plain)))
            return codec.decode(data, chunk.inner_encoding, chunk.size)
        except (codec.DecodeError, sealing.SealError) as exc:
            raise DataLoss(f"blob {chunk.digest}: {exc}") from None

    def open_config(self, data: bytes, key_id: str = "") -> bytes | None:
        """A sealed config blob opened; None when no source has its key.

        SealError when it is altered, or sealed under another key than
        ``key_id`` (the one its manifest names), when given.
        """
        named = sealing.key_id_of(data, sealing.CONFIG)
        if key_id and named != key_id:
            raise sealing.SealError(f"sealed under key {named}, not {key_id}, which the manifest names")
        try:
            return self._unseal(sealing.CONFIG, data)
        except FailedPrecondition:
            return None

    def _unseal(self, kind: int, data: bytes, plain_digest: bytes = b"") -> bytes:
        """Sealed bytes opened with the key they name; SealError if bad, FailedPrecondition if no key."""
        key_id = sealing.key_id_of(data, kind)
        key = self.keys.key(key_id) if self.keys is not None else None
        if key is None:
            raise FailedPrecondition(f"encrypted with key id {key_id}, which no configured key source has")
        return key.open(kind, data, plain_digest)

    def check_chunk(self, chunk: Chunk) -> str | None:
        """Verify a chunk's blob and that it decodes to the chunk's size; the reason it is bad, or None."""
        problem, data = self.blobs.load(chunk.digest, chunk.stored_size)
        if problem is not None:
            return problem
        try:
            self.decode_stored(chunk, data)
        except DataLoss as exc:
            return f"undecodable ({str(exc).removeprefix(f'blob {chunk.digest}: ')})"
        except FailedPrecondition as exc:
            return f"unopened ({exc})"
        return None
