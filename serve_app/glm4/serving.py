"""Applying GLM-4's facts to vLLM's OpenAI serving objects and engine, in one place.

The model replica calls :func:`frontend_defaults` before vLLM builds its
serving objects and :func:`configure` right after, so every request, whatever
the checkpoint's own configs say:

* is rendered with GLM-4's chat template, and tokenized so that only the
  template's own markers are control tokens (:mod:`serve_app.glm4.control_tokens`);
* stops on GLM-4's three stop tokens, which are the engine's EOS tokens, so
  vLLM's ``ignore_eos`` switches all three off as it does for a checkpoint whose
  ``generation_config.json`` lists them;
* has its tool calls read in GLM-4's format.

The vLLM internals this needs are reached through :mod:`serve_app.vllm_internals`.

Runs in each model replica, as it builds its engine's serving objects.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from typing import Any

from serve_app import vllm_internals
from serve_app.errors import quoted
from serve_app.glm4.control_tokens import (
    MARK_REFUSED,
    PromptTokenizer,
    find_control_mark,
)
from serve_app.glm4.format import CHAT_TEMPLATE_PATH, stop_token_ids
from serve_app.glm4.parser import PARSER_NAME, Glm4Parser

logger = logging.getLogger("ray.serve")


def frontend_defaults() -> dict[str, Any]:
    """vLLM front-end arguments GLM-4 needs; a serve config may still override them."""
    return {
        "chat_template": str(CHAT_TEMPLATE_PATH),
        "enable_auto_tool_choice": True,
        "tool_call_parser": PARSER_NAME,
        # With tool_choice "none" the model is not shown the tools, so it cannot call one.
        "exclude_tools_when_tool_choice_none": True,
    }


def configure(state: Any, engine: Any) -> list[int]:
    """Finish vLLM's serving objects (from ``init_app_state``) and its ``AsyncLLM`` for GLM-4.

    Returns the stop token ids, now the engine's EOS tokens.
    """
    chat = state.openai_serving_chat
    stop_ids = stop_token_ids(chat.renderer.tokenizer)
    make_eos_tokens(engine, stop_ids)
    if chat.chat_template == CHAT_TEMPLATE_PATH.read_text():
        tokenize_control_tokens_from_template_only(chat.renderer)
    else:  # a serve config chose its own template, which does not mark its control tokens
        logger.warning("a chat template other than GLM-4's own is configured: client text can forge turns")
    # vLLM composed its generic parser around Glm4ToolParser; GLM-4 streams need Glm4Parser.
    vllm_internals.use_chat_parser(state, Glm4Parser)
    return stop_ids


def make_eos_tokens(engine: Any, stop_ids: list[int]) -> None:
    """Make ``stop_ids`` the EOS tokens of the generation config vLLM's input processor reads.

    vLLM adds a generation config's ``eos_token_id`` list to each request's stop
    tokens unless the request sets ``ignore_eos`` (``SamplingParams.update_from_generation_config``).
    ``override_generation_config`` cannot do this: vLLM reads it for sampling
    defaults only, not for EOS tokens.
    """
    fields = vllm_internals.generation_config_fields(engine)
    listed = fields.get("eos_token_id")
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    fields["eos_token_id"] = list(dict.fromkeys([*listed, *stop_ids]))


def tokenize_control_tokens_from_template_only(renderer: Any) -> None:
    """Wrap the renderer's chat rendering: marked template markers are control tokens, the rest text.

    vLLM renders the chat template to a string and tokenizes it later with
    special tokens recognised anywhere. Here the rendered string is tokenized at
    once by :class:`PromptTokenizer` and handed on as token ids (vLLM then skips
    its own tokenization), in vLLM's tokenizer thread when rendered for a request,
    and a request whose messages or tools carry the mark is refused.
    """
    from vllm.exceptions import VLLMValidationError

    prompt_tokenizer = PromptTokenizer(renderer.get_tokenizer())

    def refuse_marks(messages: Any, params: Any) -> None:
        where = find_control_mark(messages, "messages") or find_control_mark(params.chat_template_kwargs)
        if where is not None:
            parameter = re.split(r"[.\[]", where)[0]
            raise VLLMValidationError(f"{quoted(where)} {MARK_REFUSED}", parameter=quoted(parameter))

    def as_tokens(prompt: dict[str, Any]) -> dict[str, Any]:
        text = prompt.get("prompt")
        if not isinstance(text, str) or "prompt_token_ids" in prompt:
            return prompt
        tokens = prompt_tokenizer.tokenize(text)
        return {**prompt, "prompt": tokens.text, "prompt_token_ids": tokens.token_ids}

    sync_name, async_name = vllm_internals.CHAT_RENDER_METHODS
    render, render_async = getattr(renderer, sync_name), getattr(renderer, async_name)

    @functools.wraps(render)
    def render_messages(messages: Any, params: Any) -> tuple[Any, dict[str, Any]]:
        refuse_marks(messages, params)
        conversation, prompt = render(messages, params)
        return conversation, as_tokens(prompt)

    executor = vllm_internals.tokenizer_executor(renderer)

    @functools.wraps(render_async)
    async def render_messages_async(messages: Any, params: Any) -> tuple[Any, dict[str, Any]]:
        refuse_marks(messages, params)
        conversation, prompt = await render_async(messages, params)
        # In vLLM's tokenizer thread, as vLLM tokenizes: a long prompt would stall every stream here.
        return conversation, await asyncio.get_running_loop().run_in_executor(executor, as_tokens, prompt)

    setattr(renderer, sync_name, render_messages)
    setattr(renderer, async_name, render_messages_async)
