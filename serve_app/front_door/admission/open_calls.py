"""OpenCalls: the places of calls that stay open without generating. Runs in each model replica.

A gRPC ``Stream`` call, a ``Resume`` call and an HTTP GET (or a background POST with ``stream``)
that follows an answer's events hold their connection, and one of Serve's places on the replica,
for as long as they are open, whether or not anything generates. Each holds one of these places
instead of a generation place (:mod:`serve_app.front_door.admission.capacity`), so they never
compete with generation; there are at most ``max_per_replica`` (Serve's limit of the replica is
raised by as much, so ``/health`` never waits behind them) and at most ``max_per_key`` of one
API key. Past either, 429 ``open_call_limit`` (gRPC ``RESOURCE_EXHAUSTED``). A place costs a
count: nothing is computed while a call idles.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from serve_app.config import OpenCallsConfig
from serve_app.errors import APIError

ANYONE = ""  # the key of every call where no API keys are configured


class OpenCalls:
    """The open calls of one replica, by API key (see the module's docstring)."""

    def __init__(self, limits: OpenCallsConfig) -> None:
        self.limits = limits
        self.by_key: Counter[str] = Counter()
        self.held = 0

    def take(self, key_id: str | None) -> None:
        """One place for a call of ``key_id``; 429 ``open_call_limit`` past either bound."""
        key = key_id or ANYONE
        if self.held >= self.limits.max_per_replica:
            raise open_call_limit(f"this replica holds {self.held} open calls, its limit")
        if self.by_key[key] >= self.limits.max_per_key:
            raise open_call_limit(f"this API key holds {self.by_key[key]} open calls on this replica, its limit")
        self.held += 1
        self.by_key[key] += 1

    def give_back(self, key_id: str | None) -> None:
        key = key_id or ANYONE
        self.held -= 1
        self.by_key[key] -= 1
        if not self.by_key[key]:
            del self.by_key[key]

    @contextmanager
    def hold(self, key_id: str | None) -> Iterator[None]:
        """A place while the block runs (429 if none is free), given back after."""
        self.take(key_id)
        try:
            yield
        finally:
            self.give_back(key_id)


def open_call_limit(why: str) -> APIError:
    return APIError(
        429,
        f"{why}: end a call (Stream, Resume, a followed answer) before opening another",
        code="open_call_limit",
        headers={"Retry-After": "1"},
    )
