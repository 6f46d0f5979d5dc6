"""The Redis client of the response store: its address, password, timeouts and retries.

Every call has a deadline (``timeout_s`` to connect, to read and to write); a connection idle for
:data:`HEALTH_CHECK_S` is PINGed before it is used again, and TCP keepalive finds a peer that
vanished without a word (a node's loss). A call that fails on the connection is retried
:data:`RETRIES` times with backoff (about a second in all), on a new connection, which with
``sentinel_master`` asks the Sentinels for the primary again: the retry that finds a promoted
primary. Past that the store says it is down (:class:`~.store.StoreDown`); what waits longer is
the running answers' business (:mod:`.patient`).

Runs in each model replica.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from redis import asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from serve_app.config import RedisStoreConfig

HEALTH_CHECK_S = 10  # a connection idle this long is PINGed before its next command
RETRIES = 4  # a failed call's retries, with jittered backoff from 50 ms, at most 500 ms apart


class StoreUnavailable(RuntimeError):
    """The configured store cannot be used (its address is not in the replica's environment)."""


def options(config: RedisStoreConfig) -> dict[str, Any]:
    """The keyword arguments of every connection the store opens (to Redis, or to a Sentinel)."""
    return {
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.timeout_s,
        "socket_keepalive": True,
        "health_check_interval": HEALTH_CHECK_S,
        "retry": Retry(ExponentialWithJitterBackoff(cap=0.5, base=0.05), RETRIES),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }


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
        return aioredis.Redis.from_url(url, password=password, **options(config))
    from redis.asyncio.connection import parse_url
    from redis.asyncio.sentinel import Sentinel

    sentinel = parse_url(url)
    sentinels = Sentinel(
        [(sentinel.get("host", "localhost"), int(sentinel.get("port", 26379)))],
        sentinel_kwargs={"password": password} | options(config),
        password=password,
        **options(config),
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
