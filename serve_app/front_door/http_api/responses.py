"""The Responses API's HTTP routes: create (foreground, stored, background), retrieve, cancel, delete.

``POST /v1/responses`` passes the same admission as every generation request; a
``previous_response_id`` is turned into its conversation first (:mod:`.history`). Then:

- ``store: false``: answered and forgotten, as chat is;
- stored (OpenAI's default): answered as it comes, and its final object kept with the input
  items it followed, once the answer ends (a client that leaves first leaves nothing stored);
- ``background: true``: kept at once as ``queued`` and generated detached
  (:mod:`.background`); the answer is that object, or with ``stream: true`` its event log
  followed from the start, which a client that drops resumes with ``GET
  /v1/responses/{id}?stream=true&starting_after=N`` through any replica.

Another key's response is a 404, as a missing one is: ids are not secrets, owners are.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from serve_app.errors import APIError, responses_error_event
from serve_app.front_door.admission.deadlines import Deadline
from serve_app.front_door.admission.pipeline import Admitted
from serve_app.front_door.answer_log.history import request_input_items
from serve_app.front_door.answer_log.store import (
    NO_OWNER,
    StoredResponse,
    event_response,
    is_terminal,
    split_events,
)
from serve_app.front_door.core.background import CANCELLED, end_if_orphaned, finish, follow, produce
from serve_app.front_door.core.generation import SSE_HEADERS, call_replica, settle_reply, stream_sse
from serve_app.front_door.core.stored import StoredResponses
from serve_app.front_door.telemetry.record import RequestRecord

CANCEL_WAIT_S = 5.0  # longest a cancel waits for the answer's replica to end it
CANCEL_POLL_S = 0.05


def owner_of(request: Request) -> str:
    key_id = getattr(request.state, "api_key_id", None)
    return key_id if key_id is not None else NO_OWNER


async def create(
    stored: StoredResponses, admitted: Admitted, deadline: Deadline, record: RequestRecord, retry_s: float
) -> Response:
    """Answer an admitted ``POST /v1/responses`` that is stored (the module's docstring)."""
    payload: Any = admitted.payload
    owner = record.key_id if record.key_id is not None else NO_OWNER
    model = admitted.entry.model
    if payload.background:
        response = queued_response(payload, admitted.entry.name, admitted.entry.max_output_tokens)
        queued = stored.store.save(payload.request_id, owner, response, request_input_items(payload), background=True)
        streamed = payload.model_copy(update={"stream": True})
        answer = produce(stored.store, response, model, streamed, deadline, admitted.on_tokens, retry_s)
        await stored.background.run(payload.request_id, answer, queued)
        if not payload.stream:
            return JSONResponse(response)
        return StreamingResponse(
            follow(stored.store, response, -1, stored.lease_s / 2), media_type="text/event-stream", headers=SSE_HEADERS
        )

    async def keep(response: dict[str, Any]) -> None:  # (the input's items are made once the answer ended)
        await stored.store.save(payload.request_id, owner, response, request_input_items(payload), background=False)

    first, rest = await call_replica(model, "responses", payload, deadline, record, retry_s)
    if isinstance(first, str):
        frames = stream_sse(first, rest, deadline, record, admitted.on_tokens, responses_error_event)
        return StreamingResponse(kept_at_end(frames, keep), media_type="text/event-stream", headers=SSE_HEADERS)
    settle_reply(first, record, admitted.on_tokens)
    if first.status == 200:
        await keep(json.loads(first.body))
    headers = {"Retry-After": "1"} if first.status == 503 else None
    return Response(first.body, status_code=first.status, headers=headers, media_type="application/json")


async def kept_at_end(frames: AsyncIterator[str | bytes], keep: Any) -> AsyncIterator[str | bytes]:
    """A stored answer's stream, written through; its final object, which its last frame ends with,
    kept once it has been sent (nothing is read of the frames before: the stream costs what chat's does)."""
    last: str | bytes = ""
    async for frame in frames:
        yield frame
        last = frame
    events = split_events(last) if isinstance(last, str) else []
    if events and is_terminal(events[-1]) and (final := event_response(events[-1])) is not None:
        await keep(final)


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
    stored: StoredResponses = request.app.state.settings.stored_responses
    response_id = request.path_params["response_id"]
    found = await stored.store.load(response_id, owner_of(request))
    if found is None or not found.is_response:
        raise APIError(404, f"no stored response has the id {response_id!r}", code="response_not_found")
    return stored, found


def _starting_after(request: Request) -> int:
    value = request.query_params.get("starting_after", "-1")
    if not value.lstrip("-").isdigit() or int(value) < -1:
        raise APIError(400, f"starting_after must be a sequence number, not {value!r}", param="starting_after")
    return int(value)


async def retrieve(request: Request) -> Response:
    """``GET /v1/responses/{id}``: the response as now; with ``stream=true``, its events after ``starting_after``."""
    stored, found = await _found(request)
    if request.query_params.get("stream", "false").lower() not in ("true", "1"):
        return JSONResponse((await end_if_orphaned(stored.store, found)).response)
    if not found.background:
        raise APIError(400, "only a background response's events are kept to be streamed again", param="stream")
    after = _starting_after(request)
    events = follow(stored.store, found.response, after, stored.lease_s / 2)
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


async def cancel(request: Request) -> Response:
    """``POST /v1/responses/{id}/cancel``: stop a background answer wherever it is generated; its object once ended."""
    stored, found = await _found(request)
    if not found.background:
        raise APIError(400, "only a background response can be cancelled", param="response_id")
    response_id, owner = str(found.response["id"]), owner_of(request)
    now: StoredResponse | None = found
    if found.finished:
        return JSONResponse(found.response)
    if await stored.store.leased(response_id):
        await stored.background.cancel(response_id)
    else:  # its replica is gone: nobody else will end it
        written = len(await stored.store.read(response_id, -1, 0))
        await finish(stored.store, found.response, written, None, CANCELLED)
    try:
        async with asyncio.timeout(CANCEL_WAIT_S):
            while now is not None and not now.finished:
                await asyncio.sleep(CANCEL_POLL_S)  # the store's state is polled: no event says it changed
                now = await stored.store.load(response_id, owner)
    except TimeoutError:
        raise APIError(
            504,
            f"the replica generating {response_id!r} did not confirm the cancel within {CANCEL_WAIT_S:g} s",
            code="cancel_timeout",
        ) from None
    if now is None:
        raise APIError(404, f"no stored response has the id {response_id!r}", code="response_not_found")
    return JSONResponse(now.response)


async def delete(request: Request) -> Response:
    """``DELETE /v1/responses/{id}``: forget it (a background answer still generated is cancelled first)."""
    stored, found = await _found(request)
    response_id = str(found.response["id"])
    if found.background and not found.finished:
        await stored.background.cancel(response_id)
    await stored.store.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def stored_response_routes() -> list[Route]:
    return [
        Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
    ]
