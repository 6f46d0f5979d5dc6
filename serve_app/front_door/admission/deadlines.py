"""Time limits of one request: for its first token and for the whole answer.

A request that waits too long (queued behind others, or stuck) is cancelled,
which aborts its vLLM request, and the client gets a 504 or, once its stream
has started, a final error event. The limits come from the config's ``ingress`` section; a
client may shorten the whole-answer limit for its own request with the
``X-Request-Timeout`` header (seconds), never lengthen it.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from serve_app.errors import APIError

TIMEOUT_HEADER = "x-request-timeout"
T = TypeVar("T")


@dataclass(frozen=True)
class TimeLimits:
    """Configured limits, in seconds."""

    request_timeout_s: float
    first_token_timeout_s: float


@dataclass(frozen=True)
class Deadline:
    """A request's limits as points on the event loop's clock."""

    first_token_at: float
    end_at: float
    total_s: float
    first_token_s: float

    @classmethod
    def start(cls, limits: TimeLimits, requested_s: float | None = None) -> Deadline:
        now = asyncio.get_running_loop().time()
        total = limits.request_timeout_s if requested_s is None else min(requested_s, limits.request_timeout_s)
        first = min(limits.first_token_timeout_s, total)
        return cls(first_token_at=now + first, end_at=now + total, total_s=total, first_token_s=first)

    def first_token_expired(self) -> APIError:
        return APIError(
            504,
            f"no answer began within {self.first_token_s:g} s (the model is busy or stuck); the request was cancelled",
            code="first_token_timeout",
        )

    def expired(self) -> APIError:
        return APIError(
            504, f"the answer took longer than {self.total_s:g} s; the request was cancelled", code="request_timeout"
        )


def requested_timeout(headers: Mapping[str, str]) -> float | None:
    """The client's own limit from ``X-Request-Timeout``; 400 when it is not a positive number."""
    raw = headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise APIError(
            400, f"X-Request-Timeout must be a positive number of seconds, got {raw!r}", param=TIMEOUT_HEADER
        )
    return value


class DeadlineExceeded(Exception):
    """A wait ran past its deadline."""


async def next_before(responses: AsyncIterator[T], when: float) -> T:
    """The next item of an async iterator, or :class:`DeadlineExceeded` at ``when`` (loop clock).

    Uses ``asyncio.timeout_at``, which creates no task per item; only our own
    timer's expiry counts, not a ``TimeoutError`` raised by the iterator itself.
    """
    timer = asyncio.timeout_at(when)
    try:
        async with timer:
            return await anext(responses)
    except TimeoutError:
        if timer.expired():
            raise DeadlineExceeded from None
        raise


class ItemsBefore(Generic[T]):
    """The items of one async iterator, each before the same point of the loop's clock: what
    :func:`next_before` does for one item, with one timer for them all (a stream's chunks, read
    until its end deadline: no timer armed and cancelled per token).

    Call :meth:`next` from one task at a time; :meth:`close` once done. A cancellation the
    iterator swallowed (vLLM's unary path does) is raised again as the deadline it was.
    :meth:`interrupt` ends the wait early for another reason (a stalled stream's watchdog)."""

    def __init__(self, items: AsyncIterator[T], when: float) -> None:
        self._items = items
        self._when = when
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: asyncio.Task | None = None  # the task awaiting an item, while it does
        self._reason: type[Exception] | None = None  # why the items ended early (the deadline passed, ...)
        self._cancelled = False  # ... and it cancelled the task that was waiting

    async def next(self) -> T:
        """The next item; :class:`DeadlineExceeded` once the deadline has passed (or the
        exception :meth:`interrupt` was given)."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_at(self._when, self._fire)
        if self._reason is not None:
            raise self._reason
        task = self._waiting = asyncio.current_task()
        try:
            item = await anext(self._items)
        except asyncio.CancelledError:
            if self._cancelled and task is not None and task.uncancel() == 0:
                assert self._reason is not None
                raise self._reason from None  # (only our own interruption cancelled it)
            raise
        finally:
            self._waiting = None
        if self._cancelled:  # the iterator swallowed the cancellation
            assert task is not None and self._reason is not None
            task.uncancel()
            raise self._reason
        return item

    def interrupt(self, reason: type[Exception]) -> None:
        """End the items now: the waiting :meth:`next` (or the next one) raises ``reason``."""
        if self._reason is not None:
            return
        self._reason = reason
        if self._waiting is not None:
            self._cancelled = True
            self._waiting.cancel()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _fire(self) -> None:
        self.interrupt(DeadlineExceeded)
