"""The HTTP door's middleware: each generation request's record, and its permit from its arrival.

:class:`ObserveRequests` opens a :class:`~serve_app.front_door.telemetry.record.RequestRecord`
and a span for each generation request and ends them when its last byte is written or its
client leaves. :class:`Arrivals` gives each generation request its permit as it arrives, before
its body is read (a place of the replica: 429 ``overloaded`` when there is none), and closes the
permit once the request is answered, whatever its end; an answer that goes on without its
request (a background answer) has taken the permit over by then.

Runs in each model replica, behind Serve's HAProxy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.errors import APIError
from serve_app.front_door.admission.auth import KEY_ID_SCOPE_KEY
from serve_app.front_door.admission.route_path import route_path
from serve_app.front_door.core.permit import Permit
from serve_app.front_door.telemetry.record import Observer, Phase, RequestRecord, end_record
from serve_app.observability import tracing

PERMIT_SCOPE_KEY = "permit"  # where Arrivals leaves a request's permit: request.state.permit


class ObserveRequests:
    """ASGI middleware: a :class:`RequestRecord` and a span for each request to ``paths``.

    The record is at ``request.state.record`` for the handlers. Its status is the
    one written to the client, unless the handler marked the answer failed
    mid-stream; a response that never finished is a client that left.
    """

    def __init__(
        self,
        app: ASGIApp,
        paths: dict[str, str],
        observers: list[Observer],
        on_phase: Callable[[RequestRecord, Phase, Phase], None] | None = None,
        log_content: bool = False,
    ) -> None:
        self.app = app
        self.paths = paths  # path -> endpoint name
        self.observers = observers
        self.on_phase = on_phase
        self.log_content = log_content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        observed = scope["type"] == "http" and scope.get("method") == "POST"
        endpoint = self.paths.get(route_path(scope)) if observed else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        record = RequestRecord(endpoint, on_phase=self.on_phase, log_content=self.log_content)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        record.span = tracing.start_request_span(
            f"{scope.get('method', 'POST')} {scope['path']}",
            headers,
            {"http.request.method": scope.get("method", "POST"), "url.path": scope["path"]},
        )
        scope.setdefault("state", {})["record"] = record

        async def observed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                if record.status is None:
                    record.status = message["status"]
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if body and record.first_byte_at is None and not body.startswith(b":"):  # (a keep-alive)
                    record.first_byte_at = time.monotonic()
                if record.log_content and body:
                    record.response_bytes.append(body)
                if not message.get("more_body", False):
                    record.completed = True
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        except asyncio.CancelledError:  # Serve cancels a request whose client left
            raise
        except Exception as exc:
            if record.status is not None and _client_left(exc):
                return  # mid-response: nobody is there to answer, and nothing went wrong here
            if record.status is None:
                record.status = 500
            raise
        finally:
            end_record(record, self.observers)


def _client_left(exc: BaseException) -> bool:
    """Serve reports a client that left as a cancelled task; once a response has started,
    Starlette re-raises it wrapped in a RuntimeError ("response already started")."""
    from ray.exceptions import TaskCancelledError

    return isinstance(exc, TaskCancelledError) or isinstance(exc.__cause__, TaskCancelledError)


class Arriving(Protocol):
    """Where a request's permit comes from (the front door's core)."""

    def arrive(self, record: RequestRecord | None, key_id: str | None) -> Permit: ...


class Arrivals:
    """ASGI middleware: each generation request (a POST to one of ``paths``) holds a permit from
    its arrival (a place of the replica; more once the route reads how many sequences it starts)
    until it is answered. Inside API keys: a refused key takes no place."""

    def __init__(self, app: ASGIApp, core: Arriving, paths: frozenset[str]) -> None:
        self.app = app
        self.core = core
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        state = scope.get("state") or {}
        try:  # (the record: ObserveRequests's; the key: APIKeyMiddleware's, both outside this one)
            permit = self.core.arrive(state.get("record"), state.get(KEY_ID_SCOPE_KEY))
        except APIError as refusal:
            await _refuse(send, refusal)
            return
        try:  # (a fresh state mapping, as APIKeyMiddleware's)
            await self.app(dict(scope, state=dict(state, **{PERMIT_SCOPE_KEY: permit})), receive, send)
        finally:
            permit.close()


async def _refuse(send: Send, error: APIError) -> None:
    headers = [(b"content-type", b"application/json")]
    headers += [(name.lower().encode(), value.encode()) for name, value in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": error.to_json()})
