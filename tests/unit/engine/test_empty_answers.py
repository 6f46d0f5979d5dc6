"""An answer that ended with nothing in it is told apart, streamed (OutcomeTap) and whole (_outcome_of),
on the chunks and responses vLLM's own protocol classes make."""

from __future__ import annotations

import asyncio

import pytest
from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo

from serve_app.engine.server import _outcome_of
from serve_app.engine.stream_transforms import OutcomeTap
from serve_app.protocol import EMPTY_CONTENT, EMPTY_TOOL_ARGUMENTS

USAGE = UsageInfo(prompt_tokens=7, completion_tokens=1, total_tokens=8)


def chunk(delta: DeltaMessage | None = None, finish: str | None = None) -> str:
    """One SSE event as vLLM's chat serving writes it (``exclude_unset``)."""
    if delta is None:
        response = ChatCompletionStreamResponse(model="m", choices=[], usage=USAGE)
    else:
        choice = ChatCompletionResponseStreamChoice(index=0, delta=delta, finish_reason=finish)
        response = ChatCompletionStreamResponse(model="m", choices=[choice])
    return f"data: {response.model_dump_json(exclude_unset=True)}\n\n"


def tool_delta(arguments: str, call_id: str | None = None) -> DeltaMessage:
    function = (
        DeltaFunctionCall(name="lookup", arguments=arguments) if call_id else DeltaFunctionCall(arguments=arguments)
    )
    call = DeltaToolCall(index=0, id=call_id, type="function" if call_id else None, function=function)
    return DeltaMessage(tool_calls=[call])


STREAMS = {
    "stopped at once": (
        [chunk(DeltaMessage(role="assistant", content="")), chunk(DeltaMessage(content=""), "stop")],
        EMPTY_CONTENT,
    ),
    "an answer": ([chunk(DeltaMessage(role="assistant", content="")), chunk(DeltaMessage(content="Hi"), "stop")], None),
    "cut by its length": ([chunk(DeltaMessage(role="assistant", content="")), chunk(DeltaMessage(), "length")], None),
    "a call with arguments": (
        [chunk(tool_delta("", "call-1")), chunk(tool_delta('{"q": "x"}')), chunk(DeltaMessage(), "tool_calls")],
        None,
    ),
    "a call with none": ([chunk(tool_delta("", "call-1")), chunk(DeltaMessage(), "tool_calls")], EMPTY_TOOL_ARGUMENTS),
    "text quoting a key": ([chunk(DeltaMessage(content='say "content":"'), "stop")], None),
}


@pytest.mark.parametrize("name", STREAMS)
def test_a_stream_that_ended_with_nothing_in_it_is_empty(name):
    chunks, kind = STREAMS[name]
    tap = OutcomeTap(client_asked_usage=False)

    async def through() -> list[str]:
        async def source():
            for c in [*chunks, chunk()]:
                yield c

        return [c async for c in tap.tap(source())]

    asyncio.run(through())
    assert tap.outcome is not None and tap.outcome.empty == kind


def whole(message: ChatMessage, finish: str) -> ChatCompletionResponse:
    choice = ChatCompletionResponseChoice(index=0, message=message, finish_reason=finish)
    return ChatCompletionResponse(model="m", choices=[choice], usage=USAGE)


def call(arguments: str) -> ToolCall:
    return ToolCall(function=FunctionCall(name="lookup", arguments=arguments))


@pytest.mark.parametrize(
    ("response", "kind"),
    [
        (whole(ChatMessage(role="assistant", content=""), "stop"), EMPTY_CONTENT),
        (whole(ChatMessage(role="assistant", content=None), "stop"), EMPTY_CONTENT),
        (whole(ChatMessage(role="assistant", content="Hi"), "stop"), None),
        (whole(ChatMessage(role="assistant", content=""), "length"), None),
        (whole(ChatMessage(role="assistant", tool_calls=[call("{}")]), "tool_calls"), None),
        (whole(ChatMessage(role="assistant", tool_calls=[call("")]), "tool_calls"), EMPTY_TOOL_ARGUMENTS),
    ],
)
def test_a_whole_answer_with_nothing_in_it_is_empty(response, kind):
    outcome = _outcome_of(response)
    assert outcome is not None and outcome.empty == kind
