"""GenerationCapacity: with direct streaming, a model replica refuses what it cannot queue, with OpenAI's 429.

On the relay path a model replica takes ``max_ongoing_requests`` at once and the
rest wait in Serve's queue in the ingress, up to ``max_queued_requests``; past that
the ingress answers 429 (``overloaded``). With direct streaming a request is at its
replica as soon as HAProxy forwards it, and Serve's own limit there would hold
``/health`` behind generation and answer past its queue with a plain-text status.
So the replica's Serve limit is raised past what it generates (see
:meth:`serve_app.config.ModelConfig.resolved_direct_deployment`), and this middleware keeps
the count Serve kept: generation requests in this replica, at most ``limit`` (the
configured ``max_ongoing_requests`` plus ``max_queued_requests``); past it, the same
429 the relay path answers. Requests over the engine's batch wait in vLLM's own queue.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.errors import overloaded
from serve_app.ingress.route_path import route_path


class GenerationCapacity:
    """ASGI middleware: at most ``limit`` generation requests (POSTs to ``paths``) at once."""

    def __init__(self, app: ASGIApp, limit: int, paths: frozenset[str]) -> None:
        self.app = app
        self.limit = limit
        self.paths = paths
        self.held = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.held >= self.limit:
            await _refuse(send)
            return
        self.held += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.held -= 1


async def _refuse(send: Send) -> None:
    error = overloaded()
    headers = [(b"content-type", b"application/json")]
    headers += [(name.lower().encode(), value.encode()) for name, value in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": error.to_json()})
