"""Work handed to a few threads of its own so that its caller goes on, and waited for later, all at once.

Rule: the threads start on the first piece of work; ``wait`` returns once every piece handed over so
far has ended and then raises the first failure among them (in the order they were handed over), so
nothing is left running behind a caller that was told all is done; ``close`` waits too and ends the
threads. The store's early fsyncs, an import's links and a fetch's end go through it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor


class Offload:
    """Up to ``workers`` threads named ``name-N``, started on the first ``submit``."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers = max(1, workers)
        self.name = name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []

    def submit(self, work: Callable[[], None]) -> None:
        """Run ``work()`` in one of the threads."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=self.name)
            self._pending = [f for f in self._pending if not f.done() or _failure(f) is not None]
            self._pending.append(self._pool.submit(work))

    def wait(self) -> None:
        """Wait until everything handed over so far has ended; raise the first failure among it."""
        with self._lock:
            pending, self._pending = self._pending, []
        failures = [exc for exc in map(_failure, pending) if exc is not None]
        if failures:
            raise failures[0]

    def close(self, *, cancel: bool = False) -> None:
        """End the threads: after the work still queued (or without it, with ``cancel``) and the running work.

        Idempotent; a failure is left to ``wait``, which may still be called.
        """
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=cancel)


def _failure(future: Future[None]) -> BaseException | None:
    """How ``future`` failed, once it has ended (waited for); None when it did not fail or was cancelled."""
    try:
        return future.exception()
    except CancelledError:
        return None
