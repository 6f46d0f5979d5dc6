"""IngressSettings: what every generation request is held to, whichever protocol brought it.

Built once per ingress replica from the serve config
(:class:`serve_app.ingress.deployment.Ingress`) and read by both front doors:
the HTTP routes (:mod:`serve_app.ingress.routes`) and the gRPC service
(:mod:`serve_app.grpc_api.service`).
"""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.config import CORSConfig
from serve_app.ingress.auth import APIKeys
from serve_app.ingress.deadlines import TimeLimits
from serve_app.ingress.rate_limits import KeyLimits
from serve_app.observability.record import Observer, RequestObserver
from serve_app.observability.request_log import log_request


@dataclass(frozen=True)
class IngressSettings:
    max_request_body_bytes: int
    time_limits: TimeLimits
    body_timeout_s: float = 30.0  # longest a client may take to send its body
    max_n: int = 8  # most choices one request may ask for
    # How long a request that no replica has started is sent again while replicas
    # answer "unavailable" (an engine died, a replica is going away).
    unavailable_retry_s: float = 30.0
    api_keys: APIKeys | None = None  # None: no key needed
    key_limits: KeyLimits | None = None  # None: no per-key rate limits
    cors: CORSConfig | None = None  # None: no cross-origin requests from browsers
    # Told of every generation request as it moves and when it ends (ServingMetrics in a replica).
    metrics: RequestObserver | None = None
    log_requests: bool = True  # one structured line per generation request
    log_content: bool = False  # ... with the prompt and the completion in it

    def observers(self) -> list[Observer]:
        """Who is told of each request once it has ended: the metrics, then the log line."""
        observers: list[Observer] = [self.metrics.ended] if self.metrics is not None else []
        return observers + ([log_request] if self.log_requests else [])
