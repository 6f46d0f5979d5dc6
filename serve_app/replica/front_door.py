"""The model replica answers clients itself: the front door's HTTP app, the engine called locally.

HAProxy forwards each request's connection to the replica the
:class:`~serve_app.replica_picker.ReplicaPicker` chose. The replica serves the
front door's Starlette app (:func:`serve_app.ingress.routes.build_http_app`: API keys,
rate limits, strict validation, deadlines, the request log, metrics, OpenAI-shaped
errors); the model it routes to is this replica, called in-process
(:class:`LocalModel`). Tokens go from the engine to the client's socket in this process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from serve_app.config import AppConfig, ModelConfig
from serve_app.grpc_api.methods import GenerationMethods
from serve_app.grpc_api.service import GenerationService
from serve_app.ingress.admission import default_endpoints
from serve_app.ingress.capacity import FairShare, GenerationSlots
from serve_app.ingress.rate_limits import RemoteMethod
from serve_app.ingress.readiness import ReadinessWatch
from serve_app.ingress.router import ModelEntry, ModelRouter
from serve_app.ingress.routes import build_http_app
from serve_app.ingress.settings import ingress_settings
from serve_app.protocol import Answer, GenerationRequest
from serve_app.replica.deployment import ModelServer
from serve_app.serve_internals import replica_states

GenerationMethod = Callable[[GenerationRequest, dict[str, str] | None], AsyncGenerator[Answer, None]]


class LocalAnswer:
    """A generation running in this process, shaped as a streaming handle's response (what
    :func:`serve_app.ingress.replica_client.call_replica` reads): iterate it, cancel it.

    The generator runs in the caller's task, so a deadline's cancellation lands inside
    it, and vLLM's unary path swallows it (it returns its 400 "Client disconnected"
    as if the client had left). A cancellation requested while the generator ran is
    raised again here, so the caller's deadline fires (504) as it does on a handle.
    """

    def __init__(self, generator: AsyncGenerator[Answer, None]) -> None:
        self._generator = generator
        self._closing: asyncio.Task[None] | None = None

    def __aiter__(self) -> LocalAnswer:
        return self

    async def __anext__(self) -> Answer:
        task = asyncio.current_task()
        cancelling = task.cancelling() if task is not None else 0
        item = await anext(self._generator)
        if task is not None and task.cancelling() > cancelling:  # cancelled meanwhile, and it was swallowed
            raise asyncio.CancelledError
        return item

    def cancel(self) -> None:
        """Stop the generation (vLLM aborts the request as its generator closes); a no-op once it ended."""
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._generator.aclose())


def generation_slots(model: ModelConfig, config: AppConfig) -> GenerationSlots | None:
    """The replica's count of its generation requests (None: unbounded), per API key with fair share."""
    limit = model.generation_limit()
    if limit is None:
        return None
    fair = FairShare.for_replica(limit, model.runs_at_once()) if config.ingress.applies_fair_share else None
    return GenerationSlots(limit, model.name, fair)


class OtherReplicas(Protocol):
    """A streaming handle to this replica's deployment: its other replicas, by Serve's router."""

    @property
    def chat(self) -> RemoteMethod: ...

    @property
    def completion(self) -> RemoteMethod: ...


class LocalMethod:
    """``handle.<method>`` of a streaming handle, for a method of this replica.

    Once this replica's engine has failed, a request it has not started goes to the
    deployment's other replicas through ``elsewhere`` (a streaming deployment handle):
    HAProxy has already handed the
    connection to this replica, and only this replica can still answer it.
    """

    def __init__(
        self,
        method: GenerationMethod,
        engine_failed: Callable[[], bool] = lambda: False,
        elsewhere: RemoteMethod | None = None,
    ) -> None:
        self._method = method
        self._engine_failed = engine_failed
        self._elsewhere = elsewhere

    def remote(self, payload: GenerationRequest, trace_context: dict[str, str] | None = None) -> Any:
        if self._elsewhere is not None and self._engine_failed():
            return self._elsewhere.remote(payload, trace_context)
        return LocalAnswer(self._method(payload, trace_context))


class LocalModel:
    """This replica as the ingress's routes call a model: ``chat`` and ``completion``, answered
    here, or by another replica of the deployment (``others``, a streaming handle) once this
    replica's engine has failed."""

    def __init__(
        self,
        chat: GenerationMethod,
        completion: GenerationMethod,
        engine_failed: Callable[[], bool] = lambda: False,
        others: OtherReplicas | None = None,
    ) -> None:
        self.chat = LocalMethod(chat, engine_failed, others.chat if others is not None else None)
        self.completion = LocalMethod(completion, engine_failed, others.completion if others is not None else None)

    def options(self, **_: Any) -> LocalModel:
        return self


@serve.ingress()
class DirectModelServer(ModelServer, GenerationMethods):
    """A model replica that also answers clients: ModelServer behind the ingress's HTTP app."""

    async def __init__(  # type: ignore[misc]  # Serve awaits it
        self, model: ModelConfig, config: AppConfig, rate_limiter: DeploymentHandle | None = None
    ) -> None:
        await super().__init__(model, config.ingress.prompt_logprobs)
        self.front_router = ModelRouter(
            {
                model.name: ModelEntry(
                    model.name,
                    LocalModel(
                        self.chat,
                        self.completion,
                        engine_failed=lambda: self.watch.failed,
                        others=serve.get_deployment_handle(
                            model.deployment_name, serve.get_replica_context().app_name
                        ).options(stream=True),
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
        self.grpc = GenerationService(self.front_router, self.settings, default_endpoints(), self.readiness)

    def __serve_build_asgi_app__(self) -> Starlette:
        return build_http_app(self.front_router, self.settings, self.readiness)

    def _leave(self) -> None:
        """Its engine died or hung: stop the engine, but keep the process (ModelServer's own exits).

        HAProxy and the picker keep sending this replica requests until Serve, whose
        health check of it now fails, takes it out and stops it (draining what it
        holds); until then its front door sends each one on to the other replicas.
        Exiting at once cut the requests in flight here: HAProxy's plain-text 500.
        """
        self.engine.shutdown()
