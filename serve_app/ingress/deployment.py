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

from dataclasses import replace
from functools import partial

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from serve_app.config import AppConfig
from serve_app.grpc_api.methods import GenerationMethods
from serve_app.grpc_api.service import GenerationService
from serve_app.ingress.admission import default_endpoints
from serve_app.ingress.capacity import QueueShare
from serve_app.ingress.readiness import ReadinessWatch
from serve_app.ingress.router import ModelEntry, ModelRouter
from serve_app.ingress.routes import build_http_app
from serve_app.ingress.settings import ingress_settings
from serve_app.observability import tracing
from serve_app.serve_internals import queue_state

# The model deployments' request router (prefix routing) is built on Serve's router thread,
# and it renders prompts with transformers. Imported here first, on the replica's main thread:
# transformers' lazy modules imported from two threads at once fail (ImportError in vLLM's own
# import of transformers, seen at the ingress's start).
from serve_app.prefix_routing import router as _prefix_router  # noqa: F401  # isort: skip


@serve.deployment
@serve.ingress()
class Ingress(GenerationMethods):
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
        self.settings = ingress_settings(config, rate_limiter)
        if config.ingress.applies_fair_share:
            shares = {
                m.name: QueueShare(partial(queue_state, self.router.entries[m.name].handle), m.runs_at_once())
                for m in config.models
            }
            self.settings = replace(self.settings, queue_shares=shares)
        self.readiness = ReadinessWatch(
            serve.status,
            serve.get_replica_context().app_name,
            {m.name: m.deployment_name for m in config.models},
            max_age_s=config.ingress.health_max_age_s,
        )

        self.grpc = GenerationService(self.router, self.settings, default_endpoints(), self.readiness)

    def __serve_build_asgi_app__(self) -> Starlette:
        return build_http_app(self.router, self.settings, self.readiness)
