"""ItemsBefore: a stream's chunks read under its end deadline with one timer for them all."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from serve_app.front_door.admission.deadlines import DeadlineExceeded, ItemsBefore


async def paced(gaps: list[float]) -> AsyncIterator[int]:
    """Item i after gaps[i] seconds."""
    for i, gap in enumerate(gaps):
        await asyncio.sleep(gap)
        yield i


def soon(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


async def test_items_before_the_deadline_all_come_and_the_end_is_the_iterators() -> None:
    items = ItemsBefore(paced([0, 0, 0]), soon(5))
    assert [await items.next() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(StopAsyncIteration):
        await items.next()
    items.close()


async def test_a_wait_past_the_deadline_ends_in_deadline_exceeded_and_leaves_the_task_uncancelled() -> None:
    items = ItemsBefore(paced([0, 60]), soon(0.05))
    assert await items.next() == 0
    with pytest.raises(DeadlineExceeded):
        await items.next()
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)  # (a task still cancelled would raise here)
    with pytest.raises(DeadlineExceeded):  # and every later call, at once
        await items.next()


async def test_a_deadline_that_passed_between_items_is_raised_before_waiting_again() -> None:
    items = ItemsBefore(paced([0, 0]), soon(0.01))
    assert await items.next() == 0
    await asyncio.sleep(0.05)  # the consumer was busy past the deadline
    with pytest.raises(DeadlineExceeded):
        await items.next()


async def test_a_cancellation_the_iterator_swallows_is_still_the_deadline() -> None:
    async def swallowing() -> AsyncIterator[str]:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            yield "400 Client disconnected"  # (vLLM's unary path answers a cancellation so)

    items = ItemsBefore(swallowing(), soon(0.05))
    with pytest.raises(DeadlineExceeded):
        await items.next()
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_cancellation_from_elsewhere_is_a_cancellation_not_the_deadline() -> None:
    items = ItemsBefore(paced([60]), soon(30))
    reader: asyncio.Task[int] = asyncio.create_task(items.next())
    await asyncio.sleep(0.01)
    reader.cancel()  # (the client left)
    with pytest.raises(asyncio.CancelledError):
        await reader
    items.close()


async def test_closed_its_timer_is_gone_from_the_loop() -> None:
    items = ItemsBefore(paced([0]), soon(0.02))
    assert await items.next() == 0
    items.close()
    await asyncio.sleep(0.05)  # past the deadline: nothing fired
    assert items._reason is None


async def test_an_interruption_ends_the_wait_for_an_item_with_its_reason() -> None:
    class Stalled(Exception):
        pass

    items = ItemsBefore(paced([0, 10]), soon(60))
    assert await items.next() == 0
    reader = asyncio.ensure_future(items.next())
    await asyncio.sleep(0.01)
    items.interrupt(Stalled)
    with pytest.raises(Stalled):
        await reader
    with pytest.raises(Stalled):  # and every read after it
        await items.next()
    items.close()
