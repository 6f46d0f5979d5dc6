"""What of OpenAI's Responses API this server serves: each part it does not is a 400 that names it.

GLM-4-9B-Chat reads and writes text and calls the functions a client offers. OpenAI's
hosted tools (web and file search, code interpreter, computer use, MCP, image generation),
images, files, audio, reasoning items and hosted prompt templates have nothing behind them
here, and vLLM would mostly ignore them: an answer as if they were not sent. So a body that
asks for one is refused before validation, the parameter named (``tools.1.type``,
``input.0.content.1.type``). docs/api-behaviour.md lists what is served.

Runs in each model replica (and its checker process, for a large body): no vLLM here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from serve_app.errors import APIError, quoted
from serve_app.front_door.admission.echoed import check_responses_echoed

SERVED_ITEMS = ("message", "function_call", "function_call_output")
SERVED_CONTENT = ("input_text", "output_text")
SERVED_INCLUDE = ("message.output_text.logprobs",)
SERVED_TOOL_CHOICES = ("auto", "none", "required")

# Parameters with nothing behind them on this server, and why.
NOT_SERVED = {
    "reasoning": "reasoning options are for reasoning models; GLM-4-9B-Chat answers without a reasoning phase",
    "prompt": "prompt templates are stored by OpenAI; send the prompt as input",
    "previous_input_messages": "previous_input_messages is vLLM's own; send the conversation as input items",
}


def check_served(body: dict[str, Any]) -> None:
    """400 for the first part of a Responses API ``body`` this server does not serve, or that would
    echo a string past its bound (:mod:`.echoed`)."""
    check_responses_echoed(body)
    for name, why in NOT_SERVED.items():
        if body.get(name) not in (None, False):
            raise APIError(400, why, param=name)
    if body.get("background") is True and body.get("store") is False:
        raise APIError(400, "a background response is stored: background needs store true (the default)", param="store")
    for i, included in enumerate(_listed(body.get("include"))):
        if included not in SERVED_INCLUDE:
            raise APIError(
                400,
                f"include.{i} is '{quoted(str(included))}'; this server can include only {SERVED_INCLUDE[0]}",
                param=f"include.{i}",
            )
    for i, tool in enumerate(_listed(body.get("tools"))):
        check_type(tool, f"tools.{i}", ("function",), "OpenAI's hosted tools are not served; offer function tools")
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if (isinstance(choice, str) and choice not in SERVED_TOOL_CHOICES) or (kind is not None and kind != "function"):
        shown = quoted(str(kind if kind is not None else choice))
        raise APIError(
            400, f"tool_choice '{shown}' is not served; use auto, none, required or a function", param="tool_choice"
        )
    for i, item in enumerate(_listed(body.get("input"))):
        check_item(item, f"input.{i}")


def check_item(item: Any, where: str) -> None:
    """One ``input`` item: a message of text, a function call or a function call's output."""
    if not isinstance(item, Mapping):
        return  # (the request model says what is wrong with it)
    check_type(
        item, where, SERVED_ITEMS, f"this server takes input items of types {', '.join(SERVED_ITEMS)}", "message"
    )
    for j, part in enumerate(_listed(item.get("content"))):
        check_type(
            part, f"{where}.content.{j}", SERVED_CONTENT, f"GLM-4-9B-Chat reads text only ({', '.join(SERVED_CONTENT)})"
        )


def check_type(value: Any, where: str, served: tuple[str, ...], why: str, default: str | None = None) -> None:
    """400 naming ``<where>.type`` when ``value`` is an object whose ``type`` is not one of ``served``."""
    kind = value.get("type", default) if isinstance(value, Mapping) else None
    if isinstance(kind, str) and kind not in served:
        raise APIError(400, f"{where}.type is '{quoted(kind)}': {why}", param=f"{where}.type")


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
