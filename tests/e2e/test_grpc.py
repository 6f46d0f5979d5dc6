"""The gRPC API (glm4serve.v1.Generation) on the real app, through Ray Serve's gRPC proxy, with grpcio's asyncio client.

Every stream ends with exactly one final response; a failed call also ends with
the matching non-OK status. Errors that need the app disturbed are checked where
the bed is disturbed anyway: a missing key in test_rollout (keys turned on), a
full queue in test_load's burst, an engine failing mid-stream in test_faults. A
cancelled call and an expired deadline are checked on the bed too, whose engine
holds them as long as the test needs.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from google.protobuf import descriptor_pb2, struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from serve_app.front_door.grpc_api import generation_pb2 as pb
from serve_app.front_door.grpc_api import generation_pb2_grpc as pb_grpc
from serve_app.simulated_engine.controls import Control
from tests.e2e.harness.bodies import LONG, grpc_chat
from tests.e2e.harness.grpc_calls import call, channel, ends_once
from tests.glm4_conversations import TIME_TOOL, WEATHER_TOOL
from tools.cluster_env import cluster_env

CONCURRENT = 16  # concurrent calls; 64 concurrent exact lengths over HTTP: test_concurrency.py
TOKENS = 16


@pytest.fixture
async def stub(app) -> AsyncIterator[pb_grpc.GenerationStub]:
    async with channel(app) as grpc_channel:
        yield pb_grpc.GenerationStub(grpc_channel)


async def test_concurrent_streams_each_deliver_their_max_tokens_and_one_final_response(app, stub):
    request = grpc_chat(app.model, max_tokens=TOKENS, ignore_eos=True, return_token_ids=True)
    results = await asyncio.gather(*(call(stub.ChatCompletion, request) for _ in range(CONCURRENT)))
    for result in results:
        assert result.code == grpc.StatusCode.OK, result.details
        ends_once(result)
        assert len(result.token_ids) == TOKENS
        assert result.final.usage.completion_tokens == TOKENS
        assert result.final.usage.total_tokens == result.final.usage.prompt_tokens + TOKENS
        assert [c.finish_reason for c in result.final.choices] == ["length"]
        counts = [r.completion_tokens for r in result.responses]
        assert counts == sorted(counts) and counts[-1] == TOKENS  # the count so far only grows
        assert not result.final.HasField("error")
    print(f"{CONCURRENT} streams, {sum(len(r.responses) for r in results)} responses in all")


async def test_completion_streams_text_and_ends_with_usage(app, stub):
    request = pb.CompletionRequest(model=app.model, prompt="Once upon a time", max_tokens=8, ignore_eos=True)
    result = await call(stub.Completion, request)
    assert result.code == grpc.StatusCode.OK, result.details
    ends_once(result)
    assert "".join(c.text for r in result.responses for c in r.choices)
    assert result.final.usage.completion_tokens == 8


async def test_http_and_grpc_streams_with_the_same_seed_give_the_same_tokens(app, stub):
    fields = {"max_tokens": 24, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    result = await call(stub.ChatCompletion, grpc_chat(app.model, return_token_ids=True, **fields))
    body = {
        "model": app.model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "stream": True,
        "return_token_ids": True,
    } | fields
    http_ids: list[int] = []
    async with httpx.AsyncClient(base_url=app.url, timeout=60) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices") or ():
                        http_ids += choice.get("token_ids") or []
    assert len(http_ids) == 24
    assert result.token_ids == http_ids


def tool(definition: dict) -> pb.Tool:
    function = definition["function"]
    parameters = struct_pb2.Struct()
    parameters.update(function["parameters"])
    described = {"description": function["description"]} if "description" in function else {}
    return pb.Tool(
        type="function", function=pb.FunctionDefinition(name=function["name"], parameters=parameters, **described)
    )


async def test_a_required_tool_call_streams_as_named_pieces_and_ends_with_its_finish_reason(app, stub):
    """GLM-4's tool calls through vLLM's parser, as pieces: the first names the call, the rest add arguments."""
    request = grpc_chat(
        app.model,
        tools=[tool(WEATHER_TOOL), tool(TIME_TOOL)],
        tool_choice=pb.ToolChoice(mode="required"),
        parallel_tool_calls=False,
        max_tokens=200,
    )
    request.messages[0].content = "What is the weather in Paris?"
    result = await call(stub.ChatCompletion, request)
    assert result.code == grpc.StatusCode.OK, result.details
    ends_once(result)
    pieces = [t for r in result.responses for c in r.choices for t in c.tool_calls]
    assert pieces and pieces[0].id and pieces[0].name
    assert {t.index for t in pieces} == {0} and all(not t.name for t in pieces[1:])
    arguments = json.loads("".join(t.arguments for t in pieces))
    if pieces[0].name == "get_weather":
        assert arguments["city"] in ("Beijing", "Paris")
    else:
        assert pieces[0].name == "get_time" and isinstance(arguments["utc"], bool)
    assert [c.finish_reason for c in result.final.choices] == ["tool_calls"]


async def test_a_cancelled_call_is_aborted_in_the_engine(bed):
    """On the bed, at a tenth of the engine's pace (900 tokens take a minute): once the client
    cancels a call under way, the engine lets its request go (how soon is printed), and answers
    as before."""
    app = bed.app
    await bed.engines.control_all(Control.PACE, 10.0)
    async with channel(app) as grpc_channel:
        stub = pb_grpc.GenerationStub(grpc_channel)
        stream = stub.ChatCompletion(grpc_chat(app.model, LONG))
        async for response in stream:
            if response.choices:
                break
        assert await bed.engines.holds() == 1  # under way in the engine
        stream.cancel()
        cancelled = time.monotonic()
        await bed.engines.wait_until_holding(0, within_s=30)
        took = time.monotonic() - cancelled
        await bed.engines.control_all(Control.PACE, 1.0)
        after = await call(stub.ChatCompletion, grpc_chat(app.model, 32))
    assert after.code == grpc.StatusCode.OK and after.final.usage.completion_tokens == 32
    print(f"engine empty {took:.3f} s after the cancel")


async def test_an_expired_deadline_is_deadline_exceeded_and_leaves_the_engine(bed):
    """Held by a paused engine, a call's 1 s deadline passes: DEADLINE_EXCEEDED, and the engine lets it go."""
    app = bed.app
    async with channel(app) as grpc_channel, bed.engines.paused():
        result = await call(
            pb_grpc.GenerationStub(grpc_channel).ChatCompletion, grpc_chat(app.model, LONG), timeout=1.0
        )
        assert result.code == grpc.StatusCode.DEADLINE_EXCEEDED, (result.code, result.details)
        expired = time.monotonic()
        await bed.engines.wait_until_holding(0, within_s=30)  # still paused: it left, it did not end
    print(f"engine empty {time.monotonic() - expired:.3f} s after the deadline")


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"temperature": 5.0}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        ({"max_tokens": 1_000_000}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, grpc.StatusCode.INVALID_ARGUMENT, "stop"),
        ({"messages": [pb.Message(role="robot", content="hi")]}, grpc.StatusCode.INVALID_ARGUMENT, "messages.0.role"),
        ({"messages": []}, grpc.StatusCode.INVALID_ARGUMENT, "messages"),
        ({"model": "gpt-4"}, grpc.StatusCode.NOT_FOUND, "model"),
    ],
)
async def test_bad_requests_are_refused_with_the_status_and_the_field(app, stub, fields, code, param):
    request = grpc_chat(app.model)
    for name, value in fields.items():
        request.ClearField(name)
        if isinstance(value, list):
            getattr(request, name).extend(value)
        else:
            setattr(request, name, value)
    result = await call(stub.ChatCompletion, request)
    assert result.code == code, (result.code, result.details)
    ends_once(result)
    assert result.final.error.param == param and result.final.error.status == code.value[0]
    assert param.split(".")[0] in result.details


async def test_a_message_past_the_body_limit_is_refused_before_the_app_reads_it(app, stub):
    """Past ``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE`` (deploy/cluster.env: the ingress's body limit) the
    model replica's gRPC server refuses the message itself, RESOURCE_EXHAUSTED, with no response:
    none of the app's code parsed it."""
    bound = int(cluster_env()["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"])
    result = await call(stub.ChatCompletion, grpc_chat(app.model, content="x" * (bound + 1024)))
    assert result.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (result.code, result.details)
    assert result.responses == []


async def test_health_service_and_reflection(app):
    async with channel(app) as grpc_channel:
        health = health_pb2_grpc.HealthStub(grpc_channel)
        for service in ("", "glm4serve.v1.Generation"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        reflection = reflection_pb2_grpc.ServerReflectionStub(grpc_channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        services = set()
        async for answer in reflection.ServerReflectionInfo(iter([request])):
            services |= {s.name for s in answer.list_services_response.service}
        assert {"glm4serve.v1.Generation", "grpc.health.v1.Health"} <= services, services
        described = reflection_pb2.ServerReflectionRequest(file_containing_symbol="glm4serve.v1.Generation")
        methods = {}
        async for answer in reflection.ServerReflectionInfo(iter([described])):
            for raw in answer.file_descriptor_response.file_descriptor_proto:
                for service in descriptor_pb2.FileDescriptorProto.FromString(raw).service:
                    methods |= {m.name: (m.client_streaming, m.server_streaming) for m in service.method}
    # (as `grpcurl -plaintext localhost:9000 describe glm4serve.v1.Generation` lists them)
    assert methods == {
        "ChatCompletion": (False, True),
        "Completion": (False, True),
        "Stream": (True, True),
        "Resume": (False, True),
        "CancelAnswer": (False, False),
        "DeleteAnswer": (False, False),
    }, methods
