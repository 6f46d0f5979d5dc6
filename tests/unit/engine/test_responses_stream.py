"""A Responses API stream as the front door takes it: vLLM's events framed, the outcome read from the
final event, a failure ending the stream with an error event the front door reads."""

from __future__ import annotations

import json

from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseTextDeltaEvent,
)
from openai.types.responses.response import IncompleteDetails
from vllm.entrypoints.openai.responses.protocol import (
    InputTokensDetails,
    OutputTokensDetails,
    ResponsesResponse,
    ResponseUsage,
)

from serve_app.engine.responses_stream import ResponsesStream, StreamBatchingEngine, response_outcome
from serve_app.protocol import EMPTY_CONTENT, Outcome, trailing_error

USAGE = ResponseUsage(
    input_tokens=12,
    input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
    output_tokens=5,
    output_tokens_details=OutputTokensDetails(),
    total_tokens=17,
)


def message(text: str) -> ResponseOutputMessage:
    part = ResponseOutputText(type="output_text", text=text, annotations=[])
    return ResponseOutputMessage(id="msg_1", type="message", role="assistant", status="completed", content=[part])


def response(status: str, output: list, reason: str | None = None) -> ResponsesResponse:
    return ResponsesResponse.model_construct(
        id="resp_1",
        object="response",
        status=status,
        output=output,
        usage=USAGE,
        incomplete_details=IncompleteDetails(reason=reason) if reason else None,
    )


def test_the_outcome_reads_usage_and_how_the_answer_ended():
    assert response_outcome(response("completed", [message("hi")])) == Outcome(12, 5, ("stop",))
    assert response_outcome(response("incomplete", [message("h")], "max_output_tokens")) == Outcome(12, 5, ("length",))
    call = ResponseFunctionToolCall(type="function_call", call_id="c", name="f", arguments='{"a":1}')
    assert response_outcome(response("completed", [call])) == Outcome(12, 5, ("tool_calls",))


def test_an_answer_that_stopped_with_no_text_is_empty():
    assert response_outcome(response("completed", [message("")])).empty == EMPTY_CONTENT


async def events(items, failure: Exception | None = None):
    for item in items:
        yield item
    if failure is not None:
        raise failure


def delta(n: int, text: str) -> ResponseTextDeltaEvent:
    return ResponseTextDeltaEvent(
        type="response.output_text.delta",
        sequence_number=n,
        item_id="msg_1",
        output_index=0,
        content_index=0,
        delta=text,
        logprobs=[],
    )


def created() -> ResponseCreatedEvent:
    return ResponseCreatedEvent.model_construct(type="response.created", sequence_number=0, response={"id": "resp_1"})


def parsed(frame: str) -> tuple[str, dict]:
    event_line, data_line = frame.strip("\n").split("\n")
    return event_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))


async def test_events_are_framed_as_sse_and_the_final_one_gives_the_outcome():
    final = ResponseCompletedEvent.model_construct(
        type="response.completed", sequence_number=2, response=response("completed", [message("hi")])
    )
    stream = ResponsesStream(lambda: (500, "failed", "internal_error"))
    frames = [frame async for frame in stream.frames(events([created(), delta(1, "hi"), final]))]
    assert [parsed(f)[0] for f in frames] == ["response.created", "response.output_text.delta", "response.completed"]
    assert parsed(frames[1])[1]["delta"] == "hi"
    assert stream.outcome == Outcome(12, 5, ("stop",))


async def test_an_incomplete_answer_ends_with_openais_incomplete_event():
    final = ResponseCompletedEvent.model_construct(
        type="response.completed",
        sequence_number=1,
        response=response("incomplete", [message("h")], "max_output_tokens"),
    )
    frames = [f async for f in ResponsesStream(lambda: (500, "x", None)).frames(events([created(), final]))]
    name, data = parsed(frames[-1])
    assert name == data["type"] == "response.incomplete"
    assert data["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_a_stream_that_breaks_ends_with_an_error_event_after_the_last_sequence_number():
    stream = ResponsesStream(lambda: (500, "the engine failed", "engine_failed"))
    frames = [f async for f in stream.frames(events([created(), delta(1, "hi")], RuntimeError("engine died")))]
    name, data = parsed(frames[-1])
    assert name == "error" and data["type"] == "error"
    assert data["error"]["code"] == data["code"] == "engine_failed" and data["sequence_number"] == 2
    error = trailing_error("".join(frames))  # what the front door records
    assert error is not None and (error.status, error.code) == (500, "engine_failed")
    assert stream.outcome is None


class HoldingEngine:
    """An engine holding ``held`` requests, which records what it was asked to generate."""

    def __init__(self, held: int) -> None:
        self.held = held
        self.asked: list[tuple] = []
        self.errored = False

    def get_num_unfinished_requests(self) -> int:
        return self.held

    def generate(self, engine_input, sampling_params, request_id, **kwargs):
        self.asked.append((engine_input, sampling_params.stream_interval, request_id, kwargs))
        return "generator"


def test_responses_generations_get_the_tokens_per_chunk_of_the_engines_load():
    from vllm import SamplingParams

    from serve_app.config.models import StreamBatchingConfig

    engine = HoldingEngine(held=12)
    batching = StreamBatchingConfig()
    batched = StreamBatchingEngine(engine, batching.tokens_per_chunk)
    assert batched.generate("prompt", SamplingParams(), "resp_1_0", priority=3) == "generator"
    assert engine.asked == [("prompt", batching.tokens_per_chunk(12), "resp_1_0", {"priority": 3})]
    batched.generate("prompt", SamplingParams(stream_interval=1), "resp_2_0")  # (one set already is kept)
    assert engine.asked[-1][1] == 1
    assert batched.errored is False  # everything else is the engine's
