"""StoredResponses: what one model replica holds of the Responses API's store.

The store the config names (:mod:`serve_app.front_door.answer_log.memory_store` or
:mod:`serve_app.front_door.answer_log.redis_store`, its address read from the replica's
environment) and the background answers this replica generates (:mod:`.background`). Built once
per replica, beside its front door's core.

Runs in each model replica.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from serve_app.config import ResponsesStoreConfig
from serve_app.front_door.admission.echoed import check_responses_echoed
from serve_app.front_door.answer_log.history import with_history
from serve_app.front_door.answer_log.memory_store import MemoryStore
from serve_app.front_door.answer_log.store import ResponseStore
from serve_app.front_door.core.background import BackgroundAnswers


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
            return await with_history(fields, self.store, owner)

        return expanded

    async def close(self) -> None:
        await self.background.close()
        await self.store.close()
