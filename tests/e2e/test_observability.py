"""Observability of the real app: metrics read back from Ray's Prometheus endpoint, traces
received over OTLP from both deployments. (The dashboard's queries run on a real Prometheus
in tests/e2e/test_dashboard.py.)

The 429 and abort counters are checked where those events are caused anyway:
tests/e2e/test_load.py's burst and abandoned-stream tests.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid

import grpc
import httpx
import ray

from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api import generation_pb2_grpc as pb_grpc
from serve_app.front_door.telemetry import metrics
from tests.e2e.harness.bodies import chat, grpc_chat
from tests.e2e.harness.grpc_calls import Multiplexed, channel
from tests.e2e.harness.serve_state import request_log_lines
from tests.e2e.harness.telemetry import SCRAPE_EVERY_S, scrape, settled, total
from tests.waiting import wait_until

TOKENS = 16
STREAMS = 4


def body(model: str, **extra) -> dict:
    return chat(model, TOKENS, content="Count to twenty.", **extra)


async def grpc_responses(grpc_channel, request, metadata=()) -> list:
    """A gRPC chat call's responses, read whole."""
    return [r async for r in pb_grpc.GenerationStub(grpc_channel).ChatCompletion(request, metadata=metadata)]


def serving(samples, name: str, app, **labels: str) -> float:
    """The app's own series of a serving metric (the bed serves a model of the same name)."""
    return total(samples, f"ray_{name}", application=app.name, model=app.model, **labels)


async def test_traffic_shows_in_the_serving_histograms_counters_and_engine_metrics(app, metrics_url):
    """HTTP streams, a whole answer, a gRPC call and two requests on a multiplexed call: the counts
    grow by exactly what was sent, each under its protocol and RPC; the gauges come back to 0;
    vLLM's metrics are there per replica."""
    before = await settled(metrics_url, f"ray_{metrics.REQUESTS}_total")  # earlier tests' requests all reported
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client, channel(app) as grpc_channel:
        streams = [client.post("/v1/chat/completions", json=body(app.model, stream=True)) for _ in range(STREAMS)]
        grpc_call = grpc_responses(grpc_channel, grpc_chat(app.model, TOKENS, content="Count to twenty."))
        multiplexed = multiplexed_finals(
            grpc_channel, {"a": grpc_chat(app.model, TOKENS), "b": grpc_chat(app.model, TOKENS)}
        )
        *responses, grpc_answer, stream_finals = await asyncio.gather(
            *streams, client.post("/v1/chat/completions", json=body(app.model)), grpc_call, multiplexed
        )
    assert [r.status_code for r in responses] == [200] * (STREAMS + 1)
    assert grpc_answer[-1].final and grpc_answer[-1].usage.completion_tokens == TOKENS
    assert [final.usage.completion_tokens for final in stream_finals.values()] == [TOKENS, TOKENS]
    prompt_tokens = responses[-1].json()["usage"]["prompt_tokens"]

    def grew_by(samples, name: str, **labels: str) -> float:
        return serving(samples, name, app, **labels) - serving(before, name, app, **labels)

    http, grpc_ = (("protocol", "http"),), (("protocol", "grpc"),)
    expected = {
        (metrics.TIME_TO_FIRST_TOKEN + "_count", http): STREAMS,
        (metrics.TIME_PER_OUTPUT_TOKEN + "_count", http): STREAMS,
        (metrics.E2E_LATENCY + "_count", http): STREAMS + 1,
        (metrics.COMPLETION_TOKENS + "_total", http): (STREAMS + 1) * TOKENS,
        (metrics.PROMPT_TOKENS + "_total", http): (STREAMS + 1) * prompt_tokens,
        (metrics.REQUESTS + "_total", (*http, ("status", "200"), ("finish_reason", "length"))): STREAMS + 1,
        (metrics.REQUESTS + "_total", (*grpc_, ("status", "200"), ("endpoint", "chat"))): 3,
        (metrics.REQUESTS + "_total", (*grpc_, ("rpc", "ChatCompletion"), ("status", "200"))): 1,
        (metrics.REQUESTS + "_total", (*grpc_, ("rpc", "Stream"), ("status", "200"))): 2,
        (metrics.TIME_TO_FIRST_TOKEN + "_count", grpc_): 3,
        (metrics.COMPLETION_TOKENS + "_total", grpc_): 3 * TOKENS,
    }

    def engine_tokens(samples) -> float:  # vLLM's own count of the tokens it generated
        return total(samples, "ray_vllm_generation_tokens_total")

    def counted():
        samples = scrape(metrics_url)
        grown = {key: grew_by(samples, key[0], **dict(key[1])) for key in expected}
        engine_grew = engine_tokens(samples) - engine_tokens(before) >= (STREAMS + 1) * TOKENS
        return samples if engine_grew and all(grown[key] >= want for key, want in expected.items()) else None

    samples = await wait_until(
        counted, 60, f"serving metrics grow by {expected}, vLLM's tokens too", every_s=SCRAPE_EVERY_S
    )
    assert {key: grew_by(samples, key[0], **dict(key[1])) for key in expected} == expected
    for name in (metrics.TIME_TO_FIRST_TOKEN, metrics.TIME_PER_OUTPUT_TOKEN, metrics.E2E_LATENCY):
        assert grew_by(samples, name + "_sum") > 0, name  # the requests took time

    # Every request ended: the front door's gauges of queued and running requests are back at 0
    # (present, not absent: they are set again while idle).
    def idle():
        samples = scrape(metrics_url)
        gauges = (metrics.QUEUED, metrics.RUNNING)
        present = all(any(name == f"ray_{gauge}" for name, _ in samples) for gauge in gauges)
        return present and all(serving(samples, gauge, app) == 0 for gauge in gauges)

    await wait_until(idle, 60, "queued and running gauges back at 0")
    # vLLM's own engine metrics, one series per model replica.
    engine = [labels for name, labels in samples if name == "ray_vllm_generation_tokens_total"]
    assert engine and all(dict(labels).get("ReplicaId") for labels in engine)


async def test_one_request_gives_front_door_and_engine_spans_in_the_clients_trace(app, otlp_collector):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:
        response = await client.post("/v1/chat/completions", json=body(app.model, stream=True), headers=headers)
    assert response.status_code == 200

    def both():
        names = {span.name: span for span in otlp_collector.trace(trace_id)}
        return names if {"POST /v1/chat/completions", f"chat {app.model}"} <= set(names) else None

    spans = await wait_until(both, 30, f"front door and engine spans of trace {trace_id}")
    ingress, replica = spans["POST /v1/chat/completions"], spans[f"chat {app.model}"]
    assert ingress.parent_span_id == client_span
    assert replica.parent_span_id == ingress.span_id
    assert {ingress.service, replica.service} == {"glm4-serve"}
    assert ingress.attributes["http.response.status_code"] == 200
    assert f'"id":"chatcmpl-{ingress.attributes["gen_ai.response.id"]}"' in response.text
    assert replica.attributes["gen_ai.usage.output_tokens"] == TOKENS
    assert replica.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < replica.attributes["llm.time_to_first_token_s"] <= ingress.attributes["llm.time_to_first_token_s"]


async def test_a_grpc_call_is_logged_and_traced_as_an_http_request_is(app, otlp_collector):
    """The same record: the request's log line, and a span in the client's trace (``traceparent``
    metadata) with the replica's span under it. (Its metrics: the traffic test above.)"""
    trace_id, client_span, request_id = secrets.token_hex(16), secrets.token_hex(8), uuid.uuid4().hex
    metadata = (("traceparent", f"00-{trace_id}-{client_span}-01"), ("request_id", request_id))
    async with channel(app) as grpc_channel:
        responses = await grpc_responses(grpc_channel, grpc_chat(app.model, TOKENS), metadata)
    final = responses[-1]
    assert final.final and final.usage.completion_tokens == TOKENS

    def spans():
        names = {span.name: span for span in otlp_collector.trace(trace_id)}
        return names if {"glm4serve.v1.Generation/ChatCompletion", f"chat {app.model}"} <= set(names) else None

    found = await wait_until(spans, 30, f"front door and engine spans of trace {trace_id}")
    ingress, replica = found["glm4serve.v1.Generation/ChatCompletion"], found[f"chat {app.model}"]
    assert ingress.parent_span_id == client_span and replica.parent_span_id == ingress.span_id
    assert ingress.attributes["rpc.grpc.status_code"] == 0 and ingress.attributes["rpc.system"] == "grpc"

    session_dir = ray._private.worker._global_node.get_session_dir_path()
    line = await wait_until(
        lambda: request_log_lines(session_dir, app.name).get(request_id), 30, f"the log line of {request_id}"
    )
    assert (line["protocol"], line["status"], line["completion_tokens"]) == ("grpc", 200, TOKENS)
    assert final.id == f"chatcmpl-{line['id']}"


async def multiplexed_finals(grpc_channel, requests: dict) -> dict:
    """Send ``requests`` (by id) on one Stream call; each one's final response, by id."""
    call = Multiplexed(pb_grpc.GenerationStub(grpc_channel))
    for stream_id, request in requests.items():
        await call.send(pb.StreamRequest(id=stream_id, chat=request))
    code, details = await call.close()
    assert code == grpc.StatusCode.OK, details
    return {stream_id: call.of(stream_id)[-1] for stream_id in requests}


async def test_each_request_on_a_multiplexed_call_is_logged_and_traced_as_a_call_of_its_own(app, otlp_collector):
    """Two requests on one Stream call (``traceparent`` in the call's metadata): each has its own span
    ``glm4serve.v1.Generation/Stream`` in the client's trace, naming its id, with its engine span
    under it, and its own log line with ``rpc`` and ``stream_id``."""
    trace_id, client_span, request_id = secrets.token_hex(16), secrets.token_hex(8), uuid.uuid4().hex
    metadata = (("traceparent", f"00-{trace_id}-{client_span}-01"), ("request_id", request_id))
    async with channel(app) as grpc_channel:
        call = Multiplexed(pb_grpc.GenerationStub(grpc_channel), metadata=metadata)
        for stream_id in ("a", "b"):
            await call.send(pb.StreamRequest(id=stream_id, chat=grpc_chat(app.model, TOKENS)))
        code, details = await call.close()
    assert code == grpc.StatusCode.OK, details

    def spans():
        found = [span for span in otlp_collector.trace(trace_id) if span.name == "glm4serve.v1.Generation/Stream"]
        engine = [span for span in otlp_collector.trace(trace_id) if span.name == f"chat {app.model}"]
        return (found, engine) if len(found) == 2 and len(engine) == 2 else None

    ingress, engine = await wait_until(spans, 30, f"two front door and two engine spans of trace {trace_id}")
    assert sorted(span.attributes["glm4serve.stream_id"] for span in ingress) == ["a", "b"]
    assert {span.parent_span_id for span in ingress} == {client_span}
    assert {span.parent_span_id for span in engine} == {span.span_id for span in ingress}
    session_dir = ray._private.worker._global_node.get_session_dir_path()

    def both_logged() -> dict | None:
        lines = request_log_lines(session_dir, app.name)
        found = {stream_id: lines.get(f"{request_id}/{stream_id}") for stream_id in ("a", "b")}
        return found if all(found.values()) else None

    lines = await wait_until(both_logged, 30, f"the log lines of {request_id}'s two requests")
    for stream_id, line in lines.items():
        assert (line["rpc"], line["stream_id"], line["status"], line["completion_tokens"]) == (
            "Stream",
            stream_id,
            200,
            TOKENS,
        )
        assert final_id(call, stream_id) == f"chatcmpl-{line['id']}"


def final_id(call: Multiplexed, stream_id: str) -> str:
    return call.of(stream_id)[-1].id


def end_of_text(app) -> int:
    """The model's end-of-text token (its generation_config's first eos_token_id)."""
    eos = json.loads((app.model_path / "generation_config.json").read_text())["eos_token_id"]
    return eos[0] if isinstance(eos, list) else eos


async def test_an_answer_that_stops_before_any_text_is_counted_and_logged_as_empty(app, metrics_url):
    """The failure "the first request is fine, the rest come back empty", made on purpose: the
    real engine may only pick its end-of-text token (``allowed_token_ids``), so the answer ends
    ``stop`` at once. It is a 200, counted in the empty answers (kind ``content``) and its log
    line says so; an ordinary answer's does not. (Which answers are empty: tests/unit/engine.)"""

    def empty(samples) -> float:
        return serving(samples, f"{metrics.EMPTY_ANSWERS}_total", app, kind="content")

    before = await asyncio.to_thread(scrape, metrics_url)
    ids = {kind: f"{kind}-{uuid.uuid4().hex}" for kind in ("empty", "streamed", "ordinary")}
    forced = chat(app.model, max_tokens=TOKENS, allowed_token_ids=[end_of_text(app)])
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:
        answers = await asyncio.gather(
            client.post("/v1/chat/completions", json=forced, headers={"X-Request-Id": ids["empty"]}),
            client.post(
                "/v1/chat/completions", json=forced | {"stream": True}, headers={"X-Request-Id": ids["streamed"]}
            ),
            client.post("/v1/chat/completions", json=body(app.model), headers={"X-Request-Id": ids["ordinary"]}),
        )
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    [choice] = answers[0].json()["choices"]
    assert (choice["finish_reason"], choice["message"]["content"] or "") == ("stop", ""), choice

    await wait_until(  # (earlier tests' empty answers, if any, may be reported into it too: at least)
        lambda: empty(scrape(metrics_url)) - empty(before) >= 2,
        60,
        f"2 empty answers counted in ray_{metrics.EMPTY_ANSWERS}_total",
        every_s=SCRAPE_EVERY_S,
    )
    session_dir = ray._private.worker.global_worker.node.get_session_dir_path()

    async def logged() -> dict | None:  # (a line is written as its request's record ends)
        lines = await asyncio.to_thread(request_log_lines, session_dir, app.name)
        return lines if set(ids.values()) <= set(lines) else None

    lines = await wait_until(logged, 30, "the three answers' log lines")
    assert [lines[ids[kind]].get("empty") for kind in ("empty", "streamed", "ordinary")] == ["content", "content", None]
