"""Single blobs on demand: the chunks a lazy pull left in the registry.

A checkpoint pulled with ``lazy`` is published with its memory chunks still
in the registry, and its origin recorded in the store (the reference,
pinned by digest, and how to reach the registry; never a password). When a
reader needs such a chunk (a lazy restore's page source, mostly), it is
downloaded, verified against its digest and linked into the store like any
pulled blob, so each chunk crosses the network once. The reader gets the
verified bytes at once; the blob's fsync and link follow in the import's
threads (``drain`` waits for them, as ``Origins.settle`` does). The chunks
one connection fetches go into one import (its lease in ``ingest/``), ended
after ``IMPORT_BATCH`` of them, after a failure, at ``drain`` while the
connection is idle, and at ``close``: an import per chunk would cost a
directory, a lease and a thread per megabyte. A fetch of a blob another
thread is fetching from the same origin waits for that fetch and gets its
bytes (a restore's reader behind the fetches ahead of it, `lazy.prefetch`).

A reader that cannot wait for the registry to come back fails at once; a
page source, whose restored process is already running, retries a fetch
that failed in transport (the registry refused or dropped the connection,
did not answer, or answered 5xx) with backoff until ``retry_for`` seconds
have passed (``timeouts.lazy-fetch``): a registry that goes away for a few
seconds costs a replica a pause, not its life. A blob that fails
verification, or an answer that says no (401, 403, 404), is not retried.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any, Final, Protocol

from node_agent.config.schema import RegistrySettings
from node_agent.errors import DeadlineExceeded, Internal, InvalidArgument, Unavailable
from node_agent.offload import Offload
from node_agent.registry.auth import Credentials, TokenCache
from node_agent.registry.endpoints import Endpoint, RegistryAccess, Route
from node_agent.registry.failures import log_failure
from node_agent.registry.ports import BlobImporter, BlobSink, Record
from node_agent.registry.pulling import _download_blob, _import_blob
from node_agent.registry.reference import parse_reference
from node_agent.registry.tally import Tally

log = logging.getLogger(__name__)

BACKOFF_FIRST: Final = 0.1
BACKOFF_MAX: Final = 2.0
"""Waits between tries of a fetch: doubling from the first to the largest, cut to the time left."""
IMPORT_BATCH: Final = 64
"""Blobs one connection's import takes before it is ended and the next one begun."""
HOSTS_FOR: Final = 1.0
"""Seconds an origin's hosts, as the node's registry hosts configuration names them, are used before it is read
again: a route made for hosts no longer configured (a mirror replaced or removed) is not used again."""


class ChunkLike(Protocol):
    @property
    def digest(self) -> str: ...

    @property
    def stored_size(self) -> int: ...


def credentials_of(origin: Mapping[str, Any], password: str = "") -> Credentials:
    def flag(key: str) -> bool:
        return origin.get(key) is True

    return Credentials(
        username=str(origin.get("username") or ""), password=password, ca_file=str(origin.get("ca_file") or ""),
        ca_pem=str(origin.get("ca_pem") or ""),
        plain_http=flag("plain_http"), insecure_skip_verify=flag("insecure_skip_verify"),
    )


def repository_key(reference: str) -> str:
    """``registry/repository`` of a reference: what a remembered password belongs to."""
    ref = parse_reference(reference)
    return f"{ref.registry}/{ref.repository}"


class RemoteBlobs:
    """A store's fetcher (`Origins.fetcher`): up to ``registry.connections`` fetches at once per origin, each on
    a route (kept-alive connections) of its own, given back for the next fetch.

    Passwords come from ``passwords`` (by ``registry/repository``), held in
    memory by whoever pulled; an origin without one is fetched with its
    username only (or anonymously). ``settings`` (the agent's ``registry:``
    section) bound each try like a pull's; ``timeout``, when given,
    replaces its ``io-timeout``. ``retry_for`` (seconds, 0: never) is how
    long a fetch that fails in transport is tried again (see the module's
    rule). A fetch that fails is logged (one warning) and raises.
    """

    def __init__(
        self,
        store: BlobSink[Record],
        *,
        passwords: Mapping[str, str] | None = None,
        timeout: float | None = None,
        settings: RegistrySettings | None = None,
        retry_for: float = 0.0,
        min_free: int = 0,
    ) -> None:
        self.store = store
        self.min_free = min_free
        self.passwords = dict(passwords or {})
        self.timeout = timeout
        self.settings = settings
        self.retry_for = retry_for
        self._idle: dict[str, list[Route]] = {}  # reference -> routes not in use
        self._open: dict[str, int] = {}  # reference -> routes made (in use or idle)
        self._tokens: dict[str, TokenCache] = {}  # reference -> the bearer tokens its routes share
        self._hosts: dict[str, tuple[float, list[Endpoint]]] = {}  # reference -> (read when, its hosts then)
        self._lock = threading.Condition()
        self._imports: dict[int, tuple[BlobImporter[Record], int]] = {}  # id(route) -> its import, blobs in it
        self._busy: set[int] = set()  # id() of the routes a fetch holds
        self._inflight: dict[tuple[str, str], Future[bytes | None]] = {}  # (reference, digest) -> its fetch now
        self._ending = Offload(1, "fetch-end")  # ends an import once its blobs are linked
        self._short: set[str] = set()  # references whose blobs are not kept now (the store is short of space)
        self.fetched = 0
        self.not_kept = 0  # of those fetched, the blobs handed to their readers and not kept

    def may_keep(self, size: int) -> bool:
        """Whether a blob of ``size`` bytes leaves ``min_free`` bytes free on the store's filesystem."""
        return self.store.short_of_room(size, self.min_free) is None

    def remember_password(self, reference: str, password: str) -> None:
        """Keep ``password`` in memory for the chunks later fetched from ``reference``'s repository."""
        self.passwords[repository_key(reference)] = password

    @contextlib.contextmanager
    def _route(self, origin: Mapping[str, Any]) -> Iterator[Route]:
        """A route to ``origin`` for one fetch: an idle one, a new one while fewer than ``connections`` are open,
        or else the next one given back."""
        reference = str(origin["reference"])
        lanes = (self.settings or RegistrySettings()).connections
        with self._lock:
            endpoints = self._endpoints(origin, reference)
            while True:
                idle = self._idle.setdefault(reference, [])
                if idle:
                    route = idle.pop()
                    break
                if self._open.get(reference, 0) < lanes:
                    route = self._new_route(reference, endpoints)
                    self._open[reference] = self._open.get(reference, 0) + 1
                    break
                self._lock.wait()
            self._busy.add(id(route))
        try:
            yield route
        finally:
            with self._lock:
                self._busy.discard(id(route))
                held = self._hosts.get(reference)
                if held is None or held[1] == route.endpoints:
                    self._idle.setdefault(reference, []).append(route)
                else:  # made for hosts no longer configured
                    self._drop([route], reference)
                self._lock.notify()

    def _endpoints(self, origin: Mapping[str, Any], reference: str) -> list[Endpoint]:
        """The origin's hosts as the node's configuration names them now (read again after ``HOSTS_FOR``
        seconds); idle routes made for other hosts go. The caller holds the lock."""
        now = time.monotonic()
        held = self._hosts.get(reference)
        if held is not None and now - held[0] < HOSTS_FOR:
            return held[1]
        ref = parse_reference(reference)
        if ref.digest is None:
            raise InvalidArgument(f"origin {reference} is not pinned by digest")
        creds = credentials_of(origin, self.passwords.get(repository_key(reference), ""))
        endpoints = RegistryAccess.of(self.settings).endpoints(
            ref, "pull", creds, node_logins=origin.get("node_logins") is True)
        if held is not None and held[1] != endpoints:
            log.info("origin %s: its registry hosts changed (now %s); new fetches go there", reference,
                     ", ".join(e.name for e in endpoints), extra={"phase": "lazy-fetch"})
            self._drop(self._idle.pop(reference, []), reference)
        self._hosts[reference] = (now, endpoints)
        return endpoints

    def _drop(self, routes: list[Route], reference: str) -> None:
        """Close routes no longer used (the caller holds the lock); their imports end in the background."""
        for route in routes:
            held = self._imports.pop(id(route), None)
            if held is not None:
                self._end_later(held[0])
            route.close()
        self._open[reference] = max(0, self._open.get(reference, 0) - len(routes))

    def _import_for(self, route: Route) -> BlobImporter[Record]:
        """The import the route's fetches go into (the caller holds the route), begun when it has none."""
        with self._lock:
            held = self._imports.get(id(route))
        if held is not None:
            return held[0]
        importer = self.store.importer()
        with self._lock:
            self._imports[id(route)] = (importer, 0)
        return importer

    def _took(self, route: Route, failed: bool) -> None:
        """One more blob in the route's import; it ends (in the background) once full, or when a fetch failed."""
        with self._lock:
            held = self._imports.get(id(route))
            if held is None:
                return
            importer, count = held
            if failed or count + 1 >= IMPORT_BATCH:
                del self._imports[id(route)]
            else:
                self._imports[id(route)] = (importer, count + 1)
                return
        self._end_later(importer)

    def _new_route(self, reference: str, endpoints: list[Endpoint]) -> Route:
        tokens = self._tokens.setdefault(reference, TokenCache())
        return Route(parse_reference(reference), endpoints, timeout=self.timeout, settings=self.settings,
                     actions="pull", tokens=tokens)

    def __call__(self, origin: Mapping[str, Any], chunk: ChunkLike) -> bytes | None:
        """Fetch the chunk's blob into the store (where it has room: see the module's rule); its bytes, verified
        on the way in (None: it was there already).

        A fetch of a blob another thread is fetching now from the same
        origin waits for that one and gets its bytes; when that one fails, it
        tries for itself.
        """
        key = (str(origin["reference"]), chunk.digest)
        with self._lock:
            other = self._inflight.get(key)
            if other is None:
                mine: Future[bytes | None] = Future()
                self._inflight[key] = mine
        if other is not None:
            try:
                return other.result()
            except Exception:  # noqa: BLE001 - logged by that fetch; this one tries for itself
                return self(origin, chunk)
        try:
            data = self._fetch_with_retries(origin, chunk)
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        finally:
            with self._lock:
                del self._inflight[key]
        mine.set_result(data)
        return data

    def _fetch_with_retries(self, origin: Mapping[str, Any], chunk: ChunkLike) -> bytes | None:
        start = time.monotonic()
        tries = 0
        pieces: list[bytes] = []
        while True:
            tries += 1
            try:
                keep = self._keeping(origin, chunk)
                with self._route(origin) as route:
                    if keep:
                        fetched = self._fetch(route, chunk, pieces)
                    else:
                        _download_blob(route, chunk.digest, chunk.stored_size, route.ref.digest or "?", pieces)
                        fetched = True
                break
            except (Unavailable, DeadlineExceeded) as exc:
                left = start + self.retry_for - time.monotonic()
                if left <= 0:
                    if tries > 1:
                        exc = type(exc)(f"{exc}; still failing after {tries} tries in {self.retry_for:g}s "
                                        "(timeouts.lazy-fetch)")
                    log_failure(log, f"fetch of blob {chunk.digest}", origin.get("reference"), exc)
                    raise exc from None
                if tries == 1:
                    log.warning("fetch of blob %s from %s failed (%s): %s; trying again for up to %gs "
                                "(timeouts.lazy-fetch)", chunk.digest, origin.get("reference"), exc.code, exc,
                                self.retry_for, extra={"phase": "lazy-fetch"})
                time.sleep(min(left, BACKOFF_FIRST * 2 ** min(tries - 1, 8), BACKOFF_MAX))
            except BaseException as exc:
                log_failure(log, f"fetch of blob {chunk.digest}", origin.get("reference"), exc)
                raise
        self.fetched += 1
        if not keep:
            self.not_kept += 1
        if tries > 1:
            log.warning("fetched blob %s from %s after %d tries (%.1fs)", chunk.digest, origin.get("reference"),
                        tries, time.monotonic() - start, extra={"phase": "lazy-fetch"})
        log.debug("fetched blob %s from %s", chunk.digest, origin["reference"])
        return b"".join(pieces) if fetched else None

    def _keeping(self, origin: Mapping[str, Any], chunk: ChunkLike) -> bool:
        """Whether the store keeps the chunk (see the module's rule); a change is logged once per origin."""
        keep = self.may_keep(chunk.stored_size)
        reference = str(origin["reference"])
        with self._lock:
            changed = (reference in self._short) == keep
            if changed:
                (self._short.discard if keep else self._short.add)(reference)
        if changed and keep:
            log.info("the store keeps the blobs fetched from %s again (more than min-free-bytes free)", reference,
                     extra={"phase": "lazy-fetch"})
        elif changed:
            log.warning("the store's filesystem has less than min-free-bytes (%d bytes) free beyond blob %s "
                        "(%d bytes): blobs fetched from %s are verified and handed to their readers, not kept; "
                        "the checkpoint stays lazily pulled", self.min_free, chunk.digest, chunk.stored_size,
                        reference, extra={"phase": "lazy-fetch"})
        return keep

    def _fetch(self, route: Route, chunk: ChunkLike, pieces: list[bytes]) -> bool:
        """One try of a fetch on a route the caller holds: whether the blob was downloaded (else it is in the
        store, linked)."""
        for again in (False, True):
            importer = self._import_for(route)
            try:
                fetched = _import_blob(route, importer, chunk.digest, chunk.stored_size, route.ref.digest or "?",
                                       Tally(None), keep=pieces)
            except BaseException:
                self._took(route, failed=True)
                raise
            if fetched or _linked(importer):
                self._took(route, failed=False)
                return fetched
            # An earlier fetch of this import brought it, but the store could not keep it (or another
            # blob): a new import fetches it again.
            self._took(route, failed=True)
            if again:
                break
        raise Internal(f"blob {chunk.digest} was fetched twice, and the store kept it neither time")

    def _end_later(self, importer: BlobImporter[Record]) -> None:
        """End an import once its blobs are durable and linked, in a thread of its own: the readers that
        fetched them have their verified bytes already."""
        def end() -> None:
            try:
                importer.wait_linked()
            except Exception as exc:  # noqa: BLE001 - the bytes served their reader; the next one fetches again
                log.warning("a blob was fetched and verified, but the store could not keep it: %s", exc)
            finally:
                importer.abort()

        self._ending.submit(end)

    def _end_imports(self, *, busy_too: bool) -> None:
        """End the imports of the routes no fetch holds (of all routes, with ``busy_too``) in the background."""
        with self._lock:
            ending = [key for key in self._imports if busy_too or key not in self._busy]
            importers = [self._imports.pop(key)[0] for key in ending]
        for importer in importers:
            self._end_later(importer)

    def drain(self) -> None:
        """Wait until every blob fetched so far is in the store (or the failure to keep it is logged)."""
        self._end_imports(busy_too=False)
        with self._lock:
            held = [importer for importer, _ in self._imports.values()]
        for importer in held:  # a fetch holds its route: its blobs so far are linked, its import goes on
            with contextlib.suppress(Exception):  # logged once its import ends
                importer.wait_linked()
        self._ending.wait()

    def close(self) -> None:
        self._end_imports(busy_too=True)
        self._ending.close()
        with self._lock:
            for routes in self._idle.values():
                for route in routes:
                    route.close()
            self._idle.clear()
            self._open.clear()


def _linked(importer: BlobImporter[Record]) -> bool:
    """Whether every blob the import took is in the store (waiting for the links still under way): a blob
    it skipped as already taken (an earlier fetch of the same chunk) is readable from the store once it is."""
    try:
        importer.wait_linked()
    except Exception:  # noqa: BLE001 - logged when the import ends
        return False
    return True
