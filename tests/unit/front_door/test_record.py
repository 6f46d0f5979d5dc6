"""What the front door records about each request: the record behind metrics, the log line, the spans.

The front door's app runs in process with a scripted replica (tests/unit/front_door/test_http_app.py)
and a recording stand-in for Ray's metrics; the real metrics, read back from
Ray's Prometheus endpoint, and the real spans, received over OTLP from both
deployments, are proven in tests/e2e/test_observability.py.
"""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from ray.serve.exceptions import BackPressureError

from serve_app.front_door.telemetry.record import CLIENT_GONE, Phase, RequestRecord
from serve_app.front_door.telemetry.request_log import RefusalBudget, completion_text, log_request, request_fields
from serve_app.observability import tracing
from serve_app.protocol import Outcome, WholeAnswer
from tests.unit.front_door.fakes import CHAT, HANG, SHORT, RecordingMetrics, client_for

ROLE = 'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
TOKEN = 'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
LAST = 'data: {"choices":[{"index":0,"delta":{"content":"!"},"finish_reason":"stop"}]}\n\n'
DONE = "data: [DONE]\n\n"


def test_a_stream_is_recorded_with_its_outcome_timings_and_phases():
    metrics = RecordingMetrics()
    client, _ = client_for([ROLE + TOKEN, LAST, DONE, Outcome(7, 3, ("stop",))], metrics=metrics)
    response = client.post("/v1/chat/completions", json=CHAT | {"stream": True})
    assert response.status_code == 200
    [record] = metrics.records
    assert (record.model, record.endpoint, record.stream, record.status) == ("glm-4-9b-chat", "chat", True, 200)
    assert record.outcome == Outcome(7, 3, ("stop",)) and record.finish_reason == "stop"
    assert record.completed and not record.aborted
    assert len(record.request_id) == 32
    assert 0 <= record.ttft_s <= record.duration_s
    assert record.tpot_s == pytest.approx((record.duration_s - record.ttft_s) / 2, abs=1e-3)
    assert [(old, new) for _, old, new in metrics.moves] == [
        (Phase.RECEIVED, Phase.QUEUED),
        (Phase.QUEUED, Phase.RUNNING),
        (Phase.RUNNING, Phase.ENDED),
    ]


def test_a_unary_answer_carries_its_outcome():
    metrics = RecordingMetrics()
    client, _ = client_for([WholeAnswer(200, b'{"choices":[]}', Outcome(5, 9, ("length",)))], metrics=metrics)
    assert client.post("/v1/completions", json={"model": "glm-4-9b-chat", "prompt": "x"}).status_code == 200
    [record] = metrics.records
    assert (record.endpoint, record.stream, record.finish_reason) == ("completion", False, "length")
    assert record.tpot_s is None  # time per token is a streaming figure


@pytest.mark.parametrize(
    "script, body, status, code",
    [
        ([BackPressureError(num_queued_requests=9, max_queued_requests=8)], CHAT, 429, "overloaded"),
        ([], CHAT | {"model": "nobody"}, 404, "model_not_found"),
        ([], CHAT | {"temperature": 9}, 400, None),
    ],
)
def test_refusals_are_recorded_with_status_and_code_and_no_client_model_name(script, body, status, code):
    metrics = RecordingMetrics()
    client, _ = client_for(script, metrics=metrics)
    assert client.post("/v1/chat/completions", json=body).status_code == status
    [record] = metrics.records
    assert record.status == status and record.error_code == code
    assert record.model in ("glm-4-9b-chat", None)  # "nobody" never becomes a metric label
    assert metrics.moves == [] or metrics.moves[-1][2] is Phase.ENDED


def test_a_stream_failing_midway_is_recorded_under_the_errors_status():
    metrics = RecordingMetrics()
    client, _ = client_for([TOKEN, HANG], limits=SHORT, metrics=metrics)
    response = client.post("/v1/chat/completions", json=CHAT | {"stream": True})
    assert response.status_code == 200 and "request_timeout" in response.text
    [record] = metrics.records
    assert (record.status, record.error_code, record.outcome) == (504, "request_timeout", None)


def test_other_routes_are_not_recorded():
    metrics = RecordingMetrics()
    client, _ = client_for([], metrics=metrics)
    client.get("/v1/models")
    client.get("/health")
    client.get("/v1/chat/completions")  # 405: not a generation request
    assert metrics.records == []


def test_the_log_line_has_the_facts_and_no_content_unless_asked(caplog):
    client, _ = client_for([ROLE + TOKEN, LAST, DONE, Outcome(7, 3, ("stop",))])
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        client.post("/v1/chat/completions", json=CHAT | {"stream": True})
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.getMessage().startswith('{"event":"request"')]
    assert {k: line[k] for k in ("model", "status", "finish_reason", "prompt_tokens", "completion_tokens")} == {
        "model": "glm-4-9b-chat",
        "status": 200,
        "finish_reason": "stop",
        "prompt_tokens": 7,
        "completion_tokens": 3,
    }
    assert line["ttft_ms"] <= line["duration_ms"] and len(line["id"]) == 32
    assert "request" not in line and "completion" not in line and "hi" not in json.dumps(line)


def test_refused_requests_lines_are_written_at_a_bounded_rate_and_say_how_many_were_not(caplog):
    """A flood of refusals (401s) writes its first ``burst`` lines, then ``per_s`` a second; the
    next line written counts those dropped. Answers and clients that left are always written."""
    budget = RefusalBudget(per_s=2, burst=3, updated=0.0)
    assert [budget.take(0.0) for _ in range(5)] == [0, 0, 0, None, None]
    assert budget.take(0.4) is None  # 0.8 of a line earned
    assert (budget.take(0.5), budget.take(0.5)) == (3, None)  # one earned: it says 3 were dropped

    refused, answered, left = RequestRecord("chat"), RequestRecord("chat"), RequestRecord("chat")
    refused.failed(401, "invalid_api_key")
    answered.status, left.status = 200, CLIENT_GONE
    budget = RefusalBudget(per_s=0.001, burst=1)
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        for record in (refused, refused, answered, left, refused):
            log_request(record, budget)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.getMessage().startswith('{"event":"request"')]
    assert [line["status"] for line in lines] == [401, 200, CLIENT_GONE]


def test_content_logging_shows_the_messages_and_the_completion():
    metrics = RecordingMetrics()
    client, _ = client_for([ROLE + TOKEN, LAST, DONE, Outcome(7, 3, ("stop",))], metrics=metrics, log_content=True)
    client.post("/v1/chat/completions", json=CHAT | {"stream": True})
    fields = request_fields(metrics.records[0])
    assert fields["request"] == {"messages": CHAT["messages"]}
    assert fields["completion"] == ["hi!"]


def test_completion_text_reads_whole_answers_and_streams():
    whole = {"choices": [{"index": 0, "message": {"content": "a"}}, {"index": 1, "message": {"content": "b"}}]}
    assert completion_text(json.dumps(whole).encode(), stream=False) == ["a", "b"]
    assert completion_text((TOKEN + LAST + DONE).encode(), stream=True) == ["hi!"]
    assert completion_text(b"not json", stream=False) is None


def test_completion_text_reads_a_responses_answer_whole_or_streamed():
    output = [
        {"type": "message", "content": [{"type": "output_text", "text": "hi"}]},
        {"type": "function_call", "name": "f", "arguments": "{}"},
    ]
    whole = {"object": "response", "output": output}
    assert completion_text(json.dumps(whole).encode(), stream=False) == ['hi{"name": "f", "arguments": "{}"}']
    final = {"type": "response.incomplete", "response": whole}
    streamed = f"event: response.output_text.delta\ndata: {json.dumps({'delta': 'hi'})}\n\n"
    streamed += f"event: response.incomplete\ndata: {json.dumps(final)}\n\n"
    assert completion_text(streamed.encode(), stream=True) == completion_text(json.dumps(whole).encode(), stream=False)


def test_a_client_that_leaves_is_recorded_as_aborted():
    record = RequestRecord("chat", status=CLIENT_GONE)
    assert record.aborted and record.tpot_s is None


# --- tracing -------------------------------------------------------------------------------------

SPANS = InMemorySpanExporter()


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """This process's tracer provider, exporting to memory (OpenTelemetry allows one per process)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(SPANS))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        pytest.fail("another test set this process's tracer provider first")
    return SPANS


CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


def test_front_door_and_engine_spans_share_the_clients_trace(spans):
    spans.clear()
    client, handle = client_for([ROLE + TOKEN, LAST, DONE, Outcome(7, 3, ("stop",))])
    client.post("/v1/chat/completions", json=CHAT | {"stream": True}, headers={"traceparent": TRACEPARENT})
    [context] = handle.trace_contexts
    # What the replica does with the context it was handed (serve_app.engine.server).
    tracing.start_engine_span("chat glm-4-9b-chat", context, {}).end()
    by_name = {span.name: span for span in spans.get_finished_spans()}
    ingress, replica = by_name["POST /v1/chat/completions"], by_name["chat glm-4-9b-chat"]
    assert {format(s.context.trace_id, "032x") for s in (ingress, replica)} == {CLIENT_TRACE}
    assert format(ingress.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert replica.parent.span_id == ingress.context.span_id
    assert ingress.attributes["gen_ai.usage.output_tokens"] == 3
    assert ingress.attributes["http.response.status_code"] == 200


def test_without_a_traceparent_the_front_door_starts_a_trace(spans):
    spans.clear()
    client, handle = client_for([WholeAnswer(200, b"{}", Outcome(1, 1))])
    client.post("/v1/chat/completions", json=CHAT)
    [ingress] = spans.get_finished_spans()
    assert ingress.parent is None
    assert handle.trace_contexts[0]["traceparent"].split("-")[1] == format(ingress.context.trace_id, "032x")


@pytest.mark.parametrize(
    "environ, on",
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
    ],
)
def test_tracing_is_on_only_when_the_environment_names_a_collector(environ, on):
    assert tracing.tracing_requested(environ) is on


def test_an_unknown_otlp_protocol_leaves_tracing_off():
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    assert tracing.otlp_protocol(environ) == "http/json"
    assert tracing.configure_tracing(environ) is False


def test_a_client_leaving_mid_response_is_recorded_not_raised():
    """Serve's receive raises TaskCancelledError when the client leaves; Starlette re-raises it
    as "response already started". That is a client gone (499), not a server error."""
    import asyncio

    from ray.exceptions import TaskCancelledError

    from serve_app.front_door.http_api.middleware import ObserveRequests

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        raise RuntimeError("Caught handled exception, but response already started.") from TaskCancelledError()

    records: list[RequestRecord] = []
    middleware = ObserveRequests(app, {"/v1/chat/completions": "chat"}, [records.append])
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        pass

    asyncio.run(middleware(scope, receive, send))
    assert [r.status for r in records] == [CLIENT_GONE]


def test_a_failure_before_the_response_is_a_500_and_raised():
    import asyncio

    from serve_app.front_door.http_api.middleware import ObserveRequests

    async def app(scope, receive, send):
        raise ValueError("bug")

    records: list[RequestRecord] = []
    middleware = ObserveRequests(app, {"/v1/completions": "completion"}, [records.append])
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    with pytest.raises(ValueError):
        asyncio.run(middleware(scope, None, None))
    assert [r.status for r in records] == [500]


def test_requests_under_a_route_prefix_are_recorded():
    """Serve passes route_prefix as root_path and leaves it in path: the record must still match."""
    import asyncio

    from serve_app.front_door.http_api.middleware import ObserveRequests

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        pass

    records: list[RequestRecord] = []
    middleware = ObserveRequests(app, {"/v1/chat/completions": "chat"}, [records.append])
    scope = {"type": "http", "method": "POST", "path": "/glm/v1/chat/completions", "root_path": "/glm", "headers": []}
    asyncio.run(middleware(scope, receive, send))
    assert [(r.endpoint, r.status) for r in records] == [("chat", 200)]
