"""How a Stream call's requests are answered: each as a call of its own, or stored and followed.

:class:`StreamRequests` is the :class:`~.multiplexed.RequestRunner` of one ``Stream`` call: each
request runs through the service's own pipeline with the call's metadata (key, ``traceparent``,
``x-request-timeout``), its record, permit and span its own, ``rpc`` "Stream" and its client's id.
A stored one (``store``) is admitted here, kept as an answer in the answer log
(:mod:`.stored_answers`) and generated as a background answer
(:class:`~serve_app.front_door.core.background.BackgroundAnswers`), holding its permit for its
whole life or, past its key's cap, waiting for one; the call follows its log, so a call that drops
does not stop it, and ``Resume`` on any replica reads the rest.

Runs in each model replica.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message

from serve_app.errors import APIError
from serve_app.front_door.admission.deadlines import Deadline, requested_timeout
from serve_app.front_door.admission.endpoints import Endpoint
from serve_app.front_door.admission.pipeline import Admitted
from serve_app.front_door.answer_log.store import NO_OWNER
from serve_app.front_door.core.background import GetPermit
from serve_app.front_door.core.front_door import FrontDoor
from serve_app.front_door.core.generation import Generation
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api import stored_answers
from serve_app.front_door.grpc_api.messages import SHAPES, MessageBody, ResponseWriter, wrap
from serve_app.front_door.telemetry.record import Observer, RequestRecord, end_record
from serve_app.protocol import WholeAnswer


class CallStatus:
    """The status a request on a multiplexed call would give its call: kept apart, so that one
    request's error is its final response's and never the call's (the service's ``GRPCContext``)."""

    def __init__(self, metadata: Mapping[str, str]) -> None:
        self.metadata = dict(metadata)
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


class Answering(Protocol):
    """What the requests of a Stream call use of the gRPC service (:class:`~.service.GenerationService`)."""

    core: FrontDoor
    endpoints: dict[str, Endpoint]
    observers: list[Observer]

    def record(self, kind: str, rpc: str, stream_id: str = "") -> RequestRecord: ...

    def answered(
        self, kind: str, request: Message, context: Any, record: RequestRecord
    ) -> AsyncGenerator[Message, None]: ...

    def messages(
        self,
        generation: Generation,
        first: WholeAnswer | str,
        record: RequestRecord,
        writer: ResponseWriter,
        context: Any,
    ) -> AsyncGenerator[Message, None]: ...

    def end(self, record: RequestRecord, writer: ResponseWriter, context: Any, error: APIError | None) -> Message: ...

    def start_span(self, record: RequestRecord, metadata: Mapping[str, str]) -> None: ...


class StreamRequests:
    """The requests of one Stream call (see the module's docstring)."""

    def __init__(self, service: Answering, metadata: Mapping[str, str], key_id: str | None) -> None:
        self.service = service
        self.metadata = dict(metadata)
        self.key_id = key_id
        self.stored: dict[str, str] = {}  # the call's stored requests' answer ids, by their stream ids

    async def run(
        self, kind: str, request: Message, stream_id: str, store: bool
    ) -> AsyncGenerator[pb.StreamResponse, None]:
        if not store:
            record = self.service.record(kind, "Stream", stream_id)
            index = 0
            async with aclosing(self.service.answered(kind, request, CallStatus(self.metadata), record)) as answered:
                async for response in answered:
                    yield wrap(stream_id, kind, index, response)
                    index += 1
            return
        async with aclosing(self._stored(kind, request, stream_id)) as responses:
            async for response in responses:
                yield response

    async def _stored(self, kind: str, request: Message, stream_id: str) -> AsyncGenerator[pb.StreamResponse, None]:
        """A stored request: admitted here (a refusal is its final alone, nothing kept), then kept and
        generated detached, its log followed to its final."""
        service, core = self.service, self.service.core
        stored = core.stored
        record = service.record(kind, "Stream", stream_id)
        record.key_id = self.key_id
        service.start_span(record, self.metadata)
        writer = ResponseWriter(SHAPES[kind], model=getattr(request, "model", ""))
        answer = stored_answers.new_answer(kind, stream_id)
        try:
            if stored is None:
                raise APIError(400, "this server keeps no answers", "store")
            permit = core.arrive(record, self.key_id)
            try:
                admitted = await core.admit(permit, MessageBody(request), service.endpoints[kind], record)
                produce = self._producer(kind, admitted, record, writer, answer)
                save = stored.store.save(answer["id"], self.key_id or NO_OWNER, answer, [], background=True)
                waits = admitted.waits_for_key is not None
                await stored.background.start(
                    answer["id"], self.key_id, None if waits else permit, admitted.sequences, save, produce
                )
            finally:
                permit.close()  # (a no-op once the answer took it over)
        except APIError as refusal:
            final = service.end(record, writer, CallStatus({}), refusal)
            end_record(record, service.observers)
            yield wrap(stream_id, kind, 0, final)
            return
        self.stored[stream_id] = answer["id"]
        try:
            async for response in stored_answers.follow_answer(stored.patient, answer, -1, stored.lease_s / 2):
                yield response
        finally:
            self.stored.pop(stream_id, None)

    def _producer(
        self, kind: str, admitted: Admitted, record: RequestRecord, writer: ResponseWriter, answer: dict[str, Any]
    ) -> Any:
        """A stored request's generation, as its background answer runs it: its responses logged; its
        record ended with it."""
        service, core = self.service, self.service.core
        assert core.stored is not None
        store = core.stored.patient
        method, status = service.endpoints[kind].method, CallStatus({})
        requested_s = requested_timeout(self.metadata)

        async def responses(get_permit: GetPermit) -> AsyncGenerator[Message, None]:
            try:
                permit = await get_permit()
                deadline = Deadline.start(core.settings.time_limits, requested_s)  # (its time runs from here)
                generation = core.generate(permit, admitted, method, deadline, record)
                first = await generation.start()
            except APIError as refusal:
                yield service.end(record, writer, status, refusal)
                return
            async with aclosing(service.messages(generation, first, record, writer, status)) as messages:
                async for message in messages:
                    yield message

        async def produce(get_permit: GetPermit) -> None:
            try:
                await stored_answers.produce(store, answer, responses(get_permit))
            finally:
                end_record(record, service.observers)

        return produce

    async def cancel(self, stream_id: str) -> bool:
        stored = self.service.core.stored
        if (answer_id := self.stored.get(stream_id)) is None or stored is None:
            return False
        await stored.background.cancel(answer_id)
        return True

    def refuse(self, kind: str, request: Message, stream_id: str, error: APIError) -> pb.StreamResponse:
        service = self.service
        record = service.record(kind, "Stream", stream_id)
        record.key_id = self.key_id
        final = service.end(record, ResponseWriter(SHAPES[kind], getattr(request, "model", "")), CallStatus({}), error)
        end_record(record, service.observers)
        return wrap(stream_id, kind, 0, final)

    def final(self, kind: str, request: Message, stream_id: str, index: int, error: APIError) -> pb.StreamResponse:
        return wrap(
            stream_id, kind, index, ResponseWriter(SHAPES[kind], getattr(request, "model", "")).final(None, error)
        )
