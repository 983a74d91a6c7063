"""Pull: a checkpoint from a registry repository into the store.

The manifest is fetched, bounded, checked against its digest and read as
hostile input; each blob the store lacks is streamed into one store import,
which verifies it and skips (without a request) the blobs it already holds;
the import commits the manifest last, and the checkpoint's signatures
(fetched and verified before it, ``referrers``) are attached to it. A pull
that stopped half-way keeps the blobs it finished (linked into the store as
each one is verified, kept until garbage collection), so running it again
fetches only the rest; the import's
staging goes with it (a lazy pull's origin record, which holds no password,
stays for garbage collection). A pull that fails, is stopped or runs out of
time is logged as one warning naming the reference and the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Generator

from node_agent.config import RegistrySettings
from node_agent.errors import DataLoss, Internal, InvalidArgument, NotFound
from node_agent.oci import MAX_MANIFEST_BYTES, OCI_MANIFEST_MEDIA_TYPE, sha256_digest
from node_agent.registry import referrers
from node_agent.registry.auth import Credentials
from node_agent.registry.failures import log_failure
from node_agent.registry.manifest import parse_manifest
from node_agent.registry.ports import BlobImporter, BlobSink, ProgressCallback, PullReport
from node_agent.registry.reference import Reference, parse_reference
from node_agent.registry.tally import Tally, unique_blobs
from node_agent.registry.transport import Session

log = logging.getLogger(__name__)


def recorded_origin(reference: str, creds: Credentials) -> dict[str, object]:
    """What a store records about where a lazily pulled checkpoint's blobs are (never the password)."""
    return {
        "reference": reference, "username": creds.username, "ca_file": creds.ca_file, "ca_pem": creds.ca_pem,
        "plain_http": creds.plain_http, "insecure_skip_verify": creds.insecure_skip_verify,
    }


def pull(
    store: BlobSink,
    ref: str | Reference,
    creds: Credentials,
    *,
    progress: ProgressCallback | None = None,
    timeout: float | None = None,
    defer: Callable[[str, int], Collection[str]] | None = None,
    settings: RegistrySettings | None = None,
) -> PullReport:
    """Pull ``ref`` (``host/repo:tag`` or ``host/repo@sha256:...``) into ``store``; returns once it is published.

    ``settings`` (the agent's ``registry:`` section; its defaults when None)
    bound each request (``request-timeout``, ``min-rate`` for blobs) and
    each socket operation (``io-timeout``, or ``timeout`` when given), and
    name the token realms that may be asked. Safe to run again after any
    failure. A lazy pull passes ``defer``: given the config blob (digest,
    size), once it is in the store, it names the blobs to leave in the
    registry; the store records the registry as their origin and readers
    fetch them on demand (`fetching`).
    """
    try:
        return _pull(store, ref, creds, progress, timeout, defer, settings)
    except BaseException as exc:
        log_failure(log, "pull", ref, exc)
        raise


def _pull(
    store: BlobSink,
    ref: str | Reference,
    creds: Credentials,
    progress: ProgressCallback | None,
    timeout: float | None,
    defer: Callable[[str, int], Collection[str]] | None,
    settings: RegistrySettings | None,
) -> PullReport:
    reference = parse_reference(ref)
    if reference.tag is None and reference.digest is None:
        raise InvalidArgument(f"reference {reference} names neither a tag nor a digest")
    tally = Tally(progress)
    log.info("pulling %s: fetching its manifest", reference)
    with Session(reference, creds, timeout=timeout, settings=settings, actions="pull") as session:
        tally.report("manifest")
        manifest, digest = _get_manifest(session)
        refs = parse_manifest(manifest)
        blobs = unique_blobs((b.digest, b.size) for b in refs)
        deferred: set[str] = set()
        with store.importer() as importer:
            if defer is not None:
                config = refs[0]
                _import_blob(session, importer, config.digest, config.size, digest, Tally(None))
                deferred = set(defer(config.digest, config.size)) - {config.digest}
                blobs = [(d, size) for d, size in blobs if d not in deferred]
                store.origins.remember(digest, recorded_origin(f"{reference.registry}/{reference.repository}@{digest}", creds))
            tally.plan([size for _, size in blobs])
            tally.report("blobs")
            for blob_digest, size in blobs:
                _import_blob(session, importer, blob_digest, size, digest, tally)
            signatures = referrers.fetch_signatures(session, digest)  # before the commit: a failure publishes nothing
            tally.report("commit")
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


def _import_blob(session: Session, importer: BlobImporter, digest: str, size: int, manifest: str, tally: Tally) -> None:
    """Add one blob to the import; it is fetched only if the store does not have it.

    The importer records every blob it is given (so garbage collection keeps
    it until the import ends) and reads the stream only for a blob it lacks:
    the download starts lazily, on the first read.
    """
    started = False

    def download() -> Generator[bytes, None, None]:
        nonlocal started
        started = True
        what = f"downloading blob {digest}"
        url = session.url(f"/v2/{session.ref.repository}/blobs/{digest}")
        with session.request("GET", url, what, follow_redirects=True, size=size) as resp:
            if resp.status == 404:
                raise NotFound(f"{session.where}: blob {digest} of manifest {manifest} is not in the registry")
            if resp.status != 200:
                raise resp.error(what)
            yield from tally.counted(resp.chunks(size, f"blob {digest}"))

    tally.restart_blob()
    stream = download()
    try:
        importer.add_blob(digest, size, stream)
    finally:
        stream.close()
    if started:
        tally.blob_done()
    else:
        tally.skip(size)
