"""Per-API-key limits on requests and tokens per minute, shared by every ingress replica.

One small deployment, :class:`RateLimiter`, holds every key's counts; each
ingress replica asks it once per request, before routing (the design of
Envoy's global rate limit service), and reports the tokens an answer used when
it ends. Counts kept in one place make several ingress replicas together
enforce exactly the configured rate, at the cost of one actor call (about a
millisecond) per request, paid only when limits are configured.

Each limit is a token bucket holding one minute's worth and refilled
continuously: a key may burst up to its limit, then sustain it. Tokens are
charged after the answer (they are not known before), so a key's token bucket
may go below zero; requests are admitted again once it has refilled above zero.

If the limiter cannot be reached, requests are admitted (fail open) and a
warning is logged: an outage of the bookkeeping must not become an outage of
the API.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ray import serve

from serve_app.config import RateLimitsConfig
from serve_app.errors import APIError

logger = logging.getLogger("ray.serve")

LIMITER_TIMEOUT_S = 2.0  # an admission waits this long for the limiter, then goes ahead
FORGET_EVERY_S = 60.0  # how often buckets of idle keys (full again) are dropped


@dataclass
class TokenBucket:
    """Holds up to ``capacity`` and refills ``capacity`` per minute; charges may take it below zero."""

    capacity: float
    level: float
    updated_at: float

    def at(self, now: float) -> float:
        """The level at ``now``, after refilling since the last look."""
        self.level = min(self.capacity, self.level + (now - self.updated_at) * self.capacity / 60)
        self.updated_at = now
        return self.level

    def seconds_until(self, level: float, now: float) -> float:
        return max(0.0, (level - self.at(now)) * 60 / self.capacity)


@dataclass(frozen=True)
class Decision:
    """Whether a request may go ahead; if not, which limit stops it and for how long."""

    allowed: bool
    limit: str | None = None  # "requests per minute" or "tokens per minute"
    retry_after_s: float = 0.0


@dataclass
class RateLedger:
    """Every key's buckets. Pure bookkeeping: the caller passes the clock."""

    requests_per_minute: int | None
    tokens_per_minute: int | None
    requests: dict[str, TokenBucket] = field(default_factory=dict)
    tokens: dict[str, TokenBucket] = field(default_factory=dict)
    forgotten_at: float = 0.0

    def admit(self, key_id: str, now: float) -> Decision:
        """Take one request from ``key_id``'s request bucket if both of its buckets allow it."""
        self._forget_idle(now)
        waits: list[tuple[float, str]] = []
        requests = self._bucket(self.requests, self.requests_per_minute, key_id, now)
        if requests is not None and requests.at(now) < 1:
            waits.append((requests.seconds_until(1, now), "requests per minute"))
        tokens = self._bucket(self.tokens, self.tokens_per_minute, key_id, now)
        if tokens is not None and tokens.at(now) <= 0:
            waits.append((tokens.seconds_until(1, now), "tokens per minute"))
        if waits:
            wait, limit = max(waits)
            return Decision(False, limit, wait)
        if requests is not None:
            requests.level -= 1
        return Decision(True)

    def charge(self, key_id: str, tokens: int, now: float) -> None:
        """Take the tokens an answer used; the debt stops at one bucket, about a minute of waiting."""
        bucket = self._bucket(self.tokens, self.tokens_per_minute, key_id, now)
        if bucket is not None and tokens > 0:
            bucket.level = max(-bucket.capacity, bucket.at(now) - tokens)

    def _bucket(
        self, buckets: dict[str, TokenBucket], per_minute: int | None, key_id: str, now: float
    ) -> TokenBucket | None:
        if per_minute is None:
            return None
        bucket = buckets.get(key_id)
        if bucket is None:
            bucket = buckets[key_id] = TokenBucket(per_minute, per_minute, now)
        return bucket

    def _forget_idle(self, now: float) -> None:
        """Drop buckets that are full again: a new bucket for that key would be the same."""
        if now - self.forgotten_at < FORGET_EVERY_S:
            return
        self.forgotten_at = now
        for buckets in (self.requests, self.tokens):
            for key_id in [k for k, b in buckets.items() if b.at(now) >= b.capacity]:
                del buckets[key_id]


@serve.deployment(
    num_replicas=1,  # the counts live in one place; Serve restarts it if it dies (counts start afresh)
    max_ongoing_requests=10_000,  # each call is a few microseconds of arithmetic
    ray_actor_options={"num_cpus": 0},
)
class RateLimiter:
    """The one place every ingress replica asks before a request and tells after its answer."""

    def __init__(self, limits: RateLimitsConfig) -> None:
        self.ledger = RateLedger(limits.requests_per_minute, limits.tokens_per_minute)

    async def admit(self, key_id: str) -> Decision:  # async: runs on the event loop, one call at a time
        return self.ledger.admit(key_id, time.monotonic())

    async def charge(self, key_id: str, tokens: int) -> None:
        self.ledger.charge(key_id, tokens, time.monotonic())


def rate_limited(decision: Decision) -> APIError:
    """The 429 for a refused request; ``Retry-After`` in whole seconds, at least one."""
    seconds = max(1, math.ceil(decision.retry_after_s))
    return APIError(
        429,
        f"rate limit reached: this API key's {decision.limit}; retry after {seconds} s",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(seconds)},
    )


class RemoteMethod(Protocol):
    """A method of a Serve deployment handle: ``.remote(...)`` sends the call."""

    def remote(self, *args: Any) -> Any: ...


class LimiterHandle(Protocol):
    """What the ingress calls on the RateLimiter deployment (a Serve handle to it, in production)."""

    @property
    def admit(self) -> RemoteMethod: ...

    @property
    def charge(self) -> RemoteMethod: ...


class KeyLimits:
    """The ingress's side of the limits: ask before a request, report tokens after its answer."""

    def __init__(self, limiter: LimiterHandle, counts_tokens: bool) -> None:
        self.limiter = limiter
        self.counts_tokens = counts_tokens  # whether answers must report their usage
        self._charges: set[asyncio.Task[None]] = set()

    async def admit(self, key_id: str) -> None:
        """Return if ``key_id`` may send a request now; raise the 429 otherwise."""
        response = self.limiter.admit.remote(key_id)
        try:
            decision = await asyncio.wait_for(_result(response), LIMITER_TIMEOUT_S)
        except Exception as exc:  # fail open: see the module's docstring
            response.cancel()
            logger.warning("rate limiter unreachable (%s); admitting the request", type(exc).__name__)
            return
        if not decision.allowed:
            raise rate_limited(decision)

    def charge(self, key_id: str, tokens: int) -> None:
        """Report the tokens an answer used, without making the answer wait."""
        if tokens <= 0:
            return
        task = asyncio.get_running_loop().create_task(self._charge(key_id, tokens))
        self._charges.add(task)
        task.add_done_callback(self._charges.discard)

    async def _charge(self, key_id: str, tokens: int) -> None:
        try:
            await asyncio.wait_for(_result(self.limiter.charge.remote(key_id, tokens)), LIMITER_TIMEOUT_S)
        except Exception as exc:
            logger.warning("could not report %d tokens to the rate limiter (%s)", tokens, type(exc).__name__)


async def _result(response: Any) -> Any:
    return await response
