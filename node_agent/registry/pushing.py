"""Push: a checkpoint from the store to a registry repository.

Blobs first (a HEAD on each, an upload only where the registry lacks it;
up to ``registry.connections`` at once, ``parallel``), the manifest last, so a registry never holds a manifest whose blobs are
missing, and a push that stopped half-way uploads only what is still missing
when it is run again. The checkpoint's referrers (its signatures) follow it
(``referrers_api``). A push that fails, is stopped or runs out of time is
logged as one warning naming the reference and the reason.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from typing import BinaryIO
from urllib.parse import parse_qsl, urlencode, urljoin, urlsplit, urlunsplit

from node_agent.config.schema import RegistrySettings
from node_agent.errors import DataLoss, InvalidArgument, Unavailable
from node_agent.oci import OCI_MANIFEST_MEDIA_TYPE, sha256_digest
from node_agent.registry import referrers_api
from node_agent.registry.auth import Credentials, TokenCache
from node_agent.registry.endpoints import RegistryAccess, Route
from node_agent.registry.failures import log_failure
from node_agent.registry.parallel import Stopping, each_blob
from node_agent.registry.ports import BlobSource, ProgressCallback, PushReport
from node_agent.registry.reference import Reference, parse_reference
from node_agent.registry.tally import Tally, unique_blobs
from node_agent.registry.transport import CHUNK_SIZE, Body, Resend, Session

log = logging.getLogger(__name__)

UPLOAD_ATTEMPTS = 3
"""Times one blob upload is started when the registry asks for it to be sent again."""


def push(
    store: BlobSource,
    checkpoint_id: str,
    ref: str | Reference,
    creds: Credentials,
    *,
    progress: ProgressCallback | None = None,
    timeout: float | None = None,
    settings: RegistrySettings | None = None,
) -> PushReport:
    """Push checkpoint ``checkpoint_id`` to ``ref`` (``host/repo:tag``, ``host/repo@sha256:...`` or ``host/repo``).

    Without a tag the manifest is put by its digest. ``settings`` (the
    agent's ``registry:`` section; its defaults when None) bound each request
    (``request-timeout``, ``min-rate`` for blobs) and each socket operation
    (``io-timeout``, or ``timeout`` when given), and name the token realms
    that may be asked. It goes to the first host the node's registry hosts
    configuration trusts with ``push``, with ``creds`` (or else the node's
    login) where that is the registry itself. Safe to run again after any
    failure.
    """
    try:
        return _push(store, checkpoint_id, ref, creds, progress, timeout, settings)
    except BaseException as exc:
        log_failure(log, "push", ref, exc)
        raise


def _push(
    store: BlobSource,
    checkpoint_id: str,
    ref: str | Reference,
    creds: Credentials,
    progress: ProgressCallback | None,
    timeout: float | None,
    settings: RegistrySettings | None,
) -> PushReport:
    reference = parse_reference(ref)
    digest = store.get(checkpoint_id).id
    manifest = store.manifest_bytes(digest)
    if sha256_digest(manifest) != digest:
        raise DataLoss(f"checkpoint {digest}: its manifest bytes hash to {sha256_digest(manifest)}")
    if reference.digest is not None and reference.digest != digest:
        raise InvalidArgument(f"reference {reference} names digest {reference.digest}, but checkpoint {digest} is pushed")
    blobs = unique_blobs((d.digest, d.size) for d in store.descriptors(digest))
    tally = Tally(progress)
    tally.plan([size for _, size in blobs])
    # The first host the node's registry hosts configuration trusts to push (the registry itself, unless a
    # mirror is; over HTTPS, then plain HTTP where containerd would fall back): a push is not split across hosts.
    endpoints = RegistryAccess.of(settings).endpoints(reference, "push", creds)
    endpoints = [e for e in endpoints if e.host.host == endpoints[0].host.host]

    tokens = TokenCache()  # one token serves every lane

    def lane_route() -> Route:
        return Route(reference, endpoints, timeout=timeout, settings=settings, actions="pull,push", tokens=tokens)

    def send(lane: Route, blob: tuple[str, int], stopping: Stopping) -> None:
        blob_digest, size = blob

        def attempt(session: Session) -> None:
            stopping.check()
            if _registry_has(session, blob_digest):
                tally.skip(size)
            else:
                _upload(session, store, blob_digest, size, tally, stopping)

        lane.run(attempt)

    tally.report("blobs")
    each_blob(blobs, send, lane_route, (settings or RegistrySettings()).connections)
    with lane_route() as route:
        tally.report("manifest")
        route.run(lambda session: _put_manifest(session, manifest, digest))
        referred = route.run(lambda session: _push_referrers(session, store, digest))
    tally.report("done")
    pinned = Reference(reference.registry, reference.repository, reference.tag, digest)
    log.info(
        "pushed checkpoint %s to %s: %d blob(s) uploaded (%d bytes), %d already there, %d referrer(s)",
        digest, pinned, tally.moved, tally.bytes_moved, tally.skipped, referred,
    )
    return PushReport(digest, str(pinned), tally.moved, tally.skipped, tally.bytes_moved)


def _push_referrers(session: Session, store: BlobSource, digest: str) -> int:
    """The checkpoint's referrers (its signatures) after it: their blobs, then each manifest by digest."""
    found = store.referrers(digest)
    for _, manifest in found:
        for blob in referrers_api.describe(manifest)[1]:
            if not _registry_has(session, blob.digest):
                _upload(session, store, blob.digest, blob.size, Tally(None))
        referrers_api.put_referrer(session, manifest, digest)
    return len(found)


def _blob_url(session: Session, digest: str) -> str:
    return session.url(f"/v2/{session.ref.repository}/blobs/{digest}")


def _registry_has(session: Session, digest: str) -> bool:
    with session.request("HEAD", _blob_url(session, digest), f"checking blob {digest}", follow_redirects=True) as resp:
        if resp.status == 200:
            return True
        if resp.status == 404:
            return False
        raise resp.error(f"checking blob {digest}")


def _with_query(url: str, name: str, value: str) -> str:
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    query.append((name, value))
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), parts.fragment))


def _upload(session: Session, store: BlobSource, digest: str, size: int, tally: Tally,
            stopping: Stopping | None = None) -> None:
    """POST for an upload location, then one PUT of the whole blob, streamed from the store."""
    what = f"uploading blob {digest}"
    count = tally.blob()
    for _ in range(UPLOAD_ATTEMPTS):
        start_url = session.url(f"/v2/{session.ref.repository}/blobs/uploads/")
        with session.request("POST", start_url, f"starting the upload of blob {digest}", body=b"") as resp:
            if resp.status != 202:
                raise resp.error(f"starting the upload of blob {digest}")
            location = resp.header("Location")
        if not location:
            raise Unavailable(f"{session.where}: the registry started an upload but sent no Location")
        put_url = _with_query(urljoin(start_url, location.strip()), "digest", digest)
        count.restart()
        try:
            with store.open_blob(digest) as blob:
                body = Body(size, count.counted(_read_blob(blob, digest, size, stopping)))
                resp = session.request(
                    "PUT", put_url, what, headers={"Content-Type": "application/octet-stream"}, stream=body
                )
        except Resend:
            log.debug("registry %s asked for blob %s again", session.ref.registry, digest)
            continue
        with resp:
            if resp.status != 201:
                raise resp.error(what)
            stored = resp.header("Docker-Content-Digest")
        if stored is not None and stored.strip() != digest:
            raise DataLoss(f"{session.where}: blob {digest} was stored as {stored.strip()[:80]}")
        count.done()
        return
    raise Unavailable(f"{session.where}: {what}: the registry asked for it {UPLOAD_ATTEMPTS} times")


def _read_blob(blob: BinaryIO, digest: str, size: int, stopping: Stopping | None = None) -> Iterator[bytes]:
    """The blob's bytes in chunks, checked against its size and digest as they go out."""
    hasher = hashlib.sha256()
    done = 0
    while True:
        if stopping is not None:
            stopping.check()
        try:
            data = blob.read(min(CHUNK_SIZE, size - done + 1))
        except OSError as exc:
            raise DataLoss(f"reading blob {digest} from the store: {exc.strerror or exc}") from exc
        if not data:
            break
        done += len(data)
        if done > size:
            raise DataLoss(f"blob {digest} in the store is longer than its {size} bytes")
        hasher.update(data)
        yield data
    if done != size:
        raise DataLoss(f"blob {digest} in the store is {done} bytes, not {size}")
    if "sha256:" + hasher.hexdigest() != digest:
        raise DataLoss(f"blob {digest} in the store does not match its digest")


def _put_manifest(session: Session, manifest: bytes, digest: str) -> None:
    target = session.ref.tag or digest
    what = f"putting manifest {target}"
    url = session.url(f"/v2/{session.ref.repository}/manifests/{target}")
    with session.request("PUT", url, what, headers={"Content-Type": OCI_MANIFEST_MEDIA_TYPE}, body=manifest) as resp:
        if resp.status != 201:
            raise resp.error(what)
        stored = resp.header("Docker-Content-Digest")
    if stored is not None and stored.strip() != digest:
        raise DataLoss(f"{session.where}: the registry stored the manifest as {stored.strip()[:80]}, not {digest}")
