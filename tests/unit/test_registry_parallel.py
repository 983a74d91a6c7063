"""A transfer's blobs on several lanes (``parallel.each_blob``) and their count (``tally``).

Each lane has a route of its own; every item is worked on exactly once; the first failure stops the other
lanes before their next piece and is the one raised, and every lane has ended when ``each_blob`` returns.
The lanes meet at barriers, so these tests show that work really overlaps without timing anything.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from node_agent.errors import Cancelled, NotFound
from node_agent.registry.parallel import Stopping, each_blob
from node_agent.registry.ports import Progress
from node_agent.registry.tally import Tally


class _Route:
    made: list[_Route] = []

    def __init__(self) -> None:
        self.closed = False
        _Route.made.append(self)

    def __enter__(self) -> _Route:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True


def _routes() -> Any:
    _Route.made = []
    return _Route


def test_every_item_once_each_lane_on_its_own_route_all_at_once() -> None:
    route = _routes()
    together = threading.Barrier(4, timeout=30)
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def work(own: Any, item: int, stopping: Stopping) -> None:
        if item < 4:
            together.wait()  # the first four items are in flight at the same time, on four lanes
        with lock:
            seen.append((id(own), item))

    each_blob(list(range(20)), work, route, 4)
    assert sorted(item for _, item in seen) == list(range(20))
    assert len(_Route.made) == 4 and all(r.closed for r in _Route.made)
    assert len({lane for lane, _ in seen}) == 4


def test_one_lane_is_one_route_and_the_given_order() -> None:
    route = _routes()
    order: list[int] = []
    each_blob([3, 1, 2], lambda own, item, stopping: order.append(item), route, 1)
    assert order == [3, 1, 2] and len(_Route.made) == 1 and _Route.made[0].closed


def test_the_first_failure_stops_the_other_lanes_and_is_raised() -> None:
    route = _routes()
    in_flight = threading.Event()
    failed = threading.Event()
    started: list[int] = []

    def work(own: Any, item: int, stopping: Stopping) -> None:
        started.append(item)
        if item == 0:  # a long blob: piece after piece until it is told to stop
            in_flight.set()
            while True:
                stopping.check()
                failed.wait(0.01)
        if item == 1:
            in_flight.wait(30)
            failed.set()
            raise NotFound("blob 1 is not in the registry")

    with pytest.raises(NotFound, match="blob 1"):
        each_blob(list(range(50)), work, route, 2)
    assert sorted(started) == [0, 1]  # no lane took another item after the failure
    assert all(r.closed for r in _Route.made)


def test_stopping_says_why() -> None:
    stopping = Stopping()
    stopping.check()
    stopping.set()
    with pytest.raises(Cancelled, match="another blob of the same transfer failed"):
        stopping.check()


def test_the_tally_counts_blobs_in_flight_on_several_threads() -> None:
    reports: list[Progress] = []
    tally = Tally(reports.append)
    tally.plan([10, 20, 30])
    a, b = tally.blob(), tally.blob()
    assert list(a.counted([b"12345"])) == [b"12345"]
    assert list(b.counted([b"x" * 20])) == [b"x" * 20]
    assert reports[-1].bytes_done == 25 and reports[-1].blobs_done == 0
    a.restart()  # blob a starts again: its 5 bytes are no longer counted
    assert reports[-1].bytes_done == 20
    list(a.counted([b"y" * 10]))
    a.done()
    b.done()
    tally.skip(30)
    last = reports[-1]
    assert (last.blobs_done, last.bytes_done, last.skipped) == (3, 60, 1)
    assert (tally.moved, tally.bytes_moved, tally.skipped) == (2, 30, 1)


def test_an_empty_blob_counts_once_done() -> None:
    tally = Tally(None)
    count = tally.blob()
    list(count.counted([b""]))
    assert tally.moved == 0
    count.done()
    assert (tally.moved, tally.bytes_moved) == (1, 0)
