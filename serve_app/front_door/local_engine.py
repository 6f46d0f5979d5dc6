"""This model replica's engine, as the front door calls a model: in-process, or another replica once it failed.

The front door (:mod:`serve_app.front_door.engine_call`) calls a model as it would a Serve
streaming handle (``model.chat.remote(request)``, iterate the answer, cancel it). In the
model replica the model is the engine beside it: :class:`LocalModel` answers here, and sends a
request on to the deployment's other replicas once this replica's engine has failed; under a
bare ``serve run`` with prefix routing, to the replica the ReplicaPicker names.
Runs in each model replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, cast

from ray.serve.handle import DeploymentHandle

from serve_app.front_door.rate_limits import RemoteMethod
from serve_app.protocol import Answer, GenerationRequest
from serve_app.serve_internals import picked_replica

GenerationMethod = Callable[[GenerationRequest, dict[str, str] | None], AsyncGenerator[Answer, None]]


class LocalAnswer:
    """A generation running in this process, shaped as a streaming handle's response (what
    :func:`serve_app.front_door.engine_call.call_replica` reads): iterate it, cancel it.

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


class OtherReplicas(Protocol):
    """A streaming handle to this replica's deployment: its other replicas, by Serve's router."""

    @property
    def chat(self) -> RemoteMethod: ...

    @property
    def completion(self) -> RemoteMethod: ...


@dataclass(frozen=True)
class PrefixRoute:
    """Where a bare ``serve run``'s replica asks which replica answers a request it received."""

    picker: DeploymentHandle  # the application's ReplicaPicker
    this_replica: str  # this replica's full id, as the picker names replicas


class RoutedAnswer:
    """A request this replica received, answered by the replica the ReplicaPicker names: here,
    or sent there and relayed. Shaped as a streaming handle's response (iterate it, cancel it).

    Under a bare ``serve run`` (no HAProxy) Serve's Python proxy picks the replica by load: its
    router cannot read the prompt in an HTTP request. The replica that received the request asks
    the picker once it is parsed (docs/architecture.md, record 20).
    """

    def __init__(
        self,
        route: PrefixRoute,
        method: str,
        replicas: DeploymentHandle,
        payload: GenerationRequest,
        trace_context: dict[str, str] | None,
        here: Callable[[], LocalAnswer],
    ) -> None:
        self._route = route
        self._method = method
        self._replicas = replicas
        self._payload = payload
        self._trace_context = trace_context
        self._here = here
        self._answer: Any = None  # LocalAnswer, or Serve's DeploymentResponseGenerator

    def __aiter__(self) -> RoutedAnswer:
        return self

    async def __anext__(self) -> Answer:
        if self._answer is not None:
            return await anext(self._answer)
        picked = await self._route.picker.pick.remote(self._method, self._payload)
        if picked == self._route.this_replica:
            self._answer = self._here()
            return await anext(self._answer)
        async with picked_replica(self._replicas, picked, self._payload) as chosen:
            self._answer = self._replicas.dispatch(chosen, self._payload, self._trace_context)
            return await anext(self._answer)  # within the choice, as Serve requires

    def cancel(self) -> None:
        if self._answer is not None:
            self._answer.cancel()


class LocalMethod:
    """``handle.<method>`` of a streaming handle, for a method of this replica.

    Once this replica's engine has failed, a request it has not started goes to the
    deployment's other replicas through ``elsewhere`` (a streaming deployment handle):
    HAProxy has already handed the connection to this replica, and only this replica can
    still answer it. With ``route`` (a bare ``serve run``), each request goes to the replica
    the ReplicaPicker names: here, or there through ``elsewhere`` (:class:`RoutedAnswer`).
    """

    def __init__(
        self,
        method: GenerationMethod,
        engine_failed: Callable[[], bool] = lambda: False,
        elsewhere: RemoteMethod | None = None,
        route: PrefixRoute | None = None,
        name: str = "chat",
    ) -> None:
        self._method = method
        self._engine_failed = engine_failed
        self._elsewhere = elsewhere
        self._route = route
        self._name = name

    def remote(self, payload: GenerationRequest, trace_context: dict[str, str] | None = None) -> Any:
        if self._elsewhere is not None and self._engine_failed():
            return self._elsewhere.remote(payload, trace_context)
        if self._route is not None and self._elsewhere is not None:
            here = partial(self._answer_here, payload, trace_context)
            replicas = cast(DeploymentHandle, self._elsewhere)
            return RoutedAnswer(self._route, self._name, replicas, payload, trace_context, here)
        return self._answer_here(payload, trace_context)

    def _answer_here(self, payload: GenerationRequest, trace_context: dict[str, str] | None) -> LocalAnswer:
        return LocalAnswer(self._method(payload, trace_context))


class LocalModel:
    """This replica as the ingress's routes call a model: ``chat`` and ``completion``, answered
    here, or by another replica of the deployment (``others``, a streaming handle) once this
    replica's engine has failed. With ``route`` (a bare ``serve run``), each request goes to the
    replica the ReplicaPicker names, here or through ``others``."""

    def __init__(
        self,
        chat: GenerationMethod,
        completion: GenerationMethod,
        engine_failed: Callable[[], bool] = lambda: False,
        others: OtherReplicas | None = None,
        route: PrefixRoute | None = None,
    ) -> None:
        def method(name: str, here: GenerationMethod) -> LocalMethod:
            if others is None:
                return LocalMethod(here, engine_failed)
            return LocalMethod(here, engine_failed, getattr(others, name), route, name)

        self.chat = method("chat", chat)
        self.completion = method("completion", completion)

    def options(self, **_: Any) -> LocalModel:
        return self
