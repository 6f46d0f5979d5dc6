"""Where the simulated engines' controls are posted, so that a full replica can still be reached.

A call through Serve to a replica waits for one of its ``max_ongoing_requests`` slots, so a
replica whose paused engine holds a full batch could never be resumed that way. Instead,
each model replica with a simulated engine follows the switchboard: one detached Ray actor
per cluster (:data:`NAME` in :data:`NAMESPACE`, no CPU) that a test posts a control to, for
one replica by its Ray actor id, and that answers with the engine's state once the replica
has applied it. Only a Ray client of the cluster (which needs the cluster's token) reaches
it; no HTTP route leads to it, and a replica of a real engine never starts following it.

Runs in its own detached Ray actor (the class), and in each model replica with a simulated engine
(its follower).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from serve_app.simulated_engine.controls import Control, EngineState

NAME = "glm4-serve-simulation-switchboard"
NAMESPACE = "glm4-serve"
ACK_TIMEOUT_S = 30.0  # a replica applies a control at once; longer means it is gone

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Posted:
    """A control posted for one replica, numbered so that its ack finds its poster."""

    number: int
    control: str
    pace: float | None


class Switchboard:
    """The Ray actor: a queue of posted controls per replica, and the replies to them."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[Posted]] = {}
        self._acks: dict[int, asyncio.Future[EngineState]] = {}
        self._numbers = 0

    def _queue(self, replica: str) -> asyncio.Queue[Posted]:
        return self._queues.setdefault(replica, asyncio.Queue())

    async def post(self, replica: str, control: str, pace: float | None = None) -> EngineState:
        """Have ``replica`` apply ``control``; its engine's state after it (or the replica's error)."""
        self._numbers += 1
        number = self._numbers
        ack: asyncio.Future[EngineState] = asyncio.get_running_loop().create_future()
        self._acks[number] = ack
        self._queue(replica).put_nowait(Posted(number, control, pace))
        try:
            return await asyncio.wait_for(ack, ACK_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(f"replica {replica} did not apply {control!r} within {ACK_TIMEOUT_S:g} s") from None
        finally:
            self._acks.pop(number, None)

    async def next_for(self, replica: str) -> Posted:
        """The next control posted for ``replica`` (a replica's long poll)."""
        return await self._queue(replica).get()

    def acknowledge(self, number: int, state: EngineState | None, error: str | None = None) -> None:
        future = self._acks.get(number)
        if future is None or future.done():  # (its poster gave up)
            return
        if state is None:
            future.set_exception(ValueError(error))
        else:
            future.set_result(state)


def switchboard() -> Any:
    """The cluster's switchboard actor, started by whoever asks first."""
    return (
        ray.remote(Switchboard)
        .options(name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0)
        .remote()
    )


async def follow(replica: str, apply: Callable[[Control, float | None], EngineState]) -> None:
    """Apply each control posted for ``replica`` with ``apply``, forever (a replica's background task)."""
    board = switchboard()
    while True:
        try:
            posted: Posted = await board.next_for.remote(replica)
        except ray.exceptions.RayActorError:  # (someone removed it: start another)
            logger.warning("the simulation switchboard is gone; starting it again")
            await asyncio.sleep(1.0)
            board = switchboard()
            continue
        try:
            state, error = apply(Control(posted.control), posted.pace), None
        except ValueError as exc:  # an unknown control, a bad pace
            state, error = None, str(exc)
        await board.acknowledge.remote(posted.number, state, error)
