"""The gRPC service's own decisions with fake model handles (tests/unit/front_door/fakes.py): each way a call
ends gives one final response and the status, trailing metadata and record the API promises.
The real path (Serve's gRPC proxy, the engine) is proven in tests/e2e/test_grpc.py."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2

from serve_app.deployments.rate_limiter import RateLedger
from serve_app.errors import APIError
from serve_app.front_door.admission import json_body
from serve_app.front_door.admission.auth import APIKeys
from serve_app.front_door.admission.capacity import FairShare, GenerationSlots
from serve_app.front_door.admission.deadlines import TimeLimits
from serve_app.front_door.admission.endpoints import default_endpoints
from serve_app.front_door.admission.large_bodies import LARGE_BODY_BYTES, BodyChecker
from serve_app.front_door.admission.models import ModelCatalog, ModelEntry
from serve_app.front_door.admission.pipeline import BodyRules
from serve_app.front_door.admission.rate_limits import KeyLimits
from serve_app.front_door.admission.settings import IngressSettings
from serve_app.front_door.core.front_door import FrontDoor
from serve_app.front_door.core.readiness import Readiness
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api.service import GenerationService
from serve_app.protocol import Outcome, WholeAnswer
from tests.unit.front_door.fakes import (
    HANG,
    KEYS,
    SHORT,
    FakeContext,
    FakeModel,
    FixedReadiness,
    LedgerHandle,
    RecordingMetrics,
)

MODEL = "glm-4-9b-chat"


def sse(document: dict) -> str:
    return f"data: {json.dumps(document)}\n\n"


def chunk(text: str, tokens: int, finish_reason: str | None = None) -> str:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish_reason}
    usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
    return sse({"id": "chatcmpl-x", "choices": [choice], "usage": usage})


def service(
    items: list[Any],
    limits: TimeLimits | None = None,
    key_limits: KeyLimits | None = None,
    keys: bool = False,
    slots: GenerationSlots | None = None,
    body_checker: BodyChecker | None = None,
) -> tuple[GenerationService, FakeModel, RecordingMetrics]:
    handle = FakeModel([items])
    router = ModelCatalog({MODEL: ModelEntry(MODEL, handle, 1024)})
    metrics = RecordingMetrics()
    settings = IngressSettings(
        max_request_body_bytes=1 << 20,
        time_limits=limits or TimeLimits(600, 120),
        unavailable_retry_s=0.0,
        log_requests=False,
    )
    rules = BodyRules(settings, router, key_limits, body_checker or BodyChecker())
    keyed = APIKeys("test keys", lambda: KEYS) if keys else None
    core = FrontDoor(rules, api_keys=keyed, slots=slots, metrics=metrics)
    readiness = FixedReadiness(Readiness({MODEL: True}, age_s=0.5, max_age_s=30))
    return GenerationService(core, default_endpoints(), readiness), handle, metrics


def request(**fields: Any) -> pb.ChatCompletionRequest:
    return pb.ChatCompletionRequest(model=MODEL, messages=[pb.Message(role="user", content="hi")], **fields)


def run(svc: GenerationService, message: Any, context: FakeContext) -> list[Any]:
    async def read() -> list[Any]:
        return [r async for r in svc.chat_completion(message, context)]

    return asyncio.run(read())


def test_a_stream_ends_with_one_final_response_carrying_usage_and_status_ok():
    outcome = Outcome(3, 2, ("length",))
    svc, handle, metrics = service([chunk("He", 1), chunk("y", 2, "length"), "data: [DONE]\n\n", outcome])
    context = FakeContext()
    responses = run(svc, request(max_tokens=2), context)
    assert [(r.final, [c.content for c in r.choices]) for r in responses] == [
        (False, ["He"]),
        (False, ["y"]),
        (True, [""]),
    ]
    assert responses[-1].usage.total_tokens == 5 and responses[-1].choices[0].finish_reason == "length"
    assert context.code is None  # OK: the proxy's default
    sent = handle.payloads[0]
    assert sent.stream and sent.stream_options.include_usage and sent.stream_options.continuous_usage_stats
    (record,) = metrics.records
    assert (record.protocol, record.status, record.completed, record.outcome) == ("grpc", 200, True, outcome)


def test_a_bad_field_is_invalid_argument_naming_it_and_never_reaches_a_replica():
    svc, handle, metrics = service([])
    context = FakeContext()
    (final,) = run(svc, request(temperature=9), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in context.details
    assert final.final and (final.error.param, final.error.http_status) == ("temperature", 400)
    assert handle.payloads == [] and metrics.records[0].status == 400


def test_a_key_past_its_rate_limit_is_resource_exhausted_with_the_retry_hint():
    limiter = LedgerHandle(RateLedger(requests_per_minute=1, tokens_per_minute=None))
    svc, _, _ = service([WholeAnswer(200, b"{}")], key_limits=KeyLimits(limiter, counts_tokens=False), keys=True)
    metadata = [("authorization", f"Bearer {KEYS.splitlines()[0]}")]
    run(svc, request(), FakeContext(metadata))
    context = FakeContext(metadata)
    (final,) = run(svc, request(), context)
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert final.error.code == "rate_limit_exceeded"
    trailing = dict(context.trailing)
    assert trailing["request_id"] == "abc"  # Serve's own entry is kept
    assert int(trailing["retry-after"]) >= 1
    assert trailing["grpc-retry-pushback-ms"] == str(int(trailing["retry-after"]) * 1000)


def test_with_the_replicas_places_all_held_a_call_is_resource_exhausted_overloaded_and_takes_none():
    """Direct streaming: gRPC calls and HTTP requests hold places from the same count; when the
    HTTP side holds them all, a call is refused as the HTTP door refuses (429 overloaded)."""
    slots = GenerationSlots(limit=1, model=MODEL)
    svc, handle, metrics = service([WholeAnswer(200, b"{}")], slots=slots)
    context = FakeContext()
    with slots.hold():  # an HTTP request in the replica
        (final,) = run(svc, request(), context)
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED and final.error.code == "overloaded"
    assert dict(context.trailing)["retry-after"] == "1" and handle.payloads == []
    assert (metrics.records[0].status, metrics.records[0].model) == (429, MODEL)  # counted against its model
    run(svc, request(), FakeContext())  # the place is free again: this one reaches the replica
    assert len(handle.payloads) == 1 and slots.held == 0


def test_with_fair_share_a_call_is_sent_with_its_keys_rank_as_its_engine_priority():
    """As over HTTP: the places its key holds on the replica (here one HTTP request) rank it."""
    slots = GenerationSlots(limit=8, model=MODEL, fair_share=FairShare(limit=8, reserved=2))
    svc, handle, _ = service([WholeAnswer(200, b"{}")], slots=slots, keys=True)
    metadata = [("authorization", f"Bearer {KEYS.splitlines()[0]}")]
    key_id = APIKeys("test keys", lambda: KEYS).identify(KEYS.splitlines()[0])
    with slots.hold(key_id=key_id):
        run(svc, request(), FakeContext(metadata))
    assert [p.priority for p in handle.payloads] == [1] and slots.by_key == {}


def test_a_call_holds_its_place_until_its_answer_ends():
    """Its permit lives as long as its answer: held while the engine's chunks come, given back once
    the answer ended (its final response, written after, holds nothing)."""
    slots = GenerationSlots(limit=1)
    outcome = Outcome(3, 2, ("stop",))
    svc, _, _ = service([chunk("He", 1), chunk("y", 2, "stop"), "data: [DONE]\n\n", outcome], slots=slots)

    async def read() -> list[int]:
        held = []
        async for _ in svc.chat_completion(request(), FakeContext()):
            held.append(slots.held)
        return held + [slots.held]

    assert asyncio.run(read()) == [1, 1, 0, 0]


def test_no_key_is_unauthenticated():
    svc, handle, _ = service([], keys=True)
    context = FakeContext()
    (final,) = run(svc, request(), context)
    assert context.code == grpc.StatusCode.UNAUTHENTICATED and final.error.code == "invalid_api_key"
    assert handle.payloads == []


def test_a_replica_that_cannot_serve_is_unavailable_with_the_retry_hint():
    refusal = WholeAnswer.error(503, "the model engine on this replica died; retry shortly", code="unavailable")
    svc, _, _ = service([refusal])
    context = FakeContext()
    (final,) = run(svc, request(), context)
    assert context.code == grpc.StatusCode.UNAVAILABLE and final.error.code == "unavailable"
    assert dict(context.trailing)["retry-after"] == "1"


def test_a_failure_mid_stream_is_a_final_error_then_the_status():
    failure = sse({"error": {"message": "the engine died", "type": "internal_error", "code": "engine_failed"}})
    svc, _, metrics = service([chunk("He", 1), failure, Outcome(3, 1)])
    context = FakeContext()
    responses = run(svc, request(), context)
    assert [r.final for r in responses] == [False, True]
    assert responses[-1].error.code == "engine_failed" and context.code == grpc.StatusCode.INTERNAL
    assert metrics.records[0].status == 500


def test_no_first_token_in_time_is_deadline_exceeded():
    svc, handle, _ = service([HANG], limits=SHORT)
    context = FakeContext()
    (final,) = run(svc, request(), context)
    assert context.code == grpc.StatusCode.DEADLINE_EXCEEDED and final.error.code == "first_token_timeout"
    assert handle.last is not None and handle.last.cancelled  # the replica call is cancelled: the engine aborts


def test_health_check_knows_the_service_and_the_whole_server_only():
    svc, _, _ = service([])
    serving = health_pb2.HealthCheckResponse.SERVING
    for name in ("", "glm4serve.v1.Generation"):
        context = FakeContext()
        assert svc.check(health_pb2.HealthCheckRequest(service=name), context).status == serving
        assert context.code is None
    context = FakeContext()
    answer = svc.check(health_pb2.HealthCheckRequest(service="other.Service"), context)
    assert answer.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    assert context.code == grpc.StatusCode.NOT_FOUND and "other.Service" in context.details


def test_a_call_holds_a_place_for_each_choice_and_is_refused_when_they_are_not_free():
    """As over HTTP: ``n`` choices are ``n`` engine sequences of the replica's places."""
    slots = GenerationSlots(limit=3, model=MODEL)
    svc, handle, _ = service([WholeAnswer(200, b"{}")], slots=slots)
    held_at_call: list[int] = []
    handle.on_call = lambda: held_at_call.append(slots.held)
    run(svc, request(n=3), FakeContext())
    assert held_at_call == [3] and slots.held == 0
    context = FakeContext()
    (final,) = run(svc, request(n=4), context)
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED and final.error.code == "overloaded"
    assert len(handle.payloads) == 1 and slots.held == 0


def test_a_message_is_held_to_the_http_bodys_structure_checks(monkeypatch):
    """The message becomes the HTTP API's JSON and is parsed as an HTTP body is: a count of arrays
    and objects that protobuf lets through (its depth limit is below ours) is INVALID_ARGUMENT.

    The bound is lowered to 1,000 here, so that the message stays a small body checked in this
    process: 100,001 arrays would be a large one, and the test would pay the checker process's
    start (a large message's path is the next test's)."""
    monkeypatch.setattr(json_body, "MAX_CONTAINERS", 1_000)
    svc, handle, _ = service([WholeAnswer(200, b"{}")])
    struct = struct_pb2.Struct()
    struct.update({"type": "json_object", "pad": [[] for _ in range(1_001)]})
    context = FakeContext()
    (final,) = run(svc, request(response_format=struct), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than 1000 arrays and objects" in final.error.message and handle.payloads == []


def answer_with_the_checkers_pid(request_model: type, raw: bytes, to_json: Any = None) -> APIError:
    """A check that says which process ran it and what JSON it was given (in the checker process)."""
    body = json.loads(to_json(raw))
    return APIError(400, f"checked in {os.getpid()}: {len(body['messages'][0]['content'])} characters")


def test_a_large_message_is_parsed_and_checked_in_the_checker_process_as_a_large_http_body():
    checker = BodyChecker(answer_with_the_checkers_pid, warm=None)
    svc, handle, _ = service([WholeAnswer(200, b"{}")], body_checker=checker)
    try:
        big = pb.ChatCompletionRequest(model=MODEL, messages=[pb.Message(role="user", content="x" * LARGE_BODY_BYTES)])
        context = FakeContext()
        (final,) = run(svc, big, context)
    finally:
        checker.close()
    pid, characters = final.error.message.removeprefix("checked in ").split(": ")
    assert int(pid) != os.getpid() and characters == f"{LARGE_BODY_BYTES} characters"
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and handle.payloads == []
