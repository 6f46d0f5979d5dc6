"""Readiness of the models, from Serve's view, kept fresh in the background.

``GET /health`` must answer at once, whatever the load, and must not turn a
slow Serve controller into an outage. Asking the controller per probe did both
wrong: each probe was a blocking call to the controller in a thread (a flood of
probes piled threads up), and while the controller stalled (20-30 s under load
on a small host) every replica answered 503 together, so a load balancer would
drop every backend at once.

So one task per model replica asks the controller, one call at a time, and
keeps the answer; ``/health`` reads what it kept, reports its age, and calls a
model down when Serve says so.

When the controller has not answered for ``max_age_s`` (its head pod is gone, or it
stalls), the data plane still serves: HAProxy, the pickers and the replicas keep the
routes they had. So ``/health`` then answers from what this replica knows itself: up
while its own engine serves, down once it has failed (its requests would only be
passed on). It never calls every replica down together because one controller is away.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("ray.serve")

REFRESH_S = 1.0  # between the end of one controller call and the start of the next


ReplicaStates = dict[str, dict[str, int]]  # deployment -> replica state -> count (serve_internals.replica_states)


def running_models(states: ReplicaStates, deployments: dict[str, str]) -> dict[str, bool]:
    """For each model, whether its deployment has at least one RUNNING replica."""
    return {model: states.get(deployment, {}).get("RUNNING", 0) > 0 for model, deployment in deployments.items()}


@dataclass(frozen=True)
class Readiness:
    """What ``/health`` answers: each model's state, how old Serve's word on it is, and (once that
    is older than ``max_age_s``) whether this replica's own engine serves."""

    models: dict[str, bool]
    age_s: float | None  # None: the controller has not answered yet
    max_age_s: float
    engine_serves: bool = True  # this replica's engine answers (it has not died or hung)

    @property
    def stale(self) -> bool:
        return self.age_s is None or self.age_s > self.max_age_s

    @property
    def controller_reachable(self) -> bool:
        return not self.stale

    @property
    def ready(self) -> bool:
        if self.age_s is None:
            return False  # starting: nothing known yet
        if self.stale:
            return self.engine_serves
        return bool(self.models) and all(self.models.values())

    def problem(self) -> str:
        """Why this replica is not ready (call only when it is not)."""
        if self.age_s is None:
            return "the state of the model replicas is not known yet"
        if self.stale:
            return f"the Serve controller has not answered for {self.age_s:.0f} s, and this replica's engine has failed"
        return "no healthy replica for: " + ", ".join(sorted(m for m, ok in self.models.items() if not ok))


@dataclass
class ReadinessWatch:
    """Asks ``read_states`` (blocking: :func:`serve_app.serve_internals.replica_states` of the
    application) in a background task, one call at a time; ``engine_serves`` is asked per probe
    once the controller's answer is stale (this replica's engine watch: no I/O)."""

    read_states: Callable[[], ReplicaStates]
    deployments: dict[str, str]  # model name -> deployment name
    max_age_s: float
    engine_serves: Callable[[], bool]
    refresh_s: float = REFRESH_S
    _models: dict[str, bool] = field(default_factory=dict)
    _fetched_at: float | None = None
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._refresh_forever())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _refresh_forever(self) -> None:
        failing = False
        while True:
            try:
                states = await asyncio.to_thread(self.read_states)  # the only call in flight
                self._models = running_models(states, self.deployments)
                self._fetched_at = time.monotonic()
                failing = False
            except Exception as exc:
                if not failing:  # once per outage, not once a second
                    logger.warning("reading Serve's status for /health failed: %s", exc)
                failing = True
            await asyncio.sleep(self.refresh_s)

    def readiness(self) -> Readiness:
        """The current answer; no I/O."""
        age = None if self._fetched_at is None else time.monotonic() - self._fetched_at
        models = self._models or {name: False for name in self.deployments}
        if age is not None and age > self.max_age_s:  # Serve's word too old: this replica's own
            serves = self.engine_serves()
            return Readiness({name: serves for name in self.deployments}, age, self.max_age_s, serves)
        return Readiness(dict(models), age, self.max_age_s)
