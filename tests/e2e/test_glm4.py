"""GLM-4 on the real server: prompt format, stop tokens, tool calling, context limit.

The tiny model's weights are random, so tests that need a particular answer
make the engine produce it with vLLM's own sampling controls (``logit_bias``,
a ``structured_outputs`` regex), then check what the server made of it.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from serve_app.glm4.format import STOP_TOKENS
from tests.glm4_conversations import CONVERSATIONS, TIME_TOOL, WEATHER_TOOL

TOOLS = [WEATHER_TOOL, TIME_TOOL]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Random weights may keep adding calls to a "required" answer until max_tokens;
# parallel_tool_calls=False makes vLLM's schema allow exactly one.
ONE_CALL = {"parallel_tool_calls": False}
# Room for the random model to finish the constrained JSON of a call or several,
# within the tiny model's 1024-token context (the tools' system turn takes ~780).
CALL_TOKENS = 200


@pytest.fixture
async def http(app):
    async with httpx.AsyncClient(base_url=app.url, timeout=300) as client:
        yield client


@pytest.fixture
async def client(app):
    async with openai.AsyncOpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def assert_valid_call(name: str, arguments: str) -> None:
    """A call of one of TOOLS whose arguments satisfy its schema."""
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city"} and args["city"] in ("Beijing", "Paris")
    else:
        assert name == "get_time" and set(args) == {"utc"} and isinstance(args["utc"], bool)


async def streamed_answer(stream) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """Accumulate an openai stream as an SDK user does: (content, calls, finish_reason)."""
    content, finish = "", None
    calls: dict[int, list[str]] = defaultdict(lambda: ["", "", ""])
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls[call.index]
                entry[0] = entry[0] or call.id or ""
                entry[1] += (call.function.name or "") if call.function else ""
                entry[2] += (call.function.arguments or "") if call.function else ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("name", CONVERSATIONS)
async def test_server_renders_the_documented_prompt(app, http, name):
    request, expected = CONVERSATIONS[name]
    body = {"model": app.model, **request, "max_tokens": 1, "return_prompt_text": True}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["prompt_text"] == expected


@pytest.mark.parametrize("token", STOP_TOKENS)
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
async def test_each_stop_token_ends_generation_even_with_ignore_eos(app, http, token, endpoint):
    # The tiny checkpoint's configs name only <|endoftext|>, and ignore_eos makes
    # vLLM skip even that: only the server's own stop ids can end this answer.
    token_id = Tokenizer.from_file(str(app.model_path / "tokenizer.json")).token_to_id(token)
    body = {"model": app.model, "max_tokens": 8, "ignore_eos": True, "logit_bias": {str(token_id): 100}}
    body |= {"messages": ASK} if "chat" in endpoint else {"prompt": "Hello"}
    response = await http.post(endpoint, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["stop_reason"] == token_id
    assert answer["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
async def test_forced_tool_choice_returns_a_valid_call(app, client, tool_choice):
    answer = await client.chat.completions.create(
        model=app.model, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=CALL_TOKENS, **ONE_CALL
    )
    choice = answer.choices[0]
    assert len(choice.message.tool_calls) == 1, choice
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        assert_valid_call(call.function.name, call.function.arguments)
    if tool_choice == NAMED:
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    else:
        assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
async def test_forced_tool_choice_streams_a_valid_call(app, client, tool_choice):
    stream = await client.chat.completions.create(
        model=app.model, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=CALL_TOKENS, stream=True,
        **ONE_CALL,
    )
    _, calls, finish = await streamed_answer(stream)
    assert len(calls) == 1
    assert len({call_id for call_id, _, _ in calls}) == len(calls) and all(c[0] for c in calls)
    for _, name, arguments in calls:
        assert_valid_call(name, arguments)
    assert finish == ("stop" if tool_choice == NAMED else "tool_calls")


def glm4_answer(regex: str) -> dict:
    """Make the engine write exactly this answer (GLM-4's own format) under tool_choice auto."""
    return {"structured_outputs": {"regex": regex}}


GLM4_CALLS = {
    "one call": (r'get_weather\n\{"city": "Paris"\}', "", [("get_weather", '{"city": "Paris"}')]),
    "two calls": (
        r'get_time\n\{"utc": true\}<\|assistant\|>get_weather\n\{"city": "Beijing"\}',
        "",
        [("get_time", '{"utc": true}'), ("get_weather", '{"city": "Beijing"}')],
    ),
    "malformed JSON": (r'get_weather\n\{"city": Paris\}', 'get_weather\n{"city": Paris}', []),
    "text": (r"\nIt is sunny in Paris\.", "It is sunny in Paris.", []),
}


@pytest.mark.parametrize("case", GLM4_CALLS)
async def test_auto_reads_glm4_calls_unary(app, client, case):
    regex, content, calls = GLM4_CALLS[case]
    answer = await client.chat.completions.create(
        model=app.model, messages=ASK, tools=TOOLS, max_tokens=64, extra_body=glm4_answer(regex)
    )
    choice = answer.choices[0]
    got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert got == calls
    assert (choice.message.content or "") == content
    assert choice.finish_reason == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("case", GLM4_CALLS)
async def test_auto_reads_glm4_calls_streamed(app, client, case):
    regex, content, calls = GLM4_CALLS[case]
    stream = await client.chat.completions.create(
        model=app.model, messages=ASK, tools=TOOLS, max_tokens=64, stream=True, extra_body=glm4_answer(regex)
    )
    got_content, got_calls, finish = await streamed_answer(stream)
    assert [(name, args) for _, name, args in got_calls] == calls
    assert got_content == content
    assert finish == ("tool_calls" if calls else "stop")


async def test_auto_text_streams_token_by_token(app, http):
    body = {
        "model": app.model, "messages": ASK, "tools": TOOLS, "max_tokens": 64, "stream": True,
        **glm4_answer(r"\nget the weather yourself, please\."),
    }
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        pieces = [
            delta["content"]
            async for line in response.aiter_lines()
            if line.startswith("data: {")
            for choice in json.loads(line[6:])["choices"]
            if (delta := choice["delta"]).get("content")
        ]
    assert "".join(pieces) == "get the weather yourself, please."
    # Released as it is generated, not at the end (the exact hold-back is unit-tested).
    assert len(pieces) >= 10


async def test_conversation_with_a_tool_result_is_answered(app, client):
    messages = CONVERSATIONS["tool call and result"][0]["messages"]
    answer = await client.chat.completions.create(
        model=app.model, messages=messages, tools=TOOLS, max_tokens=8, extra_body={"return_prompt_text": True}
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.model_extra["prompt_text"].endswith('<|observation|>\n{"celsius": 21}<|assistant|>')


async def test_32_concurrent_tool_call_requests_all_succeed(app, client):
    async def one(i: int) -> list[tuple[str, str]]:
        kind = ("named", "required", "auto")[i % 3]
        kwargs = {"tool_choice": NAMED if kind == "named" else "required", **ONE_CALL} if kind != "auto" else {
            "extra_body": glm4_answer(GLM4_CALLS["two calls"][0])
        }
        if i % 2:
            stream = await client.chat.completions.create(
                model=app.model, messages=ASK, tools=TOOLS, max_tokens=CALL_TOKENS, stream=True, **kwargs
            )
            return [(name, args) for _, name, args in (await streamed_answer(stream))[1]]
        answer = await client.chat.completions.create(
            model=app.model, messages=ASK, tools=TOOLS, max_tokens=CALL_TOKENS, **kwargs
        )
        return [(c.function.name, c.function.arguments) for c in answer.choices[0].message.tool_calls or []]

    results = await asyncio.gather(*(one(i) for i in range(32)))
    for calls in results:
        assert calls
        for name, arguments in calls:
            assert_valid_call(name, arguments)


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
async def test_prompt_plus_max_tokens_over_the_context_is_400_with_both_numbers(app, http, endpoint):
    body = {"model": app.model, "max_tokens": 1000}
    body |= {"messages": [{"role": "user", "content": "word " * 150}]} if "chat" in endpoint else {"prompt": "word " * 150}
    response = await http.post(endpoint, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
    prompt_tokens = int(error["message"].split("the prompt has ")[1].split()[0])
    assert 150 <= prompt_tokens < 1024 and "1000" in error["message"] and "1024" in error["message"]
