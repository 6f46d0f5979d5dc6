"""What one request may cost the engine: each bound of serve_app.front_door.admission.request_cost, on bodies as
clients send them (the hostile table runs them through the real apps in tests/e2e/test_hostile.py)."""

from __future__ import annotations

import pytest

from serve_app.config import PromptLogprobsConfig
from serve_app.errors import APIError
from serve_app.front_door.admission.request_cost import (
    Asked,
    BodySize,
    CostLimits,
    PromptSize,
    check_costs,
    check_extensions,
    check_prompt_size,
    check_sequences,
    grammar_specs,
    logprobs_asked,
    longest_token_list,
    measure,
    prompt_count,
    prompt_logprobs_asked,
    prompt_size,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
ALLOWED = PromptLogprobsConfig(max_logprobs=5, max_prompt_tokens=100)


DEFAULTS = CostLimits()


def refusal(body: dict, limits: CostLimits = DEFAULTS, max_model_len: int = 1024, ceiling: int | None = 1000):
    """The 400 a body gets from check_costs (measured as the front door measures it)."""
    with pytest.raises(APIError) as refused:
        check_costs(body, measure(body), limits, max_model_len, ceiling)
    assert refused.value.status == 400
    return refused.value


def passes(body: dict, limits: CostLimits = DEFAULTS, max_model_len: int = 1024, ceiling: int | None = 1000):
    check_costs(body, measure(body), limits, max_model_len, ceiling)


@pytest.mark.parametrize(
    ("body", "prompts"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 1),
        ({"prompt": "hi"}, 1),
        ({"prompt": [1, 2, 3]}, 1),  # token ids: one prompt
        ({"prompt": ["a", "b", "c"]}, 3),
        ({"prompt": [[1], [2]]}, 2),
        ({"prompt": []}, 1),  # vLLM refuses it; counted as one, never as none
    ],
    ids=["chat", "text", "token ids", "texts", "token-id lists", "empty list"],
)
def test_a_request_carries_its_prompts(body, prompts):
    assert prompt_count(body) == prompts


@pytest.mark.parametrize(
    ("prompts", "n", "param", "message"),
    [
        (64, 8, "prompt", "prompt has 64 prompts with n 8, 512 sequences; this server runs at most 8 per request"),
        (9, None, "prompt", "prompt has 9 prompts, 9 sequences; this server runs at most 8 per request"),
        (1, 9, "n", "n is 9; this server runs at most 8 sequences per request"),
    ],
)
def test_a_request_over_its_sequences_is_400_naming_what_makes_them(prompts, n, param, message):
    with pytest.raises(APIError) as refused:
        check_sequences({"n": n} if n is not None else {}, prompts, max_sequences=8)
    assert (refused.value.status, refused.value.param, refused.value.message) == (400, param, message)


@pytest.mark.parametrize(("prompts", "n"), [(8, 1), (4, 2), (2, 4), (1, 8), (1, None)])
def test_a_request_within_its_sequences_passes(prompts, n):
    check_sequences({"n": n}, prompts, max_sequences=8)


def test_beam_search_passes_only_when_the_config_allows_it_and_priority_never():
    check_extensions({"use_beam_search": False}, False)
    check_extensions({"use_beam_search": True}, True)
    check_extensions({"priority": 0}, False)
    for body, allow in [({"use_beam_search": True}, False), ({"priority": -1}, True)]:
        with pytest.raises(APIError) as refused:
            check_extensions(body, allow)
        assert (refused.value.status, refused.value.param) == (400, next(iter(body)))


@pytest.mark.parametrize(
    ("body", "size"),
    [
        ({"messages": [{"role": "user", "content": "hello"}]}, (1, 4 + 4 + 7 + 5, 0, "messages")),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "tools": [{"name": "f"}]},
            (1, 4 + 4 + 7 + 4 + 4 + 4 + 2 + 4 + 1, 0, "messages"),
        ),
        ({"prompt": "hello"}, (1, 5, 0, "prompt")),
        ({"prompt": ["a", "abc"]}, (2, 3, 0, "prompt")),
        ({"prompt": ["abcd"]}, (1, 4, 0, "prompt")),
        ({"prompt": [[1, 2, 3]]}, (1, 0, 3, "prompt")),
        ({"prompt": [1, 2, 3]}, (1, 0, 3, "prompt")),
        ({"prompt": [[1], [1, 2]]}, (2, 0, 2, "prompt")),
    ],
    ids=[
        "chat",
        "chat parts and tools",
        "text",
        "texts: the longest",
        "a list of one text",
        "a list of one token-id list",
        "token ids",
        "token-id lists: the longest",
    ],
)
def test_a_prompt_is_measured_before_any_tokenizer(body, size):
    assert prompt_size(body) == PromptSize(*size)


def test_a_prompt_that_cannot_fit_the_context_is_400_with_the_rule():
    check_prompt_size(PromptSize(1, 16 * 1024, 0, "messages"), 1024, 16)
    check_prompt_size(PromptSize(1, 10**9, 0, "messages"), None, 16)  # no context known: the replica counts
    with pytest.raises(APIError) as refused:
        check_prompt_size(PromptSize(1, 16 * 1024 + 1, 0, "messages"), 1024, 16)
    assert refused.value.param == "messages" and refused.value.message == (
        "the prompt has 16385 characters; at most 16384 can fit the model's context of 1024 tokens "
        "(at 16 characters per token)"
    )
    with pytest.raises(APIError) as refused:
        check_prompt_size(PromptSize(1, 0, 1025, "prompt"), 1024, 16)
    assert refused.value.param == "prompt" and "1025 token ids" in refused.value.message


@pytest.mark.parametrize(
    ("body", "asked"),
    [
        (CHAT, None),
        (CHAT | {"prompt_logprobs": 2}, Asked("prompt_logprobs", 2)),
        (CHAT | {"echo": True}, Asked("echo", 0)),  # vLLM: chat echo asks for top_logprobs' worth, 0 unset
        (CHAT | {"echo": True, "logprobs": True, "top_logprobs": 3}, Asked("echo", 3)),
        ({"prompt": "hi", "echo": True}, None),  # a completion's echo alone repeats the prompt
        ({"prompt": "hi", "echo": True, "logprobs": 2}, Asked("echo", 2)),
        ({"prompt": "hi", "echo": True, "logprobs": 2, "prompt_logprobs": 1}, Asked("prompt_logprobs", 1)),
    ],
    ids=[
        "none",
        "prompt_logprobs",
        "chat echo",
        "chat echo with top_logprobs",
        "completion echo",
        "completion echo with logprobs",
        "prompt_logprobs wins",
    ],
)
def test_prompt_logprobs_are_asked_as_vllm_reads_them(body, asked):
    assert prompt_logprobs_asked(body) == asked


@pytest.mark.parametrize(
    "body", [CHAT | {"prompt_logprobs": 0}, CHAT | {"echo": True}, {"prompt": "hi", "echo": True, "logprobs": 1}]
)
def test_prompt_logprobs_are_refused_unless_the_config_allows_them(body):
    error = refusal(body)
    assert error.param == ("prompt_logprobs" if "prompt_logprobs" in body else "echo")
    assert "prompt log-probabilities" in error.message and "off on this server" in error.message
    passes(body, CostLimits(prompt_logprobs=ALLOWED))


def test_allowed_prompt_logprobs_are_held_to_their_count_and_their_prompt_length():
    limits = CostLimits(prompt_logprobs=ALLOWED, max_prompt_chars_per_token=4)
    passes(CHAT | {"prompt_logprobs": 5}, limits)
    for asked in (6, -1):  # -1: vLLM's whole vocabulary
        assert refusal(CHAT | {"prompt_logprobs": asked}, limits).param == "prompt_logprobs"
    passes({"prompt": "x" * 400, "prompt_logprobs": 1}, limits)
    error = refusal({"prompt": "x" * 401, "prompt_logprobs": 1}, limits)
    assert error.param == "prompt" and error.message == (
        "prompt log-probabilities are computed for prompts of at most 100 tokens (400 characters); "
        "the prompt has 401 characters"
    )
    error = refusal({"prompt": list(range(101)), "echo": True, "logprobs": 1}, limits)
    assert error.param == "prompt" and "101 token ids" in error.message


@pytest.mark.parametrize(
    ("body", "asked"),
    [
        (CHAT, None),
        (CHAT | {"logprobs": False, "top_logprobs": 5}, None),
        (CHAT | {"logprobs": True}, Asked("top_logprobs", 1)),
        (CHAT | {"logprobs": True, "top_logprobs": 20}, Asked("top_logprobs", 21)),
        (CHAT | {"logprobs": True, "logprob_token_ids": [1, 2, 3]}, Asked("logprob_token_ids", 4)),
        ({"prompt": "hi"}, None),
        ({"prompt": "hi", "logprobs": 5}, Asked("logprobs", 6)),
        ({"prompt": "hi", "logprobs": 0}, Asked("logprobs", 1)),
    ],
    ids=["chat none", "chat off", "chat own", "chat top 20", "chat token ids", "text none", "text 5", "text 0"],
)
def test_each_generated_token_carries_its_own_and_the_asked_log_probabilities(body, asked):
    assert logprobs_asked(body) == asked


def test_log_probabilities_per_answer_are_sequences_times_tokens_times_per_token():
    limits = CostLimits(max_logprobs=200_000)
    top20 = CHAT | {"logprobs": True, "top_logprobs": 20}
    passes(top20 | {"max_tokens": 8192}, limits, max_model_len=10_000, ceiling=8192)  # 172,032
    error = refusal(top20 | {"max_tokens": 8192, "n": 2}, limits, max_model_len=10_000, ceiling=8192)
    assert error.param == "top_logprobs" and error.message == (
        "top_logprobs asks for up to 344064 log-probabilities (2 sequences x 8192 tokens x 21 each); this "
        "server returns at most 200000 per request: lower max_tokens, n or top_logprobs"
    )
    # Unset max_tokens counts the ceiling; max_completion_tokens wins over max_tokens, as in vLLM.
    assert "x 8192 tokens" in refusal(top20 | {"n": 2}, limits, max_model_len=10_000, ceiling=8192).message
    passes(top20 | {"n": 2, "max_tokens": 8000, "max_completion_tokens": 4000}, limits, 10_000, 8192)
    texts = {"prompt": ["a", "b", "c", "d"], "logprobs": 5, "n": 2, "max_tokens": 5000}  # 8 x 5000 x 6
    assert refusal(texts, limits, max_model_len=10_000, ceiling=8192).param == "logprobs"


def test_structured_output_specs_are_measured_as_json_and_the_largest_is_named():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100)}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = CHAT | {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    assert set(grammar_specs(body)) == {"response_format"}
    assert set(grammar_specs(CHAT | {"tools": [tool]})) == set()  # tool_choice auto: no grammar is built
    assert set(grammar_specs(CHAT | {"tools": [tool], "tool_choice": "required"})) == {"tools"}
    named = {"type": "function", "function": {"name": "f"}}
    forced = CHAT | {"tools": [tool] * 3, "tool_choice": named, "structured_outputs": {"regex": "a+"}}
    assert grammar_specs(forced)["structured_outputs"] == len('{"regex":"a+"}')
    size = measure(forced)
    assert size.grammar_param == "tools" and size.grammar_chars == sum(grammar_specs(forced).values())
    limit = CostLimits(max_grammar_chars=size.grammar_chars)
    passes(forced, limit)
    error = refusal(forced, CostLimits(max_grammar_chars=size.grammar_chars - 1))
    assert error.param == "tools" and str(size.grammar_chars) in error.message


def test_the_longest_list_of_tokens_is_measured_and_named():
    assert longest_token_list(CHAT) is None
    body = CHAT | {"logit_bias": {str(t): 1 for t in range(5)}, "allowed_token_ids": [1, 2], "stop_token_ids": [3]}
    assert longest_token_list(body) == Asked("logit_bias", 5)
    assert longest_token_list(body | {"stop_token_ids": list(range(9))}) == Asked("stop_token_ids", 9)


@pytest.mark.parametrize("param", ["logit_bias", "allowed_token_ids", "stop_token_ids"])
def test_a_list_of_tokens_past_its_bound_is_400_naming_it(param):
    tokens = list(range(11))
    body = CHAT | {param: {str(t): 1 for t in tokens} if param == "logit_bias" else tokens}
    passes(body, CostLimits(max_token_list_entries=11))
    error = refusal(body, CostLimits(max_token_list_entries=10))
    assert error.param == param and "11 entries" in error.message and "at most 10" in error.message


def test_bad_words_past_their_bound_are_400():
    body = CHAT | {"bad_words": [f"w{i}" for i in range(4)]}
    passes(body, CostLimits(max_bad_words=4))
    error = refusal(body, CostLimits(max_bad_words=3))
    assert error.param == "bad_words" and "4 words" in error.message and "at most 3" in error.message
    assert refusal(body, CostLimits(max_bad_words=0)).param == "bad_words"


def test_a_body_is_measured_once_for_every_rule():
    body = CHAT | {"logprobs": True, "echo": True, "response_format": {"type": "json_object"}}
    assert measure(body) == BodySize(
        prompt_size(body), len('{"type":"json_object"}'), "response_format", Asked("top_logprobs", 1), Asked("echo", 0)
    )


RESPONSES = {"model": "m", "input": "hello", "instructions": "Be brief.", "max_output_tokens": 4}


def test_a_responses_prompt_is_its_input_instructions_and_tools():
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    size = prompt_size(RESPONSES | {"tools": tools})
    assert (size.prompts, size.param) == (1, "input")
    assert size.characters == len("hello") + len("Be brief.") + len("typefunctionnamefparameterstypeobject")
    assert refusal(RESPONSES | {"input": "x" * 20_000}).param == "input"


def test_max_output_tokens_is_held_to_the_servers_ceiling():
    assert refusal(RESPONSES | {"max_output_tokens": 1001}).param == "max_output_tokens"


def test_a_responses_text_format_is_a_grammar_spec_and_plain_text_is_not():
    schema = {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}}
    assert set(grammar_specs(RESPONSES | {"text": schema})) == {"text"}
    assert grammar_specs(RESPONSES | {"text": {"format": {"type": "text"}}}) == {}


def test_responses_logprobs_are_asked_by_include():
    assert logprobs_asked(RESPONSES | {"top_logprobs": 5}) is None
    asked = logprobs_asked(RESPONSES | {"top_logprobs": 5, "include": ["message.output_text.logprobs"]})
    assert asked == Asked("top_logprobs", 6)
