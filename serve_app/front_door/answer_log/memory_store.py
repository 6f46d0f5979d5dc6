"""The in-process response store: one replica's own memory, for a model deployment of one replica.

What it keeps lives as long as the replica: a restart, a rollout's replacement or a second
replica does not see it (the config is refused where more than one replica may serve:
:class:`serve_app.config.app.AppConfig`). Bounded as the Redis store is: by count per owner,
by age (``ttl_s`` since the last change), and each answer's log by its output-token bound.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from serve_app.front_door.answer_log.store import StoredResponse, moves_forward, too_large


@dataclass
class _Stored:
    owner: str
    response: dict[str, Any]
    input_items: list[Any]
    background: bool
    expires_at: float
    size: int  # bytes: the object and input items as JSON, and the events
    events: list[str] = field(default_factory=list)
    grew: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) at each new event


class MemoryStore:
    """Stored responses and event logs in this replica's memory."""

    where = "in this replica's memory (one model replica; lost when it restarts)"

    def __init__(self, ttl_s: float, max_per_key: int, max_bytes_per_key: int = 64 << 20) -> None:
        self.ttl_s = ttl_s
        self.max_per_key = max_per_key
        self.max_bytes_per_key = max_bytes_per_key
        self._stored: OrderedDict[str, _Stored] = OrderedDict()  # oldest change first
        self._owned: dict[str, OrderedDict[str, None]] = {}  # each owner's responses, oldest first
        self._bytes: Counter[str] = Counter()  # each owner's responses' bytes
        self._cancels: asyncio.Queue[str] = asyncio.Queue()
        self._leases: dict[str, float] = {}  # response id -> until when its producer holds it

    def _get(self, response_id: str) -> _Stored | None:
        self._expire()
        return self._stored.get(response_id)

    def _touch(self, response_id: str, stored: _Stored) -> None:
        stored.expires_at = time.monotonic() + self.ttl_s
        self._stored.move_to_end(response_id)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._stored:
            response_id, stored = next(iter(self._stored.items()))
            if stored.expires_at > now:
                return
            self._remove(response_id)

    def _remove(self, response_id: str) -> None:
        stored = self._stored.pop(response_id, None)
        if stored is not None:
            self._owned.get(stored.owner, OrderedDict()).pop(response_id, None)
            self._bytes[stored.owner] -= stored.size
            stored.grew.set()  # a reader waiting on it reads (nothing) and finds it gone

    def _grow(self, response_id: str, stored: _Stored, by: int) -> None:
        """Count ``by`` more bytes of the owner's, then shed its oldest past its bounds (not this one)."""
        stored.size += by
        self._bytes[stored.owner] += by
        owned = self._owned.setdefault(stored.owner, OrderedDict())
        for old_id in list(owned):
            if len(owned) <= self.max_per_key and self._bytes[stored.owner] <= self.max_bytes_per_key:
                return
            if old_id != response_id and not self._leased(old_id):
                self._remove(old_id)

    async def save(
        self, response_id: str, owner: str, response: dict[str, Any], input_items: list[Any], background: bool
    ) -> None:
        self._expire()
        size = len(json.dumps(response)) + len(json.dumps(input_items))
        if size > self.max_bytes_per_key:
            raise too_large(size, self.max_bytes_per_key)
        stored = _Stored(owner, response, input_items, background, time.monotonic() + self.ttl_s, 0)
        self._stored[response_id] = stored
        self._owned.setdefault(owner, OrderedDict())[response_id] = None
        self._grow(response_id, stored, size)

    async def update(self, response_id: str, response: dict[str, Any]) -> bool:
        stored = self._get(response_id)
        if stored is None or not moves_forward(stored.response.get("status"), response.get("status")):
            return False
        before = len(json.dumps(stored.response))
        stored.response = response
        self._touch(response_id, stored)
        self._grow(response_id, stored, len(json.dumps(response)) - before)
        return True

    async def load(self, response_id: str, owner: str) -> StoredResponse | None:
        stored = self._get(response_id)
        if stored is None or stored.owner != owner:
            return None
        return StoredResponse(stored.response, stored.owner, stored.background)

    async def input_items(self, response_id: str) -> list[Any]:
        stored = self._get(response_id)
        return list(stored.input_items) if stored is not None else []

    async def exists(self, response_id: str) -> bool:
        return self._get(response_id) is not None

    async def delete(self, response_id: str) -> None:
        self._remove(response_id)

    async def append(self, response_id: str, sequence_number: int, event: str) -> bool:
        stored = self._get(response_id)
        if stored is None or sequence_number > len(stored.events):
            return False
        if sequence_number < len(stored.events):  # taken: by this same event (a retried call) or another
            return stored.events[sequence_number] == event
        stored.events.append(event)
        self._touch(response_id, stored)
        self._grow(response_id, stored, len(event.encode()))
        stored.grew.set()
        stored.grew = asyncio.Event()
        return True

    async def read(self, response_id: str, after: int, wait_s: float) -> list[tuple[int, str]]:
        stored = self._get(response_id)
        if stored is None:
            return []
        if len(stored.events) <= after + 1:
            try:
                await asyncio.wait_for(stored.grew.wait(), wait_s)
            except TimeoutError:
                return []
        return [(n, stored.events[n]) for n in range(after + 1, len(stored.events))]

    async def renew_lease(self, response_ids: list[str], lease_s: float) -> None:
        now = time.monotonic()
        self._leases = {rid: until for rid, until in self._leases.items() if until > now}  # (the lapsed go)
        self._leases |= dict.fromkeys(response_ids, now + lease_s)
        for response_id in response_ids:  # stored while generated
            if (stored := self._stored.get(response_id)) is not None:
                self._touch(response_id, stored)

    async def leased(self, response_id: str) -> bool:
        return self._leased(response_id)

    def _leased(self, response_id: str) -> bool:
        return self._leases.get(response_id, 0.0) > time.monotonic()

    async def request_cancel(self, response_id: str) -> None:
        self._cancels.put_nowait(response_id)

    async def cancel_requests(self) -> AsyncIterator[str]:
        while True:
            yield await self._cancels.get()

    async def close(self) -> None:
        return None
