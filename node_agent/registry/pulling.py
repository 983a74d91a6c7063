"""Pull: a checkpoint from a registry repository into the store.

The manifest is fetched, bounded, checked against its digest and read as
hostile input; before a byte is written, what the pull brings must fit its
bound (``budget``: ``registry.max-pull-bytes``, ``min-free-bytes``), which
counts every byte again as it arrives. Each blob the store lacks is streamed
into one store import, up to ``registry.connections`` at once (``parallel``),
from the first host of the node's registry hosts that has it (``endpoints``);
the import verifies each and skips (without a request) the blobs it already
holds; the import stages the manifest (the checkpoint
whole, listed nowhere), an ``admit`` callback judges it with the
signatures fetched and verified before (``referrers_api``), and only then is it
published and its signatures attached. A refused admission, or a manifest
or config that is not a valid checkpoint (InvalidArgument), discards the
import: nothing of what the pull, or an earlier run of it, brought stays. A
pull that stopped half-way otherwise (the registry, the network, the disk,
its deadline, its caller) keeps the blobs it finished (linked into the
store as each one is verified) under a lease kept for
``registry.partial-pull-ttl`` seconds, across agent restarts, so running it
again fetches only the rest; garbage collection takes them afterwards. The
import's staging goes with it (a lazy pull's origin record, which holds no
password, stays for garbage collection). A pull that fails, is stopped,
refused or runs out of time is logged as one warning naming the reference
and the reason.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Final, TypeGuard

from node_agent.config.schema import DEFAULT_MIN_FREE_BYTES, RegistrySettings
from node_agent import strictjson
from node_agent.errors import DataLoss, Internal, InvalidArgument, NotFound
from node_agent.oci import (
    ARTIFACT_TYPE,
    MAX_MANIFEST_BYTES,
    OCI_MANIFEST_MEDIA_TYPE,
    Descriptor,
    DocumentError,
    read_manifest,
    sha256_digest,
)
from node_agent.registry import referrers_api
from node_agent.registry.auth import Credentials
from node_agent.registry.budget import PullBudget
from node_agent.registry.endpoints import RegistryAccess, Route
from node_agent.registry.failures import log_failure
from node_agent.registry.parallel import Stopping, each_blob
from node_agent.registry.ports import R, Admission, BlobImporter, BlobSink, ProgressCallback, PullReport
from node_agent.registry.reference import Reference, check_digest, parse_reference
from node_agent.registry.tally import BlobCount, Tally, unique_blobs
from node_agent.registry.transport import CHUNK_SIZE, BodyReader, Response, Session

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)

MAX_DESCRIPTORS: Final = 1_000_000
"""Most config + layer descriptors in one manifest."""
MAX_BLOB_SIZE: Final = 1 << 50
"""Largest blob size believed (1 PiB)."""
MAX_MEDIA_TYPE_LENGTH: Final = 255
_FAULTS: Final = {
    "object": "a descriptor must be a JSON object",
    "mediaType": "bad mediaType",
    "digest": "digest must be a string",
    "size": f"size must be an integer from 0 to {MAX_BLOB_SIZE}",
}


def _believable_media_type(value: object) -> TypeGuard[str]:
    """Any short, printable name: the store checks media types in full when it commits."""
    return isinstance(value, str) and bool(value) and len(value) <= MAX_MEDIA_TYPE_LENGTH and value.isprintable()


def parse_manifest(data: bytes) -> list[Descriptor]:
    """The config and layer descriptors of a checkpoint manifest as a registry sends it, config first.

    Only what pulling needs is checked (``oci.read_manifest``: the media
    types, the descriptors to fetch); the store validates the manifest in
    full when it is committed. InvalidArgument if ``data`` is not an OCI
    image manifest of a checkpoint.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidArgument(f"manifest is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        doc = strictjson.loads(data)
    except strictjson.StrictJsonError as exc:
        raise InvalidArgument(f"manifest {exc}") from None
    try:
        read = read_manifest(doc, artifact_type=lambda kind: kind == ARTIFACT_TYPE, max_layers=MAX_DESCRIPTORS - 1,
                             keys=None, media_type=_believable_media_type, max_size=MAX_BLOB_SIZE)
    except DocumentError as exc:
        raise InvalidArgument(_manifest_fault(exc)) from None
    return [read.config, *read.layers]


def _manifest_fault(exc: DocumentError) -> str:
    """What ``read_manifest`` found wrong, in the pull's words (a digest in the reference grammar's)."""
    wrong = exc.descriptor
    if wrong is not None:
        if wrong.field == "digest" and isinstance(wrong.value, str):
            check_digest(wrong.value, f"manifest {exc.where}: digest")  # raises
        return f"manifest {exc.where}: {_FAULTS.get(wrong.field, wrong.detail)}"
    if exc.field == "object":
        return "manifest is not a JSON object"
    if exc.field == "schemaVersion":
        return "manifest schemaVersion is not 2"
    if exc.field == "mediaType":
        return f"manifest mediaType is {str(exc.value)[:100]!r}, not {OCI_MANIFEST_MEDIA_TYPE}"
    if exc.field == "artifactType":
        return f"not a node-agent checkpoint: artifactType is {str(exc.value)[:100]!r}, not {ARTIFACT_TYPE}"
    if exc.field == "layers" and exc.value is None:
        return "manifest layers must be a list"
    return f"manifest has more than {MAX_DESCRIPTORS} descriptors"


def recorded_origin(reference: str, creds: Credentials, node_logins: bool = True) -> dict[str, object]:
    """What a store records about where a lazily pulled checkpoint's blobs are (never the password)."""
    return {
        "reference": reference, "username": creds.username, "ca_file": creds.ca_file, "ca_pem": creds.ca_pem,
        "plain_http": creds.plain_http, "insecure_skip_verify": creds.insecure_skip_verify,
        "node_logins": node_logins,
    }


def pull(
    store: BlobSink[R],
    ref: str | Reference,
    creds: Credentials,
    *,
    progress: ProgressCallback | None = None,
    timeout: float | None = None,
    defer: Callable[[str, int], Collection[str]] | None = None,
    settings: RegistrySettings | None = None,
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
    admit: Callable[[Admission[R]], None] | None = None,
    node_logins: bool = True,
) -> PullReport:
    """Pull ``ref`` (``host/repo:tag`` or ``host/repo@sha256:...``) into ``store``; returns once it is published.

    ``settings`` (the agent's ``registry:`` section; its defaults when None)
    bound each request (``request-timeout``, ``min-rate`` for blobs) and
    each socket operation (``io-timeout``, or ``timeout`` when given), name
    the token realms that may be asked, and bound the pull's size
    (``max-pull-bytes``); ``min_free_bytes`` (the agent's
    ``min-free-bytes``) stay free on the store's filesystem. Either bound
    crossed is ResourceExhausted, before a byte is written when the
    manifest shows it. Safe to run again after any failure; what a failed
    run brought stays ``partial-pull-ttl`` seconds (of ``settings``) for the
    next run, which fetches only the rest. A lazy pull
    passes ``defer``: given the config blob (digest, size), once it is in
    the store, it names the blobs to leave in the registry; the store
    records the registry as their origin and readers fetch them on demand
    (`fetching`). ``admit``, when given, is called with the checkpoint
    staged (whole in the store, its signatures verified, but not
    published) and may raise to refuse it: then nothing the pull brought
    stays in the store, and the exception comes out of ``pull`` unchanged.

    Requests go to the hosts the node's registry hosts configuration names
    for the registry (``endpoints``: its mirrors, then the registry), with
    ``creds`` for the registry itself and, with ``node_logins``, the node's
    logins where ``creds`` has none.
    """
    try:
        return _pull(store, ref, creds, progress, timeout, defer, settings, min_free_bytes, admit, node_logins)
    except BaseException as exc:
        log_failure(log, "pull", ref, exc)
        raise


def _pull(
    store: BlobSink[R],
    ref: str | Reference,
    creds: Credentials,
    progress: ProgressCallback | None,
    timeout: float | None,
    defer: Callable[[str, int], Collection[str]] | None,
    settings: RegistrySettings | None,
    min_free_bytes: int,
    admit: Callable[[Admission[R]], None] | None,
    node_logins: bool,
) -> PullReport:
    reference = parse_reference(ref)
    if reference.tag is None and reference.digest is None:
        raise InvalidArgument(f"reference {reference} names neither a tag nor a digest")
    tally = Tally(progress)
    log.info("pulling %s: fetching its manifest", reference)
    access = RegistryAccess.of(settings)
    endpoints = access.endpoints(reference, "pull", creds, node_logins=node_logins)
    with Route(reference, endpoints, timeout=timeout, settings=settings, actions="pull") as route:
        tally.report("manifest")
        if reference.digest is None:  # a tag is resolved only by hosts trusted to
            resolvers = access.endpoints(reference, "resolve", creds, node_logins=node_logins)
            with Route(reference, resolvers, timeout=timeout, settings=settings, actions="pull",
                       tokens=route.tokens) as resolver:
                manifest, digest = resolver.run(_get_manifest)
        else:
            manifest, digest = route.run(_get_manifest)
        pinned = f"{reference.registry}/{reference.repository}@{digest}"
        refs = parse_manifest(manifest)
        blobs = unique_blobs((b.digest, b.size) for b in refs)
        registry = settings or RegistrySettings()
        budget = PullBudget(store, str(reference), min_free=min_free_bytes, max_bytes=registry.max_pull_bytes)
        config = refs[0]
        if defer is None:
            budget.plan(blobs, "the checkpoint")
        else:  # all of it comes in the end, on the readers' demand
            budget.bound(sum(size for _, size in blobs), len(blobs), "the checkpoint")
            budget.plan([(config.digest, config.size)], "what a lazy pull brings now")
        deferred: set[str] = set()
        # Stopped half-way (the registry, the network, the disk), it keeps what it brought for a resume.
        with store.importer(keep_for=registry.partial_pull_ttl, manifest=digest, reference=pinned) as importer:
            admitting = False
            try:
                if defer is not None:
                    _import_blob(route, importer, config.digest, config.size, digest, Tally(None), budget)
                    importer.wait_linked()  # read from the store next
                    deferred = set(defer(config.digest, config.size)) - {config.digest}
                    blobs = [(d, size) for d, size in blobs if d not in deferred]
                    budget.plan([(d, size) for d, size in blobs if d != config.digest], "what a lazy pull brings now")
                    store.origins.remember(digest, recorded_origin(pinned, creds, node_logins))
                tally.plan([size for _, size in blobs])
                tally.report("blobs")

                def fetch(lane: Route, blob: tuple[str, int], stopping: Stopping) -> None:
                    _import_blob(lane, importer, blob[0], blob[1], digest, tally, budget, stopping)

                each_blob(blobs, fetch, route.lane, registry.connections)
                signatures = route.run(lambda session: referrers_api.fetch_signatures(session, digest))  # before the commit: a failure publishes nothing
                tally.report("commit")
                staged = importer.stage(manifest, deferred=deferred)
                if admit is not None:
                    admitting = True
                    admit(Admission(pinned, staged, tuple(signatures)))
            except BaseException as exc:
                if admitting or isinstance(exc, InvalidArgument):
                    # Refused, or no valid checkpoint: running it again cannot help, and nothing of it stays
                    # (no record, no referrer, no blob that it or an earlier run of it brought).
                    _discard(importer, pinned)
                raise
            record = importer.commit(manifest, deferred=deferred)
        if not deferred:
            store.origins.settle(digest)
        for signature in signatures:
            store.attach(digest, signature.manifest, signature.blobs)
    if record.id != digest:
        raise Internal(f"the store published manifest {digest} as {record.id}")
    tally.report("done")
    log.info(
        "pulled %s as checkpoint %s: %d blob(s) downloaded (%d bytes), %d already here, %d signature(s)%s",
        reference, digest, tally.moved, tally.bytes_moved, tally.skipped, len(signatures),
        f", {len(deferred)} left in the registry until needed" if deferred else "",
    )
    return PullReport(digest, tally.moved, tally.skipped, tally.bytes_moved)


def _discard(importer: BlobImporter[R], reference: str) -> None:
    """Drop a refused import; a failure to clean up is logged, never raised over the refusal."""
    try:
        importer.discard()
    except Exception as exc:  # noqa: BLE001 - the refusal is what the caller must see
        log.warning("pull of %s: the refused checkpoint's blobs stay until garbage collection: %s", reference, exc)


def _get_manifest(session: Session) -> tuple[bytes, str]:
    """The manifest's bytes and digest, checked against the reference and the registry's own claim."""
    ref = session.ref
    target = ref.digest or ref.tag
    assert target is not None
    what = f"fetching manifest {target}"
    url = session.url(f"/v2/{ref.repository}/manifests/{target}")
    with session.request("GET", url, what, headers={"Accept": OCI_MANIFEST_MEDIA_TYPE}, follow_redirects=True) as resp:
        if resp.status == 404:
            resp.close()
            raise NotFound(f"{session.where}: there is no manifest {target}")
        if resp.status != 200:
            raise resp.error(what)
        content_type = (resp.header("Content-Type") or "").split(";")[0].strip()
        claimed = (resp.header("Docker-Content-Digest") or "").strip()
        data = resp.read(MAX_MANIFEST_BYTES, f"manifest {target}")
    if content_type and content_type != OCI_MANIFEST_MEDIA_TYPE:
        raise InvalidArgument(
            f"{session.where}: {target} is {content_type[:100]!r}, not an OCI image manifest of a checkpoint"
        )
    digest = sha256_digest(data)
    if ref.digest is not None and digest != ref.digest:
        raise DataLoss(f"{session.where}: the manifest sent for {ref.digest} hashes to {digest}; refused")
    if claimed.startswith("sha256:") and claimed != digest:
        raise DataLoss(f"{session.where}: the registry says manifest {target} is {claimed[:80]}, but it hashes to {digest}; refused")
    return data, digest


def _import_blob(route: Route, importer: BlobImporter[R], digest: str, size: int, manifest: str, tally: Tally,
                 budget: PullBudget | None = None, stopping: Stopping | None = None,
                 keep: list[bytes] | None = None) -> bool:
    """Add one blob to the import; it is fetched only if the store does not have it.

    The importer records every blob it is given (so garbage collection keeps
    it until the import ends) and reads the stream only for a blob it lacks:
    the download starts lazily, on the first read. The transport refuses a
    body longer than ``size`` and the importer one that does not hash to
    ``digest``; ``budget`` counts each piece before it is written, and gives
    back what a host that failed half-way sent before the next host is asked.
    Returns whether it was fetched; then ``keep``, when given, holds its
    pieces (the blob's bytes the importer verified), for a reader that
    needs them now.
    """

    def attempt(session: Session) -> bool:
        stream = _Download(session, digest, size, manifest, tally.blob(), budget, stopping, keep)
        try:
            importer.add_blob(digest, size, stream)
        except BaseException:
            stream.failed()
            raise
        finally:
            stream.close()
        if stream.started:
            stream.count.done()
        return stream.started

    if not route.run(attempt):
        tally.skip(size)
        return False
    return True


def _download_blob(route: Route, digest: str, size: int, manifest: str, keep: list[bytes]) -> None:
    """One blob into ``keep`` only (its pieces), verified as an import verifies it; nothing goes into a store.

    For a reader that needs the bytes where the store may not keep them
    (`fetching.RemoteBlobs`, when the store's filesystem is short of space).
    """

    def attempt(session: Session) -> None:
        stream = _Download(session, digest, size, manifest, Tally(None).blob(), None, None, keep)
        try:
            hasher = hashlib.sha256()
            got = 0
            for piece in stream:
                got += len(piece)
                if got > size:
                    raise DataLoss(f"blob {digest}: received more than the expected {size} bytes")
                hasher.update(piece)
            if got != size:
                raise DataLoss(f"blob {digest}: received {got} bytes, expected {size}")
            if (actual := "sha256:" + hasher.hexdigest()) != digest:
                raise DataLoss(f"blob {digest}: received bytes hash to {actual}")
        except BaseException:
            keep.clear()
            raise
        finally:
            stream.close()

    route.run(attempt)


class _Download:
    """One blob's body, requested from the registry on its first read: into the reader's buffer (``readinto``,
    as the store writes a new blob) or as pieces (iterating). Each piece is checked against ``stopping``,
    charged to ``budget``, counted and, with ``keep``, kept (``_import_blob``)."""

    def __init__(self, session: Session, digest: str, size: int, manifest: str, count: BlobCount,
                 budget: PullBudget | None, stopping: Stopping | None, keep: list[bytes] | None) -> None:
        self._session = session
        self._digest = digest
        self._size = size
        self._manifest = manifest
        self.count = count
        self._budget = budget
        self._stopping = stopping
        self._keep = keep
        self._resp: Response | None = None
        self._body: BodyReader | None = None
        self.started = False
        self._charged = 0

    def _open(self) -> BodyReader:
        if self._body is not None:
            return self._body
        self.started = True
        if self._keep is not None:
            self._keep.clear()  # a host that failed half-way sent some
        session, digest = self._session, self._digest
        what = f"downloading blob {digest}"
        url = session.url(f"/v2/{session.ref.repository}/blobs/{digest}")
        self._resp = resp = session.request("GET", url, what, follow_redirects=True, size=self._size)
        if resp.status == 404:
            raise NotFound(f"{session.where}: blob {digest} of manifest {self._manifest} is not in the registry")
        if resp.status != 200:
            raise resp.error(what)
        self._body = resp.body(self._size, f"blob {digest}")
        return self._body

    def readinto(self, buffer: WriteableBuffer) -> int:
        got = self._open().readinto(buffer)
        if got:
            self._took(memoryview(buffer).cast("B")[:got])
        return got

    def __iter__(self) -> Iterator[bytes]:
        body = self._open()
        while piece := body.read(CHUNK_SIZE):
            self._took(piece)
            yield piece

    def _took(self, piece: bytes | memoryview) -> None:
        if self._stopping is not None:
            self._stopping.check()
        if self._budget is not None:
            self._budget.charge(len(piece))
            self._charged += len(piece)
        if self._keep is not None:
            self._keep.append(bytes(piece))
        self.count.add(len(piece))

    def failed(self) -> None:
        """Undo what the failed try counted: its bytes are given back to the budget, the blob starts again."""
        if self._budget is not None:
            self._budget.refund(self._charged)
        self._charged = 0
        self.count.restart()

    def close(self) -> None:
        if self._resp is not None:
            self._resp.close()
