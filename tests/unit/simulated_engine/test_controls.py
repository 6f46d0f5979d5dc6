"""The simulated engine's controls and the switchboard that carries them (pure logic, one event loop).

The engine's own response to each control (a paused engine holds what arrives, a failed one
ends it through vLLM's engine-dead path, ...) is tested with vLLM's AsyncLLM in
tests/e2e/test_simulated_engine.py; the controls in use, in the load and fault tests.
"""

from __future__ import annotations

import asyncio

import pytest

from serve_app.simulated_engine import switchboard
from serve_app.simulated_engine.controls import Control, EngineState, Switches
from serve_app.simulated_engine.switchboard import Switchboard

STATE = EngineState(
    paused=True, hung=False, dead=False, pace=1.0, running=0, waiting=3, steps=10, tokens=40, busy_s=0.1
)


def test_pause_and_hang_hold_the_engine_until_resume_and_pace_must_be_positive():
    switches = Switches()
    switches.apply(Control.PAUSE)
    switches.apply(Control.HANG)
    assert (switches.paused, switches.hung) == (True, True)
    switches.apply(Control.RESUME)
    assert (switches.paused, switches.hung) == (False, False)
    switches.apply(Control.PACE, 2.5)
    assert switches.pace == 2.5
    for pace in (None, 0.0, -1.0):
        with pytest.raises(ValueError, match="positive"):
            switches.apply(Control.PACE, pace)
    assert switches.pace == 2.5
    assert STATE.holds == 3


async def test_a_posted_control_reaches_its_replica_and_its_state_comes_back():
    board = Switchboard()
    posted = asyncio.create_task(board.post("replica-a", "pause"))
    other = asyncio.create_task(board.post("replica-b", "state"))
    first = await board.next_for("replica-a")
    assert (first.control, first.pace) == ("pause", None)
    board.acknowledge(first.number, STATE)
    assert await posted == STATE
    second = await board.next_for("replica-b")  # each replica has its own queue
    board.acknowledge(second.number, None, "'nonsense' is not a valid Control")
    with pytest.raises(ValueError, match="nonsense"):
        await other


async def test_a_control_posted_before_the_replica_follows_waits_for_it():
    board = Switchboard()
    posted = asyncio.create_task(board.post("late", "pace", 3.0))
    await asyncio.sleep(0)  # a turn of the loop: the post runs, queues its control and waits
    follow = await board.next_for("late")
    assert (follow.control, follow.pace) == ("pace", 3.0)
    board.acknowledge(follow.number, STATE)
    assert await posted == STATE


async def test_a_replica_that_never_applies_it_fails_the_post_naming_the_replica(monkeypatch):
    monkeypatch.setattr(switchboard, "ACK_TIMEOUT_S", 0.05)
    board = Switchboard()
    with pytest.raises(TimeoutError, match="gone-replica"):
        await board.post("gone-replica", "resume")
    board.acknowledge(1, STATE)  # a late acknowledgement finds nobody waiting, and is dropped
