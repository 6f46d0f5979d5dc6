"""The Serve options of each deployment, decided from the config. Runs in the application's build.

The config describes (:mod:`serve_app.config`); this module decides what Serve is given, so a
reader finds each option where it is set. It imports neither vLLM nor the deployments' classes:
the build names the model deployment and its request router by import path (decision record 19).
"""

from __future__ import annotations

from typing import Any

from serve_app.config import ModelConfig, OpenCallsConfig, RateLimitsConfig
from serve_app.serve_internals import CONSISTENT_HASH_ROUTER

# The classes Serve imports in the processes that run them.
MODEL_SERVER = "serve_app.deployments.model_server.ModelServer"
PREFIX_ROUTER = "serve_app.routing.prefix_router:PrefixAffinityRouter"
# The model replica's health check only reads the engine's state, so it runs often. A replica
# whose engine died exits by itself (serve_app.engine.engine_watch); the check is the backstop.
MODEL_HEALTH_CHECKS: dict[str, Any] = {"health_check_period_s": 2, "health_check_timeout_s": 30}
# Requests a model replica takes past its generation limit (health, model list).
DIRECT_REQUESTS_HEADROOM = 64
# Past its drain, how long Serve lets a stopping ReplicaPicker close before killing it.
PICKER_STOP_MARGIN_S = 5.0
# Replicas of the RateLimiter unless the config says otherwise: one may die while the other answers.
LIMITER_REPLICAS = 2


def prefix_router_config(model: ModelConfig) -> dict[str, Any]:
    """The model deployment's ``request_router_config``: this app's prefix router and its settings."""
    routing = model.prefix_routing
    return {
        "request_router_class": PREFIX_ROUTER,
        "request_router_kwargs": {
            "model": model.name,
            "chat_template": model.engine_args.get("chat_template"),
            "max_load_gap": routing.max_load_gap,
            "block_chars": routing.block_chars,
            "max_blocks": routing.max_blocks,
        },
    }


def model_options(model: ModelConfig, longest_answer_s: float | None = None) -> dict[str, Any]:
    """The model's deployment options with the defaults this application relies on.

    ``max_ongoing_requests`` defaults to ``max_num_seqs``: a replica then
    runs as many requests as its engine batches at once (the autoscaler's unit).
    ``graceful_shutdown_timeout_s`` defaults to the longest answer allowed, so
    a replica being removed finishes every stream it has.
    """
    options = dict(model.deployment)
    options["max_ongoing_requests"] = model.runs_at_once()
    if longest_answer_s is not None and "graceful_shutdown_timeout_s" not in options:
        options["graceful_shutdown_timeout_s"] = longest_answer_s
    if model.prefix_routing.enabled:
        options["request_router_config"] = prefix_router_config(model)
    return options


def model_server_options(
    model: ModelConfig, longest_answer_s: float | None = None, open_calls: OpenCallsConfig | None = None
) -> dict[str, Any]:
    """Deployment options of the model replicas, which answer clients themselves.

    Serve's per-replica limit would hold ``/health`` and ``/v1/models`` behind
    generation and behind calls that stay open, so it is raised past the model's
    ``generation_limit`` and the open calls' ``max_per_replica``, which the replica's front door
    enforces itself (:mod:`serve_app.front_door.admission.capacity`,
    :mod:`serve_app.front_door.admission.open_calls`), by :data:`DIRECT_REQUESTS_HEADROOM` more;
    the engine queues past its batch.
    """
    options = model_options(model, longest_answer_s)
    limit = model.generation_limit()
    held_open = (open_calls or OpenCallsConfig()).max_per_replica
    options["max_ongoing_requests"] = (limit or options["max_ongoing_requests"]) + held_open + DIRECT_REQUESTS_HEADROOM
    options.pop("max_queued_requests", None)
    return {"name": model.deployment_name, **MODEL_HEALTH_CHECKS, **options}


def picker_options(drain_s: float) -> dict[str, Any]:
    """The ReplicaPicker's options with HAProxy. Serve pins its replicas to the nodes that run a
    proxy, ``RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE`` on each (Serve's default, one: two split
    the prefix tables, docs/architecture.md record 23), whatever ``num_replicas`` says, and each
    node's HAProxy asks its own. A ReplicaPicker Serve
    stops keeps answering as long as a model replica would (Serve drains only the ingress's
    replicas): an HAProxy process of the configuration before still sends the requests of its
    open keep-alive connections to it (docs/operations.md). (Without HAProxy, a bare ``serve
    run``, it is a one-replica deployment: a model replica that cannot ask it answers itself.)
    """
    return {"graceful_shutdown_wait_loop_s": drain_s, "graceful_shutdown_timeout_s": drain_s + PICKER_STOP_MARGIN_S}


def rate_limiter_options(limits: RateLimitsConfig) -> dict[str, Any]:
    """The RateLimiter's options: ``rate_limits.deployment`` over two replicas, each API key's calls
    sent to one of them by Ray's consistent-hash router (the front door names the key as the call's
    session id), so that each key's counts live in one place. With no fallback replica: a key's
    calls never split between two sets of counts; while its replica is gone, the front door's calls
    fail and it admits as it does when the limiter cannot be reached
    (:mod:`serve_app.front_door.admission.rate_limits`), until Serve's next list of replicas moves the key."""
    router = {"request_router_class": CONSISTENT_HASH_ROUTER, "request_router_kwargs": {"num_fallback_replicas": 0}}
    options = {"name": "rate-limiter", "num_replicas": LIMITER_REPLICAS, "request_router_config": router}
    return options | limits.deployment
