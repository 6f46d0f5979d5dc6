"""Between gRPC messages and the HTTP API's JSON (serve_app/front_door/grpc_api/messages.py): pure conversions."""

import json

import pytest
from google.protobuf import struct_pb2

from serve_app.errors import APIError
from serve_app.front_door.admission.endpoints import default_endpoints
from serve_app.front_door.admission.validation import field_names, parse_request
from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api.messages import (
    CHAT,
    COMPLETION,
    STREAM_OPTIONS,
    MessageBody,
    ResponseWriter,
    message_json,
    request_body,
)
from serve_app.protocol import Outcome


def event(document: dict) -> str:
    return f"data: {json.dumps(document)}\n\n"


def chat_chunk(index: int = 0, finish_reason: str | None = None, usage: int | None = None, **delta) -> dict:
    document: dict = {"id": "chatcmpl-1", "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason}]}
    if usage is not None:
        document["usage"] = {"prompt_tokens": 5, "completion_tokens": usage, "total_tokens": 5 + usage}
    return document


@pytest.mark.parametrize(
    ("message", "endpoint"), [(pb.ChatCompletionRequest, "chat"), (pb.CompletionRequest, "completion")]
)
def test_every_request_field_is_the_http_api_s_parameter_of_the_same_name(message, endpoint):
    (model,) = [e.request_model for e in default_endpoints() if e.method == endpoint]
    assert {field.name for field in message.DESCRIPTOR.fields} <= field_names(model)


def test_only_the_fields_a_client_set_are_sent_and_the_stream_always_reports_usage():
    body = request_body(pb.ChatCompletionRequest(model="m", messages=[pb.Message(role="user", content="hi")]))
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": STREAM_OPTIONS,
    }
    # Explicit zeros are set fields (proto3 `optional`): the validator sees them and refuses them as HTTP would.
    assert request_body(pb.ChatCompletionRequest(max_tokens=0, temperature=0.0))["max_tokens"] == 0


def test_numbers_keep_their_json_types():
    body = request_body(pb.ChatCompletionRequest(seed=2**40, temperature=0.5, n=2))
    assert body["seed"] == 2**40 and type(body["seed"]) is int  # protobuf's own JSON would make it a string
    assert type(body["n"]) is int and type(body["temperature"]) is float


def test_tools_tool_choice_and_earlier_tool_calls_become_the_http_api_s_shapes():
    parameters = struct_pb2.Struct()
    parameters.update({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    request = pb.ChatCompletionRequest(
        model="m",
        messages=[
            pb.Message(role="user", content="weather?"),
            pb.Message(
                role="assistant",
                tool_calls=[
                    pb.ToolCall(id="call_1", type="function", function=pb.FunctionCall(name="w", arguments="{}"))
                ],
            ),
            pb.Message(role="tool", tool_call_id="call_1", content="sunny"),
        ],
        tools=[pb.Tool(type="function", function=pb.FunctionDefinition(name="w", parameters=parameters))],
        tool_choice=pb.ToolChoice(function_name="w"),
    )
    body = request_body(request)
    assert body["tools"][0]["function"]["parameters"]["required"] == ["city"]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "w"}}
    assert body["messages"][1]["tool_calls"][0]["function"] == {"name": "w", "arguments": "{}"}
    assert request_body(pb.ChatCompletionRequest(tool_choice=pb.ToolChoice(mode="required")))["tool_choice"] == (
        "required"
    )
    (chat,) = [e for e in default_endpoints() if e.method == "chat"]
    parse_request(chat.request_model, body)  # the HTTP API's validator accepts it


def test_bad_values_are_refused_by_the_http_validator_naming_the_field():
    (chat,) = [e for e in default_endpoints() if e.method == "chat"]
    body = request_body(pb.ChatCompletionRequest(model="m", messages=[pb.Message(role="user")], temperature=7))
    with pytest.raises(APIError) as refused:
        parse_request(chat.request_model, body)
    assert (refused.value.status, refused.value.param) == (400, "temperature")


def test_a_chunk_of_several_events_becomes_one_response():
    writer = ResponseWriter(CHAT, model="m")
    assert writer.response(event(chat_chunk(role="assistant", content=""))) == (None, None)  # vLLM's role delta
    chunk = event(chat_chunk(content="Hel", usage=1)) + event(chat_chunk(content="lo", usage=2))
    response, error = writer.response(chunk)
    assert error is None
    assert (response.id, response.model, response.completion_tokens) == ("chatcmpl-1", "m", 2)
    assert [(c.index, c.content) for c in response.choices] == [(0, "Hello")]
    assert not response.final


def test_tool_call_pieces_and_finish_reasons_reach_the_final_response():
    writer = ResponseWriter(CHAT, model="m")
    first = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "w", "arguments": ""}}
    piece = {"index": 0, "function": {"arguments": '{"city":'}}
    response, _ = writer.response(event(chat_chunk(tool_calls=[first])) + event(chat_chunk(tool_calls=[piece])))
    assert [(t.id, t.name, t.arguments) for t in response.choices[0].tool_calls] == [
        ("call_1", "w", ""),
        ("", "", '{"city":'),
    ]
    response, _ = writer.response(event(chat_chunk(finish_reason="tool_calls", usage=7)))
    assert response.choices[0].finish_reason == "tool_calls"
    final = writer.final(Outcome(5, 7, ("tool_calls",)))
    assert final.final and [(c.index, c.finish_reason) for c in final.choices] == [(0, "tool_calls")]
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.total_tokens) == (5, 7, 12)
    assert not final.HasField("error")


def test_an_error_event_becomes_the_final_response_s_error():
    writer = ResponseWriter(COMPLETION, model="m")
    text = {"id": "cmpl-1", "choices": [{"index": 0, "text": "once", "token_ids": [7, 8], "finish_reason": None}]}
    failure = {
        "error": {"message": "the engine died", "type": "internal_error", "param": None, "code": "engine_failed"}
    }
    response, error = writer.response(event(text) + event(failure))
    assert [(c.text, list(c.token_ids)) for c in response.choices] == [("once", [7, 8])]
    assert error is not None and (error.status, error.code) == (500, "engine_failed")
    final = writer.final(None, error)
    assert final.final and not final.HasField("usage")
    assert (final.error.status, final.error.code, final.error.http_status) == (13, "engine_failed", 500)  # INTERNAL


def test_done_is_not_an_event():
    assert ResponseWriter(CHAT, model="m").response("data: [DONE]\n\n") == (None, None)


def test_a_message_is_admitted_as_the_json_its_serialized_bytes_become_and_counts_their_size():
    """The gRPC door hands admission the message itself; the checker process gets its bytes."""
    message = pb.ChatCompletionRequest(
        model="m", messages=[pb.Message(role="user", content="h\u00e9llo")], max_tokens=7, seed=-(2**40)
    )
    body = MessageBody(message)
    raw = message.SerializeToString()
    assert body.size == len(raw)
    assert body.json() == message_json(pb.ChatCompletionRequest, raw)
    crossing, to_json = body.for_checker()
    assert crossing == raw and to_json is not None and to_json(crossing) == body.json()
