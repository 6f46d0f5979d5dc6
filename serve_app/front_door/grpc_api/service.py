"""The gRPC front door: ``glm4serve.v1.Generation`` and ``grpc.health.v1.Health``, answered in the model replica.

Ray Serve's gRPC proxy receives each call and hands it, with a copy of its
metadata, to the model deployment's method of the same name
(:class:`serve_app.deployments.model_server.ModelServer`), which runs :class:`GenerationService`.
A call goes the way an HTTP request goes: API key, validation by the same code
(:mod:`serve_app.front_door.admission.pipeline`), rate limits, a replica through
:func:`~serve_app.front_door.core.generation.call_replica`, its stream read by
:func:`~serve_app.front_door.core.generation.stream_sse`, and the same record for
metrics, the log line and the span. Only the ends differ:

* every stream ends with exactly one response whose ``final`` is set: it carries
  the finish reasons and usage, or the error that ended the stream;
* a call that ends in an error also ends with that error's gRPC status
  (:func:`serve_app.errors.grpc_status`), refused before streaming or not, and
  a refusal worth retrying (429, 503) carries ``retry-after`` (seconds) and
  ``grpc-retry-pushback-ms`` in its trailing metadata.

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
from contextlib import ExitStack, aclosing
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from serve_app.errors import APIError, grpc_status
from serve_app.front_door.admission.auth import authenticate
from serve_app.front_door.admission.capacity import SlotHold
from serve_app.front_door.admission.deadlines import Deadline, requested_timeout
from serve_app.front_door.admission.endpoints import Endpoint
from serve_app.front_door.admission.models import ModelCatalog
from serve_app.front_door.admission.pipeline import admit
from serve_app.front_door.admission.settings import IngressSettings
from serve_app.front_door.answer_log.store import NO_OWNER
from serve_app.front_door.core.background import end_if_orphaned
from serve_app.front_door.core.generation import call_replica, settle_reply, stream_sse
from serve_app.front_door.core.readiness import Readiness
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api import kept_answers
from serve_app.front_door.grpc_api.messages import (
    SHAPES,
    MessageBody,
    ResponseWriter,
    StreamShape,
    error_of_event,
    wrap,
)
from serve_app.front_door.grpc_api.multiplexed import MultiplexedCall
from serve_app.front_door.telemetry.record import RequestRecord, end_record
from serve_app.observability import tracing
from serve_app.protocol import Reply

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
    """The gRPC API's calls, over the same model catalog and settings as the HTTP routes."""

    def __init__(
        self,
        models: ModelCatalog[Any],
        settings: IngressSettings,
        endpoints: list[Endpoint],
        readiness: ReadinessReader,
    ) -> None:
        self.models = models
        self.settings = settings
        self.endpoints = {e.method: e for e in endpoints}
        self.readiness = readiness
        self.observers = settings.observers()

    def chat_completion(self, request: Message, context: GRPCContext) -> AsyncIterator[Message]:
        return self._generate("chat", request, context, "ChatCompletion")

    def completion(self, request: Message, context: GRPCContext) -> AsyncIterator[Message]:
        return self._generate("completion", request, context, "Completion")

    async def stream(self, requests: AsyncIterator[pb.StreamRequest], context: GRPCContext) -> AsyncIterator[Message]:
        """Generation/Stream: many requests on one call (:mod:`.multiplexed`), each admitted as a call
        of its own would be. A call without an accepted key ends UNAUTHENTICATED before any of its
        messages is read."""
        metadata = dict(context.invocation_metadata())
        if self.settings.api_keys is not None:
            try:
                authenticate(self.settings.api_keys, metadata)
            except APIError as refusal:
                context.set_code(grpc_status(refusal.status))
                context.set_details(refusal.message)
                return
        call = MultiplexedCall(StreamRequests(self, metadata), self.settings.grpc_stream)
        async with aclosing(call.responses(requests)) as responses:
            async for response in responses:
                yield response

    async def resume(self, request: pb.ResumeRequest, context: GRPCContext) -> AsyncIterator[pb.StreamResponse]:
        """Generation/Resume: a kept answer's responses after ``after_index``, read from its log on
        whichever replica takes the call, to its final. Another key's answer is NOT_FOUND, as a
        missing one is; an answer that ended before ``after_index`` ends the call with nothing."""
        metadata = dict(context.invocation_metadata())
        stored = self.settings.stored_responses
        try:
            owner = _key_id(self.settings, metadata) or NO_OWNER
            if stored is None:
                raise APIError(400, "this server keeps no answers", "answer_id")
            if request.after_index < -1:
                raise APIError(400, f"after_index must be -1 or more, not {request.after_index}", "after_index")
            found = await stored.store.load(request.answer_id, owner)
            if found is None or found.response.get("object") != kept_answers.OBJECT:
                raise kept_answers.not_found(request.answer_id)
        except APIError as refusal:
            context.set_code(grpc_status(refusal.status))
            context.set_details(refusal.message)
            return
        found = await end_if_orphaned(stored.store, found)
        wait_s = stored.lease_s / 2
        async for response in kept_answers.follow_answer(stored.store, found.response, request.after_index, wait_s):
            yield response

    def _generate(
        self, kind: str, request: Message, context: GRPCContext, rpc: str, stream_id: str = ""
    ) -> AsyncGenerator[Message, None]:
        shape, endpoint = SHAPES[kind], self.endpoints[kind]
        return self._answered(shape, endpoint, request, context, self._record(endpoint, rpc, stream_id))

    def _record(self, endpoint: Endpoint, rpc: str, stream_id: str) -> RequestRecord:
        metrics = self.settings.metrics
        return RequestRecord(
            endpoint.method,
            protocol="grpc",
            rpc=rpc,
            stream_id=stream_id,
            stream=True,
            on_phase=metrics.moved if metrics is not None else None,
            keep_content=self.settings.log_content,
        )

    async def _answered(
        self, shape: StreamShape, endpoint: Endpoint, request: Message, context: GRPCContext, record: RequestRecord
    ) -> AsyncGenerator[Message, None]:
        metadata = dict(context.invocation_metadata())
        attributes = {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": record.rpc}
        if record.stream_id:
            attributes["glm4serve.stream_id"] = record.stream_id
        record.span = tracing.start_request_span(f"{SERVICE}/{record.rpc}", metadata, attributes)
        writer = ResponseWriter(shape, model=getattr(request, "model", ""))
        try:
            async with aclosing(self._answer(endpoint, request, metadata, record, writer, context)) as responses:
                async for response in responses:
                    yield response
        finally:
            end_record(record, self.observers)

    async def _answer(
        self,
        endpoint: Endpoint,
        request: Message,
        metadata: Mapping[str, str],
        record: RequestRecord,
        writer: ResponseWriter,
        context: GRPCContext,
    ) -> AsyncGenerator[Message, None]:
        settings = self.settings
        with ExitStack() as holding:  # a place among the replica's generation requests, held to the end
            try:
                if settings.api_keys is not None:
                    record.key_id = authenticate(settings.api_keys, metadata)
                hold: SlotHold | None = None
                if settings.generation_slots is not None:  # as HTTP: after the key, so a refused key takes none
                    hold = holding.enter_context(settings.generation_slots.hold(record, record.key_id))
                deadline = Deadline.start(settings.time_limits, requested_timeout(metadata))
                admitted = await admit(MessageBody(request), endpoint, self.models, settings, record, hold)
                first, rest = await call_replica(
                    admitted.entry.model,
                    endpoint.method,
                    admitted.payload,
                    deadline,
                    record,
                    settings.unavailable_retry_s,
                )
            except APIError as refusal:
                yield self._end(record, writer, context, refusal)
                return
            except Exception as exc:  # a bug here must still end the stream as the API promises
                logger.exception("unhandled error in the gRPC service", exc_info=exc)
                yield self._end(record, writer, context, APIError(500, "internal server error", code="internal_error"))
                return
            if isinstance(first, Reply):  # refused by the replica before any token (too long a prompt, ...)
                settle_reply(first, record, admitted.on_tokens)
                yield self._end(record, writer, context, _error_of_reply(first))
                return
            error: APIError | None = None
            # The stream ends after an error event, once it has read the engine's outcome.
            async with aclosing(stream_sse(first, rest, deadline, record, admitted.on_tokens)) as chunks:
                async for chunk in chunks:
                    if record.first_byte_at is None:
                        record.first_byte_at = time.monotonic()
                    text = chunk if isinstance(chunk, str) else chunk.decode()
                    if record.keep_content:
                        record.response_bytes.append(text.encode())
                    response, error = writer.response(text)
                    if response is not None:
                        yield response
            yield self._end(record, writer, context, error)

    def _end(
        self, record: RequestRecord, writer: ResponseWriter, context: GRPCContext, error: APIError | None
    ) -> Message:
        """The final response; with an error, also the call's status (and a retry hint when retrying helps)."""
        record.completed = True
        if error is None:
            record.status = record.status or 200
            return writer.final(record.outcome)
        record.failed(error.status, error.code)
        context.set_code(grpc_status(error.status))
        context.set_details(error.message)
        if error.status in (429, 503):
            seconds = int((error.headers or {}).get("Retry-After", RETRY_AFTER_S))
            hint = [("retry-after", str(seconds)), ("grpc-retry-pushback-ms", str(seconds * 1000))]
            context.set_trailing_metadata(list(context.trailing_metadata()) + hint)
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


class CallStatus:
    """The status a request on a multiplexed call would give its call: kept apart, so that one
    request's error is its final response's and never the call's (:class:`GRPCContext`)."""

    def __init__(self, metadata: dict[str, str]) -> None:
        self.metadata = metadata
        self.trailers: list[tuple[str, str]] = []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return list(self.metadata.items())

    def set_code(self, code: grpc.StatusCode) -> None:
        pass

    def set_details(self, details: str) -> None:
        pass

    def trailing_metadata(self) -> list[tuple[str, str]]:
        return self.trailers

    def set_trailing_metadata(self, metadata: list[tuple[str, str]]) -> None:
        self.trailers = metadata


class StreamRequests:
    """How a Stream call's requests are answered (:class:`~.multiplexed.RequestRunner`): each as a call
    of its own with the call's metadata (key, ``traceparent``, ``x-request-timeout``), its record
    and span its own, ``rpc`` "Stream" and its client's id; a kept one as a background answer
    (:mod:`.kept_answers`), which the call follows in its log."""

    def __init__(self, service: GenerationService, metadata: dict[str, str]) -> None:
        self.service = service
        self.metadata = metadata
        self.kept: dict[str, str] = {}  # the call's kept requests' answer ids, by their stream ids

    async def run(
        self, kind: str, request: Message, stream_id: str, keep: bool
    ) -> AsyncGenerator[pb.StreamResponse, None]:
        responses = self.service._generate(kind, request, CallStatus(self.metadata), "Stream", stream_id)
        if not keep:
            index = 0
            async with aclosing(responses) as answered:
                async for response in answered:
                    yield wrap(stream_id, kind, index, response)
                    index += 1
            return
        stored = self.service.settings.stored_responses
        if stored is None:
            await responses.aclose()
            yield self.refuse(kind, request, stream_id, APIError(400, "this server keeps no answers", "keep"))
            return
        answer = kept_answers.new_answer(kind, stream_id)
        owner = _key_id(self.service.settings, self.metadata) or NO_OWNER
        saved = stored.store.save(answer["id"], owner, answer, [], background=True)
        try:
            await stored.background.run(answer["id"], kept_answers.produce(stored.store, answer, responses), saved)
        except APIError as refusal:  # this replica generates as many as it may
            yield self.refuse(kind, request, stream_id, refusal)
            return
        self.kept[stream_id] = answer["id"]
        try:
            async for response in kept_answers.follow_answer(stored.store, answer, -1, stored.lease_s / 2):
                yield response
        finally:
            self.kept.pop(stream_id, None)

    async def cancel(self, stream_id: str) -> bool:
        stored = self.service.settings.stored_responses
        if (answer_id := self.kept.get(stream_id)) is None or stored is None:
            return False
        await stored.background.cancel(answer_id)
        return True

    def refuse(self, kind: str, request: Message, stream_id: str, error: APIError) -> pb.StreamResponse:
        service = self.service
        record = service._record(service.endpoints[kind], "Stream", stream_id)
        record.key_id = _key_id(service.settings, self.metadata)
        final = service._end(record, ResponseWriter(SHAPES[kind], getattr(request, "model", "")), CallStatus({}), error)
        end_record(record, service.observers)
        return wrap(stream_id, kind, 0, final)

    def final(self, kind: str, request: Message, stream_id: str, index: int, error: APIError) -> pb.StreamResponse:
        return wrap(
            stream_id, kind, index, ResponseWriter(SHAPES[kind], getattr(request, "model", "")).final(None, error)
        )


def _key_id(settings: IngressSettings, metadata: Mapping[str, str]) -> str | None:
    """The call's key's id (the call was let in with it)."""
    return authenticate(settings.api_keys, metadata) if settings.api_keys is not None else None


def _error_of_reply(reply: Reply) -> APIError:
    """The error of a replica's whole-body refusal, with the Retry-After the HTTP API would send."""
    error = error_of_event(json.loads(reply.body))
    error.status = reply.status
    if reply.status == 503:
        error.headers = {"Retry-After": str(RETRY_AFTER_S)}
    return error
