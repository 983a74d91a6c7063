"""Blobs moved several at a time: one thread and one route (kept-alive connections of its own) per lane.

Rule: a transfer's blobs are independent (each verified and linked alone, the manifest goes last), so up to
``registry.connections`` of them move at once; a single lane is the same work one blob after another. The
first failure stops every lane before its next blob (a lane in the middle of one ends it early: its
``stopping`` is set) and is what the caller sees; the lanes have all ended when ``each_blob`` returns or
raises, so nothing is left writing into the store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from node_agent.errors import Cancelled
from node_agent.registry.endpoints import Route

T = TypeVar("T")


class Stopping:
    """Set when another lane failed: a lane checks it between pieces of a blob and stops."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled("stopped: another blob of the same transfer failed")


def each_blob(items: Sequence[T], work: Callable[[Route, T, Stopping], None], route: Callable[[], Route],
              lanes: int) -> None:
    """``work(route, item, stopping)`` for every item, on up to ``lanes`` threads, each with its own route."""
    stopping = Stopping()
    if lanes <= 1 or len(items) <= 1:
        with route() as own:
            for item in items:
                work(own, item, stopping)
        return
    pending: Iterator[T] = iter(items)
    done = object()
    taking = threading.Lock()
    failures: list[BaseException] = []

    def lane() -> None:
        try:
            with route() as own:
                while True:
                    with taking:
                        if failures:
                            return
                        item = next(pending, done)
                    if item is done:
                        return
                    work(own, item, stopping)  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            with taking:
                failures.append(exc)
            stopping.set()

    threads = [threading.Thread(target=lane, name=f"registry-lane-{n}", daemon=True)
               for n in range(min(lanes, len(items)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        first = next((f for f in failures if not isinstance(f, Cancelled)), failures[0])
        raise first
