"""An engine that died, or hung, is stopped at once, and its replica fails Serve's health check.

The watch polls vLLM's flag for its engine's death. Once the calls the dead engine
held have had their errors delivered, ``leave`` runs: the model replica
(:meth:`serve_app.engine.server.EngineServer._leave`) stops its engine but keeps its
process, whose front door passes each request HAProxy still hands it on to the
other replicas, until Serve, whose health check of it now fails, takes it out and
stops it. (Exiting at once cut the requests it was passing on.)

An engine can also hang without dying (a stuck collective, a wedged worker):
it holds requests and produces nothing, and vLLM's ``errored`` flag stays
false. So the watch also reads when the engine last produced output
(:class:`EngineProgress`, fed by vLLM's stat-logger hook after every engine
step): holding requests with no output for ``stall_timeout_s`` counts as a
death, after the requests it holds are given errors.

Runs in each model replica, beside its engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

logger = logging.getLogger("ray.serve")

POLL_S = 0.5  # vLLM offers no event for its engine's death, only the `errored` flag
DRAIN_S = 5.0  # for the requests the dead engine was serving to send their errors back
# Then for Ray to deliver those errors: it sends a call's last items to the caller after the
# user code has yielded them, and a process that exits at once can drop them; the caller then
# sees a dead replica instead of the error, and sends the request to another replica.
# Ray has no call that waits for that delivery. 1 s was not always enough on 2 cores busy with
# two engines and 128 clients (a CI run's killed engine had held requests that came back 200
# from the other replica, so none got its engine_failed); the cost is a dead replica's 2 s more.
DELIVER_S = 3.0


@dataclass
class EngineProgress:
    """When the engine last produced output, or was last seen idle (seconds of ``clock``)."""

    clock: Callable[[], float] = time.monotonic
    last_output_at: float = field(init=False)

    def __post_init__(self) -> None:
        self.last_output_at = self.clock()

    def saw_output(self) -> None:
        self.last_output_at = self.clock()


@dataclass
class EngineWatch:
    """Counts the calls a replica is answering and calls ``leave`` when its engine dies or hangs.

    ``engine_dead`` reads the engine's flag; ``held`` the requests the engine
    holds; ``fail_requests`` gives each of them an error; ``leave`` stops the
    engine (in tests, records that it was called).
    """

    engine_dead: Callable[[], bool]
    leave: Callable[[], object]
    held: Callable[[], int] = lambda: 0
    fail_requests: Callable[[], object] = lambda: None
    stall_timeout_s: float | None = None
    progress: EngineProgress = field(default_factory=EngineProgress)
    ongoing: int = 0
    stopping: bool = False  # set when Serve stops the replica: its engine shuts down on purpose
    stalled: bool = False  # the engine held requests and produced nothing for stall_timeout_s
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def failed(self) -> bool:
        """The engine can no longer answer: it died, or it hung."""
        return self.stalled or self.engine_dead()

    def _stall_seconds(self) -> float:
        """How long the engine has held requests without producing output (0 while idle)."""
        if self.held() == 0:
            self.progress.saw_output()  # idle is not stuck: the clock starts with the next request
            return 0.0
        return self.progress.clock() - self.progress.last_output_at

    @contextmanager
    def call(self) -> Iterator[None]:
        """Wrap each call the replica answers, so a dying replica can let them finish."""
        self.ongoing += 1
        try:
            yield
        finally:
            self.ongoing -= 1

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.watch())

    async def watch(self, poll_s: float = POLL_S, drain_s: float = DRAIN_S, deliver_s: float = DELIVER_S) -> None:
        while not self.engine_dead():
            if self.stall_timeout_s is not None and self._stall_seconds() > self.stall_timeout_s:
                self.stalled = True
                break
            await asyncio.sleep(poll_s)
        if self.stopping:
            return
        if self.stalled:
            logger.error(
                "the vLLM engine holds %d requests and has produced nothing for %.0f s: taken as hung; "
                "this replica answers its %d calls with errors, then exits",
                self.held(),
                self._stall_seconds(),
                self.ongoing,
            )
            self.fail_requests()
        else:
            logger.error(
                "the vLLM engine died: this replica answers its %d calls with errors, then exits", self.ongoing
            )
        drain_by = time.monotonic() + drain_s
        while self.ongoing and time.monotonic() < drain_by:
            await asyncio.sleep(poll_s / 5)
        await asyncio.sleep(deliver_s)
        if not self.stopping:
            self.leave()
