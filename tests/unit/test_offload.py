"""Work handed to threads of its own (node_agent/offload.py): waited for all at once, the first failure raised."""

from __future__ import annotations

import threading

import pytest

from node_agent.offload import Offload

pytestmark = pytest.mark.usefixtures("no_leaked_threads")


def test_the_caller_goes_on_and_wait_returns_once_everything_handed_over_has_ended() -> None:
    gate = threading.Event()
    done: list[int] = []
    work = Offload(2, "t-offload")
    try:
        for n in range(5):
            work.submit(lambda n=n: (gate.wait(30), done.append(n)) and None)
        assert done == []  # handed over, not run here
        assert {t.name for t in threading.enumerate() if t.name.startswith("t-offload")}  # started on first use
        gate.set()
        work.wait()
        assert sorted(done) == [0, 1, 2, 3, 4]
        work.wait()  # nothing left: returns at once
    finally:
        work.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("t-offload")]


def test_wait_waits_for_all_then_raises_the_first_failure_in_the_order_handed_over() -> None:
    second_may_fail = threading.Event()
    ended: list[str] = []
    work = Offload(3, "t-offload")

    def fail(what: str, after: threading.Event | None = None) -> None:
        if after is not None:
            assert after.wait(30)
        ended.append(what)
        raise ValueError(what)

    try:
        work.submit(lambda: fail("first", second_may_fail))
        work.submit(lambda: (fail("second"), None)[1])
        work.submit(lambda: ended.append("fine"))
        second_may_fail.set()
        with pytest.raises(ValueError, match="^first$"):
            work.wait()
        assert sorted(ended) == ["fine", "first", "second"]  # none left running behind the failure
        work.wait()  # each failure is raised once
    finally:
        work.close()


def test_close_with_cancel_drops_queued_work_and_a_later_wait_does_not_trip_on_it() -> None:
    gate = threading.Event()
    ran: list[int] = []
    work = Offload(1, "t-offload")
    work.submit(lambda: (gate.wait(30), ran.append(0)) and None)
    for n in range(1, 4):
        work.submit(lambda n=n: ran.append(n))
    closing = threading.Thread(target=work.close, kwargs={"cancel": True})
    closing.start()
    gate.set()
    closing.join(30)
    assert not closing.is_alive() and ran[0] == 0
    work.wait()
    work.close()  # again: nothing to do
