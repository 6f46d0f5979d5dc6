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
from functools import partial
from typing import Any

from serve_app.config import ResponsesStoreConfig
from serve_app.front_door.answer_log.history import with_history
from serve_app.front_door.answer_log.memory_store import MemoryStore
from serve_app.front_door.answer_log.store import ResponseStore
from serve_app.front_door.core.background import BackgroundAnswers


@dataclass
class StoredResponses:
    """A replica's response store and the background answers it generates."""

    store: ResponseStore
    background: BackgroundAnswers
    lease_s: float

    @classmethod
    def from_config(cls, config: ResponsesStoreConfig) -> StoredResponses:
        """The store the config names, its address read from this replica's environment."""
        store: ResponseStore
        if config.redis is None:
            store = MemoryStore(config.ttl_s, config.max_per_key)
        else:
            from serve_app.front_door.answer_log.redis_store import RedisStore, connect

            where = "in Redis, through its Sentinels" if config.redis.sentinel_master else "in Redis"
            store = RedisStore(connect(config.redis), config.ttl_s, config.max_per_key, where)
        background = BackgroundAnswers(
            store, config.max_background_per_replica, config.lease_s, config.max_waiting_per_key
        )
        return cls(store, background, config.lease_s)

    def expand(self, owner: str) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]:
        """Admission's ``expand`` for a request of ``owner``: its previous response's conversation first."""
        return partial(with_history, store=self.store, owner=owner)

    async def close(self) -> None:
        await self.background.close()
        await self.store.close()
