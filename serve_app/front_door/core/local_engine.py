"""This model replica's engine, as the front door calls it: in-process, or another replica once it failed.

The front door (:mod:`serve_app.front_door.core.generation`) calls ``model.generate(method,
request, trace_context)`` and reads the answer as it comes (iterate it, cancel it: an
:class:`~serve_app.front_door.core.generation.AnswerStream`). :class:`LocalModel` answers with the
engine beside it, a plain call in this process; once this replica's engine has failed it sends
a request on to the deployment's other replicas through a Serve handle, and under a bare
``serve run`` with prefix routing, to the replica the ReplicaPicker names.
Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from functools import partial

from ray.serve.handle import DeploymentHandle

from serve_app.front_door.core.generation import AnswerStream
from serve_app.protocol import AnswerItem, GenerationRequest
from serve_app.serve_internals import picked_replica

logger = logging.getLogger("ray.serve")

GenerationMethod = Callable[[GenerationRequest, dict[str, str] | None], AsyncGenerator[AnswerItem, None]]


class LocalAnswer:
    """A generation running in this process, read as the front door reads every answer
    (:func:`serve_app.front_door.core.generation.call_replica`): iterate it, cancel it.

    The generator runs in the caller's task, so a deadline's cancellation lands inside
    it, and vLLM's unary path swallows it (it returns its 400 "Client disconnected"
    as if the client had left). A cancellation requested while the first item was
    made (a unary answer's only one) is raised again here, so the caller's deadline
    fires (504) as it does on a handle; a stream's later chunks are read under
    :class:`~serve_app.front_door.admission.deadlines.ItemsBefore`, which does the same.
    """

    def __init__(self, generator: AsyncGenerator[AnswerItem, None]) -> None:
        self._generator = generator
        self._closing: asyncio.Task[None] | None = None
        self._started = False  # its first item was read

    def __aiter__(self) -> LocalAnswer:
        return self

    async def __anext__(self) -> AnswerItem:
        if self._started:
            return await anext(self._generator)
        task = asyncio.current_task()
        cancelling = task.cancelling() if task is not None else 0
        item = await anext(self._generator)
        if task is not None and task.cancelling() > cancelling:  # cancelled meanwhile, and it was swallowed
            raise asyncio.CancelledError
        self._started = True
        return item

    def cancel(self) -> None:
        """Stop the generation (vLLM aborts the request as its generator closes); a no-op once it ended."""
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._generator.aclose())


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
    the picker once it is parsed (docs/architecture.md, record 20), and answers it itself when the
    picker cannot be asked (its replica died): a picker's death costs no request its answer.
    """

    def __init__(
        self,
        route: PrefixRoute,
        method: str,
        replicas: DeploymentHandle,  # a streaming handle to the deployment's `method`
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
        self._answer: AnswerStream | None = None  # LocalAnswer, or Serve's DeploymentResponseGenerator

    def __aiter__(self) -> RoutedAnswer:
        return self

    async def __anext__(self) -> AnswerItem:
        if self._answer is not None:
            return await anext(self._answer)
        try:
            picked = await self._route.picker.pick.remote(self._method, self._payload)
        except Exception as exc:  # the picker died or cannot answer: load already chose this replica
            logger.warning("the ReplicaPicker could not be asked (%s); answering here", type(exc).__name__)
            picked = self._route.this_replica
        if picked == self._route.this_replica:
            self._answer = self._here()
            return await anext(self._answer)
        async with picked_replica(self._replicas, picked, self._payload) as chosen:
            self._answer = self._replicas.dispatch(chosen, self._payload, self._trace_context)
            return await anext(self._answer)  # within the choice, as Serve requires

    def cancel(self) -> None:
        if self._answer is not None:
            self._answer.cancel()


class LocalModel:
    """This replica's engine as the front door calls it: each method (``chat``, ``completion``)
    answered here, or by another replica of the deployment (``others``, a streaming handle to
    it) once this replica's engine has failed: HAProxy has already handed the connection to this
    replica, and only this replica can still answer it. With ``route`` (a bare ``serve run``),
    each request goes to the replica the ReplicaPicker names: here, or there through ``others``
    (:class:`RoutedAnswer`)."""

    def __init__(
        self,
        methods: dict[str, GenerationMethod],
        engine_failed: Callable[[], bool] = lambda: False,
        others: DeploymentHandle | None = None,
        route: PrefixRoute | None = None,
    ) -> None:
        self._methods = methods
        self._engine_failed = engine_failed
        self._others = others
        self._route = route

    def generate(self, method: str, payload: GenerationRequest, trace_context: dict[str, str] | None) -> AnswerStream:
        """The answer to ``payload`` by the engine's ``method``: a :class:`LocalAnswer`, or a Serve
        handle's response from the replica that answers in its place."""
        if self._others is not None and self._engine_failed():
            return getattr(self._others, method).remote(payload, trace_context)
        here = partial(self._answer_here, method, payload, trace_context)
        if self._route is not None and self._others is not None:
            # The handle to the method (Serve's dispatch calls the method its handle names).
            return RoutedAnswer(self._route, method, getattr(self._others, method), payload, trace_context, here)
        return here()

    def _answer_here(
        self, method: str, payload: GenerationRequest, trace_context: dict[str, str] | None
    ) -> LocalAnswer:
        return LocalAnswer(self._methods[method](payload, trace_context))
