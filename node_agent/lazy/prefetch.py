"""Fetching a lazily pulled checkpoint's chunks before its restore asks for them.

A restore through a Pod learns its checkpoint at RunPodSandbox, and its
processes exist only once StartContainer has run: in between, the kubelet
pulls each image, creates the containers and starts them, and the link to
the registry stands idle. `Prefetch` puts that time to use. Once the sandbox
is made, it fetches the chunks the pull left in the registry into the store,
in the order the restore reads them: every container's files first (which
CreateContainer reads), then the chunks of the memory images that hold what
CRIU places itself (CreateContainer reads those too, scattered over the
images: a chunk each, one after another, `staging.read_memory`), then the
rest of the memory images, file by file, as the page source streams them.
It uses the store's own fetcher (`Origins.fetch_for`), so each blob is
verified against its digest and made durable as a pull's are, on as many
connections at once as the registry's pull uses (``registry.connections``);
a reader in this process that needs a chunk already on its way waits for
that fetch (`registry.fetching.RemoteBlobs`).

It stops when the page source takes over (the restore connected: the source
fetches what it lacks, in the order the process needs it), when every chunk
is in, when the pod goes, when the agent stops, before a chunk that would
leave less than ``min-free-bytes`` free on the store's filesystem (what it
fetches is for the store; the restore's own readers still get every chunk,
`registry.fetching`), and at its first failure:
that is logged, and the restore fetches what it needs itself and reports any
failure as its own. A fetch under way when it stops ends by itself (`wait`
waits for it, as the agent's stop does), so nothing it started is left
behind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator

from node_agent.lazy.staging import placed_chunks
from node_agent.podformat import PAGES_PATH
from node_agent.store import CheckpointRecord, Store
from node_agent.store.documents import Chunk

log = logging.getLogger(__name__)


def order(store: Store, record: CheckpointRecord) -> Iterator[Chunk]:
    """The chunks of ``record`` not in ``store``, each once, in the order the restore reads them: every
    file's but the memory images' (CreateContainer's), then those of the memory CRIU places itself (read by
    CreateContainer too, `staging.read_memory`, wherever they lie in the memory images; their pagemaps
    come in the first part), then the rest of the memory images, each file from its start."""
    missing = {c.digest for c in store.origins.missing(record)}

    def fresh(chunks: Iterable[Chunk]) -> Iterator[Chunk]:
        for chunk in chunks:
            if chunk.digest in missing:
                missing.discard(chunk.digest)
                yield chunk

    memory = [e for e in record.files if PAGES_PATH.match(e.path) is not None]
    yield from fresh(c for e in record.files if PAGES_PATH.match(e.path) is None for c in e.chunks)
    yield from fresh(placed_chunks(store, record))
    yield from fresh(c for e in memory for c in e.chunks)


class Prefetch:
    """The fetches ahead of one restore of a lazily pulled checkpoint, on ``lanes`` threads."""

    def __init__(self, store: Store, record: CheckpointRecord, lanes: int, what: str, min_free: int = 0) -> None:
        self.store = store
        self.min_free = min_free
        self.checkpoint_id = record.id
        self.what = what
        self._fetch = store.origins.fetch_for(record.id)
        self._record = record
        self._todo: Iterator[Chunk] | None = None  # `order`, worked out by the first thread
        self._lock = threading.Lock()
        self._taking = threading.Lock()  # one lane at a time takes the next chunk
        self._stop = threading.Event()
        self._why = ""
        self.fetched = 0
        self.bytes = 0
        self.began = time.monotonic()
        self._threads = [threading.Thread(target=self._run, name=f"prefetch-{i}", daemon=True)
                         for i in range(max(1, lanes))]
        self._lanes_left = len(self._threads)  # the last lane to end reports (a lane may end before the next starts)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self, why: str) -> None:
        """Fetch nothing more (the fetches under way end by themselves; `wait` waits for them)."""
        with self._lock:
            if not self._stop.is_set():
                self._why = why
                self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the threads are done; whether they are."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            if t.ident is not None:  # started
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self.running

    @property
    def why(self) -> str:
        """Why it stopped before every chunk was in ("" while it goes on, or once it has them all)."""
        with self._lock:
            return self._why

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    @property
    def complete(self) -> bool:
        """Every chunk it set out to fetch is in (or on its way into) the store."""
        return not self.running and not self._why

    def _next(self) -> Chunk | None:
        # Working out the order may read a pagemap, waiting for its fetch: not under `_lock`, which `stop` takes.
        with self._taking:
            if self._stop.is_set():
                return None
            if self._todo is None:
                self._todo = order(self.store, self._record)
            chunk = next(self._todo, None)
            if chunk is None:
                with self._lock:
                    self._stop.set()
            return chunk

    def _run(self) -> None:
        fetch = self._fetch
        try:
            while fetch is not None and (chunk := self._next()) is not None:
                if self.store.blobs.size_of(chunk.digest) is not None:
                    continue  # a reader fetched it already
                free = self.store.short_of_room(chunk.stored_size, self.min_free)
                if free is not None:
                    self.stop(f"the store's filesystem is short of space ({free} bytes free, min-free-bytes "
                              f"{self.min_free})")
                    break
                fetch(chunk)
                with self._lock:
                    self.fetched += 1
                    self.bytes += chunk.stored_size
        except Exception as exc:  # noqa: BLE001 - the restore fetches it again, and reports what fails
            self.stop(f"failed: {exc}")
            log.warning("%s: fetching checkpoint %s ahead of its restore stopped: %s (the restore fetches what "
                        "it needs itself)", self.what, self.checkpoint_id, exc,
                        extra={"checkpoint": self.checkpoint_id, "phase": "prefetch"})
        with self._lock:
            self._lanes_left -= 1
            if self._lanes_left:
                return
            why = self._why or "every chunk is in"
        log.info("%s: fetched %d chunks (%.1f MiB) of checkpoint %s ahead of its restore in %.2fs; %s", self.what,
                 self.fetched, self.bytes / 2**20, self.checkpoint_id, time.monotonic() - self.began, why,
                 extra={"checkpoint": self.checkpoint_id, "phase": "prefetch"})
