"""Hypothesis strategies for request bodies: mostly shaped like a chat request, any values.

Shared by the front door's fuzz test (fake replicas, many examples) and the
end-to-end one (the real engine, few examples). ``max_output`` bounds the
answers that pass validation, so fuzzing a real engine stays quick.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

from tests.hostile_requests import CHAT_PATH, COMPLETION_PATH, MODEL, RESPONSES_PATH

JSON_LEAF = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
JSON_VALUE = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]) | JSON_VALUE,
        "content": st.text(max_size=30) | JSON_VALUE,
        "tool_calls": JSON_VALUE,
        "tool_call_id": st.text(max_size=8),
        "name": st.text(max_size=8),
    },
)
# Parameters a fuzzed body may carry, with any JSON value (plus a few names nobody knows).
FREE_PARAMS = [
    "stream",
    "temperature",
    "top_p",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "seed",
    "tools",
    "tool_choice",
    "response_format",
    "stream_options",
    "user",
    "store",
    "metadata",
    "temperatur",
    "guided_json",
]


def chat_bodies(max_output: int | None = None) -> st.SearchStrategy[dict]:
    """Chat-shaped bodies. With ``max_output``, any that the server accepts asks for at most that many tokens."""
    tokens = st.integers(-5, 5000) | JSON_VALUE if max_output is None else st.integers(-1, max_output) | JSON_LEAF
    choices = st.integers(-2, 200) | JSON_VALUE if max_output is None else st.integers(-1, 2) | JSON_LEAF
    required = {
        "model": st.just(MODEL) | JSON_VALUE,
        "messages": st.lists(MESSAGE | JSON_VALUE, max_size=3) | JSON_VALUE,
    }
    if max_output is not None:
        required["max_tokens"] = tokens  # always bounded: no default of "the rest of the context"
    optional = {name: JSON_VALUE for name in FREE_PARAMS} | {"n": choices}
    if max_output is None:
        optional |= {"max_tokens": tokens, "max_completion_tokens": tokens, "min_tokens": JSON_VALUE}
    return st.fixed_dictionaries(required, optional=optional)


def completion_bodies(max_output: int | None = None) -> st.SearchStrategy[dict]:
    """Completion-shaped bodies: a prompt as text, token ids, a batch, or anything."""
    tokens = st.integers(-5, 5000) | JSON_VALUE if max_output is None else st.integers(-1, max_output) | JSON_LEAF
    prompt = (
        st.text(max_size=30) | st.lists(st.integers(-3, 600), max_size=6) | st.lists(st.text(max_size=8), max_size=3)
    )
    required = {"model": st.just(MODEL) | JSON_VALUE, "prompt": prompt | JSON_VALUE, "max_tokens": tokens}
    optional = {name: JSON_VALUE for name in ("stream", "temperature", "stop", "logprobs", "echo", "seed", "suffix")}
    return st.fixed_dictionaries(required, optional=optional)


# A Responses API input item: served kinds, kinds with nothing behind them here, and anything.
CONTENT_PART = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["input_text", "output_text", "input_image", "refusal"]) | JSON_VALUE,
        "text": st.text(max_size=20) | JSON_VALUE,
    },
)
ITEM = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "image"])
        | JSON_VALUE,
        "role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]) | JSON_VALUE,
        "content": st.text(max_size=20) | st.lists(CONTENT_PART | JSON_VALUE, max_size=3) | JSON_VALUE,
        "call_id": st.text(max_size=8) | JSON_VALUE,
        "name": st.text(max_size=8) | JSON_VALUE,
        "arguments": st.text(max_size=20) | JSON_VALUE,
        "output": st.text(max_size=20) | JSON_VALUE,
    },
)
RESPONSES_PARAMS = ["stream", "store", "background", "previous_response_id", "metadata", "user", "instructions"]
RESPONSES_PARAMS += ["tools", "tool_choice", "include", "temperature", "text", "truncation", "reasoning"]


def responses_bodies(max_output: int | None = None) -> st.SearchStrategy[dict]:
    """Responses-shaped bodies: input as text, a list of items of any kind and shape, or anything."""
    tokens = st.integers(-5, 5000) | JSON_VALUE if max_output is None else st.integers(-1, max_output) | JSON_LEAF
    required = {
        "model": st.just(MODEL) | JSON_VALUE,
        "input": st.text(max_size=30) | st.lists(ITEM | JSON_VALUE, max_size=4) | JSON_VALUE,
    }
    if max_output is not None:
        required["max_output_tokens"] = tokens
    optional = {name: JSON_VALUE for name in RESPONSES_PARAMS}
    if max_output is None:
        optional["max_output_tokens"] = tokens
    return st.fixed_dictionaries(required, optional=optional)


def request_bodies(max_output: int | None = None) -> st.SearchStrategy[tuple[str, bytes]]:
    """(path, raw body): chat-, completion- or Responses-shaped JSON, any JSON, or any bytes, to any route."""
    any_path = st.sampled_from([CHAT_PATH, COMPLETION_PATH, RESPONSES_PATH])
    shapeless = JSON_VALUE.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64)
    return st.one_of(
        st.tuples(st.just(CHAT_PATH), chat_bodies(max_output).map(lambda b: json.dumps(b).encode())),
        st.tuples(st.just(COMPLETION_PATH), completion_bodies(max_output).map(lambda b: json.dumps(b).encode())),
        st.tuples(st.just(RESPONSES_PATH), responses_bodies(max_output).map(lambda b: json.dumps(b).encode())),
        st.tuples(any_path, shapeless),
    )
