"""What of the Responses API is served: each part that is not is a 400 naming it, before validation."""

from __future__ import annotations

from typing import Any

import pytest

from serve_app.errors import APIError
from serve_app.front_door.admission.responses_rules import check_served

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
SERVED: dict[str, Any] = {
    "model": "m",
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "user", "content": [{"type": "input_text", "text": "Now."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Calling."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ],
    "tools": [TOOL],
    "tool_choice": {"type": "function", "name": "get_weather"},
    "include": ["message.output_text.logprobs"],
    "background": True,
    "previous_response_id": "resp_1",
}


def refused(**changes) -> APIError:
    with pytest.raises(APIError) as refusal:
        check_served(SERVED | changes)
    assert refusal.value.status == 400
    return refusal.value


def test_text_messages_function_calls_and_their_outputs_are_served():
    check_served(SERVED)
    check_served({"model": "m", "input": "hello", "tool_choice": "required"})


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"tools": [TOOL, {"type": "web_search_preview"}]}, "tools.1.type"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"input": [{"type": "reasoning", "id": "r1", "summary": []}]}, "input.0.type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"}, {"type": "input_image"}]}]},
            "input.0.content.1.type",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type"),
        ({"include": ["file_search_call.results"]}, "include.0"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"store": False}, "store"),  # (SERVED is a background request: stored)
        ({"previous_input_messages": [{"role": "user", "content": "x"}]}, "previous_input_messages"),
    ],
)
def test_each_part_not_served_is_refused_by_name(changes, param):
    assert refused(**changes).param == param


def test_a_refusal_quotes_what_was_sent_within_bounds():
    error = refused(tools=[{"type": "x" * 10_000}])
    assert "hosted tools are not served" in error.message and len(error.message) < 500
