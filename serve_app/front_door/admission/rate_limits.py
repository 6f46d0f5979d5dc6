"""Per-API-key limits, the front door's side: ask the RateLimiter before a request, report after it.

The counts live in one deployment (:class:`serve_app.deployments.rate_limiter.RateLimiter`,
shared by every model replica; each key's in one of its replicas). A key's requests under way
at once are leases: the front door takes one as it admits a request and gives it back when the
request's answer ends (its :class:`~serve_app.front_door.core.permit.Permit` closes, whatever became
of it; a background answer's permit lives as long as the answer). A lease lasts
:data:`LEASE_S` at the limiter and is renewed while its request runs, so a place never given back
(a replica that died, a release lost, an admission the limiter answered after the front door had
stopped waiting) is held at most that long after its request.

If the limiter cannot be reached, the request and token rates are not checked
and a warning is logged: an outage of the bookkeeping must not become an outage
of the API. The concurrency limit is then kept by each replica on its own (a
key holds at most that many requests in each), not dropped. Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

from serve_app.errors import APIError

logger = logging.getLogger("ray.serve")

LIMITER_TIMEOUT_S = 2.0  # an admission waits this long for the limiter, then goes ahead
LEASE_S = 30.0  # how long the limiter keeps a place its model replica no longer renews
RENEW_EVERY_S = LEASE_S / 3  # each replica renews the leases of its requests under way this often


CONCURRENT = "requests at once"
CONCURRENT_RETRY_S = 1.0  # a request of the key may end any moment


@dataclass(frozen=True)
class KeyLease:
    """A request's place among its key's requests at once: in this replica's count, and at the limiter."""

    key_id: str
    lease_id: str
    at_limiter: bool  # False: the limiter did not answer in time (held by this replica's count; it may hold it too)


@dataclass(frozen=True)
class Decision:
    """Whether a request may go ahead; if not, which limit stops it and for how long."""

    allowed: bool
    limit: str | None = None  # "requests per minute", "tokens per minute" or "requests at once"
    retry_after_s: float = 0.0


class AtKeyCap(APIError):
    """The 429 of a key holding its ``max_concurrent_requests`` already: a background answer waits
    for a place instead (:mod:`serve_app.front_door.core.background`)."""


def rate_limited(decision: Decision) -> APIError:
    """The 429 for a refused request; ``Retry-After`` in whole seconds, at least one."""
    seconds = max(1, math.ceil(decision.retry_after_s))
    refusal = AtKeyCap if decision.limit == CONCURRENT else APIError
    return refusal(
        429,
        f"rate limit reached: this API key's {decision.limit}; retry after {seconds} s",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(seconds)},
    )


class RemoteMethod(Protocol):
    """A method of a Serve deployment handle: ``.remote(...)`` sends the call."""

    def remote(self, *args: Any) -> Any: ...


class LimiterHandle(Protocol):
    """What the front door calls on the RateLimiter deployment (a Serve handle to it, in production).

    Every call names its key as the call's session id (:meth:`options`): the limiter's router sends
    each key's calls to the one replica that keeps its counts."""

    def options(self, *, session_id: str) -> LimiterHandle: ...

    @property
    def admit(self) -> RemoteMethod: ...

    @property
    def charge(self) -> RemoteMethod: ...

    @property
    def renew(self) -> RemoteMethod: ...

    @property
    def release(self) -> RemoteMethod: ...


class KeyLimits:
    """The front door's side of the limits: ask before a request, report tokens after its answer, give
    its place back when it ends. ``max_concurrent`` is also this replica's own limit per key, kept
    while the limiter cannot be reached; ``lease_s`` how long the limiter holds a place not given back."""

    def __init__(
        self, limiter: LimiterHandle, counts_tokens: bool, max_concurrent: int | None = None, lease_s: float = LEASE_S
    ) -> None:
        self.limiter = limiter
        self.counts_tokens = counts_tokens  # whether answers must report their usage
        self.max_concurrent = max_concurrent
        self.lease_s = lease_s
        self.held: Counter[str] = Counter()  # each key's requests under way in this replica
        self.leases: dict[str, set[str]] = {}  # each key's lease ids the limiter may hold: renewed until they end
        self._renewer: asyncio.Task[None] | None = None
        self._calls: set[asyncio.Task[None]] = set()

    async def admit(self, key_id: str) -> KeyLease | None:
        """The request's lease if ``key_id`` may send one now (None without a concurrency limit);
        raise the 429 otherwise. Give the lease back with :meth:`ended`."""
        lease_id = uuid.uuid4().hex if self.max_concurrent is not None else None
        response = self.limiter.options(session_id=key_id).admit.remote(key_id, lease_id, self.lease_s)
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
        # Renewed (and given back) also when the limiter did not answer: its answer may come late.
        self.leases.setdefault(key_id, set()).add(lease_id)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_while_held())
        return KeyLease(key_id, lease_id, at_limiter)

    def ended(self, lease: KeyLease) -> None:
        """A request holding ``lease`` ended: its place is free again, here and at the limiter (a
        lease the limiter never took is no lease there: giving it back changes nothing)."""
        self.held[lease.key_id] -= 1
        if not self.held[lease.key_id]:
            del self.held[lease.key_id]
        held = self.leases.get(lease.key_id, set())
        held.discard(lease.lease_id)
        if not held:
            self.leases.pop(lease.key_id, None)
        self._call("release", lease.key_id, lease.lease_id)

    async def _renew_while_held(self) -> None:
        """Renew every lease of this replica's requests under way, each ``RENEW_EVERY_S``, until none is."""
        while self.leases:
            await asyncio.sleep(RENEW_EVERY_S)  # (a period: the lease's own clock runs at the limiter)
            for key_id, lease_ids in list(self.leases.items()):
                self._call("renew", key_id, sorted(lease_ids), self.lease_s)

    def charge(self, key_id: str, tokens: int) -> None:
        """Report tokens an answer made, without making the answer wait."""
        if tokens > 0:
            self._call("charge", key_id, tokens)

    def _call(self, method: str, key_id: str, *args: Any) -> None:
        """Call the limiter's ``method`` for ``key_id`` in the background (nothing waits for it)."""
        task = asyncio.get_running_loop().create_task(self._send(method, key_id, *args))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _send(self, method: str, key_id: str, *args: Any) -> None:
        try:
            limiter = self.limiter.options(session_id=key_id)
            await asyncio.wait_for(_result(getattr(limiter, method).remote(key_id, *args)), LIMITER_TIMEOUT_S)
        except Exception as exc:
            logger.warning("could not %s at the rate limiter (%s)", method, type(exc).__name__)


async def _result(response: Any) -> Any:
    return await response
