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
from contextlib import aclosing
from functools import partial
from typing import Any

from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from serve_app.config import AppConfig, ModelConfig
from serve_app.engine.server import EngineServer
from serve_app.engine.stream_transforms import coalesce
from serve_app.front_door.admission.auth import load_api_keys
from serve_app.front_door.admission.capacity import FairShare, GenerationSlots
from serve_app.front_door.admission.endpoints import default_endpoints
from serve_app.front_door.admission.models import ModelCatalog, ModelEntry
from serve_app.front_door.admission.pipeline import BodyRules
from serve_app.front_door.admission.rate_limits import KeyLimits, LimiterHandle
from serve_app.front_door.admission.settings import ingress_settings
from serve_app.front_door.core.front_door import FrontDoor
from serve_app.front_door.core.local_engine import LocalModel, PrefixRoute
from serve_app.front_door.core.readiness import ReadinessWatch
from serve_app.front_door.core.stored import StoredResponses
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api.service import GenerationService, GRPCContext
from serve_app.front_door.http_api.app import build_http_app, probe_answers
from serve_app.front_door.telemetry.metrics import ServingMetrics
from serve_app.protocol import AnswerItem
from serve_app.serve_internals import (
    AUTOSCALING_COUNT,
    answer_probes_first,
    ignore_client_control_headers,
    replica_states,
)


def generation_slots(model: ModelConfig, config: AppConfig) -> GenerationSlots | None:
    """The replica's count of its generation requests (None: unbounded), per API key with fair share."""
    limit = model.generation_limit()
    if limit is None:
        return None
    fair = FairShare.for_replica(limit, model.runs_at_once()) if config.ingress.applies_fair_share else None
    return GenerationSlots(limit, model.name, fair)


def key_limits(config: AppConfig, rate_limiter: LimiterHandle | None) -> KeyLimits | None:
    """The front door's side of the per-key limits (None: no rate limits configured)."""
    limits = config.ingress.rate_limits
    if limits is None or rate_limiter is None:
        return None
    return KeyLimits(
        rate_limiter,
        counts_tokens=limits.tokens_per_minute is not None,
        max_concurrent=limits.max_concurrent_requests,
    )


def front_door(models: ModelCatalog[Any], model: ModelConfig, config: AppConfig, limiter: Any) -> FrontDoor:
    """This replica's front door core: the ingress section's settings and the services that apply them,
    read here, in the replica (the environment, or a mounted file, is the node's, not the deployer's)."""
    rules = BodyRules(ingress_settings(config), models, key_limits(config, limiter))
    return FrontDoor(
        rules,
        api_keys=load_api_keys(config.ingress.api_keys),
        slots=generation_slots(model, config),
        metrics=ServingMetrics([m.name for m in config.models], [e.method for e in default_endpoints()]),
        stored=StoredResponses.from_config(config.ingress.responses_store),
    )


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
        self.core = front_door(self.models, model, config, rate_limiter)
        self.readiness = ReadinessWatch(
            partial(replica_states, context.app_name, (model.deployment_name,)),
            {model.name: model.deployment_name},
            max_age_s=config.ingress.health_max_age_s,
            engine_serves=lambda: not self.engine.watch.failed,
        )
        self.grpc = GenerationService(self.core, default_endpoints(), self.readiness)
        answer_probes_first(probe_answers(self.readiness))  # (before Serve starts this replica's server)

    def __serve_build_asgi_app__(self) -> Starlette:
        return build_http_app(self.core, self.readiness)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaling counts for this replica: the answers it runs and queues (each
        request on a Stream call, each background answer, running or waiting), in place of the calls
        Serve sees (a Stream call counts as one; a background answer as none). A plain request counts
        one from its arrival to its end, as Serve counts it."""
        return {AUTOSCALING_COUNT: float(self.core.answers())}

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

    async def CancelAnswer(self, request: pb.AnswerRequest, grpc_context: GRPCContext) -> pb.AnswerState:
        return await self.grpc.cancel_answer(request, grpc_context)

    async def DeleteAnswer(self, request: pb.AnswerRequest, grpc_context: GRPCContext) -> pb.AnswerState:
        return await self.grpc.delete_answer(request, grpc_context)

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

    # Each item is a message between actors here: chunks already waiting go out as one (coalesce).

    async def chat(self, request: Any, trace_context: dict[str, str] | None = None) -> AsyncGenerator[AnswerItem, None]:
        async with aclosing(coalesce(self.engine.chat(request, trace_context))) as items:
            async for item in items:
                yield item

    async def completion(
        self, request: Any, trace_context: dict[str, str] | None = None
    ) -> AsyncGenerator[AnswerItem, None]:
        async with aclosing(coalesce(self.engine.completion(request, trace_context))) as items:
            async for item in items:
                yield item

    async def responses(
        self, request: Any, trace_context: dict[str, str] | None = None
    ) -> AsyncGenerator[AnswerItem, None]:
        async with aclosing(coalesce(self.engine.responses(request, trace_context))) as items:
            async for item in items:
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
        core = getattr(self, "core", None)
        if core is not None and core.stored is not None:
            await core.stored.background.drain()  # (within graceful_shutdown_timeout_s)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()
