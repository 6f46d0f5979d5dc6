"""Prompt plus requested output must fit the context; the refusal names both numbers."""

from __future__ import annotations

from types import SimpleNamespace

from serve_app.replica.context_limit import (
    effective_prompt_tokens,
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
