"""The Redis response store: stored responses and event logs every replica reads, in production.

Keys, all under ``responses:`` and all expiring ``ttl_s`` after their last change:

- ``responses:<id>``: a hash of the response object (JSON), its owner, whether it is a
  background answer, and the input items its answer followed (JSON);
- ``responses:<id>:events``: the event log, a Redis Stream whose entry ids are
  ``0-<sequence_number + 1>``, so Redis itself refuses a number taken twice (``XADD`` with an id
  not above the last) and ``XREAD`` from ``0-<n + 1>`` is "after event ``n``", waiting for the
  tail (``BLOCK``);
- ``responses:<id>:lease``: set for ``lease_s`` by the producing replica, renewed while it lives;
- ``responses:owner:<owner>``: the owner's responses by creation time, for the count bound.

A cancel is published on ``responses:cancel``; every replica listens, and the one generating
the answer stops it. With ``sentinel_master`` the client asks the Sentinels for the primary, and
again after a failover.

Runs in each model replica.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from redis import asyncio as aioredis
from redis.exceptions import ResponseError

from serve_app.config import RedisStoreConfig
from serve_app.front_door.answer_log.store import StoredResponse

logger = logging.getLogger("ray.serve")

PREFIX = "responses:"
CANCEL_CHANNEL = PREFIX + "cancel"


class StoreUnavailable(RuntimeError):
    """The configured store cannot be used (its address is not in the replica's environment)."""


def connect(config: RedisStoreConfig) -> aioredis.Redis:
    """A client of the configured Redis, its address and password read from this replica's environment."""
    url = os.environ.get(config.url_env, "")
    if not url:
        raise StoreUnavailable(
            f"ingress.responses_store.redis names the environment variable {config.url_env} for Redis's URL, "
            "and it is not set in this replica"
        )
    password = password_of(config)
    if config.sentinel_master is None:
        return aioredis.Redis.from_url(url, password=password)
    from redis.asyncio.connection import parse_url
    from redis.asyncio.sentinel import Sentinel

    sentinel = parse_url(url)
    sentinels = Sentinel(
        [(sentinel.get("host", "localhost"), int(sentinel.get("port", 26379)))],
        sentinel_kwargs={"password": password},
        password=password,
    )
    return sentinels.master_for(config.sentinel_master)


def password_of(config: RedisStoreConfig) -> str | None:
    """Redis's password, from the file or the environment variable the config names (None: none)."""
    if config.password_file is not None:
        try:
            return Path(config.password_file).read_text().strip() or None
        except OSError as exc:
            raise StoreUnavailable(f"ingress.responses_store.redis.password_file cannot be read: {exc}") from None
    return (os.environ.get(config.password_env) or None) if config.password_env is not None else None


class RedisStore:
    """Stored responses and event logs in Redis (the module's docstring)."""

    def __init__(self, client: aioredis.Redis, ttl_s: float, max_per_key: int, where: str = "in Redis") -> None:
        # (redis-py types its commands for its sync and async clients at once: Any here)
        self.redis: Any = client
        self.ttl_ms = int(ttl_s * 1000)
        self.max_per_key = max_per_key
        self.where = where

    async def save(
        self, response_id: str, owner: str, response: dict[str, Any], input_items: list[Any], background: bool
    ) -> None:
        key, owned = PREFIX + response_id, f"{PREFIX}owner:{owner}"
        fields = {
            "response": json.dumps(response),
            "owner": owner,
            "background": "1" if background else "",
            "input": json.dumps(input_items),
        }
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping=fields).pexpire(key, self.ttl_ms)
            pipe.zadd(owned, {response_id: time.time()}).pexpire(owned, self.ttl_ms)
            pipe.zcard(owned)
            *_, count = await pipe.execute()
        if count > self.max_per_key:  # the owner's oldest go
            oldest = await self.redis.zpopmin(owned, count - self.max_per_key)
            for old_id, _ in oldest:
                await self.delete(old_id.decode())

    async def update(self, response_id: str, response: dict[str, Any]) -> None:
        key = PREFIX + response_id
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, "response", json.dumps(response)).pexpire(key, self.ttl_ms)
            pipe.pexpire(key + ":events", self.ttl_ms)
            await pipe.execute()

    async def load(self, response_id: str, owner: str) -> StoredResponse | None:
        found = await self.redis.hmget(PREFIX + response_id, ["response", "owner", "background"])
        response, stored_owner, background = found
        if response is None or stored_owner is None or stored_owner.decode() != owner:
            return None
        return StoredResponse(json.loads(response), owner, bool(background))

    async def input_items(self, response_id: str) -> list[Any]:
        found = await self.redis.hget(PREFIX + response_id, "input")
        return json.loads(found) if found is not None else []

    async def exists(self, response_id: str) -> bool:
        return bool(await self.redis.exists(PREFIX + response_id))

    async def delete(self, response_id: str) -> None:
        key = PREFIX + response_id
        await self.redis.delete(key, key + ":events", key + ":lease")

    async def append(self, response_id: str, sequence_number: int, event: str) -> bool:
        log = f"{PREFIX}{response_id}:events"
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(log, {"e": event}, id=f"0-{sequence_number + 1}").pexpire(log, self.ttl_ms)
                await pipe.execute()
        except ResponseError as exc:  # the number was taken (Redis: "equal or smaller than the target")
            if "equal or smaller" in str(exc):
                return False
            raise
        return True

    async def read(self, response_id: str, after: int, wait_s: float) -> list[tuple[int, str]]:
        log = f"{PREFIX}{response_id}:events"
        found = await self.redis.xread({log: f"0-{after + 1}"}, block=max(1, int(wait_s * 1000)))
        if not found:
            return []
        ((_, entries),) = found
        return [(int(entry_id.split(b"-")[1]) - 1, fields[b"e"].decode()) for entry_id, fields in entries]

    async def renew_lease(self, response_ids: list[str], lease_s: float) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for response_id in response_ids:
                key = PREFIX + response_id
                pipe.set(key + ":lease", b"1", px=int(lease_s * 1000))
                pipe.pexpire(key, self.ttl_ms).pexpire(key + ":events", self.ttl_ms)  # kept while generated
            await pipe.execute()

    async def leased(self, response_id: str) -> bool:
        return bool(await self.redis.exists(f"{PREFIX}{response_id}:lease"))

    async def request_cancel(self, response_id: str) -> None:
        await self.redis.publish(CANCEL_CHANNEL, response_id)

    async def cancel_requests(self) -> AsyncIterator[str]:
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(CANCEL_CHANNEL)
        try:
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    yield message["data"].decode()
        finally:
            await pubsub.aclose()

    async def close(self) -> None:
        await self.redis.aclose()
