"""DirectModelServer: the model deployment, and the application's ingress. Runs in each model replica.

HAProxy forwards each request's connection to the replica the
:class:`~serve_app.deployments.replica_picker.ReplicaPicker` chose. The replica answers it
itself: its front door (:mod:`serve_app.front_door`: the HTTP app of
:func:`~serve_app.front_door.http_app.build_http_app` and the gRPC service, API keys, rate
limits, strict validation, deadlines, the request log, metrics, OpenAI-shaped errors) calls
its own engine (:mod:`serve_app.engine`) in-process
(:class:`~serve_app.front_door.local_engine.LocalModel`). Tokens go from the engine to the
client's socket in this process. This module composes the two; neither imports the other.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from serve_app.config import AppConfig, ModelConfig
from serve_app.engine.server import ModelServer
from serve_app.front_door.capacity import FairShare, GenerationSlots
from serve_app.front_door.endpoints import default_endpoints
from serve_app.front_door.grpc_api.methods import GenerationMethods
from serve_app.front_door.grpc_api.service import GenerationService
from serve_app.front_door.http_app import build_http_app
from serve_app.front_door.local_engine import LocalModel, PrefixRoute
from serve_app.front_door.models import ModelCatalog, ModelEntry
from serve_app.front_door.readiness import ReadinessWatch
from serve_app.front_door.settings import ingress_settings
from serve_app.serve_internals import replica_states


def generation_slots(model: ModelConfig, config: AppConfig) -> GenerationSlots | None:
    """The replica's count of its generation requests (None: unbounded), per API key with fair share."""
    limit = model.generation_limit()
    if limit is None:
        return None
    fair = FairShare.for_replica(limit, model.runs_at_once()) if config.ingress.applies_fair_share else None
    return GenerationSlots(limit, model.name, fair)


@serve.ingress()
class DirectModelServer(ModelServer, GenerationMethods):
    """A model replica that also answers clients: the engine (ModelServer) behind the front door."""

    async def __init__(  # type: ignore[misc]  # Serve awaits it
        self,
        model: ModelConfig,
        config: AppConfig,
        rate_limiter: DeploymentHandle | None = None,
        picker: DeploymentHandle | None = None,
    ) -> None:
        """``picker``: the application's ReplicaPicker where no HAProxy asks it (a bare ``serve
        run`` with prefix routing): this replica asks it for each request it received."""
        await super().__init__(model, config.ingress.prompt_logprobs)
        context = serve.get_replica_context()
        route = PrefixRoute(picker, context.replica_id.to_full_id_str()) if picker is not None else None
        self.models = ModelCatalog(
            {
                model.name: ModelEntry(
                    model.name,
                    LocalModel(
                        {"chat": self.chat, "completion": self.completion},
                        engine_failed=lambda: self.watch.failed,
                        others=serve.get_deployment_handle(model.deployment_name, context.app_name).options(
                            stream=True
                        ),
                        route=route,
                    ),
                    model.engine_args.get("max_model_len"),
                    model.max_output_tokens,
                    simulated=model.simulated_engine is not None,
                )
            }
        )
        # A request that meets this replica after its engine died goes to the others, and
        # is sent again (for up to ingress.unavailable_retry_s) while they answer
        # `unavailable`.
        slots = generation_slots(model, config)
        self.settings = replace(ingress_settings(config, rate_limiter), generation_slots=slots)
        self.readiness = ReadinessWatch(
            partial(replica_states, serve.get_replica_context().app_name),
            {model.name: model.deployment_name},
            max_age_s=config.ingress.health_max_age_s,
        )
        self.grpc = GenerationService(self.models, self.settings, default_endpoints(), self.readiness)

    def __serve_build_asgi_app__(self) -> Starlette:
        return build_http_app(self.models, self.settings, self.readiness)

    def _leave(self) -> None:
        """Its engine died or hung: stop the engine, but keep the process (ModelServer's own exits).

        HAProxy and the picker keep sending this replica requests until Serve, whose
        health check of it now fails, takes it out and stops it (draining what it
        holds); until then its front door sends each one on to the other replicas.
        Exiting at once cut the requests in flight here: HAProxy's plain-text 500.
        """
        self.engine.shutdown()
