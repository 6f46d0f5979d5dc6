"""GenerationSlots: with direct streaming, a model replica refuses what it cannot queue, with OpenAI's 429.

On the relay path a model replica takes ``max_ongoing_requests`` at once and the
rest wait in Serve's queue in the ingress, up to ``max_queued_requests``; past that
the ingress answers 429 (``overloaded``). With direct streaming a request is at its
replica as soon as HAProxy forwards it, and Serve's own limit there would hold
``/health`` behind generation and answer past its queue with a plain-text status.
So the replica's Serve limit is raised past what it generates (see
:meth:`serve_app.config.ModelConfig.resolved_direct_deployment`), and the replica keeps
the count Serve kept: generation requests in this replica, HTTP and gRPC together, at
most ``limit`` (the configured ``max_ongoing_requests`` plus ``max_queued_requests``);
past it, the same 429 the relay path answers (gRPC: ``RESOURCE_EXHAUSTED``). Requests
over the engine's batch wait in vLLM's own queue.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.errors import APIError, overloaded
from serve_app.ingress.route_path import route_path
from serve_app.observability.record import RequestRecord


class GenerationSlots:
    """The generation requests one replica holds, whichever front door took them: at most ``limit``.

    ``model`` is the model the replica serves: a request it refuses is counted against that
    model (its metrics' ``model`` label), as the relay path counts Serve's refusals, though its
    body was never read.
    """

    def __init__(self, limit: int, model: str | None = None) -> None:
        self.limit = limit
        self.model = model
        self.held = 0

    def take(self, record: RequestRecord | None = None) -> None:
        """Take a place; raises the ``overloaded`` APIError (429) when none is free, with
        ``record`` (the request's) counted against this replica's model."""
        if self.held >= self.limit:
            if record is not None and record.model is None:
                record.model = self.model
            raise overloaded()
        self.held += 1

    def give_back(self) -> None:
        self.held -= 1

    @contextmanager
    def hold(self, record: RequestRecord | None = None) -> Iterator[None]:
        """A place held while the block runs (:meth:`take`, then :meth:`give_back`)."""
        self.take(record)
        try:
            yield
        finally:
            self.give_back()


class GenerationCapacity:
    """ASGI middleware: each generation request (a POST to one of ``paths``) holds one of ``slots``."""

    def __init__(self, app: ASGIApp, slots: GenerationSlots, paths: frozenset[str]) -> None:
        self.app = app
        self.slots = slots
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        record = scope.get("state", {}).get("record")  # ObserveRequests's, outside this middleware
        try:
            self.slots.take(record)
        except APIError as refusal:
            await _refuse(send, refusal)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.slots.give_back()


async def _refuse(send: Send, error: APIError) -> None:
    headers = [(b"content-type", b"application/json")]
    headers += [(name.lower().encode(), value.encode()) for name, value in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": error.to_json()})
