"""Turns at a model replica's checker process, shared between API keys.

The checker runs one job at a time (a large body's check, a grammar's build), so that a build's
time limit counts only its own work; a build past its limit also costs the process, killed and
forked again. Taken in arrival order, one key sending many costly specs would keep every other
key's structured outputs and large bodies waiting behind all of them. So the turns go round the
keys that have jobs waiting, each key's in arrival order: another key's job waits for at most one
job of each key ahead of it, however many one key sent. Jobs without a key (no keys configured)
are one more such queue.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator


class TakeTurns:
    """One holder at a time; those waiting get their turns round the keys, in arrival order within one."""

    def __init__(self) -> None:
        self._busy = False
        self._waiting: OrderedDict[str | None, deque[asyncio.Future[None]]] = OrderedDict()

    def waiting(self, key: str | None) -> int:
        """How many of ``key``'s jobs wait for a turn."""
        return len(self._waiting.get(key, ()))

    @contextlib.asynccontextmanager
    async def turn(self, key: str | None) -> AsyncIterator[None]:
        """Hold the turn for the block, once it is ``key``'s."""
        if self._busy or self._waiting:
            granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(key, deque()).append(granted)
            try:
                await granted
            except asyncio.CancelledError:
                if granted.done() and not granted.cancelled():  # given the turn as it left: pass it on
                    self._pass_on()
                else:
                    self._forget(key, granted)
                raise
        else:
            self._busy = True
        try:
            yield
        finally:
            self._pass_on()

    def _pass_on(self) -> None:
        """The turn goes to the next key round (the key after the last one served), or nobody."""
        while self._waiting:
            key, queue = next(iter(self._waiting.items()))
            granted = queue.popleft()
            if queue:
                self._waiting.move_to_end(key)  # its next job waits for every other key's
            else:
                del self._waiting[key]
            if not granted.done():
                granted.set_result(None)
                return
        self._busy = False

    def _forget(self, key: str | None, granted: asyncio.Future[None]) -> None:
        queue = self._waiting.get(key)
        if queue is not None and granted in queue:
            queue.remove(granted)
            if not queue:
                del self._waiting[key]
