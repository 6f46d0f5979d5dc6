"""A running answer's view of the store: its calls wait out an outage instead of failing at once.

A request that needs the store and finds it down gets 503 at once (:class:`~.store.StoreDown`),
to be sent again. An answer being generated, and its followers, cannot be sent again without
losing what they have: their calls go through :class:`PatientStore`, which calls again, with
backoff, while the store stays down, for up to ``ride_through_s`` (a Sentinel failover takes
the Sentinels' down-after and an election); past it the StoreDown is theirs to end on. Retrying
is safe: every write is idempotent (an append carries its sequence number, a status update is
refused once done) and every read is a read.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from serve_app.front_door.answer_log.store import ResponseStore, StoreDown, StoredResponse

logger = logging.getLogger("ray.serve")

T = TypeVar("T")

FIRST_BACKOFF_S, LAST_BACKOFF_S = 0.1, 1.0


class PatientStore:
    """``store`` whose calls are made again while it is down, for up to ``ride_through_s``."""

    def __init__(self, store: ResponseStore, ride_through_s: float) -> None:
        self.store = store
        self.ride_through_s = ride_through_s

    @property
    def where(self) -> str:
        return self.store.where

    async def _patiently(self, call: Callable[[], Awaitable[T]]) -> T:
        deadline = time.monotonic() + self.ride_through_s
        backoff = FIRST_BACKOFF_S
        while True:
            try:
                return await call()
            except StoreDown as down:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                logger.warning("the response store is down; calling again for %.0f s more: %s", left, down.message)
                await asyncio.sleep(min(backoff, left))  # (backoff: the store says nothing when it is back)
                backoff = min(backoff * 2, LAST_BACKOFF_S)

    async def save(
        self, response_id: str, owner: str, response: dict[str, Any], input_items: list[Any], background: bool
    ) -> None:
        await self._patiently(lambda: self.store.save(response_id, owner, response, input_items, background))

    async def update(self, response_id: str, response: dict[str, Any]) -> bool:
        return await self._patiently(lambda: self.store.update(response_id, response))

    async def load(self, response_id: str, owner: str) -> StoredResponse | None:
        return await self._patiently(lambda: self.store.load(response_id, owner))

    async def input_items(self, response_id: str) -> list[Any]:
        return await self._patiently(lambda: self.store.input_items(response_id))

    async def exists(self, response_id: str) -> bool:
        return await self._patiently(lambda: self.store.exists(response_id))

    async def delete(self, response_id: str) -> None:
        await self._patiently(lambda: self.store.delete(response_id))

    async def append(self, response_id: str, sequence_number: int, event: str) -> bool:
        return await self._patiently(lambda: self.store.append(response_id, sequence_number, event))

    async def read(self, response_id: str, after: int, wait_s: float) -> list[tuple[int, str]]:
        return await self._patiently(lambda: self.store.read(response_id, after, wait_s))

    async def renew_lease(self, response_ids: list[str], lease_s: float) -> None:
        await self._patiently(lambda: self.store.renew_lease(response_ids, lease_s))

    async def leased(self, response_id: str) -> bool:
        return await self._patiently(lambda: self.store.leased(response_id))

    async def request_cancel(self, response_id: str) -> None:
        await self._patiently(lambda: self.store.request_cancel(response_id))

    def cancel_requests(self) -> AsyncIterator[str]:
        return self.store.cancel_requests()

    async def close(self) -> None:
        await self.store.close()
