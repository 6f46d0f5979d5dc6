"""Applying GLM-4's facts to vLLM's OpenAI serving objects, in one place.

The model replica calls :func:`frontend_defaults` before vLLM builds its
serving objects and :func:`configure` right after, so every request, whatever
the checkpoint's own configs say, is rendered with GLM-4's chat template, stops
on GLM-4's three stop tokens, and has its tool calls read in GLM-4's format.
"""

from __future__ import annotations

from typing import Any

from serve_app.glm4.format import CHAT_TEMPLATE_PATH, stop_token_ids
from serve_app.glm4.parser import PARSER_NAME, Glm4Parser


def frontend_defaults() -> dict[str, Any]:
    """vLLM front-end arguments GLM-4 needs; a serve config may still override them."""
    return {
        "chat_template": str(CHAT_TEMPLATE_PATH),
        "enable_auto_tool_choice": True,
        "tool_call_parser": PARSER_NAME,
        # With tool_choice "none" the model is not shown the tools, so it cannot call one.
        "exclude_tools_when_tool_choice_none": True,
    }


def configure(state: Any) -> list[int]:
    """Finish vLLM's serving objects (from ``init_app_state``) for GLM-4.

    Returns the stop token ids now added to every request.
    """
    chat, completion = state.openai_serving_chat, state.openai_serving_completion
    stop_ids = stop_token_ids(chat.renderer.tokenizer)
    for serving in (chat, completion):
        # vLLM merges these server defaults into each request's own stop_token_ids.
        defaults = serving.default_sampling_params
        defaults["stop_token_ids"] = list(dict.fromkeys([*defaults.get("stop_token_ids", []), *stop_ids]))
    # vLLM composed its generic parser around Glm4ToolParser; GLM-4 streams need Glm4Parser.
    chat.parser_cls = Glm4Parser
    state.online_renderer.parser = Glm4Parser
    return stop_ids
