"""EngineWatch: a replica whose engine died lets its calls finish, then leaves; one being stopped does not."""

from __future__ import annotations

import asyncio
import time

from serve_app.replica.engine_watch import EngineWatch


class Engine:
    def __init__(self) -> None:
        self.dead = False


def watch_of(engine: Engine) -> tuple[EngineWatch, list[int]]:
    left: list[int] = []
    return EngineWatch(engine_dead=lambda: engine.dead, leave=lambda: left.append(1)), left


async def test_leaves_once_the_engine_dies() -> None:
    engine = Engine()
    watch, left = watch_of(engine)
    task = asyncio.create_task(watch.watch(poll_s=0.01, drain_s=5))
    await asyncio.sleep(0.05)
    assert not task.done() and left == []  # a live engine: keeps watching
    engine.dead = True
    await asyncio.wait_for(task, timeout=5)
    assert left == [1]


async def test_lets_the_calls_it_holds_finish_first() -> None:
    engine = Engine()
    watch, left = watch_of(engine)
    release = asyncio.Event()

    async def call() -> None:
        with watch.call():
            await release.wait()

    calls = [asyncio.create_task(call()) for _ in range(2)]
    await asyncio.sleep(0)
    assert watch.ongoing == 2
    engine.dead = True
    task = asyncio.create_task(watch.watch(poll_s=0.01, drain_s=30))
    await asyncio.sleep(0.1)
    assert left == [] and not task.done()
    release.set()
    await asyncio.gather(*calls)
    await asyncio.wait_for(task, timeout=5)
    assert left == [1] and watch.ongoing == 0


async def test_leaves_only_after_the_errors_had_time_to_be_delivered() -> None:
    """The calls have ended (their errors yielded); the process still waits ``deliver_s``
    for Ray to send them before it exits."""
    engine = Engine()
    engine.dead = True
    watch, left = watch_of(engine)
    task = asyncio.create_task(watch.watch(poll_s=0.01, drain_s=5, deliver_s=30))
    await asyncio.sleep(0.2)
    assert watch.ongoing == 0 and left == [] and not task.done()
    task.cancel()


async def test_a_call_that_never_ends_does_not_keep_it_alive() -> None:
    engine = Engine()
    engine.dead = True
    watch, left = watch_of(engine)
    with watch.call():
        await asyncio.wait_for(watch.watch(poll_s=0.01, drain_s=0.1), timeout=5)
        assert left == [1] and watch.ongoing == 1


async def test_a_replica_serve_is_stopping_shuts_its_engine_down_without_leaving() -> None:
    engine = Engine()
    watch, left = watch_of(engine)
    task = asyncio.create_task(watch.watch(poll_s=0.01, drain_s=5))
    watch.stopping = True
    engine.dead = True  # what the engine's shutdown in __del__ looks like
    await asyncio.wait_for(task, timeout=5)
    assert left == []


async def test_stopping_during_the_drain_does_not_leave() -> None:
    engine = Engine()
    engine.dead = True
    watch, left = watch_of(engine)
    with watch.call():
        task = asyncio.create_task(watch.watch(poll_s=0.01, drain_s=30))
        await asyncio.sleep(0.05)
        watch.stopping = True
    await asyncio.wait_for(task, timeout=5)
    assert left == []


def test_a_failing_call_still_counts_down() -> None:
    watch, _ = watch_of(Engine())
    try:
        with watch.call():
            raise ValueError("boom")
    except ValueError:
        pass
    assert watch.ongoing == 0


async def test_an_engine_that_holds_requests_and_produces_nothing_is_taken_as_hung():
    held, failed = [3], []
    left = asyncio.Event()
    watch = EngineWatch(
        engine_dead=lambda: False,
        leave=left.set,
        held=lambda: held[0],
        fail_requests=lambda: failed.append(True),
        stall_timeout_s=0.2,
    )
    watch.progress.last_output_at = time.monotonic() - 0.1
    task = asyncio.create_task(watch.watch(poll_s=0.02, drain_s=0.1, deliver_s=0.1))
    await asyncio.wait_for(left.wait(), timeout=2)
    await task
    assert watch.stalled and watch.failed and failed == [True]


async def test_an_engine_that_keeps_producing_or_sits_idle_is_not_hung():
    held, left = [0], asyncio.Event()
    watch = EngineWatch(engine_dead=lambda: False, leave=left.set, held=lambda: held[0], stall_timeout_s=0.2)
    watch.progress.last_output_at = time.monotonic() - 3600  # idle for an hour
    task = asyncio.create_task(watch.watch(poll_s=0.02))
    await asyncio.sleep(0.3)
    held[0] = 5  # a request arrives after the long idle spell: the clock starts now
    for _ in range(10):  # and the engine steps every 50 ms
        await asyncio.sleep(0.05)
        watch.progress.saw_output()
    assert not left.is_set() and not watch.stalled
    task.cancel()


async def test_a_replica_being_stopped_does_not_fail_a_hung_engines_requests():
    failed, left = [], asyncio.Event()
    watch = EngineWatch(
        engine_dead=lambda: False,
        leave=left.set,
        held=lambda: 1,
        fail_requests=lambda: failed.append(True),
        stall_timeout_s=0.05,
    )
    watch.stopping = True
    watch.progress.last_output_at = time.monotonic() - 1
    await asyncio.wait_for(watch.watch(poll_s=0.01), timeout=2)
    assert not left.is_set() and failed == []
