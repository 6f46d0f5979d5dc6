"""The Responses API's HTTP routes: create (foreground, stored, background), retrieve, cancel, delete.

``POST /v1/responses`` passes the same admission as every generation request; a
``previous_response_id`` is turned into its conversation first
(:mod:`serve_app.front_door.answer_log.history`). Then:

- ``store: false``: answered and forgotten, as chat is;
- stored (OpenAI's default): answered as it comes, and its final object kept with the input
  items it followed, once the answer ends (a client that leaves first leaves nothing stored; a
  store down then costs the keeping, logged, not the answer);
- ``background: true``: kept at once as ``queued`` and generated detached, holding the request's
  places for its whole life, or, past its key's cap, once it has waited for its key's place
  (:mod:`serve_app.front_door.core.background`); the answer is that object, or with
  ``stream: true`` its event log followed from the start, which a client that drops resumes
  with ``GET /v1/responses/{id}?stream=true&starting_after=N`` through any replica. A follower
  holds an open call's place (:mod:`serve_app.front_door.admission.open_calls`), not a generation one.

Another key's response is a 404, as a missing one is: ids are not secrets, owners are.

Runs in each model replica.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from types import SimpleNamespace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from serve_app.errors import APIError, quoted, responses_error_event
from serve_app.front_door.admission.deadlines import Deadline
from serve_app.front_door.admission.echoed import checked_id, checked_position, names_stored
from serve_app.front_door.admission.endpoints import Endpoint
from serve_app.front_door.admission.open_calls import OpenCalls
from serve_app.front_door.admission.pipeline import Admitted
from serve_app.front_door.answer_log.follow import end_if_orphaned, follow
from serve_app.front_door.answer_log.history import request_input_items
from serve_app.front_door.answer_log.store import (
    NO_OWNER,
    StoreDown,
    StoredResponse,
    event_response,
    is_terminal,
    split_events,
)
from serve_app.front_door.core.background import produce_response
from serve_app.front_door.core.front_door import FrontDoor
from serve_app.front_door.core.generation import ErrorEvent, Generation, chat_error_event
from serve_app.front_door.core.permit import Permit
from serve_app.front_door.core.stored import StoredResponses
from serve_app.front_door.http_api.beginning import SSE_HEADERS, BeginningStream, sse_response
from serve_app.front_door.telemetry.record import RequestRecord
from serve_app.protocol import WholeAnswer, streamed

logger = logging.getLogger("ray.serve")


def owner_of(request: Request) -> str:
    key_id = getattr(request.state, "api_key_id", None)
    return key_id if key_id is not None else NO_OWNER


def responses_event(status: int, message: str, code: str | None, sent: int) -> bytes:
    """A Responses stream's error event, numbered after the ``sent`` events before it."""
    return responses_error_event(status, message, code, sent)


def error_event_of(endpoint: Endpoint) -> ErrorEvent:
    """The error event that ends a failed stream of ``endpoint``."""
    return responses_event if endpoint.method == "responses" else chat_error_event


async def create(
    core: FrontDoor,
    stored: StoredResponses,
    permit: Permit,
    admitted: Admitted,
    deadline: Deadline,
    record: RequestRecord,
) -> Response | BeginningStream:
    """Answer an admitted ``POST /v1/responses`` that is stored (the module's docstring)."""
    owner = record.key_id if record.key_id is not None else NO_OWNER
    if admitted.background:
        return await create_background(core, stored, permit, admitted, owner)

    async def save(response: dict[str, Any]) -> None:  # (the input's items are made once the answer ended)
        try:
            await stored.store.save(
                admitted.payload.request_id, owner, response, input_items(admitted), background=False
            )
        except StoreDown as down:  # the answer is the client's whole; only its keeping failed
            logger.warning("response %s answered and not stored: %s", admitted.payload.request_id, down.message)

    generation = core.generate(permit, admitted, "responses", deadline, record, responses_event)

    def frames() -> AsyncGenerator[str | bytes, None]:
        return stored_at_end(generation, save)

    def respond(first: WholeAnswer | str) -> Response:
        if isinstance(first, str):
            return sse_response(frames())
        headers = {"Retry-After": "1"} if first.status == 503 else None
        return Response(first.body, status_code=first.status, headers=headers, media_type="application/json")

    if admitted.payload.stream:  # (its first item is awaited as the response is written: keep-alives)
        return BeginningStream(generation, core.settings.sse_keepalive_s, respond, frames)
    first = await generation.start()
    if isinstance(first, WholeAnswer) and first.status == 200:
        await save(json.loads(first.body))
    return respond(first)


async def create_background(
    core: FrontDoor, stored: StoredResponses, permit: Permit, admitted: Admitted, owner: str
) -> Response:
    """Keep a background answer ``queued`` and start it under the request's permit (or, past its key's
    cap, once it waited for one); answer with its object, or follow its log (an open call's place)."""
    assert admitted.stored is not None
    payload: Any = admitted.stored.request
    response = queued_response(payload, admitted.entry.name, admitted.entry.max_output_tokens)
    save = stored.store.save(payload.request_id, owner, response, input_items(admitted), background=True)
    background = Admitted(admitted.entry, streamed(admitted.payload), admitted.sequences)
    record = RequestRecord("responses", request_id=payload.request_id, key_id=permit.key_id, stream=True)

    def generation_for(held: Permit, deadline: Deadline) -> Generation:
        return core.generate(held, background, "responses", deadline, record, responses_event)

    async def produce(get_permit: Any) -> None:
        await produce_response(stored.patient, response, get_permit, generation_for, core.settings.time_limits)

    follows = bool(payload.stream)
    if follows:
        core.open_calls.take(permit.key_id)  # before anything is kept: a follower past its bound refuses it all
    try:
        waits = admitted.waits_for_key is not None
        await stored.background.start(
            payload.request_id, permit.key_id, None if waits else permit, admitted.sequences, save, produce
        )
    except BaseException:
        if follows:
            core.open_calls.give_back(permit.key_id)
        raise
    if not follows:
        return JSONResponse(response)
    return FollowedStream(follow(stored.patient, response, -1, stored.lease_s / 2), core.open_calls, permit.key_id)


class FollowedStream(StreamingResponse):
    """An answer's events as a follower reads them, holding an open call's place (taken by its caller)
    until the response ends, however it ends (a client gone before the first byte included)."""

    def __init__(self, events: AsyncIterator[str], open_calls: OpenCalls, key_id: str | None) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._open_calls, self._key_id = open_calls, key_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._open_calls.give_back(self._key_id)


def input_items(admitted: Admitted) -> list[Any]:
    """The request's input as a later turn's history keeps it (made in the checker for a body checked there)."""
    assert admitted.stored is not None
    if admitted.stored.input_items is not None:
        return admitted.stored.input_items
    return request_input_items(admitted.stored.request)


async def stored_at_end(generation: Generation, save: Any) -> AsyncGenerator[str | bytes, None]:
    """A stored answer's stream, written through; its final object, which its last frame ends with,
    kept once it has been sent (nothing is read of the frames before: the stream costs what chat's does)."""
    last: str | bytes = ""
    async for frame in generation.chunks():
        yield frame
        last = frame
    events = split_events(last) if isinstance(last, str) else []
    if events and is_terminal(events[-1]) and (final := event_response(events[-1])) is not None:
        await save(final)


def queued_response(payload: Any, model_name: str, max_output_tokens: int | None) -> dict[str, Any]:
    """A background answer's object before its generation begins, built as vLLM builds its responses."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesResponse

    sampling = SimpleNamespace(
        temperature=payload.temperature if payload.temperature is not None else 1.0,
        top_p=payload.top_p if payload.top_p is not None else 1.0,
        max_tokens=payload.max_output_tokens or max_output_tokens or 0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        logprobs=payload.top_logprobs,
    )
    response = ResponsesResponse.from_request(payload, sampling, model_name, int(time.time()), [], "queued")
    return response.model_dump(mode="json", by_alias=True)


async def _found(request: Request) -> tuple[StoredResponses, StoredResponse]:
    stored: StoredResponses = request.app.state.core.stored
    response_id = checked_id(request.path_params["response_id"], "response_id")
    found = await stored.store.load(response_id, owner_of(request)) if names_stored(response_id) else None
    if found is None or not found.is_response:
        raise APIError(404, f"no stored response has the id {response_id!r}", code="response_not_found")
    return stored, found


def _starting_after(request: Request) -> int:
    value = request.query_params.get("starting_after", "-1")
    if len(value) > 20 or not value.lstrip("-").isdigit():
        raise APIError(400, f"starting_after must be a sequence number, not {quoted(value)!r}", param="starting_after")
    return checked_position(int(value), "starting_after")


async def retrieve(request: Request) -> Response:
    """``GET /v1/responses/{id}``: the response as now; with ``stream=true``, its events after ``starting_after``."""
    stored, found = await _found(request)
    if request.query_params.get("stream", "false").lower() not in ("true", "1"):
        return JSONResponse((await end_if_orphaned(stored.store, found)).response)
    if not found.background:
        raise APIError(400, "only a background response's events are kept to be streamed again", param="stream")
    after = _starting_after(request)
    core: FrontDoor = request.app.state.core
    key_id = getattr(request.state, "api_key_id", None)
    core.open_calls.take(key_id)  # (a follower holds an open call's place, given back as it ends)
    return FollowedStream(follow(stored.patient, found.response, after, stored.lease_s / 2), core.open_calls, key_id)


async def cancel(request: Request) -> Response:
    """``POST /v1/responses/{id}/cancel``: stop a background answer wherever it is generated; its object once ended."""
    stored, found = await _found(request)
    if not found.background:
        raise APIError(400, "only a background response can be cancelled", param="response_id")
    now = await stored.cancel(found)
    if now is None:
        raise APIError(404, f"no stored response has the id {found.response['id']!r}", code="response_not_found")
    return JSONResponse(now.response)


async def delete(request: Request) -> Response:
    """``DELETE /v1/responses/{id}``: forget it (a background answer still generated is cancelled first)."""
    stored, found = await _found(request)
    await stored.delete(found)
    return JSONResponse({"id": found.response["id"], "object": "response", "deleted": True})


def stored_response_routes() -> list[Route]:
    return [
        Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
    ]
