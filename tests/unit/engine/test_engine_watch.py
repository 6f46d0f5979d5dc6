"""EngineWatch: a replica whose engine died lets its calls finish, then leaves; one being stopped does not.

The watch polls; these tests wait for it to have looked a number of times (never for a
time), and the hang tests run its stall clock by hand.
"""

from __future__ import annotations

import asyncio

from serve_app.engine.engine_watch import EngineProgress, EngineWatch
from tests.waiting import wait_until


class Engine:
    """An engine whose ``dead`` flag counts how often the watch read it."""

    def __init__(self) -> None:
        self._dead = False
        self.looks = 0

    @property
    def dead(self) -> bool:
        self.looks += 1
        return self._dead

    @dead.setter
    def dead(self, value: bool) -> None:
        self._dead = value


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watch_of(engine: Engine) -> tuple[EngineWatch, list[int]]:
    left: list[int] = []
    return EngineWatch(engine_dead=lambda: engine.dead, leave=lambda: left.append(1)), left


async def looked(engine: Engine, times: int) -> None:
    """Wait until the watch has read the engine's flag ``times`` more times."""
    target = engine.looks + times
    await wait_until(lambda: engine.looks >= target, 5, f"the watch reading the engine {times} times", every_s=0.005)


async def test_leaves_once_the_engine_dies() -> None:
    engine = Engine()
    watch, left = watch_of(engine)
    task = asyncio.create_task(watch.watch(poll_s=0.01, drain_s=5))
    await looked(engine, 5)
    assert not task.done() and left == []  # a live engine: keeps watching
    engine.dead = True
    await asyncio.wait_for(task, timeout=5)
    assert left == [1]


async def test_lets_the_calls_it_holds_finish_first() -> None:
    engine = Engine()
    watch, left = watch_of(engine)
    release = asyncio.Event()
    entered = 0

    async def call() -> None:
        nonlocal entered
        with watch.call():
            entered += 1
            await release.wait()

    calls = [asyncio.create_task(call()) for _ in range(2)]
    await wait_until(lambda: entered == 2, 5, "both calls under way", every_s=0.005)
    assert watch.ongoing == 2
    engine.dead = True
    task = asyncio.create_task(watch.watch(poll_s=0.01, drain_s=30, deliver_s=0))
    await wait_until(lambda: engine.looks >= 1, 5, "the watch seeing the dead engine", every_s=0.005)
    await asyncio.sleep(0.1)  # a window in which it must not leave: both calls still run
    assert left == [] and not task.done()
    release.set()
    await asyncio.gather(*calls)
    await asyncio.wait_for(task, timeout=5)
    assert left == [1] and watch.ongoing == 0


async def test_leaves_only_after_the_errors_had_time_to_be_delivered(caplog) -> None:
    """The calls have ended (their errors yielded); the process still waits ``deliver_s``
    for Ray to send them before it exits."""
    engine = Engine()
    engine.dead = True
    watch, left = watch_of(engine)
    task = asyncio.create_task(watch.watch(poll_s=0.01, drain_s=5, deliver_s=30))
    # It logs, finds no call to drain and starts its wait of deliver_s in one step of its task.
    await wait_until(lambda: "the vLLM engine died" in caplog.text, 5, "the watch saying the engine died")
    assert watch.ongoing == 0 and left == [] and not task.done()
    task.cancel()


async def test_a_call_that_never_ends_does_not_keep_it_alive() -> None:
    engine = Engine()
    engine.dead = True
    watch, left = watch_of(engine)
    with watch.call():
        await asyncio.wait_for(watch.watch(poll_s=0.01, drain_s=0.1, deliver_s=0), timeout=5)
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
        task = asyncio.create_task(watch.watch(poll_s=0.01, drain_s=30, deliver_s=0))
        await looked(engine, 1)  # it saw the death and drains
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
    clock, failed = Clock(), []
    left = asyncio.Event()
    watch = EngineWatch(
        engine_dead=lambda: False,
        leave=left.set,
        held=lambda: 3,
        fail_requests=lambda: failed.append(True),
        stall_timeout_s=20,
        progress=EngineProgress(clock),
    )
    task = asyncio.create_task(watch.watch(poll_s=0.005, drain_s=0.1, deliver_s=0))
    clock.now += 21  # no output for longer than the stall timeout
    await asyncio.wait_for(left.wait(), timeout=5)
    await task
    assert watch.stalled and watch.failed and failed == [True]


async def test_an_engine_that_keeps_producing_or_sits_idle_is_not_hung():
    clock, held, polls = Clock(), [0], [0]
    left = asyncio.Event()

    def holding() -> int:
        polls[0] += 1
        return held[0]

    watch = EngineWatch(
        engine_dead=lambda: False, leave=left.set, held=holding, stall_timeout_s=20, progress=EngineProgress(clock)
    )
    task = asyncio.create_task(watch.watch(poll_s=0.005))

    async def polled() -> None:
        target = polls[0] + 2
        await wait_until(lambda: polls[0] >= target, 5, "the watch polling", every_s=0.005)

    clock.now += 3600  # idle for an hour
    await polled()
    held[0] = 5  # a request arrives after the long idle spell: the clock starts now
    for _ in range(10):  # and the engine makes a step every 10 s, each within the timeout
        clock.now += 10
        watch.progress.saw_output()
        await polled()
    assert not left.is_set() and not watch.stalled
    task.cancel()


async def test_a_replica_being_stopped_does_not_fail_a_hung_engines_requests():
    clock, failed, left = Clock(), [], asyncio.Event()
    watch = EngineWatch(
        engine_dead=lambda: False,
        leave=left.set,
        held=lambda: 1,
        fail_requests=lambda: failed.append(True),
        stall_timeout_s=20,
        progress=EngineProgress(clock),
    )
    watch.stopping = True
    clock.now += 60
    await asyncio.wait_for(watch.watch(poll_s=0.005), timeout=5)
    assert not left.is_set() and failed == []
