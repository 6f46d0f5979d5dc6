"""Prompt plus requested output must fit the context; the refusal names both numbers."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from serve_app.engine.context_limit import (
    asks_prompt_logprobs,
    effective_prompt_tokens,
    enforce_context_limit,
    over_context_message,
    requested_output,
)


def test_fitting_requests_pass() -> None:
    assert over_context_message(600, "max_tokens", 424, 1024) is None


def test_overflow_names_the_limit_the_prompt_and_the_request() -> None:
    message = over_context_message(605, "max_completion_tokens", 900, 1024)
    assert message is not None
    for part in ("1024", "605", "900", "1505", "max_completion_tokens", "at most 419"):
        assert part in message


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    request = SimpleNamespace(max_completion_tokens=5, max_tokens=50)
    assert requested_output(request) == ("max_completion_tokens", 5)
    assert requested_output(SimpleNamespace(max_tokens=None)) == ("max_tokens", None)


def test_prompt_truncation_is_counted_as_vllm_applies_it() -> None:
    assert effective_prompt_tokens(900, SimpleNamespace(truncate_prompt_tokens=100), 1024) == 100
    assert effective_prompt_tokens(900, SimpleNamespace(truncate_prompt_tokens=-1), 1024) == 900
    assert effective_prompt_tokens(900, SimpleNamespace(), 1024) == 900


def test_prompt_logprobs_are_asked_as_vllm_reads_its_request() -> None:
    assert asks_prompt_logprobs(SimpleNamespace(prompt_logprobs=0, echo=False))
    assert asks_prompt_logprobs(SimpleNamespace(prompt_logprobs=None, echo=True, messages=[]))  # chat echo: always
    assert asks_prompt_logprobs(SimpleNamespace(prompt_logprobs=None, echo=True, logprobs=1))
    assert not asks_prompt_logprobs(SimpleNamespace(prompt_logprobs=None, echo=True, logprobs=None))
    assert not asks_prompt_logprobs(SimpleNamespace(prompt_logprobs=None, echo=False, messages=[]))


class RenderingServing:
    """vLLM's serving object as the wrapper meets it: a render step whose prompts have known lengths."""

    def __init__(self, prompt_tokens: int) -> None:
        self.model_config = SimpleNamespace(max_model_len=1024)
        self.prompt_tokens = prompt_tokens

    async def render(self, request: Any) -> tuple[Any, list[str]]:
        return request, ["rendered"]

    def _extract_prompt_len(self, engine_input: Any) -> int:
        return self.prompt_tokens

    def create_error_response(self, message: str, param: str) -> ErrorLike:
        return ErrorLike(message, param)


@dataclass
class ErrorLike:
    message: str
    param: str


async def test_a_prompt_whose_logprobs_are_asked_is_held_to_its_token_cap_on_the_rendered_tokens() -> None:
    asked = SimpleNamespace(prompt_logprobs=1, echo=False, max_tokens=None, messages=[])
    for tokens, refused in ((100, False), (101, True)):
        serving = RenderingServing(tokens)
        enforce_context_limit(serving, "render", max_logprobs_prompt_tokens=100)
        answer = await serving.render(asked)
        assert isinstance(answer, ErrorLike) == refused
    assert answer == ErrorLike(
        "prompt log-probabilities are computed for prompts of at most 100 tokens; the prompt has 101 tokens",
        "messages",
    )
    not_asked = SimpleNamespace(prompt_logprobs=None, echo=False, max_tokens=None, prompt="x")
    serving = RenderingServing(5000)
    enforce_context_limit(serving, "render", max_logprobs_prompt_tokens=100)
    assert not isinstance(await serving.render(not_asked), ErrorLike)


class RenderingResponses(RenderingServing):
    """vLLM's Responses serving as the wrapper meets it: one render result holding its engine input."""

    async def render(self, request: Any) -> Any:
        return SimpleNamespace(messages=[], engine_input="rendered")


async def test_a_responses_request_is_held_to_the_context_by_its_max_output_tokens() -> None:
    serving = RenderingResponses(1000)
    enforce_context_limit(serving, "render")
    fits = SimpleNamespace(max_output_tokens=24, input="hi", prompt_logprobs=None, echo=False)
    assert not isinstance(await serving.render(fits), ErrorLike)
    refused = await serving.render(SimpleNamespace(max_output_tokens=25, input="hi", prompt_logprobs=None, echo=False))
    assert isinstance(refused, ErrorLike) and refused.param == "max_output_tokens"
    assert "Lower max_output_tokens to at most 24" in refused.message
