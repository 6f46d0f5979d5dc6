"""Strict validation at the front door, with vLLM's real request models and fake replicas.

The same hostile table runs against the real app in tests/e2e/test_hostile.py;
here it runs in milliseconds (a grammar's build in the checker process, seconds),
with property-based fuzzing on top.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings

from serve_app.config import IngressConfig
from serve_app.errors import APIError
from serve_app.front_door.admission.json_body import MAX_CONTAINERS, MAX_NESTING, decode_body, structure
from serve_app.front_door.admission.request_cost import CostLimits
from serve_app.front_door.admission.validation import parameter_path
from serve_app.protocol import WholeAnswer
from tests.hostile_requests import (
    CHAT_PATH,
    COMPLETION_PATH,
    HOSTILE,
    MODEL,
    RESPONSES_PATH,
    Hostile,
    chat,
    encoded,
    padded,
    responses,
)
from tests.openai_errors import assert_openai_error
from tests.request_strategies import request_bodies, responses_bodies
from tests.unit.front_door.fakes import client_for


@pytest.fixture(scope="module")
def app():
    """The front door's app with an engine that answers every request it is sent with 200, and the
    serve config's bounds on what a request costs (grammars built first in a checker process)."""
    return client_for([WholeAnswer(200, b"{}")], limit=8388608, costs=CostLimits.from_config(IngressConfig()))


@pytest.mark.parametrize("case", HOSTILE, ids=lambda c: c.id)
def test_hostile_request_gets_its_4xx_naming_the_parameter_and_reaches_no_replica(app, case: Hostile):
    client, handle = app
    sent = len(handle.payloads)
    response = client.request(case.method, case.path, content=case.body, headers=case.headers)
    assert_openai_error(response, case.status, case.param)
    assert len(handle.payloads) == sent


@pytest.mark.parametrize(
    "body",
    [chat(model="m" * 100_000), chat(**{"p" * 100_000: 1}), chat(messages=[{"role": "r" * 100_000}])],
    ids=["model", "parameter name", "role"],
)
def test_error_messages_quote_at_most_100_characters_of_client_input(app, body):
    client, _ = app
    error = client.post(CHAT_PATH, json=body).json()["error"]
    assert len(error["message"]) < 300
    assert not any(char * 101 in error["message"] or char * 101 in (error["param"] or "") for char in "mpr")


def test_the_table_is_large_and_varied():
    assert len(HOSTILE) >= 30
    assert len({c.id for c in HOSTILE}) == len(HOSTILE)
    assert {c.status for c in HOSTILE} == {400, 404, 405, 413}


@pytest.mark.parametrize(
    "body",
    [
        chat(),
        chat(stream=True, stream_options={"include_usage": True}),
        chat(temperature=0, top_p=1, n=1, presence_penalty=-2, frequency_penalty=2, seed=7, stop=["a", "b", "c", "d"]),
        chat(temperature=2, max_completion_tokens=1, logprobs=True, top_logprobs=20, logit_bias={"5": -100}),
        chat(
            messages=[
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ]
        ),
        chat(
            messages=[
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            tools=[{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {}}}}],
            tool_choice="auto",
        ),
        chat(response_format={"type": "json_object"}, min_tokens=2, ignore_eos=True),  # vLLM's own extensions
        chat(chat_template_kwargs={"a": json.loads("[" * (MAX_NESTING - 3) + "]" * (MAX_NESTING - 3))}),
        chat(store=False, metadata={"team": "search"}, service_tier="auto"),  # OpenAI's, no effect here
    ],
    ids=[
        "plain",
        "stream",
        "bounds low",
        "bounds high",
        "content parts",
        "tool round trip",
        "vllm extras",
        "deep within the limit",
        "ignored openai params",
    ],
)
def test_valid_chat_requests_pass(app, body):
    client, handle = app
    response = client.post(CHAT_PATH, json=body)
    assert response.status_code == 200, response.text
    assert handle.payloads[-1].model == MODEL


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "prompt": "hi"},
        {"model": MODEL, "prompt": ["a", "b"], "logprobs": 5, "max_tokens": 2},
        {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2},
    ],
    ids=["text", "batch", "token ids"],
)
def test_valid_completion_requests_pass(app, body):
    client, _ = app
    assert client.post(COMPLETION_PATH, json=body).status_code == 200


WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize(
    "body",
    [
        responses(),
        responses(instructions="Be brief.", stream=True, temperature=0.5, top_p=0.9, store=False),
        responses(
            input=[
                {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
        ),
        responses(text={"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}, "strict": True}}),
        responses(include=["message.output_text.logprobs"], top_logprobs=5, ignore_eos=True),
    ],
    ids=["plain", "stream with instructions", "function tool round trip", "structured output", "logprobs"],
)
def test_valid_responses_requests_pass_with_a_response_id(app, body):
    client, handle = app
    response = client.post(RESPONSES_PATH, json=body)
    assert response.status_code == 200, response.text
    assert handle.payloads[-1].model == MODEL and handle.payloads[-1].request_id.startswith("resp_")


def test_brackets_inside_strings_do_not_count_as_nesting():
    body = json.dumps(chat(messages=[{"role": "user", "content": "[{" * 1000}])).encode()
    assert decode_body(body)["messages"][0]["content"].startswith("[{")


@pytest.mark.parametrize(
    ("text", "depth", "containers"),
    [
        (b'"[[{"', 0, 0),
        (b'{"a": "[[", "b": [[{}]], "c": "\\"[["}', 4, 4),  # an escaped quote does not end a string
        (b'["\\\\", [1]]', 2, 2),  # an escaped backslash does not escape the quote after it
        (b"[]" * 5, 1, 5),
    ],
)
def test_structure_counts_brackets_outside_strings_only(text, depth, containers):
    assert structure(text) == (depth, containers)


def test_container_limit_is_exact():
    def arrays(n: int) -> bytes:  # the body, messages' array and object, metadata, and n - 4 more
        return encoded(chat(metadata=[[] for _ in range(n - 4)]))

    decode_body(arrays(MAX_CONTAINERS))
    with pytest.raises(APIError, match="more than 100000 arrays and objects"):
        decode_body(arrays(MAX_CONTAINERS + 1))


def test_a_large_body_is_parsed_off_the_event_loop_and_answered(app):
    client, handle = app
    sent = len(handle.payloads)
    body = padded(chat(messages=[{"role": "user", "content": "x" * 10_000}]), size=400_000)
    response = client.post(CHAT_PATH, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200 and len(handle.payloads) == sent + 1


def test_nesting_limit_is_exact():
    def depth(n: int) -> bytes:
        return b'{"a": ' + b"[" * (n - 1) + b"]" * (n - 1) + b"}"

    decode_body(depth(MAX_NESTING))
    with pytest.raises(APIError, match="deeper than"):
        decode_body(depth(MAX_NESTING + 1))


@pytest.mark.parametrize(
    ("loc", "param"),
    [
        (("stop", "list[str]", 0), "stop.0"),
        (("messages", 0, "ChatCompletionUserMessageParam", "content", "str"), "messages.0.content"),
        (("prompt", "list[constrained-int]", 2), "prompt.2"),
        (("tool_choice", "function", "name"), "tool_choice.function.name"),
        ((), ""),
    ],
)
def test_parameter_paths_drop_union_branches(loc, param):
    assert parameter_path(loc) == param


# Property-based fuzzing: whatever a client sends, the ingress answers 2xx or an
# OpenAI-shaped 4xx, never a 5xx, and never forwards a request it refused. 100 examples: at 400,
# mostly generating bodies, it took 76 s of the unit tests' run beside the end-to-end suite.


def check_answer(response, handle, sent_before: int) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert_openai_error(response, response.status_code)
        assert len(handle.payloads) == sent_before, "a refused request reached a replica"


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(request=request_bodies())
def test_fuzzed_bodies_never_get_a_5xx(app, request: tuple[str, bytes]):
    path, body = request
    client, handle = app
    sent = len(handle.payloads)
    check_answer(client.post(path, content=body), handle, sent)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=responses_bodies())
def test_fuzzed_responses_bodies_never_get_a_5xx(app, body: dict):
    """The Responses API's item lists of any kind and shape, stored, backgrounded and streamed or not."""
    client, handle = app
    sent = len(handle.payloads)
    check_answer(client.post(RESPONSES_PATH, content=json.dumps(body).encode()), handle, sent)


def test_every_body_the_hostile_benchmark_sends_is_refused_by_the_ingress(app):
    """What benchmarks.hostile_bodies measures is the ingress's cost of refusing, nothing else."""
    from benchmarks.hostile_bodies import hostile_bodies

    client, handle = app
    sent = len(handle.payloads)
    for name, body in hostile_bodies(MODEL, 400_000).items():
        response = client.post(CHAT_PATH, content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, (name, response.text[:200])
    assert len(handle.payloads) == sent
