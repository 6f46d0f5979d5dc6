"""The response stores the front door's tests run on: the in-process one and a real Redis (Debian's
redis-server, as production's store is one), reached by the client the replicas build."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from redis import asyncio as aioredis

from serve_app.config import RedisStoreConfig
from serve_app.front_door.answer_log.memory_store import MemoryStore
from serve_app.front_door.answer_log.redis_client import options
from serve_app.front_door.answer_log.redis_store import RedisStore
from serve_app.front_door.answer_log.store import ResponseStore
from tools.local_redis import LocalRedis


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory) -> Iterator[LocalRedis]:
    server = LocalRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(params=["memory", "redis"])
async def make_store(request, redis_server) -> AsyncIterator:
    """Builds a store of the parameter's kind with the given expiry and bounds per owner."""
    made: list[ResponseStore] = []

    def make(ttl_s: float = 60.0, max_per_key: int = 100, max_bytes_per_key: int = 1 << 20) -> ResponseStore:
        if request.param == "memory":
            store: ResponseStore = MemoryStore(ttl_s, max_per_key, max_bytes_per_key)
        else:
            shipped = options(RedisStoreConfig())  # (the replicas' timeouts, keepalive and retries)
            client = aioredis.Redis(port=redis_server.port, password=redis_server.password, **shipped)
            store = RedisStore(client, ttl_s, max_per_key, max_bytes_per_key=max_bytes_per_key)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()
