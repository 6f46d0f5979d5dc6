"""The in-process response store: one replica's own memory, for a model deployment of one replica.

What it keeps lives as long as the replica: a restart, a rollout's replacement or a second
replica does not see it (the config is refused where more than one replica may serve:
:class:`serve_app.config.app.AppConfig`). Bounded as the Redis store is: by count per owner,
by age (``ttl_s`` since the last change), and each answer's log by its output-token bound.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from serve_app.front_door.answer_log.store import StoredResponse


@dataclass
class _Kept:
    owner: str
    response: dict[str, Any]
    input_items: list[Any]
    background: bool
    expires_at: float
    events: list[str] = field(default_factory=list)
    grew: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) at each new event


class MemoryStore:
    """Stored responses and event logs in this replica's memory."""

    where = "in this replica's memory (one model replica; lost when it restarts)"

    def __init__(self, ttl_s: float, max_per_key: int) -> None:
        self.ttl_s = ttl_s
        self.max_per_key = max_per_key
        self._kept: OrderedDict[str, _Kept] = OrderedDict()  # oldest change first
        self._owned: dict[str, OrderedDict[str, None]] = {}
        self._cancels: asyncio.Queue[str] = asyncio.Queue()
        self._leases: dict[str, float] = {}  # response id -> until when its producer holds it

    def _get(self, response_id: str) -> _Kept | None:
        self._expire()
        return self._kept.get(response_id)

    def _touch(self, response_id: str, kept: _Kept) -> None:
        kept.expires_at = time.monotonic() + self.ttl_s
        self._kept.move_to_end(response_id)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._kept:
            response_id, kept = next(iter(self._kept.items()))
            if kept.expires_at > now:
                return
            self._remove(response_id)

    def _remove(self, response_id: str) -> None:
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self._owned.get(kept.owner, OrderedDict()).pop(response_id, None)
            kept.grew.set()  # a reader waiting on it reads (nothing) and finds it gone

    async def save(
        self, response_id: str, owner: str, response: dict[str, Any], input_items: list[Any], background: bool
    ) -> None:
        self._expire()
        self._kept[response_id] = _Kept(owner, response, input_items, background, time.monotonic() + self.ttl_s)
        owned = self._owned.setdefault(owner, OrderedDict())
        owned[response_id] = None
        while len(owned) > self.max_per_key:
            self._remove(next(iter(owned)))

    async def update(self, response_id: str, response: dict[str, Any]) -> None:
        if (kept := self._get(response_id)) is not None:
            kept.response = response
            self._touch(response_id, kept)

    async def load(self, response_id: str, owner: str) -> StoredResponse | None:
        kept = self._get(response_id)
        if kept is None or kept.owner != owner:
            return None
        return StoredResponse(kept.response, kept.owner, kept.background)

    async def input_items(self, response_id: str) -> list[Any]:
        kept = self._get(response_id)
        return list(kept.input_items) if kept is not None else []

    async def exists(self, response_id: str) -> bool:
        return self._get(response_id) is not None

    async def delete(self, response_id: str) -> None:
        self._remove(response_id)

    async def append(self, response_id: str, sequence_number: int, event: str) -> bool:
        kept = self._get(response_id)
        if kept is None or sequence_number != len(kept.events):
            return False
        kept.events.append(event)
        self._touch(response_id, kept)
        kept.grew.set()
        kept.grew = asyncio.Event()
        return True

    async def read(self, response_id: str, after: int, wait_s: float) -> list[tuple[int, str]]:
        kept = self._get(response_id)
        if kept is None:
            return []
        if len(kept.events) <= after + 1:
            try:
                await asyncio.wait_for(kept.grew.wait(), wait_s)
            except TimeoutError:
                return []
        return [(n, kept.events[n]) for n in range(after + 1, len(kept.events))]

    async def renew_lease(self, response_ids: list[str], lease_s: float) -> None:
        now = time.monotonic()
        self._leases = {rid: until for rid, until in self._leases.items() if until > now}  # (the lapsed go)
        self._leases |= dict.fromkeys(response_ids, now + lease_s)
        for response_id in response_ids:  # kept while generated
            if (kept := self._kept.get(response_id)) is not None:
                self._touch(response_id, kept)

    async def leased(self, response_id: str) -> bool:
        return self._leases.get(response_id, 0.0) > time.monotonic()

    async def request_cancel(self, response_id: str) -> None:
        self._cancels.put_nowait(response_id)

    async def cancel_requests(self) -> AsyncIterator[str]:
        while True:
            yield await self._cancels.get()

    async def close(self) -> None:
        return None
