"""What pushing and pulling need from the checkpoint store, and what they report.

Small structural interfaces: ``node_agent.store.Store`` provides both, and
nothing here imports the store. A pull's admission callback gets an
``Admission``: the checkpoint as the store staged it, whole but not yet
published, with the signatures the pull fetched.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import BinaryIO, Generic, Protocol, TypeVar

from node_agent.errors import DataLoss, NotFound
from node_agent.oci import Descriptor, sha256_digest
from node_agent.signing import SIGNATURE_ARTIFACT_TYPE, SignatureArtifact


class Record(Protocol):
    """A checkpoint in the store; only its ID is used here."""

    @property
    def id(self) -> str: ...


R_co = TypeVar("R_co", bound=Record, covariant=True)
"""The store's own record type, which pulling hands back to an admission callback untouched."""
R = TypeVar("R", bound=Record)


class BlobSource(Protocol):
    """The store, as pushing sees it."""

    def get(self, checkpoint_id: str) -> Record: ...

    def manifest_bytes(self, checkpoint_id: str) -> bytes: ...

    def descriptors(self, checkpoint_id: str) -> Sequence[Descriptor]: ...

    def open_blob(self, digest: str) -> BinaryIO: ...

    def referrers(self, subject_id: str, artifact_type: str | None = None) -> Sequence[tuple[str, bytes]]:
        """(digest, manifest bytes) of the checkpoint's referrers: its signatures."""


class BlobImporter(Protocol[R_co]):
    """One import into the store, holding a lease until it commits, aborts or discards."""

    def __enter__(self) -> BlobImporter[R_co]: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None: ...

    def add_blob(self, digest: str, size: int, stream: Iterable[bytes]) -> None:
        """Store a verified blob; one already present is recorded without reading ``stream``."""

    def wait_linked(self) -> None:
        """Wait until every blob added so far is durable and in the store."""

    def stage(self, manifest: bytes, *, deferred: Collection[str] = ()) -> R_co:
        """Validate the manifest, require its blobs, store it; the record of the checkpoint, not yet published."""

    def commit(self, manifest: bytes, *, deferred: Collection[str] = ()) -> Record: ...

    def abort(self) -> None: ...

    def discard(self) -> object:
        """Stop, and delete the blobs this import brought in that nothing else reaches."""


class OriginBook(Protocol):
    """Where the blobs a lazy pull left in the registry are (the store's ``origins``)."""

    def remember(self, checkpoint_id: str, origin: Mapping[str, object]) -> None: ...

    def settle(self, checkpoint_id: str) -> bool: ...


class BlobSink(Protocol[R_co]):
    """The store, as pulling sees it."""

    @property
    def root(self) -> str: ...

    @property
    def origins(self) -> OriginBook: ...

    def importer(self, *, keep_for: float = 0.0, manifest: str = "", reference: str = "") -> BlobImporter[R_co]:
        """One import; with ``keep_for``, one that stops unpublished keeps what it brought that many seconds."""

    def has_blob(self, digest: str) -> bool: ...

    def free_bytes(self) -> int:
        """Bytes still free for the store on its filesystem."""

    def short_of_room(self, size: int, min_free: int) -> int | None:
        """The bytes free when ``size`` more would leave less than ``min_free``; None when they fit."""

    def attach(self, subject_id: str, manifest: bytes, blobs: Mapping[str, bytes]) -> str:
        """Keep a referrer (a signature) of a published checkpoint, with its blobs."""


@dataclass(frozen=True)
class Admission(Generic[R]):
    """A pulled checkpoint before it is published: what a pull's ``admit`` callback judges.

    ``reference`` is the reference pulled, pinned by digest
    (``host/repo@sha256:...``). ``record`` is the store's record of the
    checkpoint, whole in the store (its files read through the store as
    any record's: ``Store.open`` and ``materialize`` take it) but listed
    nowhere yet. ``signatures`` are those the pull fetched and verified;
    they are attached once it is published. An ``Admission`` serves them as
    a store serves referrers (``referrers``, ``read_blob``), so
    ``signing.require_trusted(admission, admission.record, ...)`` judges them.
    """

    reference: str
    record: R
    signatures: tuple[SignatureArtifact, ...] = ()

    def referrers(self, subject_id: str, artifact_type: str | None = None) -> list[tuple[str, bytes]]:
        """(digest, manifest bytes) of the fetched signatures of ``subject_id``."""
        if subject_id != self.record.id or artifact_type not in (None, SIGNATURE_ARTIFACT_TYPE):
            return []
        return [(s.digest, s.manifest) for s in self.signatures]

    def read_blob(self, digest: str, size: int) -> bytes:
        """A fetched signature's blob, checked against ``digest`` and ``size``."""
        for signature in self.signatures:
            data = signature.blobs.get(digest)
            if data is not None:
                if len(data) != size or sha256_digest(data) != digest:
                    raise DataLoss(f"blob {digest} of a signature of {self.record.id} is not {size} bytes of that digest")
                return data
        raise NotFound(f"blob {digest} is not among the signatures pulled with {self.record.id}")


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
