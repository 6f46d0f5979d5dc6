"""The front door's HTTP app with fake model handles (tests/unit/front_door/fakes.py): limits, errors, framing."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from itertools import pairwise

import pytest
from ray.serve.exceptions import BackPressureError
from starlette.testclient import TestClient

from serve_app.front_door.admission.deadlines import TimeLimits
from serve_app.front_door.admission.models import ModelCatalog, ModelEntry
from serve_app.front_door.admission.pipeline import BodyRules
from serve_app.front_door.admission.settings import IngressSettings
from serve_app.front_door.core.front_door import FrontDoor
from serve_app.front_door.core.generation import RETRY_INTERVAL_S
from serve_app.front_door.core.readiness import Readiness
from serve_app.front_door.http_api.app import build_http_app
from serve_app.protocol import WholeAnswer
from tests.openai_errors import assert_openai_error
from tests.unit.front_door.fakes import CHAT, HANG, SHORT, SLOW, FixedReadiness, client_for


def test_unary_reply_is_written_with_its_status():
    client, handle = client_for([WholeAnswer(200, b'{"id": "x"}')])
    response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    assert response.json() == {"id": "x"}
    assert handle.payloads[0].messages[0]["content"] == "hi"


def test_each_request_gets_a_fresh_uuid_even_if_the_client_sends_one():
    client, handle = client_for([WholeAnswer(200, b"{}")])
    client.post("/v1/chat/completions", json=CHAT | {"request_id": "same"})
    client.post("/v1/chat/completions", json=CHAT | {"request_id": "same"})
    ids = [p.request_id for p in handle.payloads]
    assert len(set(ids)) == 2 and "same" not in ids
    assert all(len(i) == 32 for i in ids)


def test_stream_is_relayed_as_server_sent_events():
    client, handle = client_for(['data: {"a": 1}\n\n', 'data: {"b": 2}\n\ndata: [DONE]\n\n'])
    response = client.post("/v1/chat/completions", json=CHAT | {"stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text == 'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    assert handle.last.cancelled  # released once finished


def test_failure_mid_stream_ends_with_an_error_event():
    client, _ = client_for(['data: {"a": 1}\n\n', RuntimeError("replica crashed")])
    response = client.post("/v1/chat/completions", json=CHAT | {"stream": True})
    events = [e for e in response.text.split("\n\n") if e]
    assert events[0] == 'data: {"a": 1}'
    last = json.loads(events[-1].removeprefix("data: "))
    assert last["error"]["type"] == "internal_error"
    assert "replica crashed" not in response.text  # no internals leak to clients
    assert "[DONE]" not in response.text


def test_replica_error_reply_keeps_its_status():
    client, _ = client_for([WholeAnswer.error(400, "max_tokens is too large", "max_tokens")])
    assert_openai_error(client.post("/v1/chat/completions", json=CHAT), 400, "max_tokens")


def test_backpressure_is_429_with_retry_after():
    client, _ = client_for([BackPressureError(num_queued_requests=9, max_queued_requests=8)])
    response = client.post("/v1/chat/completions", json=CHAT)
    error = assert_openai_error(response, 429)
    assert error["type"] == "rate_limit_error"
    assert response.headers["retry-after"] == "1"


def test_unknown_model_is_404():
    client, _ = client_for([])
    error = assert_openai_error(client.post("/v1/chat/completions", json=CHAT | {"model": "gpt-4"}), 404, "model")
    assert error["code"] == "model_not_found"


def test_malformed_json_is_400():
    client, _ = client_for([])
    response = client.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_openai_error(response, 400)["message"]


@pytest.mark.parametrize("body", [b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_body_that_is_not_a_json_object_is_400(body):
    client, _ = client_for([])
    assert_openai_error(client.post("/v1/completions", content=body), 400)


def test_invalid_parameter_is_400_naming_it():
    client, _ = client_for([])
    response = client.post("/v1/chat/completions", json=CHAT | {"temperature": "hot"})
    assert "temperature" in assert_openai_error(response, 400, "temperature")["message"]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [], "tool_choice": "auto"}, "tools"),
    ],
    ids=["named function not offered", "tool_choice without tools", "empty tools"],
)
def test_tool_mistakes_caught_by_vllms_validators_are_400_naming_the_parameter(extra, param):
    client, handle = client_for([])
    assert_openai_error(client.post("/v1/chat/completions", json=CHAT | extra), 400, param)
    assert handle.payloads == []


def test_body_over_the_limit_is_413_before_parsing():
    client, handle = client_for([], limit=100)
    response = client.post("/v1/chat/completions", json=CHAT | {"padding": "x" * 200})
    assert_openai_error(response, 413)
    assert handle.payloads == []


def test_chunked_body_over_the_limit_is_413():
    client, _ = client_for([], limit=100)

    def chunks():
        yield b'{"model": "glm-4-9b-chat", "x": "'
        yield b"y" * 200
        yield b'"}'

    assert_openai_error(client.post("/v1/completions", content=chunks()), 413)


def test_unknown_route_and_wrong_method_are_openai_shaped():
    client, _ = client_for([])
    assert_openai_error(client.get("/v1/nothing"), 404)
    assert_openai_error(client.get("/v1/chat/completions"), 405)


def test_models_lists_configured_models():
    client, _ = client_for([])
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["glm-4-9b-chat"]


@pytest.mark.parametrize("healthy, status", [(True, 200), (False, 503)])
def test_health_reflects_model_replicas(healthy, status):
    client, _ = client_for([], healthy=healthy)
    response = client.get("/health")
    assert response.status_code == status
    assert response.json()["models"] == {"glm-4-9b-chat": healthy}
    assert response.json()["age_s"] == 0.5


def test_liveness_says_the_ingress_answers_whatever_the_models():
    client, _ = client_for([], healthy=False)
    assert client.get("/health").status_code == 503
    response = client.get("/health/live")
    assert response.status_code == 200 and response.json() == {"status": "alive"}


def test_the_app_starts_and_stops_its_readiness_watch_with_itself():
    from serve_app.front_door.admission.endpoints import default_endpoints

    events = []

    class Recording(FixedReadiness):
        def start(self) -> None:
            events.append("start")

        def stop(self) -> None:
            events.append("stop")

    router = ModelCatalog({"glm-4-9b-chat": ModelEntry("glm-4-9b-chat", None, 1024)})
    settings = IngressSettings(max_request_body_bytes=1024, time_limits=TimeLimits(600, 120))
    readiness = Recording(Readiness({"glm-4-9b-chat": True}, age_s=0.1, max_age_s=30))
    core = FrontDoor(BodyRules(settings, router))
    with TestClient(build_http_app(core, readiness, default_endpoints())) as client:
        assert events == ["start"] and client.get("/health").status_code == 200
    assert events == ["start", "stop"]


FIRST = 'data: {"choices": []}\n\n'


def test_stream_without_a_first_chunk_in_time_is_504_and_cancelled():
    client, handle = client_for([HANG], limits=SHORT)
    response = client.post("/v1/chat/completions", json=CHAT | {"stream": True})
    error = assert_openai_error(response, 504)
    assert error["code"] == "first_token_timeout" and "0.1 s" in error["message"]
    assert handle.last.cancelled


def test_unary_answer_has_the_whole_request_limit():
    client, handle = client_for([HANG], limits=SHORT)
    error = assert_openai_error(client.post("/v1/chat/completions", json=CHAT), 504)
    assert error["code"] == "request_timeout" and "0.3 s" in error["message"]
    assert handle.last.cancelled


def test_stream_past_the_request_limit_ends_with_an_error_event_and_is_cancelled():
    client, handle = client_for([FIRST, HANG], limits=SHORT)
    response = client.post("/v1/chat/completions", json=CHAT | {"stream": True})
    assert response.status_code == 200
    events = [e for e in response.text.split("\n\n") if e]
    assert events[0] == FIRST.strip()
    last = json.loads(events[-1].removeprefix("data: "))
    assert last["error"]["code"] == "request_timeout" and last["error"]["type"] == "timeout_error"
    assert "[DONE]" not in response.text
    assert handle.last.cancelled


def test_client_may_shorten_its_own_limit():
    client, _ = client_for([HANG], limits=TimeLimits(600, 600))
    response = client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Timeout": "0.2"})
    assert "0.2 s" in assert_openai_error(response, 504)["message"]


def test_client_cannot_lengthen_the_limit():
    client, _ = client_for([HANG], limits=SHORT)
    response = client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Timeout": "3600"})
    assert "0.3 s" in assert_openai_error(response, 504)["message"]


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan", ""])
def test_invalid_timeout_header_is_400(value):
    client, handle = client_for([])
    response = client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Timeout": value})
    assert_openai_error(response, 400, "x-request-timeout")
    assert handle.payloads == []


def test_a_replica_that_cannot_serve_says_retry():
    from serve_app.protocol import WholeAnswer

    client, _ = client_for([WholeAnswer.error(503, "engine died", code="unavailable")])
    response = client.post("/v1/chat/completions", json=CHAT)
    assert assert_openai_error(response, 503)["code"] == "unavailable"
    assert response.headers["retry-after"] == "1"


UNAVAILABLE = WholeAnswer.error(503, "engine died", code="unavailable")


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_refused_by_an_unavailable_replica_is_sent_again(stream):
    from ray.exceptions import ActorDiedError

    answer = [FIRST] if stream else [WholeAnswer(200, b'{"id": "x"}')]
    client, handle = client_for([UNAVAILABLE], then=[[ActorDiedError()], answer], retry_s=5)
    response = client.post("/v1/chat/completions", json=CHAT | {"stream": stream})
    assert response.status_code == 200
    assert len(handle.payloads) == 3 and len({id(p) for p in handle.payloads}) == 1


def test_retries_stop_after_their_window_with_a_503():
    client, handle = client_for([UNAVAILABLE], retry_s=1.0)
    response = client.post("/v1/chat/completions", json=CHAT)
    assert assert_openai_error(response, 503)["code"] == "unavailable"
    assert response.headers["retry-after"] == "1"
    assert len(handle.payloads) == 2  # at 0 and 0.5 s; a third, at 1.0 s, would not fit


def test_retries_end_at_the_first_token_deadline():
    client, handle = client_for([UNAVAILABLE], limits=TimeLimits(600, 0.7), retry_s=60)
    response = client.post("/v1/chat/completions", json=CHAT | {"stream": True})
    assert assert_openai_error(response, 503)["code"] == "unavailable"
    assert len(handle.payloads) == 2


@pytest.mark.parametrize("failure", ["400", "500", "429"])
def test_other_failures_are_not_retried(failure):
    from ray.serve.exceptions import BackPressureError

    first = {
        "400": WholeAnswer.error(400, "bad", param="messages"),
        "500": RuntimeError("boom"),
        "429": BackPressureError(num_queued_requests=1, max_queued_requests=1),
    }[failure]
    client, handle = client_for([first], retry_s=5)
    response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == int(failure)
    assert len(handle.payloads) == 1


def test_a_request_serve_cancelled_because_its_client_left_is_not_logged_as_an_error(caplog):
    from ray.exceptions import TaskCancelledError

    client, handle = client_for([TaskCancelledError()], retry_s=5)
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        response = client.post("/v1/chat/completions", json=CHAT | {"stream": True})
    assert response.status_code == 499
    assert len(handle.payloads) == 1 and not caplog.records


def test_the_retry_window_starts_at_the_first_refusal():
    # Not at the request: here the refusal comes after 0.6 s.
    client, handle = client_for([SLOW, UNAVAILABLE], then=[[WholeAnswer(200, b'{"id": "x"}')]], retry_s=0.55)
    response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    assert len(handle.payloads) == 2


ENGINE_FAILED = WholeAnswer.error(500, "the engine failed under this request", code="engine_failed")


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_engine_died_under_it_is_answered_once_never_sent_again(stream):
    client, handle = client_for([ENGINE_FAILED], then=[[WholeAnswer(200, b'{"id": "x"}')]], retry_s=5)
    response = client.post("/v1/chat/completions", json=CHAT | {"stream": stream})
    assert assert_openai_error(response, 500)["code"] == "engine_failed"
    assert len(handle.payloads) == 1


def test_a_stream_whose_engine_died_mid_answer_ends_with_its_error_and_is_counted():
    from serve_app.errors import sse_error_event
    from tests.unit.front_door.fakes import RecordingMetrics

    metrics = RecordingMetrics()
    failed = sse_error_event(500, "the engine failed", "engine_failed").decode()
    client, handle = client_for([FIRST, 'data: {"x": 1}\n\n' + failed], retry_s=5, metrics=metrics)
    response = client.post("/v1/chat/completions", json=CHAT | {"stream": True})
    assert response.status_code == 200 and response.text.endswith(failed) and "[DONE]" not in response.text
    assert len(handle.payloads) == 1
    [record] = metrics.records
    assert (record.status, record.error_code) == (500, "engine_failed")


@pytest.mark.parametrize("where", ["first chunk", "later chunk"])
def test_a_replica_that_dies_after_its_error_event_adds_no_second_error(where):
    """A replica whose engine died sends its streams' error events, then its process exits;
    the call's failure that follows is the same event: each stream ends with one error."""
    from ray.exceptions import ActorDiedError

    from serve_app.errors import sse_error_event
    from serve_app.protocol import Outcome
    from tests.unit.front_door.fakes import RecordingMetrics

    metrics = RecordingMetrics()
    failed = sse_error_event(500, "the engine failed", "engine_failed").decode()
    chunks = [FIRST + failed] if where == "first chunk" else [FIRST, 'data: {"x": 1}\n\n' + failed]
    client, _ = client_for([*chunks, Outcome(5, 1, ()), ActorDiedError()], metrics=metrics)
    response = client.post("/v1/chat/completions", json=CHAT | {"stream": True})
    assert response.status_code == 200 and response.text.endswith(failed)
    assert response.text.count('"error"') == 1
    [record] = metrics.records
    assert (record.status, record.error_code) == (500, "engine_failed")
    assert record.outcome == Outcome(5, 1, ())  # still read after the error event


def test_a_replica_process_that_died_during_the_call_is_tried_on_one_more_replica_at_most():
    from ray.exceptions import ActorDiedError

    client, handle = client_for([ActorDiedError()], retry_s=30)
    response = client.post("/v1/chat/completions", json=CHAT)
    assert assert_openai_error(response, 503)["code"] == "unavailable"
    assert len(handle.payloads) == 2


def test_a_deployment_with_no_replica_is_tried_until_the_window_ends():
    """Sent again one retry interval after each refusal while another attempt fits in the window
    (1.2 s from the first refusal), then answered 503: two or three attempts, however slow the
    machine, and the answer no sooner than an interval before the window's end."""
    from ray.serve.exceptions import DeploymentUnavailableError

    retry_s = 1.2
    client, handle = client_for([DeploymentUnavailableError("model-glm")], retry_s=retry_s)
    tried_at: list[float] = []
    handle.on_call = lambda: tried_at.append(time.monotonic())  # the event loop's clock
    response = client.post("/v1/chat/completions", json=CHAT)
    answered_at = time.monotonic()
    assert assert_openai_error(response, 503)["code"] == "unavailable"
    assert 2 <= len(tried_at) <= 1 + int(retry_s / RETRY_INTERVAL_S), tried_at
    assert all(later - earlier >= RETRY_INTERVAL_S for earlier, later in pairwise(tried_at)), tried_at
    assert answered_at >= tried_at[0] + retry_s - RETRY_INTERVAL_S


@pytest.mark.parametrize(("n", "status"), [(8, 200), (9, 400), (128, 400)])
def test_choices_per_request_are_bounded(n, status):
    client, handle = client_for([WholeAnswer(200, b'{"id": "x"}')])
    response = client.post("/v1/chat/completions", json=CHAT | {"n": n})
    assert response.status_code == status
    if status == 400:
        assert "at most 8 choices" in assert_openai_error(response, 400, "n")["message"] and not handle.payloads


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_an_answer_longer_than_the_models_ceiling_is_400_naming_it(param):
    client, handle = client_for([WholeAnswer(200, b'{"id": "x"}')], max_output_tokens=256)
    assert client.post("/v1/chat/completions", json=CHAT | {param: 256}).status_code == 200
    error = assert_openai_error(client.post("/v1/chat/completions", json=CHAT | {param: 257}), 400, param)
    assert "at most 256 tokens" in error["message"] and len(handle.payloads) == 1


async def test_a_body_that_arrives_too_slowly_is_408():
    client, handle = client_for([WholeAnswer(200, b'{"id": "x"}')], body_timeout_s=0.3)
    parts = [b'{"model": "glm-4-9b-chat", ', b'"messages": [{"role": "user", "content": "hi"}]}']

    async def receive() -> dict:  # a client that sends half its body, then stalls for good
        if len(parts) == 2:
            return {"type": "http.request", "body": parts.pop(0), "more_body": True}
        await asyncio.Event().wait()  # only the server's body timeout ends this wait
        raise AssertionError("unreachable")

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("test", 80),
        "client": ("test", 1),
    }
    await client.app(scope, receive, send)
    assert sent[0]["status"] == 408 and b"body_timeout" in sent[1]["body"] and not handle.payloads
