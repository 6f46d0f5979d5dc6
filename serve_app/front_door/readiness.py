"""Readiness of the models, from Serve's view, kept fresh in the background.

``GET /health`` must answer at once, whatever the load, and must not turn a
slow Serve controller into an outage. Asking the controller per probe did both
wrong: each probe was a blocking call to the controller in a thread (a flood of
probes piled threads up), and while the controller stalled (20-30 s under load
on a small host) every replica answered 503 together, so a load balancer would
drop every backend at once.

So one task per model replica asks the controller, one call at a time, and
keeps the answer; ``/health`` reads what it kept, reports its age, and calls a
model down only when Serve says so or when the controller has not answered for
``max_age_s``.

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
    """What ``/health`` answers: each model's state and how old that knowledge is."""

    models: dict[str, bool]
    age_s: float | None  # None: the controller has not answered yet
    max_age_s: float

    @property
    def stale(self) -> bool:
        return self.age_s is None or self.age_s > self.max_age_s

    @property
    def ready(self) -> bool:
        return not self.stale and bool(self.models) and all(self.models.values())

    def problem(self) -> str:
        """Why this replica is not ready (call only when it is not)."""
        if self.age_s is None:
            return "the state of the model replicas is not known yet"
        if self.stale:
            return f"the Serve controller has not answered for {self.age_s:.0f} s"
        return "no healthy replica for: " + ", ".join(sorted(m for m, ok in self.models.items() if not ok))


@dataclass
class ReadinessWatch:
    """Asks ``read_states`` (blocking: :func:`serve_app.serve_internals.replica_states` of the
    application) in a background task, one call at a time."""

    read_states: Callable[[], ReplicaStates]
    deployments: dict[str, str]  # model name -> deployment name
    max_age_s: float
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
        return Readiness(dict(models), age, self.max_age_s)
