"""The HTTP door: Starlette routes of the OpenAI-compatible API over the front door's core.

A generation route reads the body (413 when too large, 408 when too slow), has the core admit it
(:meth:`~serve_app.front_door.core.front_door.FrontDoor.admit`: the key's limits, strict
validation, cost bounds, the places its sequences take; 4xx naming the problem) and generate it
(:meth:`~serve_app.front_door.core.front_door.FrontDoor.generate`), and writes the answer: a
whole answer as a JSON response, a stream as Server-Sent Events written through as the engine
framed them. Its record and its permit are the middleware's (:mod:`.middleware`), API keys are
checked before any of it (:mod:`serve_app.front_door.admission.auth`), and the Responses API's
stored and background answers are :mod:`.responses`'.

Runs in each model replica, behind Serve's HAProxy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Protocol

from ray.exceptions import TaskCancelledError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serve_app.errors import UNAVAILABLE, APIError, error_body
from serve_app.front_door.admission.auth import APIKeyMiddleware
from serve_app.front_door.admission.deadlines import Deadline, requested_timeout
from serve_app.front_door.admission.endpoints import Endpoint, default_endpoints
from serve_app.front_door.admission.request_body import JSONBody
from serve_app.front_door.core.front_door import FrontDoor
from serve_app.front_door.core.generation import Generation
from serve_app.front_door.core.permit import Permit
from serve_app.front_door.core.readiness import Readiness
from serve_app.front_door.http_api import responses as stored_routes
from serve_app.front_door.http_api.beginning import BeginningStream, sse_response
from serve_app.front_door.http_api.middleware import PERMIT_SCOPE_KEY, Arrivals, ObserveRequests
from serve_app.front_door.telemetry.record import RequestRecord
from serve_app.protocol import WholeAnswer

logger = logging.getLogger("ray.serve")


class ReadinessSource(Protocol):
    """Where ``/health`` reads readiness (:class:`serve_app.front_door.core.readiness.ReadinessWatch`)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def readiness(self) -> Readiness: ...


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    """The raw request body, refusing oversized bodies before reading them whole, and slow ones."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="body_timeout") from None
    return b"".join(chunks)


async def handle_generation(request: Request, endpoint: Endpoint) -> Response | BeginningStream:
    core: FrontDoor = request.app.state.core
    record: RequestRecord = request.state.record  # opened by ObserveRequests
    permit: Permit = getattr(request.state, PERMIT_SCOPE_KEY)  # taken by Arrivals
    record.key_id = permit.key_id
    deadline = Deadline.start(core.settings.time_limits, requested_timeout(request.headers))
    raw = await read_body(request, core.settings.max_request_body_bytes, core.settings.body_timeout_s)
    stored = core.stored if endpoint.method == "responses" else None
    expand = stored.expand(stored_routes.owner_of(request)) if stored is not None else None
    admitted = await core.admit(permit, JSONBody(raw), endpoint, record, expand)
    if stored is not None and admitted.to_store:
        return await stored_routes.create(core, stored, permit, admitted, deadline, record)
    generation = core.generate(
        permit, admitted, endpoint.method, deadline, record, stored_routes.error_event_of(endpoint)
    )
    if admitted.payload.stream:  # (its first item is awaited as the response is written: keep-alives)
        return BeginningStream(
            generation, core.settings.sse_keepalive_s, lambda first: answer(first, generation), generation.chunks
        )
    return answer(await generation.start(), generation)


def answer(first: WholeAnswer | str, generation: Generation) -> Response:
    """The HTTP response of an answer that began with ``first``: a whole answer as it is, a stream as SSE."""
    if isinstance(first, WholeAnswer):
        # A replica that cannot serve right now (its engine died) says so with 503: retry.
        headers = {"Retry-After": "1"} if first.status == 503 else None
        return Response(first.body, status_code=first.status, headers=headers, media_type="application/json")
    return sse_response(generation.chunks())


def generation_route(endpoint: Endpoint) -> Route:
    async def route(request: Request) -> Response | BeginningStream:
        return await handle_generation(request, endpoint)

    return Route(endpoint.path, route, methods=["POST"], name=endpoint.method)


async def list_models(request: Request) -> Response:
    return JSONResponse(request.app.state.models.model_list())


def health_response(readiness: Readiness) -> Response:
    """Readiness: 200 only when every configured model has a running, healthy replica; while
    Serve's controller does not answer, when this replica's engine serves.

    Answered from what :mod:`serve_app.front_door.core.readiness` last read, never by asking the
    controller; ``age_s`` says how old that is, ``controller_reachable`` whether it is too old.
    """
    age = None if readiness.age_s is None else round(readiness.age_s, 3)
    known = {"models": readiness.models, "age_s": age, "controller_reachable": readiness.controller_reachable}
    if readiness.ready:
        return JSONResponse({"status": "ok"} | known)
    return JSONResponse(error_body(503, readiness.problem(), code=UNAVAILABLE) | known, status_code=503)


def alive_response() -> Response:
    """Liveness: the model replica's process answers. Says nothing of the models (that is /health)."""
    return JSONResponse({"status": "alive"})


def probe_answers(readiness: ReadinessSource) -> dict[str, Callable[[], Response]]:
    """``/health`` and ``/health/live``, each answered from memory without an await: what the model
    replica answers before Serve's work for a request (:func:`serve_app.serve_internals.answer_probes_first`),
    and the routes below where Serve's proxy calls the application (a bare ``serve run``)."""
    return {"/health": lambda: health_response(readiness.readiness()), "/health/live": alive_response}


async def health(request: Request) -> Response:
    return health_response(request.app.state.readiness.readiness())


async def alive(request: Request) -> Response:
    return alive_response()


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    if (record := getattr(request.state, "record", None)) is not None:
        record.error_code = exc.code
    return Response(exc.to_json(), exc.status, headers=exc.headers, media_type="application/json")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code, headers=exc.headers)


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client left (Serve reports it as a cancelled task): nothing to answer, nothing to log."""
    return Response(status_code=499)


async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error in the front door", exc_info=exc)
    return JSONResponse(error_body(500, "internal server error", code="internal_error"), 500)


def build_http_app(
    core: FrontDoor,
    readiness: ReadinessSource,
    endpoints: list[Endpoint] | None = None,
) -> Starlette:
    """The Starlette app each model replica serves (the application's ingress); ``readiness`` runs while it does."""
    endpoints = endpoints or default_endpoints()
    settings = core.settings
    routes = [generation_route(e) for e in endpoints]
    routes += [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health/live", alive, methods=["GET"]),
    ]
    if core.stored is not None:
        routes += stored_routes.stored_response_routes()
    middleware = []
    if settings.cors is not None:  # outermost: a browser's preflight carries no API key
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=settings.cors.allow_origins,
                allow_methods=["GET", "POST"],
                allow_headers=settings.cors.allow_headers,
                max_age=settings.cors.max_age_s,
            )
        )
    # Inside CORS (a preflight is no request), outside API keys (a 401 is counted and logged).
    middleware.append(
        Middleware(
            ObserveRequests,
            paths={e.path: e.method for e in endpoints},
            observers=core.observers(),
            on_phase=core.metrics.moved if core.metrics is not None else None,
            log_content=settings.log_content,
        )
    )
    if core.api_keys is not None:
        middleware.append(Middleware(APIKeyMiddleware, keys=core.api_keys))
    # Inside API keys: a refused key takes no place.
    middleware.append(Middleware(Arrivals, core=core, paths=frozenset(e.path for e in endpoints)))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        readiness.start()
        try:
            yield
        finally:
            readiness.stop()
            core.rules.body_checker.close()
            if core.stored is not None:  # (its background answers end first: the replica is stopping)
                await core.stored.background.drain()
                await core.stored.close()

    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            ClientDisconnect: _client_gone,
            TaskCancelledError: _client_gone,
            Exception: _unexpected,
        },
    )
    app.state.core = core
    app.state.models = core.models
    app.state.readiness = readiness
    return app
