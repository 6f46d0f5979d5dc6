"""RateLimiter: the deployment that holds every API key's counts. Runs in its own replicas.

Every model replica's front door asks it once per request, before the engine (the design of
Envoy's global rate limit service), and reports the tokens an answer used when it ends
(:mod:`serve_app.front_door.admission.rate_limits`, which also says what happens when it cannot be
reached). Each key's calls all go to one replica (Ray's consistent-hash router, keyed by the
key: :func:`serve_app.deployments.options.rate_limiter_options`), so each key's counts are kept
in one place and several model replicas together enforce exactly the configured rate, at the
cost of one actor call (about a millisecond) per request, paid only when limits are configured.
When a replica goes, its keys' calls move to another, where their counts start afresh.

Each limit is a token bucket holding one minute's worth and refilled continuously: a key may
burst up to its limit, then sustain it. Tokens are charged after the answer (they are not
known before), so a key's token bucket may go below zero; requests are admitted again once it
has refilled above zero. A key's requests under way at once are leases, given back when each
request ends. A lease is short (the front door's ``LEASE_S``) and renewed by the model replica
holding it while its request runs, so one never given back (its replica died, its release was
lost, or its admission's answer came too late) holds a place at most that long after its
request; expired leases are purged with idle keys' buckets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ray import serve

from serve_app.config import RateLimitsConfig
from serve_app.front_door.admission.rate_limits import CONCURRENT, CONCURRENT_RETRY_S, Decision

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

    def renew(self, key_id: str, lease_ids: list[str], lease_s: float, *, now: float) -> None:
        """Extend the key's leases ``lease_ids`` to ``lease_s`` from now; one not held is not taken."""
        held = self.leases.get(key_id, {})
        for lease_id in lease_ids:
            if lease_id in held:
                held[lease_id] = now + lease_s

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
            del held[lease_id]  # never given back: the model replica that took it died, or lost the call
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
        """Drop buckets that are full again (a new bucket for that key would be the same), and expired
        leases, also of keys that never come back."""
        if now - self.forgotten_at < FORGET_EVERY_S:
            return
        self.forgotten_at = now
        for buckets in (self.requests, self.tokens):
            for key_id in [k for k, b in buckets.items() if b.at(now) >= b.capacity]:
                del buckets[key_id]
        for key_id in list(self.leases):
            if not self._live_leases(key_id, now):
                del self.leases[key_id]


@serve.deployment(
    # (replicas and router: deployments.options.rate_limiter_options; each key's counts live in one
    # replica, and start afresh in another when it goes)
    max_ongoing_requests=10_000,  # each call is a few microseconds of arithmetic
    ray_actor_options={"num_cpus": 0},
)
class RateLimiter:
    """The one place every model replica's front door asks before a request and tells after its answer."""

    def __init__(self, limits: RateLimitsConfig) -> None:
        self.ledger = RateLedger(limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent_requests)

    async def admit(self, key_id: str, lease_id: str | None = None, lease_s: float = 0.0) -> Decision:
        # async: runs on the event loop, one call at a time
        return self.ledger.admit(key_id, lease_id, lease_s, now=time.monotonic())

    async def charge(self, key_id: str, tokens: int) -> None:
        self.ledger.charge(key_id, tokens, now=time.monotonic())

    async def renew(self, key_id: str, lease_ids: list[str], lease_s: float) -> None:
        self.ledger.renew(key_id, lease_ids, lease_s, now=time.monotonic())

    async def release(self, key_id: str, lease_id: str) -> None:
        self.ledger.release(key_id, lease_id)
