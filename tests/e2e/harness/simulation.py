"""Driving the simulated engines of a deployment, replica by replica, through the cluster's
switchboard (see :mod:`serve_app.simulated_engine.controls` and ``switchboard``).

A load or fault test sets up what it measures with these instead of racing the
engine: it pauses the engines while a burst arrives (what each replica admits then
stays in its count), slows their pace so that streams are still under way when it
acts, makes one engine fail or hang at the moment it chooses, and reads what each
engine holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from serve_app.simulated_engine import switchboard
from serve_app.simulated_engine.controls import Control, EngineState
from tests.e2e.harness.apps import RunningApp
from tests.e2e.harness.serve_state import (
    SETTLE_S,
    DeploymentName,
    live_replicas,
    ongoing_at,
    running_live,
    single_replica,
)
from tests.waiting import wait_until


class SimulatedEngines:
    """The simulated engines of one model deployment."""

    def __init__(self, deployment: DeploymentName) -> None:
        self.deployment = deployment

    async def replicas(self) -> list[str]:
        """The live replicas' actor ids."""
        return sorted(await live_replicas(self.deployment))

    async def control(self, replica: str, control: Control, pace: float | None = None) -> EngineState:
        """Post ``control`` for one replica on the cluster's switchboard; its engine's state after it."""
        return await switchboard.switchboard().post.remote(replica, control.value, pace)

    async def control_all(self, control: Control, pace: float | None = None) -> dict[str, EngineState]:
        return {replica: await self.control(replica, control, pace) for replica in await self.replicas()}

    async def states(self) -> dict[str, EngineState]:
        return await self.control_all(Control.STATE)

    async def holds(self) -> int:
        """Sequences all the engines hold (each choice of a request is one)."""
        return sum(state.holds for state in (await self.states()).values())

    async def wait_until_holding(self, count: int, within_s: float = 60) -> dict[str, EngineState]:
        """Wait until the engines together hold ``count`` sequences; return each one's state."""

        async def holding() -> dict[str, EngineState] | None:
            states = await self.states()
            return states if sum(s.holds for s in states.values()) == count else None

        return await wait_until(holding, within_s, f"{self.deployment}'s engines holding {count}", every_s=0.05)

    async def wait_until_idle(self, within_s: float = 60) -> None:
        """Wait until no engine holds anything and Serve counts no request at any replica (a call
        ends there a little after its engine let it go)."""

        async def idle() -> bool:
            replicas = await self.replicas()
            states = [await self.control(replica, Control.STATE) for replica in replicas]
            return all(s.holds == 0 for s in states) and all([await ongoing_at(r) == 0 for r in replicas])

        await wait_until(idle, within_s, f"{self.deployment} idle", every_s=0.05)

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Every engine paused for the block (requests admitted and held, no token), resumed after."""
        await self.control_all(Control.PAUSE)
        try:
            yield
        finally:
            await self.control_all(Control.RESUME)

    async def reset(self) -> None:
        """Every engine running at the timing model's pace."""
        await self.control_all(Control.RESUME)
        await self.control_all(Control.PACE, 1.0)


@dataclass(frozen=True)
class Bed:
    """The bed (or a variant of it) for one test: its app, its model deployment and that deployment's
    simulated engines."""

    app: RunningApp
    model: DeploymentName
    engines: SimulatedEngines


async def ready_bed(app: RunningApp, replicas: int = 1) -> Bed:
    """``app`` (the bed or a variant) as every test finds it: its replicas running at the timing
    model's pace, holding nothing."""
    model = DeploymentName(app.name, app.model_deployment)
    engines = SimulatedEngines(model)
    if replicas == 1:
        await single_replica(model)
    else:
        await wait_until(lambda: running_live(model, replicas), SETTLE_S, f"{model} at {replicas} running replicas")
    await engines.reset()
    await engines.wait_until_idle()
    return Bed(app, model, engines)
