"""The gRPC door: ``glm4serve.v1.Generation`` and ``grpc.health.v1.Health``, answered in the model replica.

Serve hands each call, with a copy of its metadata, to the model deployment's method of the same
name (:class:`serve_app.deployments.model_server.ModelServer`), which runs :class:`GenerationService`.
A call goes the way an HTTP request goes, through the same core
(:class:`~serve_app.front_door.core.front_door.FrontDoor`): API key, a permit from its arrival,
admission by the same code with the same limits, the answer (a
:class:`~serve_app.front_door.core.generation.Generation`), and the same record for metrics, the
log line and the span. Only the ends differ:

* every stream ends with exactly one response whose ``final`` is set: it carries
  the finish reasons and usage, or the error that ended the stream;
* a call that ends in an error also ends with that error's gRPC status
  (:func:`serve_app.errors.grpc_status`), refused before streaming or not, and
  a refusal worth retrying (429, 503) carries ``retry-after`` (seconds) and
  ``grpc-retry-pushback-ms`` in its trailing metadata.

A ``Stream`` call carries many requests (:mod:`.stream_requests`, :mod:`.multiplexed`) and a
``Resume`` call reads a stored answer's log (:mod:`.stored_answers`); each holds an open call's
place (:mod:`serve_app.front_door.admission.open_calls`) for as long as it is open, and each
request on a Stream call holds its own permit.

The client's deadline is gRPC's own: when it passes, the proxy cancels the call,
which cancels it here and aborts the request in the engine, as a client that
leaves does; ``x-request-timeout`` metadata shortens the server's limits as the
HTTP header does.

Runs in each model replica.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import aclosing
from typing import Protocol

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from serve_app.errors import APIError, grpc_status
from serve_app.front_door.admission.auth import authenticate
from serve_app.front_door.admission.deadlines import Deadline, requested_timeout
from serve_app.front_door.admission.echoed import checked_id, checked_position, names_stored
from serve_app.front_door.admission.endpoints import Endpoint
from serve_app.front_door.answer_log.follow import end_if_orphaned
from serve_app.front_door.answer_log.store import NO_OWNER, StoredResponse
from serve_app.front_door.core.front_door import FrontDoor
from serve_app.front_door.core.generation import Generation
from serve_app.front_door.core.readiness import Readiness
from serve_app.front_door.core.stored import StoredResponses
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api import stored_answers
from serve_app.front_door.grpc_api.messages import SHAPES, MessageBody, ResponseWriter, error_of_event
from serve_app.front_door.grpc_api.multiplexed import MultiplexedCall
from serve_app.front_door.grpc_api.stream_requests import StreamRequests
from serve_app.front_door.telemetry.record import RequestRecord, end_record
from serve_app.observability import tracing
from serve_app.protocol import WholeAnswer

logger = logging.getLogger("ray.serve")

SERVICE = "glm4serve.v1.Generation"
RETRY_AFTER_S = 1  # what a refusal worth retrying tells the client to wait, as the HTTP API's Retry-After


class GRPCContext(Protocol):
    """What the service uses of Ray Serve's ``RayServegRPCContext``: a copy of the call's context,
    sent back to the proxy with each response, which applies its code, details and trailing metadata."""

    def invocation_metadata(self) -> list[tuple[str, str]]: ...

    def set_code(self, code: grpc.StatusCode) -> None: ...

    def set_details(self, details: str) -> None: ...

    def trailing_metadata(self) -> list[tuple[str, str]]: ...

    def set_trailing_metadata(self, metadata: list[tuple[str, str]]) -> None: ...


class ReadinessReader(Protocol):
    def readiness(self) -> Readiness: ...


class GenerationService:
    """The gRPC API's calls, over the same core as the HTTP routes."""

    def __init__(self, core: FrontDoor, endpoints: list[Endpoint], readiness: ReadinessReader) -> None:
        self.core = core
        self.endpoints = {e.method: e for e in endpoints}
        self.readiness = readiness
        self.observers = core.observers()

    def chat_completion(self, request: Message, context: GRPCContext) -> AsyncIterator[Message]:
        return self.answered("chat", request, context, self.record("chat", "ChatCompletion"))

    def completion(self, request: Message, context: GRPCContext) -> AsyncIterator[Message]:
        return self.answered("completion", request, context, self.record("completion", "Completion"))

    def key_of(self, metadata: Mapping[str, str]) -> str | None:
        """The call's key's id (UNAUTHENTICATED's 401 when keys are configured and it has none accepted)."""
        return authenticate(self.core.api_keys, metadata) if self.core.api_keys is not None else None

    async def stream(self, requests: AsyncIterator[pb.StreamRequest], context: GRPCContext) -> AsyncIterator[Message]:
        """Generation/Stream: many requests on one call (:mod:`.multiplexed`), each admitted as a call
        of its own would be. A call without an accepted key ends UNAUTHENTICATED before any of its
        messages is read; one past its key's or the replica's open calls, RESOURCE_EXHAUSTED."""
        metadata = dict(context.invocation_metadata())
        try:
            key_id = self.key_of(metadata)
            self.core.open_calls.take(key_id)
        except APIError as refusal:
            set_status(context, refusal)
            return
        try:
            call = MultiplexedCall(StreamRequests(self, metadata, key_id), self.core.settings.grpc_stream)
            async with aclosing(call.responses(requests)) as responses:
                async for response in responses:
                    yield response
            if call.idled:
                context.set_code(grpc.StatusCode.UNAVAILABLE)
                context.set_details(call.idled)
        finally:
            self.core.open_calls.give_back(key_id)

    async def resume(self, request: pb.ResumeRequest, context: GRPCContext) -> AsyncIterator[pb.StreamResponse]:
        """Generation/Resume: a stored answer's responses after ``after_index``, read from its log on
        whichever replica takes the call, to its final. Another key's answer is NOT_FOUND, as a
        missing one is; an answer that ended before ``after_index`` ends the call with nothing."""
        metadata = dict(context.invocation_metadata())
        try:
            key_id = self.key_of(metadata)
            checked_position(request.after_index, "after_index")
            stored, found = await self.stored_answer(request.answer_id, key_id)
            self.core.open_calls.take(key_id)
        except APIError as refusal:
            set_status(context, refusal)
            return
        try:
            found = await end_if_orphaned(stored.store, found)
            wait_s = stored.lease_s / 2
            answer = found.response
            async for response in stored_answers.follow_answer(stored.patient, answer, request.after_index, wait_s):
                yield response
        finally:
            self.core.open_calls.give_back(key_id)

    async def stored_answer(self, answer_id: str, key_id: str | None) -> tuple[StoredResponses, StoredResponse]:
        """The key's stored answer of that id (NOT_FOUND for another key's, as for a missing one)."""
        stored = self.core.stored
        if stored is None:
            raise APIError(400, "this server keeps no answers", "answer_id")
        stored_id = checked_id(answer_id, "answer_id")
        found = await stored.store.load(stored_id, key_id or NO_OWNER) if names_stored(stored_id) else None
        if found is None or found.response.get("object") != stored_answers.OBJECT:
            raise stored_answers.not_found(answer_id)
        return stored, found

    async def cancel_answer(self, request: pb.AnswerRequest, context: GRPCContext) -> pb.AnswerState:
        """Generation/CancelAnswer: stop a stored answer wherever it runs (its Stream call may be gone),
        as the Responses API's cancel does; its state once it ended."""
        try:
            key_id = self.key_of(dict(context.invocation_metadata()))
            stored, found = await self.stored_answer(request.answer_id, key_id)
            now = await stored.cancel(found)
            if now is None:
                raise stored_answers.not_found(request.answer_id)
        except APIError as refusal:
            set_status(context, refusal)
            return pb.AnswerState()
        return pb.AnswerState(answer_id=request.answer_id, status=now.status)

    async def delete_answer(self, request: pb.AnswerRequest, context: GRPCContext) -> pb.AnswerState:
        """Generation/DeleteAnswer: forget a stored answer and its log (stopped first if it runs)."""
        try:
            key_id = self.key_of(dict(context.invocation_metadata()))
            stored, found = await self.stored_answer(request.answer_id, key_id)
            await stored.delete(found)
        except APIError as refusal:
            set_status(context, refusal)
            return pb.AnswerState()
        return pb.AnswerState(answer_id=request.answer_id, status=found.status, deleted=True)

    def record(self, kind: str, rpc: str, stream_id: str = "") -> RequestRecord:
        return self.core.new_record(
            self.endpoints[kind].method, protocol="grpc", rpc=rpc, stream_id=stream_id, stream=True
        )

    async def answered(
        self, kind: str, request: Message, context: GRPCContext, record: RequestRecord
    ) -> AsyncGenerator[Message, None]:
        """A call's (or a Stream request's) responses, the last one final; its record ended with it."""
        metadata = dict(context.invocation_metadata())
        self.start_span(record, metadata)
        writer = ResponseWriter(SHAPES[kind], model=getattr(request, "model", ""))
        try:
            async with aclosing(self._answer(kind, request, metadata, record, writer, context)) as responses:
                async for response in responses:
                    yield response
        finally:
            end_record(record, self.observers)

    def start_span(self, record: RequestRecord, metadata: Mapping[str, str]) -> None:
        """The request's span, a child of the call's ``traceparent``."""
        attributes = {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": record.rpc}
        if record.stream_id:
            attributes["glm4serve.stream_id"] = record.stream_id
        record.span = tracing.start_request_span(f"{SERVICE}/{record.rpc}", metadata, attributes)

    async def admitted_generation(
        self, kind: str, request: Message, metadata: Mapping[str, str], record: RequestRecord
    ) -> tuple[Generation, WholeAnswer | str]:
        """Admit a request and begin its answer (raises the :class:`APIError` of a refusal)."""
        core, endpoint = self.core, self.endpoints[kind]
        record.key_id = self.key_of(metadata)
        permit = core.arrive(record, record.key_id)  # as HTTP: after the key, so a refused key takes none
        try:
            deadline = Deadline.start(core.settings.time_limits, requested_timeout(metadata))
            admitted = await core.admit(permit, MessageBody(request), endpoint, record)
            generation = core.generate(permit, admitted, endpoint.method, deadline, record)
        except BaseException:
            permit.close()
            raise
        return generation, await generation.start()

    async def _answer(
        self,
        kind: str,
        request: Message,
        metadata: Mapping[str, str],
        record: RequestRecord,
        writer: ResponseWriter,
        context: GRPCContext,
    ) -> AsyncGenerator[Message, None]:
        try:
            generation, first = await self.admitted_generation(kind, request, metadata, record)
        except APIError as refusal:
            yield self.end(record, writer, context, refusal)
            return
        except Exception as exc:  # a bug here must still end the stream as the API promises
            logger.exception("unhandled error in the gRPC service", exc_info=exc)
            yield self.end(record, writer, context, APIError(500, "internal server error", code="internal_error"))
            return
        async with aclosing(self.messages(generation, first, record, writer, context)) as messages:
            async for message in messages:
                yield message

    async def messages(
        self,
        generation: Generation,
        first: WholeAnswer | str,
        record: RequestRecord,
        writer: ResponseWriter,
        context: GRPCContext,
    ) -> AsyncGenerator[Message, None]:
        """An answer that began with ``first`` as response messages, the last one final."""
        if isinstance(first, WholeAnswer):  # refused by the engine before any token (too long a prompt, ...)
            yield self.end(record, writer, context, _error_of_whole_answer(first))
            return
        error: APIError | None = None
        # The stream ends after an error event, once it has read the engine's outcome.
        async with aclosing(generation.chunks()) as chunks:
            async for chunk in chunks:
                if record.first_byte_at is None:
                    record.first_byte_at = time.monotonic()
                text = chunk if isinstance(chunk, str) else chunk.decode()
                if record.log_content:
                    record.response_bytes.append(text.encode())
                response, error = writer.response(text)
                if response is not None:
                    yield response
        yield self.end(record, writer, context, error)

    def end(
        self, record: RequestRecord, writer: ResponseWriter, context: GRPCContext, error: APIError | None
    ) -> Message:
        """The final response; with an error, also the call's status (and a retry hint when retrying helps)."""
        record.completed = True
        if error is None:
            record.status = record.status or 200
            return writer.final(record.outcome)
        record.failed(error.status, error.code)
        set_status(context, error)
        return writer.final(record.outcome, error)

    def check(self, request: health_pb2.HealthCheckRequest, context: GRPCContext) -> health_pb2.HealthCheckResponse:
        """grpc.health.v1.Health/Check, as ``GET /health``: SERVING only when every model has a
        healthy replica (NOT_SERVING with the reason as details); NOT_FOUND for another service."""
        if request.service not in ("", SERVICE):
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(f"unknown service {request.service!r}")
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        readiness = self.readiness.readiness()
        if not readiness.ready:
            context.set_details(readiness.problem())
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def watch(
        self, request: health_pb2.HealthCheckRequest, context: GRPCContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """grpc.health.v1.Health/Watch is not offered: a watch would hold a place in the replica for
        as long as its client lives (probes use Check). UNIMPLEMENTED."""
        context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        context.set_details("Watch is not offered; call Check")
        raise NotImplementedError("grpc.health.v1.Health/Watch")
        yield  # an async generator, as a server-streaming method must be


def set_status(context: GRPCContext, error: APIError) -> None:
    """A call's status for ``error``, with a retry hint in its trailing metadata when retrying helps."""
    context.set_code(grpc_status(error.status))
    context.set_details(error.message)
    if error.status in (429, 503):
        seconds = int((error.headers or {}).get("Retry-After", RETRY_AFTER_S))
        hint = [("retry-after", str(seconds)), ("grpc-retry-pushback-ms", str(seconds * 1000))]
        context.set_trailing_metadata(list(context.trailing_metadata()) + hint)


def _error_of_whole_answer(whole: WholeAnswer) -> APIError:
    """The error of a replica's whole-body refusal, with the Retry-After the HTTP API would send."""
    error = error_of_event(json.loads(whole.body))
    error.status = whole.status
    if whole.status == 503:
        error.headers = {"Retry-After": str(RETRY_AFTER_S)}
    return error
