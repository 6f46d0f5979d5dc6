"""The Redis response store: stored responses and event logs every replica reads, in production.

Keys, all under ``responses:`` and all expiring ``ttl_s`` after their last change:

- ``responses:<id>``: a hash of the response object (JSON), its owner, whether it is a
  background answer, and the input items its answer followed (JSON);
- ``responses:<id>:events``: the event log, a Redis Stream whose entry ids are
  ``0-<sequence_number + 1>``, so Redis itself refuses a number taken twice (``XADD`` with an id
  not above the last) and ``XREAD`` from ``0-<n + 1>`` is "after event ``n``", waiting for the
  tail (``BLOCK``);
- ``responses:<id>:lease``: set for ``lease_s`` by the producing replica, renewed while it lives;
- ``responses:owner:<owner>``: the owner's responses by creation time, for its count bound;
- ``responses:owner:<owner>:bytes``: each of the owner's responses' bytes and their total, for its
  byte bound (:mod:`.redis_scripts`: past either bound the owner's own oldest go).

An append and a status update are Lua scripts, each one step for Redis: an append is refused
when the answer is gone or its number is another event's (the same event again, a retried call's,
is taken as done), and a status never goes back (:mod:`.store`). A Sentinel failover can lose the
last writes the old primary acknowledged (Redis replicates after it answers): an append that
finds its log shorter than the writer left it writes the missing events again from the tail this
writer keeps of each log it writes (:data:`TAIL_EVENTS`), so readers get every event once, in
order. A cancel is published on ``responses:cancel``; every replica listens, and the one generating
the answer stops it. The client, its timeouts and retries: :mod:`.redis_client`; a call that
fails past them raises :class:`~.store.StoreDown`.

Runs in each model replica.
"""

from __future__ import annotations

import functools
import json
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from redis import asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from serve_app.front_door.answer_log.redis_scripts import APPEND, DELETE, PREFIX, SAVE, UPDATE
from serve_app.front_door.answer_log.store import StoredResponse, is_terminal, store_down, store_full, too_large

CANCEL_CHANNEL = PREFIX + "cancel"
TAIL_EVENTS = 256  # the last events of each log this replica writes, kept to write again after a failover
TAILS = 256  # logs whose tails are kept (the most recently written)
LISTEN_WAIT_S = 1.0  # the cancel listener's longest wait for a message, its connection checked meanwhile

P = ParamSpec("P")
T = TypeVar("T")
Method = Callable[Concatenate["RedisStore", P], Coroutine[Any, Any, T]]


def store_call(method: Method[P, T]) -> Method[P, T]:
    """A store method whose Redis did not answer (after the client's retries) raises StoreDown."""

    @functools.wraps(method)
    async def call(self: RedisStore, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await method(self, *args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise store_down(exc) from exc
        except ResponseError as exc:
            if str(exc).startswith("OOM"):  # Redis at its maxmemory (noeviction: it evicts nothing)
                raise store_full() from exc
            raise

    return call


class RedisStore:
    """Stored responses and event logs in Redis (the module's docstring)."""

    def __init__(
        self,
        client: aioredis.Redis,
        ttl_s: float,
        max_per_key: int,
        where: str = "in Redis",
        max_wait_s: float = 1.0,
        max_bytes_per_key: int = 64 << 20,
    ) -> None:
        # (redis-py types its commands for its sync and async clients at once: Any here)
        self.redis: Any = client
        self.ttl_ms = int(ttl_s * 1000)
        self.max_per_key = max_per_key
        self.max_bytes_per_key = max_bytes_per_key
        self.where = where
        self.max_wait_s = max_wait_s  # a read's longest block: below the client's read timeout
        self._save, self._append, self._update, self._delete = (
            client.register_script(script) for script in (SAVE, APPEND, UPDATE, DELETE)
        )
        self._tails: OrderedDict[str, deque[tuple[int, str]]] = OrderedDict()

    @property
    def _bounds(self) -> list[int]:
        return [self.max_per_key, self.max_bytes_per_key]

    @store_call
    async def save(
        self, response_id: str, owner: str, response: dict[str, Any], input_items: list[Any], background: bool
    ) -> None:
        fields = [json.dumps(response), "1" if background else "", json.dumps(input_items)]
        args: list[str | float] = [response_id, owner, *fields, self.ttl_ms, time.time(), *self._bounds]
        saved = await self._save(keys=[PREFIX + response_id], args=args)
        if saved == 0:
            raise too_large(len(fields[0]) + len(fields[2]), self.max_bytes_per_key)
        if saved < 0:
            raise store_full()

    @store_call
    async def update(self, response_id: str, response: dict[str, Any]) -> bool:
        key = PREFIX + response_id
        args: list[str | int] = [response_id, json.dumps(response), str(response.get("status")), self.ttl_ms]
        args += self._bounds
        return bool(await self._update(keys=[key, key + ":events"], args=args))

    @store_call
    async def load(self, response_id: str, owner: str) -> StoredResponse | None:
        found = await self.redis.hmget(PREFIX + response_id, ["response", "owner", "background"])
        response, stored_owner, background = found
        if response is None or stored_owner is None or stored_owner.decode() != owner:
            return None
        return StoredResponse(json.loads(response), owner, bool(background))

    @store_call
    async def input_items(self, response_id: str) -> list[Any]:
        found = await self.redis.hget(PREFIX + response_id, "input")
        return json.loads(found) if found is not None else []

    @store_call
    async def exists(self, response_id: str) -> bool:
        return bool(await self.redis.exists(PREFIX + response_id))

    @store_call
    async def delete(self, response_id: str) -> None:
        self._tails.pop(response_id, None)
        await self._delete(keys=[PREFIX + response_id], args=[response_id])

    @store_call
    async def append(self, response_id: str, sequence_number: int, event: str) -> bool:
        done = await self._append_one(response_id, sequence_number, event)
        if done[0] == 2:  # the log lost its last events (a failover): this writer writes them again
            done = await self._heal(response_id, done[1], sequence_number, event)
        if done[0] != 1 or is_terminal(event):
            self._tails.pop(response_id, None)
            return done[0] == 1
        tail = self._tails.setdefault(response_id, deque(maxlen=TAIL_EVENTS))
        tail.append((sequence_number, event))
        self._tails.move_to_end(response_id)
        while len(self._tails) > TAILS:
            self._tails.popitem(last=False)
        return True

    async def _heal(self, response_id: str, logged: int, sequence_number: int, event: str) -> list[int]:
        """Append the events after ``logged`` up to ``event`` from this writer's tail (refused: not all there)."""
        tail = dict(self._tails.get(response_id, ()))
        for number in range(logged + 1, sequence_number):
            if number not in tail or (await self._append_one(response_id, number, tail[number]))[0] != 1:
                return [0]
        return await self._append_one(response_id, sequence_number, event)

    async def _append_one(self, response_id: str, sequence_number: int, event: str) -> list[int]:
        key = PREFIX + response_id
        args: list[str | int] = [response_id, sequence_number, event, self.ttl_ms, *self._bounds]
        found = await self._append(keys=[key, key + ":events"], args=args)
        return [int(value) for value in found]

    @store_call
    async def read(self, response_id: str, after: int, wait_s: float) -> list[tuple[int, str]]:
        log = f"{PREFIX}{response_id}:events"
        block = max(1, int(min(wait_s, self.max_wait_s) * 1000))
        found = await self.redis.xread({log: f"0-{after + 1}"}, block=block)
        if not found:
            return []
        ((_, entries),) = found
        return [(int(entry_id.split(b"-")[1]) - 1, fields[b"e"].decode()) for entry_id, fields in entries]

    @store_call
    async def renew_lease(self, response_ids: list[str], lease_s: float) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for response_id in response_ids:
                key = PREFIX + response_id
                pipe.set(key + ":lease", b"1", px=int(lease_s * 1000))
                pipe.pexpire(key, self.ttl_ms).pexpire(key + ":events", self.ttl_ms)  # kept while generated
            await pipe.execute()

    @store_call
    async def leased(self, response_id: str) -> bool:
        return bool(await self.redis.exists(f"{PREFIX}{response_id}:lease"))

    @store_call
    async def request_cancel(self, response_id: str) -> None:
        await self.redis.publish(CANCEL_CHANNEL, response_id)

    async def cancel_requests(self) -> AsyncIterator[str]:
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(CANCEL_CHANNEL)
            while True:  # (not listen(): it would read past the read timeout on a quiet channel)
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=LISTEN_WAIT_S)
                if message is not None and message.get("type") == "message":
                    yield message["data"].decode()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise store_down(exc) from exc
        finally:
            await pubsub.aclose()

    async def close(self) -> None:
        await self.redis.aclose()
