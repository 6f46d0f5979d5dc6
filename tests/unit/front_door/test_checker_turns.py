"""Turns at the checker process go round the API keys with jobs waiting."""

from __future__ import annotations

import asyncio

from serve_app.front_door.admission.checker_turns import TakeTurns


async def run_in_turns(jobs: list[str | None]) -> list[str | None]:
    """Each job (named by its key) holds the turn for one loop pass; the order the turns came in.
    The first job holds the turn while all the others arrive, in the order given."""
    turns, order = TakeTurns(), []
    first_holds, release = asyncio.Event(), asyncio.Event()

    async def job(key: str | None, first: bool) -> None:
        async with turns.turn(key):
            order.append(key)
            if first:
                first_holds.set()
                await release.wait()

    tasks = [asyncio.create_task(job(jobs[0], True))]
    await first_holds.wait()
    tasks += [asyncio.create_task(job(key, False)) for key in jobs[1:]]
    await asyncio.sleep(0)  # (one pass of the loop: every other job waits for its turn)
    release.set()
    await asyncio.gather(*tasks)
    return order


async def test_another_keys_job_waits_for_one_job_of_a_flooding_key_not_all_of_them():
    assert await run_in_turns(["a", "a", "a", "a", "b", "a"]) == ["a", "a", "b", "a", "a", "a"]


async def test_turns_go_round_the_keys_each_keys_jobs_in_arrival_order():
    assert await run_in_turns(["a", "a", "a", "b", "b", None]) == ["a", "a", "b", None, "a", "b"]


async def test_a_job_that_leaves_while_waiting_gives_up_its_place_and_the_turns_go_on():
    turns, order = TakeTurns(), []
    holding, release = asyncio.Event(), asyncio.Event()

    async def job(key: str, hold: bool = False) -> None:
        async with turns.turn(key):
            order.append(key)
            if hold:
                holding.set()
                await release.wait()

    first = asyncio.create_task(job("a", hold=True))
    await holding.wait()
    leaving, staying = asyncio.create_task(job("b")), asyncio.create_task(job("c"))
    await asyncio.sleep(0)
    leaving.cancel()
    await asyncio.sleep(0)
    assert turns.waiting("b") == 0 and turns.waiting("c") == 1
    release.set()
    await asyncio.gather(first, staying)
    assert order == ["a", "c"]
    async with turns.turn("d"):  # free again: taken at once
        assert turns.waiting("d") == 0
