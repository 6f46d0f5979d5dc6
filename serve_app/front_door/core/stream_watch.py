"""Streams that never hang silent: a keep-alive while an answer has not begun, a watchdog once it has.

- **Keep-alive**: a stream whose first chunk has not come within ``ingress.sse_keepalive_s``
  (queued behind others, or in a long prefill) gets its response's headers and an SSE comment,
  :data:`KEEPALIVE`, every ``sse_keepalive_s`` until it begins, so that a proxy or a client that
  cuts a connection idle for a minute keeps it (the HTTP door's
  :class:`~serve_app.front_door.http_api.beginning.BeginningStream`).
- **Stall watchdog** (:class:`StallWatch`, one per model replica): a stream that has begun and
  then waits ``ingress.stream_stall_timeout_s`` for its next chunk while the replica's other
  streams get theirs is ended with an error event (504 ``stream_stalled``) and its engine request
  aborted. A stream waits only while it reads: one whose client reads slowly is never stalled, and
  when no stream of the replica moves (an engine that is slow for all, or hung: the engine's own
  watch answers that) no stream is ended.

The watch costs a stream two attribute writes per chunk: a task of the watch counts ticks
(``check_s``); a stream notes the tick at which it began to wait, and the replica the tick of its
last chunk, any stream's.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from serve_app.errors import STREAM_STALLED, APIError

KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: every client ignores it
CHECK_EVERY_S = 1.0  # the watch's tick, at most (a quarter of the timeout when that is shorter)


class StreamStalled(Exception):
    """The watchdog ended a stream that got no chunk while the replica's others did."""


def stalled_error(timeout_s: float) -> APIError:
    return APIError(
        504,
        f"no token for {timeout_s:g} s while this replica's other answers went on; the request was cancelled",
        code=STREAM_STALLED,
    )


@dataclass(eq=False)
class Watched:
    """One stream under the watch: ``stop`` ends it; ``waiting_since`` is the tick its wait for a
    chunk began at (None while it is not waiting)."""

    stop: Callable[[], None]
    waiting_since: int | None = None


class StallWatch:
    """The replica's streams that have begun, and the watchdog over them (the module's docstring).
    ``timeout_s`` None: no watchdog (:meth:`watch` returns None)."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.check_s = min(CHECK_EVERY_S, timeout_s / 4) if timeout_s is not None else CHECK_EVERY_S
        self._stall_ticks = round(timeout_s / self.check_s) if timeout_s is not None else 0
        self.tick = 0
        self.moved_at = -1  # the tick of the replica's last chunk, any stream's
        self._streams: set[Watched] = set()
        self._task: asyncio.Task | None = None

    def watch(self, stop: Callable[[], None]) -> Watched | None:
        if self.timeout_s is None:
            return None
        watched = Watched(stop)
        self._streams.add(watched)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._check_forever(), name="stall-watch")
        return watched

    def waits(self, watched: Watched | None) -> None:
        """The stream begins to wait for its next chunk."""
        if watched is not None:
            watched.waiting_since = self.tick

    def got(self, watched: Watched | None) -> None:
        """The stream got a chunk."""
        if watched is not None:
            watched.waiting_since = None
            self.moved_at = self.tick

    def forget(self, watched: Watched | None) -> None:
        if watched is not None:
            self._streams.discard(watched)

    def check(self) -> list[Watched]:
        """One tick: the streams stalled as of it (stopped)."""
        self.tick += 1
        if self.tick - self.moved_at > 1:  # no stream of the replica moved in the last tick
            return []
        stalled = [
            w for w in self._streams if w.waiting_since is not None and self.tick - w.waiting_since > self._stall_ticks
        ]
        for watched in stalled:
            self._streams.discard(watched)
            watched.stop()
        return stalled

    async def _check_forever(self) -> None:
        while self._streams:
            await asyncio.sleep(self.check_s)
            self.check()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
