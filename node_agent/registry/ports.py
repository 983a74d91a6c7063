"""What pushing and pulling need from the checkpoint store, and what they report.

Small structural interfaces: ``node_agent.store.Store`` provides both, and
nothing here imports the store.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import BinaryIO, Protocol

from node_agent.oci import Descriptor


class Record(Protocol):
    """A published checkpoint; only its ID is used here."""

    @property
    def id(self) -> str: ...


class BlobSource(Protocol):
    """The store, as pushing sees it."""

    def get(self, checkpoint_id: str) -> Record: ...

    def manifest_bytes(self, checkpoint_id: str) -> bytes: ...

    def descriptors(self, checkpoint_id: str) -> Sequence[Descriptor]: ...

    def open_blob(self, digest: str) -> BinaryIO: ...

    def referrers(self, subject_id: str, artifact_type: str | None = None) -> Sequence[tuple[str, bytes]]:
        """(digest, manifest bytes) of the checkpoint's referrers: its signatures."""


class BlobImporter(Protocol):
    """One import into the store, holding a lease until it commits or aborts."""

    def __enter__(self) -> BlobImporter: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None: ...

    def add_blob(self, digest: str, size: int, stream: Iterable[bytes]) -> None:
        """Store a verified blob; one already present is recorded without reading ``stream``."""

    def commit(self, manifest: bytes, *, deferred: Collection[str] = ()) -> Record: ...

    def abort(self) -> None: ...


class OriginBook(Protocol):
    """Where the blobs a lazy pull left in the registry are (the store's ``origins``)."""

    def remember(self, checkpoint_id: str, origin: Mapping[str, object]) -> None: ...

    def settle(self, checkpoint_id: str) -> bool: ...


class BlobSink(Protocol):
    """The store, as pulling sees it."""

    @property
    def origins(self) -> OriginBook: ...

    def importer(self) -> BlobImporter: ...

    def attach(self, subject_id: str, manifest: bytes, blobs: Mapping[str, bytes]) -> str:
        """Keep a referrer (a signature) of a published checkpoint, with its blobs."""


@dataclass(frozen=True)
class Progress:
    """Where a push or pull stands.

    ``phase`` is ``"manifest"``, ``"blobs"``, ``"commit"`` (pull only) or ``"done"``.
    ``bytes_done`` counts bytes sent or received plus the sizes of blobs
    skipped, so that it ends at ``bytes_total``.
    """

    phase: str
    blobs_done: int
    blobs_total: int
    bytes_done: int
    bytes_total: int
    skipped: int


ProgressCallback = Callable[[Progress], None]
"""Called from the transferring thread: after each blob, and after each chunk
(about 1 MiB) sent or received. An exception it raises stops the transfer and
leaves push or pull unchanged: this is the way to cancel one."""


@dataclass(frozen=True)
class PushReport:
    """``ref`` is the pushed reference pinned to the manifest digest (``host/repo:tag@sha256:...``)."""

    digest: str
    ref: str
    blobs_uploaded: int
    blobs_skipped: int
    bytes_uploaded: int


@dataclass(frozen=True)
class PullReport:
    checkpoint_id: str
    blobs_downloaded: int
    blobs_skipped: int
    bytes_downloaded: int
