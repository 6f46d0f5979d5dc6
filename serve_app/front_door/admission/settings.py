"""IngressSettings: what every generation request is held to, whichever protocol brought it.

Built once per model replica from the serve config
(:class:`serve_app.deployments.model_server.ModelServer`) and read by both front doors:
the HTTP routes (:mod:`serve_app.front_door.http_api.app`) and the gRPC service
(:mod:`serve_app.front_door.grpc_api.service`).

Runs in each model replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.config import AppConfig, CORSConfig, GRPCStreamConfig
from serve_app.front_door.admission.auth import APIKeys, load_api_keys
from serve_app.front_door.admission.capacity import GenerationSlots
from serve_app.front_door.admission.deadlines import TimeLimits
from serve_app.front_door.admission.endpoints import default_endpoints
from serve_app.front_door.admission.large_bodies import BodyChecker
from serve_app.front_door.admission.rate_limits import KeyLimits, LimiterHandle
from serve_app.front_door.admission.request_cost import CostLimits
from serve_app.front_door.core.stored import StoredResponses
from serve_app.front_door.telemetry.metrics import ServingMetrics
from serve_app.front_door.telemetry.record import Observer, RequestObserver
from serve_app.front_door.telemetry.request_log import log_request


@dataclass(frozen=True)
class IngressSettings:
    max_request_body_bytes: int
    time_limits: TimeLimits
    body_timeout_s: float = 30.0  # longest a client may take to send its body
    costs: CostLimits = CostLimits()  # what one request may cost the engine
    # How long a request that no replica has started is sent again while replicas
    # answer "unavailable" (an engine died, a replica is going away).
    unavailable_retry_s: float = 30.0
    api_keys: APIKeys | None = None  # None: no key needed
    key_limits: KeyLimits | None = None  # None: no per-key rate limits
    isolate_prefix_cache: bool = False  # each key's prompts cached apart (serve_app.front_door.admission.cache_salt)
    cors: CORSConfig | None = None  # None: no cross-origin requests from browsers
    grpc_stream: GRPCStreamConfig = GRPCStreamConfig()  # the bounds of a multiplexed gRPC call
    # Told of every generation request as it moves and when it ends (ServingMetrics in a replica).
    metrics: RequestObserver | None = None
    log_requests: bool = True  # one structured line per generation request
    log_content: bool = False  # ... with the prompt and the completion in it
    # The generation requests this model replica holds, queued ones included, shared by both
    # front doors (serve_app.front_door.admission.capacity); None: unbounded.
    generation_slots: GenerationSlots | None = None
    # The Responses API's stored responses and background answers; None: none are stored.
    stored_responses: StoredResponses | None = None
    # Bodies over 256 KiB are checked in this process's checker process, whichever door brought them.
    body_checker: BodyChecker = field(default_factory=BodyChecker)

    def observers(self) -> list[Observer]:
        """Who is told of each request once it has ended: its key's limits (its place back), the
        metrics, then the log line."""
        observers: list[Observer] = [self.key_limits.request_ended] if self.key_limits is not None else []
        observers += [self.metrics.ended] if self.metrics is not None else []
        return observers + ([log_request] if self.log_requests else [])


def key_limits(config: AppConfig, rate_limiter: LimiterHandle | None) -> KeyLimits | None:
    limits = config.ingress.rate_limits
    if limits is None or rate_limiter is None:
        return None
    return KeyLimits(
        rate_limiter,
        counts_tokens=limits.tokens_per_minute is not None,
        max_concurrent=limits.max_concurrent_requests,
    )


def ingress_settings(config: AppConfig, rate_limiter: LimiterHandle | None) -> IngressSettings:
    """The settings of the model replica that answers clients, read from the serve config in that replica."""
    return IngressSettings(
        max_request_body_bytes=config.ingress.max_request_body_bytes,
        body_timeout_s=config.ingress.body_timeout_s,
        costs=CostLimits.from_config(config.ingress),
        time_limits=TimeLimits(
            request_timeout_s=config.ingress.request_timeout_s,
            first_token_timeout_s=config.ingress.first_token_timeout_s,
        ),
        unavailable_retry_s=config.ingress.unavailable_retry_s,
        # Read here, in the replica: the environment (or mounted file) is the node's, not the deployer's.
        api_keys=load_api_keys(config.ingress.api_keys),
        cors=config.ingress.cors,
        grpc_stream=config.ingress.grpc_stream,
        key_limits=key_limits(config, rate_limiter),
        isolate_prefix_cache=config.ingress.isolates_prefix_cache,
        metrics=ServingMetrics([m.name for m in config.models], [e.method for e in default_endpoints()]),
        log_requests=config.ingress.log_requests,
        log_content=config.ingress.log_content,
        stored_responses=StoredResponses.from_config(config.ingress.responses_store),
    )
