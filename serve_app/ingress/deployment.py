"""The ingress deployment: the Starlette app of :mod:`serve_app.ingress.routes`, served by Ray Serve.

It stays thin: validate, route, stream bytes through. It holds one
``DeploymentHandle`` per model deployment and answers ``GET /health`` from
Serve's own view of replica health (each model replica runs vLLM's engine
health check every ``health_check_period_s``), read in the background
(:mod:`serve_app.ingress.readiness`), so a health probe never waits on the controller
or queues behind generation requests.
"""

from __future__ import annotations

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from serve_app.config import AppConfig
from serve_app.ingress.auth import load_api_keys
from serve_app.ingress.deadlines import TimeLimits
from serve_app.ingress.rate_limits import KeyLimits
from serve_app.ingress.readiness import ReadinessWatch
from serve_app.ingress.router import ModelEntry, ModelRouter
from serve_app.ingress.routes import HTTPSettings, build_http_app, default_endpoints
from serve_app.observability import tracing
from serve_app.observability.metrics import ServingMetrics


def key_limits(config: AppConfig, rate_limiter: DeploymentHandle | None) -> KeyLimits | None:
    limits = config.ingress.rate_limits
    if limits is None or rate_limiter is None:
        return None
    return KeyLimits(rate_limiter, counts_tokens=limits.tokens_per_minute is not None)


@serve.deployment
@serve.ingress()
class Ingress:
    """Receives OpenAI-style HTTP requests and streams them to model replicas."""

    def __init__(
        self, config: AppConfig, handles: dict[str, DeploymentHandle], rate_limiter: DeploymentHandle | None = None
    ) -> None:
        tracing.configure_tracing()
        self.router = ModelRouter(
            {
                # Streaming handles, made once: every call is answered by a generator.
                m.name: ModelEntry(
                    m.name,
                    handles[m.name].options(stream=True),
                    m.engine_args.get("max_model_len"),
                    m.max_output_tokens,
                    simulated=m.simulated_engine is not None,
                )
                for m in config.models
            }
        )
        self.settings = HTTPSettings(
            max_request_body_bytes=config.ingress.max_request_body_bytes,
            body_timeout_s=config.ingress.body_timeout_s,
            max_n=config.ingress.max_n,
            time_limits=TimeLimits(
                request_timeout_s=config.ingress.request_timeout_s,
                first_token_timeout_s=config.ingress.first_token_timeout_s,
            ),
            unavailable_retry_s=config.ingress.unavailable_retry_s,
            # Read here, in the replica: the environment (or mounted file) is the node's, not the deployer's.
            api_keys=load_api_keys(config.ingress.api_keys),
            cors=config.ingress.cors,
            key_limits=key_limits(config, rate_limiter),
            metrics=ServingMetrics([m.name for m in config.models], [e.method for e in default_endpoints()]),
            log_requests=config.ingress.log_requests,
            log_content=config.ingress.log_content,
        )
        self.readiness = ReadinessWatch(
            serve.status,
            serve.get_replica_context().app_name,
            {m.name: m.deployment_name for m in config.models},
            max_age_s=config.ingress.health_max_age_s,
        )

    def __serve_build_asgi_app__(self) -> Starlette:
        return build_http_app(self.router, self.settings, self.readiness)
