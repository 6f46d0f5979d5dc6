"""The text a request's prompt will be, as the router sees it: the chat template rendered.

The router must key on what the engine will cache, not on the request's JSON: the
same conversation sent with its content as a string or as text parts, with keys in
another order or with other sampling parameters, is the same prompt. So a chat
request is rendered with the model's chat template (the one its replicas use) from its
messages and tools, as the replica renders it: text parts joined by newlines (as vLLM
joins them), tools left out when ``tool_choice`` is ``"none"`` (as the replica's
``exclude_tools_when_tool_choice_none`` does). A completion's prompt is its text (token
ids are written as numbers). Rendering uses transformers' own ``render_jinja_template``,
which the tokenizer's ``apply_chat_template`` uses.

The *opening* of a chat is the rendered text through its first user message: every
later turn of the conversation starts with it. A completion's opening is its first
``OPENING_CHARS_OF_A_COMPLETION`` characters.

Runs in each ReplicaPicker replica, inside the router.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

from serve_app.protocol import PickledRequest

OPENING_CHARS_OF_A_COMPLETION = 256


@dataclass(frozen=True)
class PromptText:
    text: str
    opening: str  # a prefix of text


def field(value: Any, name: str) -> Any:
    """A field of a parsed body's dict or of a validated request's model."""
    return value.get(name) if isinstance(value, Mapping) else getattr(value, name, None)


def as_text(content: Any) -> Any:
    """A message's content as vLLM hands it to the template: text parts joined by newlines."""
    if isinstance(content, list):
        return "\n".join(text for part in content if isinstance(text := field(part, "text"), str))
    return content


def responses_messages(instructions: Any, items: Any) -> list[dict[str, Any]]:
    """A Responses API request's ``instructions`` and ``input`` as the chat messages vLLM renders them
    from (its messages; function calls and their outputs, which come after a conversation's opening,
    are left out)."""
    messages = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for item in items if isinstance(items, list) else ():
        role = field(item, "role")
        if isinstance(role, str) and field(item, "type") in (None, "message"):
            messages.append({"role": role, "content": as_text(field(item, "content"))})
    return messages


def responses_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The Responses API's function tools in chat's shape, as vLLM hands them to the template."""
    functions = [
        {"type": "function", "function": {k: field(t, k) for k in ("name", "description", "parameters")}}
        for t in tools or ()
        if field(t, "type") == "function"
    ]
    return functions or None


def plain(value: Any) -> Any:
    """Pydantic models (vLLM's tool parameters) as the dicts the template reads."""
    if hasattr(value, "model_dump"):
        return value.model_dump()
    return value


class PromptRenderer:
    """Renders requests with one chat template (``template``: its text)."""

    def __init__(self, template: str) -> None:
        self.template = template

    def render_chat(self, request: Any) -> PromptText:
        messages = [{**message, "content": as_text(message.get("content"))} for message in request.messages]
        tools = None
        if request.tools and request.tool_choice != "none":
            tools = [plain(tool) for tool in request.tools]
        kwargs = dict(request.chat_template_kwargs or {})
        add_generation_prompt = kwargs.pop("add_generation_prompt", request.add_generation_prompt)
        return self._chat_text(messages, tools, add_generation_prompt, kwargs)

    def render_responses(self, request: Any) -> PromptText:
        """A Responses API request's prompt, as a chat of its instructions and input."""
        messages = responses_messages(field(request, "instructions"), field(request, "input"))
        choice = field(request, "tool_choice")
        tools = responses_tools(field(request, "tools")) if choice != "none" else None
        return self._chat_text(messages, tools, True, {})

    def _chat_text(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, generation: bool, kwargs: dict[str, Any]
    ) -> PromptText:
        text = self._render(messages, tools, generation, kwargs)
        users = [i for i, message in enumerate(messages) if message.get("role") == "user"]
        opening = self._render(messages[: users[0] + 1 if users else len(messages)], tools, False, kwargs)
        # (A template that renders a shorter conversation differently has no common opening.)
        return PromptText(text, opening if text.startswith(opening) else "")

    def _render(
        self, messages: Sequence[Mapping[str, Any]], tools: list[Any] | None, generation: bool, kwargs: dict[str, Any]
    ) -> str:
        rendered, _ = render_jinja_template(
            conversations=[list(messages)],
            tools=tools,
            chat_template=self.template,
            add_generation_prompt=generation,
            **kwargs,
        )
        return rendered[0]

    def render(self, request: Any) -> PromptText | None:
        """The prompt text of a chat, completion or Responses API request (any may be pickled); None if it has none."""
        if isinstance(request, PickledRequest):
            request = request.load()
        if hasattr(request, "messages"):
            return self.render_chat(request)
        if hasattr(request, "input"):
            return self.render_responses(request)
        prompt = getattr(request, "prompt", None)
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of prompts goes to one replica: key on the first
        if isinstance(prompt, list):
            prompt = "".join(f"{token}," for token in prompt)
        if not isinstance(prompt, str):
            return None
        return PromptText(prompt, prompt[:OPENING_CHARS_OF_A_COMPLETION])
