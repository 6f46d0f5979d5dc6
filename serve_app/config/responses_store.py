"""The ``ingress.responses_store`` section: where stored responses and background answers live, and their bounds.

Runs in the application's build, which validates the config; the replicas hold what it validated.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from serve_app.config.base import StrictModel


class RedisStoreConfig(StrictModel):
    """The Redis that holds stored responses and background answers' event logs for every replica.

    Read in each replica from its environment (a Kubernetes Secret fills it): a replica whose
    variable is unset does not start, so a configured store never silently means none.
    """

    url_env: str = Field(
        default="RESPONSES_STORE_URL",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of an environment variable holding the Redis URL, redis://host:port/db (with "
        "sentinel_master set: a Sentinel's URL, redis://host:26379).",
    )
    password_env: str | None = Field(
        default="RESPONSES_STORE_PASSWORD",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of an environment variable holding Redis's password (and the Sentinels'); null: none, "
        "or password_file.",
    )
    password_file: str | None = Field(
        default=None,
        min_length=1,
        description="Path of a file holding Redis's password (a mounted Secret), read as the replica starts; "
        "set password_env to null with it.",
    )
    sentinel_master: str | None = Field(
        default=None,
        min_length=1,
        description="The name the Sentinels know the primary by: the URL names a Sentinel, which is asked for "
        "the primary and, after a failover, for the new one.",
    )
    timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=60,
        description="Longest a connection to Redis (or a Sentinel) may take to open, and a call to be written "
        "or answered; a failed call is retried on a new connection for about a second more, then the store "
        "is down for that call (503 store_unavailable, Retry-After).",
    )
    ride_through_s: float = Field(
        default=30.0,
        ge=0,
        description="How long a running background or kept answer's writes, and its followers' reads, wait "
        "for a Redis that stopped answering (a Sentinel failover: the Sentinels' down-after, 5 s as shipped, "
        "then an election) before the answer or the follower ends with store_unavailable.",
    )

    @model_validator(mode="after")
    def _one_password(self) -> RedisStoreConfig:
        if self.password_env is not None and self.password_file is not None:
            raise ValueError("set at most one of 'password_env' and 'password_file'")
        return self


class ResponsesStoreConfig(StrictModel):
    """Where the Responses API keeps stored responses (``store``, ``previous_response_id``, ``GET
    /v1/responses/{id}``) and background answers' event logs (docs/api-behaviour.md, "Where answers live")."""

    redis: RedisStoreConfig | None = Field(
        default=None,
        description="Unset: each replica keeps them in its own memory, which only a model deployment of one "
        "replica may do (the config is refused otherwise: a GET could reach a replica that holds nothing).",
    )
    ttl_s: float = Field(
        default=86_400.0,
        gt=0,
        description="How long a stored response and its event log are kept after they last changed (a "
        "background answer being generated is kept while its replica renews its lease).",
    )
    max_per_key: int = Field(
        default=1000,
        ge=1,
        description="Most stored responses one API key (or, without keys, all clients together) keeps; "
        "a new one past it removes the key's oldest (never one being generated).",
    )
    max_bytes_per_key: int = Field(
        default=64 << 20,
        ge=1 << 20,
        description="Most bytes one API key's stored responses take (their objects and input items as JSON, "
        "their answers' events), counted at each write: past it the key's own oldest go (never one being "
        "generated, never another key's); a response past it on its own is refused, 413 response_too_large. "
        "docs/operations.md sizes Redis's memory from it.",
    )
    max_background_per_replica: int = Field(
        default=64,
        ge=1,
        description="Most background answers (and stored gRPC answers) one replica holds at once, running or "
        "waiting for their key's place; past it, 429 background_limit. A running one holds a generation place "
        "of the replica and its key's place for its whole life, as a request does.",
    )
    max_waiting_per_key: int = Field(
        default=16,
        ge=0,
        description="Background answers of one API key that wait on one replica, queued, for a place of their "
        "key (past rate_limits.max_concurrent_requests) or of the replica; each runs once one is free, in the "
        "order they came. Past it, 429 background_queue_full.",
    )
    lease_s: float = Field(
        default=10.0,
        gt=0,
        description="A background answer's replica renews its lease every third of this; a reader that finds "
        "the lease lapsed ends the answer failed, with an error event every reader sees.",
    )
