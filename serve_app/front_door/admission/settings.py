"""IngressSettings: what every generation request is held to, whichever protocol brought it.

Read once per model replica from the serve config's ``ingress`` section
(:func:`ingress_settings`). Settings only: the services that apply them (API keys, the key's
limits, the checker, the replica's places, the answer log) live on the front door's core
(:class:`serve_app.front_door.core.front_door.FrontDoor`).

Runs in each model replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.config import AppConfig, CORSConfig, GRPCStreamConfig, OpenCallsConfig
from serve_app.front_door.admission.deadlines import TimeLimits
from serve_app.front_door.admission.request_cost import CostLimits


@dataclass(frozen=True)
class IngressSettings:
    max_request_body_bytes: int
    time_limits: TimeLimits
    body_timeout_s: float = 30.0  # longest a client may take to send its body
    costs: CostLimits = CostLimits()  # what one request may cost the engine
    # How long a request that no replica has started is sent again while replicas
    # answer "unavailable" (an engine died, a replica is going away).
    unavailable_retry_s: float = 30.0
    sse_keepalive_s: float | None = None  # a stream not yet begun gets a keep-alive this often (None: never)
    stream_stall_timeout_s: float | None = None  # the stall watchdog's bound (None: no watchdog)
    isolate_prefix_cache: bool = False  # each key's prompts cached apart (serve_app.front_door.admission.cache_salt)
    cors: CORSConfig | None = None  # None: no cross-origin requests from browsers
    grpc_stream: GRPCStreamConfig = GRPCStreamConfig()  # the bounds of a multiplexed gRPC call
    open_calls: OpenCallsConfig = OpenCallsConfig()  # calls that stay open without generating
    log_requests: bool = True  # one structured line per generation request
    log_content: bool = False  # ... with the prompt and the completion in it


def ingress_settings(config: AppConfig) -> IngressSettings:
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
        sse_keepalive_s=config.ingress.sse_keepalive_s,
        stream_stall_timeout_s=config.ingress.stream_stall_timeout_s,
        cors=config.ingress.cors,
        grpc_stream=config.ingress.grpc_stream,
        open_calls=config.ingress.open_calls,
        isolate_prefix_cache=config.ingress.isolates_prefix_cache,
        log_requests=config.ingress.log_requests,
        log_content=config.ingress.log_content,
    )
