"""ModelServer: the model deployment, and the application's ingress. Runs in each model replica.

HAProxy forwards each request's connection to the replica the
:class:`~serve_app.deployments.replica_picker.ReplicaPicker` chose. The replica answers it
itself: its front door (:mod:`serve_app.front_door`: the HTTP app of
:func:`~serve_app.front_door.http_api.app.build_http_app` and the gRPC service, API keys, rate
limits, strict validation, deadlines, the request log, metrics, OpenAI-shaped errors) calls
its own engine (:class:`~serve_app.engine.server.EngineServer`) in-process
(:class:`~serve_app.front_door.core.local_engine.LocalModel`). Tokens go from the engine to the
client's socket in this process. This module composes the two; neither imports the other.

Every method Serve calls is here, each handing the call to the part that answers it: the
gRPC methods (named as the RPCs) to the gRPC door, the engine's methods (``chat`` and
``completion`` for other replicas' front doors, health, load) to the engine.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from functools import partial
from typing import Any

from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from serve_app.config import AppConfig, ModelConfig
from serve_app.engine.server import EngineServer
from serve_app.front_door.admission.capacity import FairShare, GenerationSlots
from serve_app.front_door.admission.endpoints import default_endpoints
from serve_app.front_door.admission.models import ModelCatalog, ModelEntry
from serve_app.front_door.admission.settings import ingress_settings
from serve_app.front_door.core.local_engine import LocalModel, PrefixRoute
from serve_app.front_door.core.readiness import ReadinessWatch
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api.service import GenerationService, GRPCContext
from serve_app.front_door.http_api.app import build_http_app
from serve_app.protocol import Answer
from serve_app.serve_internals import ignore_client_control_headers, replica_states


def generation_slots(model: ModelConfig, config: AppConfig) -> GenerationSlots | None:
    """The replica's count of its generation requests (None: unbounded), per API key with fair share."""
    limit = model.generation_limit()
    if limit is None:
        return None
    fair = FairShare.for_replica(limit, model.runs_at_once()) if config.ingress.applies_fair_share else None
    return GenerationSlots(limit, model.name, fair)


@serve.ingress()
class ModelServer:
    """A model replica that answers clients: the front door (HTTP and gRPC) over the engine."""

    async def __init__(  # type: ignore[misc]  # Serve awaits it
        self,
        model: ModelConfig,
        config: AppConfig,
        rate_limiter: DeploymentHandle | None = None,
        picker: DeploymentHandle | None = None,
    ) -> None:
        """``picker``: the application's ReplicaPicker where no HAProxy asks it (a bare ``serve
        run`` with prefix routing): this replica asks it for each request it received."""
        ignore_client_control_headers()  # (Serve's own request settings are not a client's to set)
        self.engine = await EngineServer.start(model, config.ingress.prompt_logprobs)
        context = serve.get_replica_context()
        route = PrefixRoute(picker, context.replica_id.to_full_id_str()) if picker is not None else None
        # A request that meets this replica after its engine died goes to the others, and
        # is sent again (for up to ingress.unavailable_retry_s) while they answer `unavailable`.
        self.models = ModelCatalog(
            {
                model.name: ModelEntry(
                    model.name,
                    LocalModel(
                        {
                            "chat": self.engine.chat,
                            "completion": self.engine.completion,
                            "responses": self.engine.responses,
                        },
                        engine_failed=lambda: self.engine.watch.failed,
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
        slots = generation_slots(model, config)
        self.settings = replace(ingress_settings(config, rate_limiter), generation_slots=slots)
        self.readiness = ReadinessWatch(
            partial(replica_states, context.app_name, (model.deployment_name,)),
            {model.name: model.deployment_name},
            max_age_s=config.ingress.health_max_age_s,
            engine_serves=lambda: not self.engine.watch.failed,
        )
        self.grpc = GenerationService(self.models, self.settings, default_endpoints(), self.readiness)

    def __serve_build_asgi_app__(self) -> Starlette:
        return build_http_app(self.models, self.settings, self.readiness)

    # The gRPC API (glm4serve.v1.Generation, grpc.health.v1.Health): Serve calls the method named as the RPC.

    async def ChatCompletion(
        self, request: pb.ChatCompletionRequest, grpc_context: GRPCContext
    ) -> AsyncIterator[pb.ChatCompletionResponse]:
        async for response in self.grpc.chat_completion(request, grpc_context):
            yield response

    async def Completion(
        self, request: pb.CompletionRequest, grpc_context: GRPCContext
    ) -> AsyncIterator[pb.CompletionResponse]:
        async for response in self.grpc.completion(request, grpc_context):
            yield response

    async def Stream(
        self, requests: AsyncIterator[pb.StreamRequest], grpc_context: GRPCContext
    ) -> AsyncIterator[pb.StreamResponse]:
        async for response in self.grpc.stream(requests, grpc_context):
            yield response

    async def Resume(self, request: pb.ResumeRequest, grpc_context: GRPCContext) -> AsyncIterator[pb.StreamResponse]:
        async for response in self.grpc.resume(request, grpc_context):
            yield response

    async def Check(
        self, request: health_pb2.HealthCheckRequest, grpc_context: GRPCContext
    ) -> health_pb2.HealthCheckResponse:
        return self.grpc.check(request, grpc_context)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, grpc_context: GRPCContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        async for response in self.grpc.watch(request, grpc_context):
            yield response

    # The engine, called through handles: by another replica's front door (this replica answers
    # in its place, or the picker named it), by operators and tests, and by Serve's health check.

    async def chat(self, request: Any, trace_context: dict[str, str] | None = None) -> AsyncGenerator[Answer, None]:
        async for item in self.engine.chat(request, trace_context):
            yield item

    async def completion(
        self, request: Any, trace_context: dict[str, str] | None = None
    ) -> AsyncGenerator[Answer, None]:
        async for item in self.engine.completion(request, trace_context):
            yield item

    async def responses(
        self, request: Any, trace_context: dict[str, str] | None = None
    ) -> AsyncGenerator[Answer, None]:
        async for item in self.engine.responses(request, trace_context):
            yield item

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def ping(self) -> str:
        return await self.engine.ping()

    async def in_flight(self) -> int:
        return await self.engine.in_flight()

    async def engine_load(self) -> tuple[str, int]:
        return await self.engine.engine_load()

    async def __del__(self) -> None:  # Serve is stopping this replica, its requests drained
        settings = getattr(self, "settings", None)
        if settings is not None and settings.stored_responses is not None:
            await settings.stored_responses.background.drain()  # (within graceful_shutdown_timeout_s)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()
