"""OpenAI's Responses API through the official SDK, through the same front door as chat: on the
real CPU engine, exact lengths unary and streamed, a function tool's round trip, a conversation
continued from its stored response, structured output that parses, each answer counted and logged
under its endpoint; on the simulated bed, streams whose clients leave let go by the engine. (Stored
and background responses across replicas: test_stored_responses.py.) (What is not served gets its named 400 in
tests/hostile_requests.py's table, run against this app by tests/e2e/test_hostile.py.)"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import ray

from serve_app.front_door.telemetry import metrics
from serve_app.simulated_engine.controls import Control
from tests.e2e.harness.bodies import LONG
from tests.e2e.harness.serve_state import request_log_lines
from tests.e2e.harness.streams import open_streams
from tests.e2e.harness.telemetry import SCRAPE_EVERY_S, scrape, settled, total
from tests.glm4_conversations import WEATHER_TOOL
from tests.json_schemas import parse_and_check
from tests.waiting import wait_until

# GLM-4's stop tokens are the engine's EOS tokens: ignore_eos lets an answer run to max_output_tokens.
EXACTLY = {"ignore_eos": True}
WEATHER = {"type": "function", **WEATHER_TOOL["function"]}  # (the Responses API names it at the top)
ASK = "What is the weather in Paris?"
CALL_TOKENS = 200  # room for the random model to finish the constrained JSON of one call
ANSWER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "warm": {"type": "boolean"}},
    "required": ["city", "warm"],
    "additionalProperties": False,
}


@pytest.fixture
async def client(app):
    async with openai.AsyncOpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


async def test_a_unary_response_has_exactly_max_output_tokens(app, client):
    response = await client.responses.create(
        model=app.model, instructions="Be brief.", input="Hi!", max_output_tokens=6, extra_body=EXACTLY
    )
    assert response.id.startswith("resp_") and response.model == app.model
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert response.usage.output_tokens == 6 and response.usage.input_tokens > 0
    assert [item.type for item in response.output] == ["message"] and isinstance(response.output_text, str)


async def test_a_streamed_response_sends_every_event_in_sequence_and_its_deltas_are_its_text(app, client):
    stream = await client.responses.create(
        model=app.model,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Count to twenty."}]}],
        max_output_tokens=12,
        stream=True,
        extra_body=EXACTLY,
    )
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # OpenAI's last event for an answer cut by max_output_tokens
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert final.usage.output_tokens == 12
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == events[-4].text


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
async def test_a_function_tool_round_trip(app, client, stream):
    """A forced call of the tool (its arguments valid for its schema), then its output sent back as an
    input item: the model answers the conversation."""
    call_request = dict(
        model=app.model,
        input=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=CALL_TOKENS,
    )
    if stream:
        async with client.responses.stream(**call_request) as events:
            argument_deltas = [e.delta async for e in events if e.type == "response.function_call_arguments.delta"]
            first = await events.get_final_response()
    else:
        first = await client.responses.create(**call_request)
    assert first.status == "completed"
    [call] = first.output
    assert (call.type, call.name) == ("function_call", "get_weather") and call.call_id
    assert json.loads(call.arguments)["city"] in ("Beijing", "Paris")
    if stream:
        assert "".join(argument_deltas) == call.arguments
    answer = await client.responses.create(
        model=app.model,
        input=[
            {"role": "user", "content": ASK},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sky": "clear"})},
        ],
        tools=[WEATHER],
        max_output_tokens=8,
        extra_body=EXACTLY,
    )
    assert answer.usage.output_tokens == 8 and answer.usage.input_tokens > first.usage.input_tokens
    assert [item.type for item in answer.output] in (["message"], ["function_call"])


async def test_a_conversation_continues_from_its_stored_response(app, client):
    """The CPU app keeps responses in its replica's memory: a forced call is retrieved as it was made,
    its output sent back with only ``previous_response_id`` for the conversation (the call found,
    the id echoed), a third turn continues the second, streamed; one made with ``store: false`` is
    not kept."""
    first = await client.responses.create(
        model=app.model,
        input=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=CALL_TOKENS,
    )
    [call] = first.output
    assert (await client.responses.retrieve(first.id)).output[0].arguments == call.arguments
    second = await client.responses.create(
        model=app.model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sky": "clear"})}],
        tools=[WEATHER],
        max_output_tokens=8,
        extra_body=EXACTLY,
    )
    assert second.previous_response_id == first.id and second.usage.output_tokens == 8
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn, its call and the call's output
    stream = await client.responses.create(
        model=app.model,
        previous_response_id=second.id,
        input="Thanks.",
        tools=[WEATHER],  # (tools, as instructions, are the request's own: not carried over)
        max_output_tokens=4,
        stream=True,
        store=False,
        extra_body=EXACTLY,
    )
    third = [event async for event in stream][-1].response
    assert third.previous_response_id == second.id
    assert third.usage.input_tokens > second.usage.input_tokens  # the second turn's answer too
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(third.id)


async def test_structured_output_through_text_format_always_parses(app, client):
    """Unary, and through the SDK's stream helper, which parses the final text as the schema's JSON."""
    text = {"format": {"type": "json_schema", "name": "weather", "schema": ANSWER, "strict": True}}
    for _ in range(3):
        response = await client.responses.create(model=app.model, input=ASK, text=text, max_output_tokens=60)
        assert response.status == "completed", response.incomplete_details
        parse_and_check(response.output_text, ANSWER)
    async with client.responses.stream(model=app.model, input=ASK, text=text, max_output_tokens=60) as events:
        final = await events.get_final_response()
    parse_and_check(final.output_text, ANSWER)


async def test_a_response_is_counted_and_logged_under_its_endpoint(app, client, metrics_url):
    name = f"ray_{metrics.REQUESTS}_total"
    labels = dict(application=app.name, model=app.model, endpoint="responses", status="200", finish_reason="length")
    before = total(await settled(metrics_url, name), name, **labels)
    stream = await client.responses.create(
        model=app.model, input="Hi!", max_output_tokens=5, stream=True, extra_body=EXACTLY
    )
    response_id = [event async for event in stream][-1].response.id
    await wait_until(
        lambda: total(scrape(metrics_url), name, **labels) == before + 1,
        60,
        "one more answered response",
        every_s=SCRAPE_EVERY_S,
    )
    session_dir = ray._private.worker._global_node.get_session_dir_path()

    def logged() -> dict | None:
        return next(
            (line for line in request_log_lines(session_dir, app.name).values() if line["id"] == response_id), None
        )

    line = await wait_until(lambda: asyncio.to_thread(logged), 30, f"the log line of {response_id}")
    assert (line["endpoint"], line["stream"], line["status"], line["completion_tokens"]) == ("responses", True, 200, 5)


async def test_responses_streams_whose_clients_leave_leave_the_engine(bed):
    """Four long Responses streams whose clients leave once each has its first event: the engine
    lets every one go. At a tenth of the engine's pace they cannot end by themselves (900 tokens
    take a minute)."""
    app = bed.app
    await bed.engines.control_all(Control.PACE, 10.0)
    body = {"model": app.model, "input": "Count.", "max_output_tokens": LONG, "stream": True, **EXACTLY}
    async with httpx.AsyncClient(base_url=app.url, timeout=120) as client:
        async with open_streams(client, body, 4, "/v1/responses"):
            await bed.engines.wait_until_holding(4, within_s=30)
        await bed.engines.wait_until_holding(0, within_s=30)
