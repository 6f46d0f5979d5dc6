"""A model replica whose engine died leaves the cluster at once.

Serve's health check would replace it too, but only after three failed checks
made by the controller, whose loop stalls for tens of seconds on a busy host (it
logs "The last control loop was slow"). Until then every router keeps sending
the dead replica requests it can only refuse, and the ingress's retries run out.
A replica process that has exited is dropped by each router on the first call or
queue-length probe that fails, and Serve's next health check sees a crashed
actor and starts a replacement without waiting for three failures.
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


@dataclass
class EngineWatch:
    """Counts the calls a replica is answering and ends its process when its engine dies.

    ``engine_dead`` reads the engine's flag; ``leave`` ends the process (in tests,
    records that it was called).
    """

    engine_dead: Callable[[], bool]
    leave: Callable[[], object]
    ongoing: int = 0
    stopping: bool = False  # set when Serve stops the replica: its engine shuts down on purpose
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

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

    async def watch(self, poll_s: float = POLL_S, drain_s: float = DRAIN_S) -> None:
        while not self.engine_dead():
            await asyncio.sleep(poll_s)
        if self.stopping:
            return
        logger.error("the vLLM engine died: this replica answers its %d calls with errors, then exits", self.ongoing)
        drain_by = time.monotonic() + drain_s
        while self.ongoing and time.monotonic() < drain_by:
            await asyncio.sleep(poll_s / 5)
        if not self.stopping:
            self.leave()
