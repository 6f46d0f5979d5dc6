"""The ingress deployment: the Starlette app of :mod:`serve_app.ingress.routes` and the gRPC
service of :mod:`serve_app.grpc_api.service`, served by Ray Serve's HTTP and gRPC proxies.

It stays thin: validate, route, stream bytes through. It holds one
``DeploymentHandle`` per model deployment and answers ``GET /health`` from
Serve's own view of replica health (each model replica runs vLLM's engine
health check every ``health_check_period_s``), read in the background
(:mod:`serve_app.ingress.readiness`), so a health probe never waits on the controller
or queues behind generation requests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from serve_app.config import AppConfig
from serve_app.grpc_api import generation_pb2 as pb
from serve_app.grpc_api.service import GenerationService, GRPCContext
from serve_app.ingress.admission import default_endpoints
from serve_app.ingress.auth import load_api_keys
from serve_app.ingress.deadlines import TimeLimits
from serve_app.ingress.rate_limits import KeyLimits
from serve_app.ingress.readiness import ReadinessWatch
from serve_app.ingress.router import ModelEntry, ModelRouter
from serve_app.ingress.routes import build_http_app
from serve_app.ingress.settings import IngressSettings
from serve_app.observability import tracing
from serve_app.observability.metrics import ServingMetrics

# The model deployments' request router (prefix routing) is built on Serve's router thread,
# and it renders prompts with transformers. Imported here first, on the replica's main thread:
# transformers' lazy modules imported from two threads at once fail (ImportError in vLLM's own
# import of transformers, seen at the ingress's start).
from serve_app.prefix_routing import router as _prefix_router  # noqa: F401


def key_limits(config: AppConfig, rate_limiter: DeploymentHandle | None) -> KeyLimits | None:
    limits = config.ingress.rate_limits
    if limits is None or rate_limiter is None:
        return None
    return KeyLimits(rate_limiter, counts_tokens=limits.tokens_per_minute is not None)


@serve.deployment
@serve.ingress()
class Ingress:
    """Receives OpenAI-style HTTP requests and gRPC calls and streams them to model replicas."""

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
        self.settings = IngressSettings(
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

        self.grpc = GenerationService(self.router, self.settings, default_endpoints(), self.readiness)

    def __serve_build_asgi_app__(self) -> Starlette:
        return build_http_app(self.router, self.settings, self.readiness)

    # The gRPC API: Serve's gRPC proxy calls the method named as the RPC, with a copy of its context.

    async def ChatCompletion(  # named as the RPC
        self, request: pb.ChatCompletionRequest, grpc_context: GRPCContext
    ) -> AsyncIterator[pb.ChatCompletionResponse]:
        async for response in self.grpc.chat_completion(request, grpc_context):
            yield response

    async def Completion(
        self, request: pb.CompletionRequest, grpc_context: GRPCContext
    ) -> AsyncIterator[pb.CompletionResponse]:
        async for response in self.grpc.completion(request, grpc_context):
            yield response

    async def Check(  # grpc.health.v1.Health
        self, request: health_pb2.HealthCheckRequest, grpc_context: GRPCContext
    ) -> health_pb2.HealthCheckResponse:
        """As ``GET /health``: SERVING only when every model has a healthy replica; NOT_FOUND for another service."""
        health = self.grpc.health(request.service)
        if health is None:
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {request.service!r}")
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        ready, problem = health
        if not ready:
            grpc_context.set_details(problem)
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(  # grpc.health.v1.Health
        self, request: health_pb2.HealthCheckRequest, grpc_context: GRPCContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """Not offered: a watch would hold an ingress slot for as long as its client lives (probes use Check)."""
        grpc_context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        grpc_context.set_details("Watch is not offered; call Check")
        raise NotImplementedError("grpc.health.v1.Health/Watch")
        yield  # an async generator, as a server-streaming method must be
