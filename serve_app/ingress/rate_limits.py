"""Per-API-key limits on requests and tokens per minute and on requests at once, shared by every ingress replica.

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

A key's requests under way at once are leases: the ingress takes one as it
admits a request and gives it back when the request's record ends (every request
ends one, whatever became of it). A lease also expires a minute after the longest
answer allowed, so one never given back (its ingress replica died) holds no place
for long.

If the limiter cannot be reached, the request and token rates are not checked
and a warning is logged: an outage of the bookkeeping must not become an outage
of the API. The concurrency limit is then kept by each replica on its own (a
key holds at most that many requests in each), not dropped.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from ray import serve

from serve_app.config import RateLimitsConfig
from serve_app.errors import APIError
from serve_app.observability.record import RequestRecord

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


CONCURRENT = "requests at once"
CONCURRENT_RETRY_S = 1.0  # a request of the key may end any moment


@dataclass(frozen=True)
class Decision:
    """Whether a request may go ahead; if not, which limit stops it and for how long."""

    allowed: bool
    limit: str | None = None  # "requests per minute", "tokens per minute" or "requests at once"
    retry_after_s: float = 0.0


@dataclass
class RateLedger:
    """Every key's buckets. Pure bookkeeping: the caller passes the clock."""

    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent: int | None = None
    requests: dict[str, TokenBucket] = field(default_factory=dict)
    tokens: dict[str, TokenBucket] = field(default_factory=dict)
    leases: dict[str, dict[str, float]] = field(default_factory=dict)  # key: lease id -> expires at
    forgotten_at: float = 0.0

    def admit(self, key_id: str, lease_id: str | None = None, lease_s: float = 0.0, *, now: float) -> Decision:
        """Take one request from ``key_id``'s request bucket, and a lease ``lease_id`` of ``lease_s`` on
        one of its places at once, if its buckets and its places allow it."""
        self._forget_idle(now)
        waits: list[tuple[float, str]] = []
        held = self._live_leases(key_id, now)
        if self.max_concurrent is not None and len(held) >= self.max_concurrent:
            waits.append((CONCURRENT_RETRY_S, CONCURRENT))
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
        if self.max_concurrent is not None and lease_id is not None:
            self.leases.setdefault(key_id, {})[lease_id] = now + lease_s
        return Decision(True)

    def release(self, key_id: str, lease_id: str) -> None:
        """Give back a lease (a request of the key ended)."""
        held = self.leases.get(key_id)
        if held is not None:
            held.pop(lease_id, None)
            if not held:
                del self.leases[key_id]

    def _live_leases(self, key_id: str, now: float) -> dict[str, float]:
        held = self.leases.get(key_id, {})
        for lease_id in [lease for lease, expires_at in held.items() if expires_at <= now]:
            del held[lease_id]  # never given back: its ingress replica died, or lost the call
        return held

    def charge(self, key_id: str, tokens: int, *, now: float) -> None:
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
        self.ledger = RateLedger(limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent_requests)

    async def admit(self, key_id: str, lease_id: str | None = None, lease_s: float = 0.0) -> Decision:
        # async: runs on the event loop, one call at a time
        return self.ledger.admit(key_id, lease_id, lease_s, now=time.monotonic())

    async def charge(self, key_id: str, tokens: int) -> None:
        self.ledger.charge(key_id, tokens, now=time.monotonic())

    async def release(self, key_id: str, lease_id: str) -> None:
        self.ledger.release(key_id, lease_id)


def rate_limited(decision: Decision) -> APIError:
    """The 429 for a refused request; ``Retry-After`` in whole seconds, at least one."""
    seconds = max(1, math.ceil(decision.retry_after_s))
    return APIError(
        429,
        f"rate limit reached: this API key's {decision.limit}; retry after {seconds} s",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(seconds)},
    )


@dataclass(frozen=True)
class KeyLease:
    """A request's place among its key's requests at once: in this replica's count, and at the limiter."""

    key_id: str
    lease_id: str
    at_limiter: bool  # False: taken while the limiter could not be reached (this replica's count only)


class RemoteMethod(Protocol):
    """A method of a Serve deployment handle: ``.remote(...)`` sends the call."""

    def remote(self, *args: Any) -> Any: ...


class LimiterHandle(Protocol):
    """What the ingress calls on the RateLimiter deployment (a Serve handle to it, in production)."""

    @property
    def admit(self) -> RemoteMethod: ...

    @property
    def charge(self) -> RemoteMethod: ...

    @property
    def release(self) -> RemoteMethod: ...


class KeyLimits:
    """The ingress's side of the limits: ask before a request, report tokens after its answer, give
    its place back when it ends. ``max_concurrent`` is also this replica's own limit per key, kept
    while the limiter cannot be reached; ``lease_s`` how long the limiter holds a place not given back."""

    def __init__(
        self, limiter: LimiterHandle, counts_tokens: bool, max_concurrent: int | None = None, lease_s: float = 660.0
    ) -> None:
        self.limiter = limiter
        self.counts_tokens = counts_tokens  # whether answers must report their usage
        self.max_concurrent = max_concurrent
        self.lease_s = lease_s
        self.held: Counter[str] = Counter()  # each key's requests under way in this replica
        self._calls: set[asyncio.Task[None]] = set()

    async def admit(self, key_id: str) -> KeyLease | None:
        """The request's lease if ``key_id`` may send one now (None without a concurrency limit);
        raise the 429 otherwise. Give the lease back with :meth:`ended`."""
        lease_id = uuid.uuid4().hex if self.max_concurrent is not None else None
        response = self.limiter.admit.remote(key_id, lease_id, self.lease_s)
        try:
            decision = await asyncio.wait_for(_result(response), LIMITER_TIMEOUT_S)
        except Exception as exc:  # see the module's docstring
            response.cancel()
            if self.max_concurrent is not None and self.held[key_id] >= self.max_concurrent:
                raise rate_limited(Decision(False, CONCURRENT, CONCURRENT_RETRY_S)) from None
            logger.warning("rate limiter unreachable (%s); admitting the request", type(exc).__name__)
            return self._hold(key_id, lease_id, at_limiter=False)
        if not decision.allowed:
            raise rate_limited(decision)
        return self._hold(key_id, lease_id, at_limiter=True)

    def _hold(self, key_id: str, lease_id: str | None, at_limiter: bool) -> KeyLease | None:
        if lease_id is None:
            return None
        self.held[key_id] += 1
        return KeyLease(key_id, lease_id, at_limiter)

    def ended(self, lease: KeyLease) -> None:
        """A request holding ``lease`` ended: its place is free again, here and at the limiter."""
        self.held[lease.key_id] -= 1
        if not self.held[lease.key_id]:
            del self.held[lease.key_id]
        if lease.at_limiter:
            self._call("release", lease.key_id, lease.lease_id)

    def request_ended(self, record: RequestRecord) -> None:
        """An observer of every request's end (see :func:`serve_app.observability.record.end_record`)."""
        if record.key_lease is not None:
            self.ended(record.key_lease)
            record.key_lease = None

    def charge(self, key_id: str, tokens: int) -> None:
        """Report the tokens an answer used, without making the answer wait."""
        if tokens > 0:
            self._call("charge", key_id, tokens)

    def _call(self, method: str, *args: Any) -> None:
        """Call the limiter's ``method`` in the background (nothing waits for it)."""
        task = asyncio.get_running_loop().create_task(self._send(method, *args))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _send(self, method: str, *args: Any) -> None:
        try:
            await asyncio.wait_for(_result(getattr(self.limiter, method).remote(*args)), LIMITER_TIMEOUT_S)
        except Exception as exc:
            logger.warning("could not %s at the rate limiter (%s)", method, type(exc).__name__)


async def _result(response: Any) -> Any:
    return await response
