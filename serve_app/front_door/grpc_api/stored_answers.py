"""Stored answers of the gRPC API (``StreamRequest.store``), in the Responses API's store and log.

A kept request is generated as a background answer is (:mod:`serve_app.front_door.core.background`):
as a task of the replica that took it, detached from the call that asked, its lease renewed while
it runs, stopped by a cancel from any replica. Each of its responses is appended to its log
under its ``index``; the call that asked follows the log, and so does ``Resume`` on any replica
after the last index its client received, so nothing is lost or repeated. The stored object is
``{"id", "object": "grpc.answer", "status", "kind", "stream_id"}``; its owner, expiry and the
per-key bound are a stored response's.

A log entry is ``event: grpc.response`` (or ``grpc.final``, the last) whose data is the
:class:`StreamResponse`'s bytes in base64. A log another writer ended (the producer's replica
died: ``replica_lost``; or a cancel found no replica to stop it) ends with the Responses API's
``error`` event instead, which a reader turns into the final response with that error.

Runs in each model replica.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from google.protobuf.message import Message

from serve_app.errors import APIError
from serve_app.front_door.answer_log.follow import CANCELLED, finish, follow
from serve_app.front_door.answer_log.store import ResponseStore, StoreDown, event_type
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api.messages import SHAPES, ResponseWriter, error_of_event, wrap

logger = logging.getLogger("ray.serve")

OBJECT = "grpc.answer"
RESPONSE_EVENT, FINAL_EVENT = "grpc.response", "grpc.final"
STATUS_BY_CODE = {"response_cancelled": 499, "response_gone": 410}  # (their error ``type`` says 400)


def new_answer(kind: str, stream_id: str) -> dict[str, Any]:
    """A kept answer's stored object, as it is before it runs."""
    return {
        "id": "ans_" + uuid.uuid4().hex,
        "object": OBJECT,
        "status": "queued",
        "kind": kind,
        "stream_id": stream_id,
        "created_at": int(time.time()),
    }


def stream_response(answer: dict[str, Any], index: int, response: Message) -> pb.StreamResponse:
    """One of a kept answer's responses as its calls receive it."""
    return wrap(answer["stream_id"], answer["kind"], index, response, answer["id"])


def encode(response: pb.StreamResponse, final: bool) -> str:
    kind = FINAL_EVENT if final else RESPONSE_EVENT
    return f"event: {kind}\ndata: {base64.b64encode(response.SerializeToString()).decode()}\n\n"


def decode(event: str, answer: dict[str, Any], index: int) -> pb.StreamResponse:
    """A log entry as the response it stands for (an ``error`` event: the final response with its error)."""
    data = event.partition("\ndata: ")[2].strip()
    if event_type(event) in (RESPONSE_EVENT, FINAL_EVENT):
        return pb.StreamResponse.FromString(base64.b64decode(data))
    fields = json.loads(data)
    error = error_of_event(fields)
    error.status = STATUS_BY_CODE.get(error.code or "", error.status)
    return stream_response(answer, index, ResponseWriter(SHAPES[answer["kind"]], model="").final(None, error))


async def produce(store: ResponseStore, answer: dict[str, Any], responses: AsyncGenerator[Message, None]) -> None:
    """Generate a kept answer: each response appended to its log under its index, then its object
    kept ``completed`` (or ``failed``, its final carrying an error; ``cancelled`` by a cancel)."""
    written = 0
    status: str | None = None
    failure = None
    try:
        async for response in responses:
            final = bool(getattr(response, "final", False))
            if not await store.append(answer["id"], written, encode(stream_response(answer, written, response), final)):
                return  # another writer ended it (its lease lapsed while this replica was stalled)
            if written == 0:
                await store.update(answer["id"], answer | {"status": "in_progress"})
            written += 1
            if final:
                status = "failed" if response.HasField("error") else "completed"
    except asyncio.CancelledError:
        failure = CANCELLED
    except Exception as exc:  # the store failed under it (past its outage's wait): readers learn it from the lease
        logger.exception("kept answer %s could not be logged", answer["id"], exc_info=exc)
        return
    finally:
        await responses.aclose()
    ended = answer | {"status": status} if status is not None else None
    try:
        await finish(store, answer, written, ended, failure)
    except StoreDown as down:
        logger.warning("kept answer %s could not be ended: %s", answer["id"], down.message)


async def follow_answer(
    store: ResponseStore, answer: dict[str, Any], after: int, wait_s: float
) -> AsyncIterator[pb.StreamResponse]:
    """A kept answer's responses after index ``after``, to its final (:func:`follow`: one whose
    producer's replica died ends with ``replica_lost``)."""
    index = after + 1
    async for event in follow(store, answer, after, wait_s):
        yield decode(event, answer, index)
        index += 1


def not_found(answer_id: str) -> APIError:
    return APIError(404, f"no kept answer has the id {answer_id!r}", "answer_id", "answer_not_found")
