"""The GLM-4 chat template renders the documented prompt format exactly."""

from __future__ import annotations

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from serve_app.glm4.format import CHAT_TEMPLATE_PATH
from tests.glm4_conversations import CONVERSATIONS


def render(request: dict, add_generation_prompt: bool = True) -> str:
    rendered, _ = render_jinja_template(
        [request["messages"]],
        tools=request.get("tools"),
        chat_template=CHAT_TEMPLATE_PATH.read_text(),
        add_generation_prompt=add_generation_prompt,
    )
    return rendered[0]


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_prompt_is_the_documented_format(name: str) -> None:
    request, expected = CONVERSATIONS[name]
    assert render(request) == expected


def test_tool_call_arguments_given_as_an_object_render_as_json() -> None:
    # vLLM hands templates the arguments already parsed into a dict.
    request, expected = CONVERSATIONS["tool call and result"]
    call = request["messages"][1]["tool_calls"][0]["function"]
    parsed = {**call, "arguments": {"city": "Paris"}}
    messages = [*request["messages"]]
    messages[1] = {**messages[1], "tool_calls": [{"type": "function", "function": parsed}]}
    assert render({**request, "messages": messages}) == expected


def test_assistant_text_and_call_in_one_message_render_as_two_turns() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
        },
    ]
    assert render({"messages": messages}, add_generation_prompt=False) == (
        "[gMASK]<sop><|user|>\nHi<|assistant|>\nChecking.<|assistant|>get_time\n{}"
    )


def test_content_parts_are_joined_as_text() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render({"messages": messages}) == "[gMASK]<sop><|user|>\nab<|assistant|>"
