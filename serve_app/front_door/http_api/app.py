"""The HTTP surface: Starlette routes of the OpenAI-compatible API.

Each generation route does the same four things: read the body (413 when too
large), validate it strictly with vLLM's own request model and the OpenAI API's
rules (:mod:`serve_app.front_door.admission.validation`, or for a large body
:mod:`serve_app.front_door.admission.large_bodies` in another process; 400 naming the
parameter), route it by ``model`` (404 when nobody serves it) and hand it to
:mod:`serve_app.front_door.core.generation`, which calls a model replica and relays
its answer.

API keys are checked before any of that, by :mod:`serve_app.front_door.admission.auth`'s
middleware; other per-request policies (rate limits, timeouts) belong between
parsing and routing, in :func:`handle_generation`.

Runs in each model replica, behind Serve's HAProxy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

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
from serve_app.front_door.admission.capacity import SLOT_HOLD_SCOPE_KEY, GenerationCapacity
from serve_app.front_door.admission.deadlines import Deadline, requested_timeout
from serve_app.front_door.admission.endpoints import Endpoint, default_endpoints
from serve_app.front_door.admission.models import ModelCatalog
from serve_app.front_door.admission.pipeline import admit
from serve_app.front_door.admission.request_body import JSONBody
from serve_app.front_door.admission.settings import IngressSettings
from serve_app.front_door.core.generation import relay
from serve_app.front_door.core.readiness import Readiness
from serve_app.front_door.http_api import responses as stored_routes
from serve_app.front_door.telemetry.record import ObserveRequests, RequestRecord

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


async def handle_generation(request: Request, endpoint: Endpoint) -> Response:
    state = request.app.state
    record: RequestRecord = request.state.record  # opened by ObserveRequests
    record.key_id = getattr(request.state, "api_key_id", None)
    deadline = Deadline.start(state.settings.time_limits, requested_timeout(request.headers))
    settings: IngressSettings = state.settings
    raw = await read_body(request, settings.max_request_body_bytes, settings.body_timeout_s)
    hold = getattr(request.state, SLOT_HOLD_SCOPE_KEY, None)  # (GenerationCapacity's)
    stored = settings.stored_responses if endpoint.method == "responses" else None
    expand = stored.expand(stored_routes.owner_of(request)) if stored is not None else None
    admitted = await admit(JSONBody(raw), endpoint, state.models, settings, record, hold, expand)
    if stored is not None and getattr(admitted.payload, "store", False):
        return await stored_routes.create(stored, admitted, deadline, record, settings.unavailable_retry_s)
    return await relay(
        admitted.entry.model,
        endpoint.method,
        admitted.payload,
        deadline,
        record,
        settings.unavailable_retry_s,
        admitted.on_tokens,
    )


def generation_route(endpoint: Endpoint) -> Route:
    async def route(request: Request) -> Response:
        return await handle_generation(request, endpoint)

    return Route(endpoint.path, route, methods=["POST"], name=endpoint.method)


async def list_models(request: Request) -> Response:
    return JSONResponse(request.app.state.models.model_list())


async def health(request: Request) -> Response:
    """Readiness: 200 only when every configured model has a running, healthy replica; while
    Serve's controller does not answer, when this replica's engine serves.

    Answered from what :mod:`serve_app.front_door.core.readiness` last read, never by asking the
    controller; ``age_s`` says how old that is, ``controller_reachable`` whether it is too old.
    """
    readiness: Readiness = request.app.state.readiness.readiness()
    age = None if readiness.age_s is None else round(readiness.age_s, 3)
    known = {"models": readiness.models, "age_s": age, "controller_reachable": readiness.controller_reachable}
    if readiness.ready:
        return JSONResponse({"status": "ok"} | known)
    return JSONResponse(error_body(503, readiness.problem(), code=UNAVAILABLE) | known, status_code=503)


async def alive(request: Request) -> Response:
    """Liveness: the model replica's process answers. Says nothing of the models (that is /health)."""
    return JSONResponse({"status": "alive"})


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
    models: ModelCatalog[Any],
    settings: IngressSettings,
    readiness: ReadinessSource,
    endpoints: list[Endpoint] | None = None,
) -> Starlette:
    """The Starlette app each model replica serves (the application's ingress); ``readiness`` runs while it does."""
    endpoints = endpoints or default_endpoints()
    routes = [generation_route(e) for e in endpoints]
    routes += [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health/live", alive, methods=["GET"]),
    ]
    if settings.stored_responses is not None:
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
            observers=settings.observers(),
            on_phase=settings.metrics.moved if settings.metrics is not None else None,
            keep_content=settings.log_content,
        )
    )
    if settings.api_keys is not None:
        middleware.append(Middleware(APIKeyMiddleware, keys=settings.api_keys))
    if settings.generation_slots is not None:  # inside API keys: a refused key takes no place
        paths = frozenset(e.path for e in endpoints)
        middleware.append(Middleware(GenerationCapacity, slots=settings.generation_slots, paths=paths))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        readiness.start()
        try:
            yield
        finally:
            readiness.stop()
            settings.body_checker.close()
            if settings.stored_responses is not None:  # (its background answers end first: the replica is stopping)
                await settings.stored_responses.background.drain()
                await settings.stored_responses.close()

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
    app.state.models = models
    app.state.settings = settings
    app.state.readiness = readiness
    return app
