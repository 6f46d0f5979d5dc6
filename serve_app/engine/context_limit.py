"""Refuse a request whose prompt plus ``max_tokens`` does not fit the context.

vLLM quietly lowers ``max_tokens`` to what is left of the context after the
prompt, so a client asking for 900 tokens may get 400 and a ``"length"`` finish
with no word why. OpenAI answers 400 instead, naming both numbers; so do we.
A prompt whose log-probabilities are asked for is held to
``ingress.prompt_logprobs.max_prompt_tokens`` here too, on its real tokens (the
front door checked its characters).

The check needs the prompt's token count, known only once vLLM has rendered and
tokenized it, so it wraps the serving object's own render step: nothing is
rendered twice.

Runs in each model replica.
"""

from __future__ import annotations

import functools
from typing import Any

from serve_app import vllm_internals


def requested_output(request: Any) -> tuple[str, int | None]:
    """The output-length parameter a request set, and its value (None if unset)."""
    if hasattr(request, "max_output_tokens"):  # the Responses API's
        return "max_output_tokens", request.max_output_tokens
    if getattr(request, "max_completion_tokens", None) is not None:
        return "max_completion_tokens", request.max_completion_tokens
    return "max_tokens", request.max_tokens


def prompt_param(request: Any) -> str:
    """The parameter a request's prompt is: ``messages``, ``input`` (the Responses API's) or ``prompt``."""
    return next((name for name in ("messages", "input") if hasattr(request, name)), "prompt")


def effective_prompt_tokens(prompt_tokens: int, request: Any, max_model_len: int) -> int:
    """Prompt length after the truncation a request may ask for, as vLLM applies it."""
    limit = getattr(request, "truncate_prompt_tokens", None)
    if limit is None:
        return prompt_tokens
    return min(prompt_tokens, max_model_len if limit == -1 else limit)


def over_context_message(prompt_tokens: int, param: str, requested: int, max_model_len: int) -> str | None:
    """Why a request does not fit, or None when it does."""
    if prompt_tokens + requested <= max_model_len:
        return None
    return (
        f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
        f"{prompt_tokens} tokens and {param} asks for {requested} more "
        f"({prompt_tokens + requested} in all). Lower {param} to at most "
        f"{max(max_model_len - prompt_tokens, 0)} or shorten the prompt."
    )


def asks_prompt_logprobs(request: Any) -> bool:
    """Whether vLLM computes a request's prompt log-probabilities: ``prompt_logprobs``, or ``echo``
    (chat always; a completion with ``logprobs``), as its ``to_sampling_params`` reads them."""
    if getattr(request, "prompt_logprobs", None) is not None:
        return True
    if not getattr(request, "echo", False):
        return False
    return hasattr(request, "messages") or getattr(request, "logprobs", None) is not None


def over_logprobs_prompt_message(prompt_tokens: int, most: int) -> str | None:
    if prompt_tokens <= most:
        return None
    return (
        f"prompt log-probabilities are computed for prompts of at most {most} tokens; the prompt has "
        f"{prompt_tokens} tokens"
    )


def enforce_context_limit(serving: Any, render_method: str, max_logprobs_prompt_tokens: int | None = None) -> None:
    """Wrap ``serving.<render_method>`` (vLLM's render step, named in :mod:`serve_app.vllm_internals`);
    ``max_logprobs_prompt_tokens`` None: prompt log-probabilities are refused at the front door."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    render = getattr(serving, render_method)
    max_model_len = serving.model_config.max_model_len

    @functools.wraps(render)
    async def render_within_context(request: Any, *args: Any, **kwargs: Any) -> Any:
        result = await render(request, *args, **kwargs)
        param, requested = requested_output(request)
        logprobs_cap = max_logprobs_prompt_tokens if asks_prompt_logprobs(request) else None
        if isinstance(result, ErrorResponse) or (requested is None and logprobs_cap is None):
            return result
        engine_inputs = (
            result[1]
            if isinstance(result, tuple)
            else [result.engine_input]  # (the Responses API's render result)
            if hasattr(result, "engine_input")
            else result
        )
        for engine_input in engine_inputs:
            counted = vllm_internals.prompt_token_count(serving, engine_input)
            prompt = effective_prompt_tokens(counted, request, max_model_len)
            if logprobs_cap is not None and (message := over_logprobs_prompt_message(prompt, logprobs_cap)):
                return serving.create_error_response(message, param=prompt_param(request))
            if requested is not None and (message := over_context_message(prompt, param, requested, max_model_len)):
                return serving.create_error_response(message, param=param)
        return result

    setattr(serving, render_method, render_within_context)
