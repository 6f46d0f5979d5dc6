"""StoredResponses: what one model replica holds of the Responses API's store.

The store the config names (:mod:`serve_app.front_door.answer_log.memory_store` or
:mod:`serve_app.front_door.answer_log.redis_store`, its address read from the replica's
environment) and the background answers this replica generates (:mod:`.background`). Built once
per replica, beside its front door's core. Stopping and forgetting an answer (a Responses API
background answer, a kept gRPC answer) is done here once, for the HTTP routes and the gRPC calls.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from serve_app.config import ResponsesStoreConfig
from serve_app.errors import APIError
from serve_app.front_door.admission.echoed import check_responses_echoed, names_stored
from serve_app.front_door.answer_log.follow import CANCELLED, finish
from serve_app.front_door.answer_log.history import PARAM, previous_not_found, with_history
from serve_app.front_door.answer_log.memory_store import MemoryStore
from serve_app.front_door.answer_log.store import ResponseStore, StoredResponse
from serve_app.front_door.core.background import BackgroundAnswers

CANCEL_WAIT_S = 5.0  # longest a cancel waits for the answer's replica to end it
CANCEL_POLL_S = 0.05


@dataclass
class StoredResponses:
    """A replica's response store (``patient``: as running answers and their followers call it,
    waiting out an outage) and the background answers it generates."""

    store: ResponseStore
    patient: ResponseStore
    background: BackgroundAnswers
    lease_s: float

    @classmethod
    def from_config(cls, config: ResponsesStoreConfig) -> StoredResponses:
        """The store the config names, its address read from this replica's environment."""
        store: ResponseStore
        patient: ResponseStore
        if config.redis is None:
            store = patient = MemoryStore(config.ttl_s, config.max_per_key, config.max_bytes_per_key)  # (never down)
        else:
            from serve_app.front_door.answer_log.patient import PatientStore
            from serve_app.front_door.answer_log.redis_client import connect
            from serve_app.front_door.answer_log.redis_store import RedisStore

            where = "in Redis, through its Sentinels" if config.redis.sentinel_master else "in Redis"
            max_wait_s = config.redis.timeout_s / 2  # (a read's block, well within the read timeout)
            client = connect(config.redis)
            store = RedisStore(client, config.ttl_s, config.max_per_key, where, max_wait_s, config.max_bytes_per_key)
            patient = PatientStore(store, config.redis.ride_through_s)
        background = BackgroundAnswers(
            store, config.max_background_per_replica, config.lease_s, config.max_waiting_per_key
        )
        return cls(store, patient, background, config.lease_s)

    def expand(self, owner: str) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]:
        """Admission's ``expand`` for a request of ``owner``: its previous response's conversation
        first (its id, and what the response would echo, held to their bounds before the store is asked)."""

        async def expanded(fields: dict[str, Any]) -> dict[str, Any]:
            check_responses_echoed(fields)
            previous_id = fields.get(PARAM)
            if isinstance(previous_id, str) and not names_stored(previous_id):
                raise previous_not_found(previous_id)  # (stored nowhere: the store is not asked)
            return await with_history(fields, self.store, owner)

        return expanded

    async def close(self) -> None:
        await self.background.close()
        await self.store.close()

    async def cancel(self, found: StoredResponse) -> StoredResponse | None:
        """Stop a background answer wherever it is generated: by its replica (asked through the
        store's cancel channel), or here when its replica is gone; the answer once it ended (None: it
        was deleted meanwhile; 504 ``cancel_timeout`` when its replica did not end it in time)."""
        response_id, owner = str(found.response["id"]), found.owner
        if found.finished:
            return found
        if await self.store.leased(response_id):
            await self.background.cancel(response_id)
        else:  # its replica is gone: nobody else will end it
            written = len(await self.store.read(response_id, -1, 0))
            await finish(self.store, found.response, written, None, CANCELLED)
        now: StoredResponse | None = found
        try:
            async with asyncio.timeout(CANCEL_WAIT_S):
                while now is not None and not now.finished:
                    await asyncio.sleep(CANCEL_POLL_S)  # the store's state is polled: no event says it changed
                    now = await self.store.load(response_id, owner)
        except TimeoutError:
            raise APIError(
                504,
                f"the replica generating {response_id!r} did not confirm the cancel within {CANCEL_WAIT_S:g} s",
                code="cancel_timeout",
            ) from None
        return now

    async def delete(self, found: StoredResponse) -> None:
        """Forget a response and its log (a background answer still generated is stopped first)."""
        response_id = str(found.response["id"])
        if found.background and not found.finished:
            await self.background.cancel(response_id)
        await self.store.delete(response_id)
