from __future__ import annotations

import asyncio

import pytest

from node_agent import errors
from node_agent.turns import Turns


async def test_one_at_a_time_in_order_and_bounded() -> None:
    turns = Turns(max_waiting=2)
    order: list[int] = []
    gate = asyncio.Event()

    async def op(i: int) -> None:
        async with turns.turn("pod", "op"):
            order.append(i)
            await gate.wait()

    tasks = [asyncio.create_task(op(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert turns.busy("pod") and order == [0]
    with pytest.raises(errors.ResourceExhausted):
        async with turns.turn("pod", "op"):
            pass
    gate.set()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert not turns.busy("pod") and not turns._lines


async def test_a_waiter_that_times_out_leaves_the_line() -> None:
    turns = Turns()
    release = asyncio.Event()

    async def holder() -> None:
        async with turns.turn("p", "op"):
            await release.wait()

    h = asyncio.create_task(holder())
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            async with turns.turn("p", "op"):
                pass
    assert turns._lines["p"].waiting == 0
    release.set()
    await h
    assert not turns._lines
