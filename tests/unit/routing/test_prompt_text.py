"""What the prefix router keys on: the prompt rendered with the chat template, not the request's JSON."""

from __future__ import annotations

import pickle

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from serve_app.glm4.format import CHAT_TEMPLATE_PATH
from serve_app.protocol import PickledRequest
from serve_app.routing.prompt_text import OPENING_CHARS_OF_A_COMPLETION, PromptRenderer

RENDERER = PromptRenderer(CHAT_TEMPLATE_PATH.read_text())
SYSTEM = {"role": "system", "content": "You answer briefly."}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def chat(messages: list[dict], **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "glm-4-9b-chat", "messages": messages, **fields})


def test_equivalent_requests_render_alike():
    as_string = chat([SYSTEM, {"role": "user", "content": "line one\nline two"}])
    parts = [{"type": "text", "text": "line one"}, {"text": "line two", "type": "text"}]
    as_parts = chat([SYSTEM, {"content": parts, "role": "user"}], temperature=0.2, max_tokens=5, seed=3)
    assert RENDERER.render(as_string) == RENDERER.render(as_parts)


def test_each_turn_starts_with_the_turn_before_and_shares_its_opening():
    turns = [SYSTEM, {"role": "user", "content": "first question"}]
    rendered = []
    for n in range(3):
        rendered.append(RENDERER.render(chat(turns)))
        turns += [{"role": "assistant", "content": f"answer {n}"}, {"role": "user", "content": f"question {n + 2}"}]
    for before, after in zip(rendered, rendered[1:], strict=False):
        assert after.text.startswith(before.text)
        assert after.opening == before.opening
    first = rendered[0]
    assert first.text.startswith(first.opening) and first.opening.endswith("first question")


def test_tools_are_part_of_the_prompt_unless_tool_choice_none_hides_them():
    plain = RENDERER.render(chat([{"role": "user", "content": "hi"}]))
    with_tools = RENDERER.render(chat([{"role": "user", "content": "hi"}], tools=TOOLS))
    hidden = RENDERER.render(chat([{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="none"))
    assert "weather" in with_tools.text and "weather" in with_tools.opening
    assert hidden == plain != with_tools


def test_a_completion_keys_on_its_text_or_token_ids():
    text = "x" * (OPENING_CHARS_OF_A_COMPLETION + 50)
    prompt = RENDERER.render(CompletionRequest.model_validate({"model": "m", "prompt": text}))
    assert prompt is not None and (prompt.text, prompt.opening) == (text, text[:OPENING_CHARS_OF_A_COMPLETION])
    ids = RENDERER.render(CompletionRequest.model_validate({"model": "m", "prompt": [5, 6, 7]}))
    longer = RENDERER.render(CompletionRequest.model_validate({"model": "m", "prompt": [5, 6, 7, 8]}))
    assert ids is not None and longer is not None and longer.text.startswith(ids.text)


def test_a_pickled_large_request_renders_as_the_request_itself():
    request = chat([SYSTEM, {"role": "user", "content": "a large body " * 10}])
    pickled = PickledRequest(pickle.dumps(request), request_id="r", stream=True)
    assert RENDERER.render(pickled) == RENDERER.render(request)


def test_a_responses_request_is_keyed_as_the_chat_vllm_renders_it_from():
    """Instructions are the system message and input items the messages (vLLM's construct_input_messages),
    so a conversation is routed alike, whichever of the two APIs carries it."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    user = {"role": "user", "content": "line one"}
    tool = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
    responses = ResponsesRequest.model_validate(
        {"model": "glm-4-9b-chat", "instructions": SYSTEM["content"], "input": [user], "tools": [tool]}
    )
    as_string = ResponsesRequest.model_validate(
        {"model": "glm-4-9b-chat", "instructions": SYSTEM["content"], "input": "line one", "tools": [tool]}
    )
    as_chat = chat([SYSTEM, user], tools=TOOLS)
    assert RENDERER.render(responses) == RENDERER.render(as_string) == RENDERER.render(as_chat)
    parsed_body = {"instructions": SYSTEM["content"], "input": "line one", "tools": [tool]}  # (the picker's namespace)
    assert RENDERER.render_responses(parsed_body) == RENDERER.render(as_string)
